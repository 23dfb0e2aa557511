"""Calls whose caller stopped reading, against real agent and router processes
(docs/security.md, "Callers that stop reading"), made by a bare HTTP/2 client
(tests/support/h2raw.py) that never reads a response, and that answers the server's
PINGs or, like a client whose host died or whose process is stopped, does not:

- a Get whose caller reads nothing holds its call, one of its tenant's
  max_calls_per_tenant, and the responses queued for it, for as long as the connection
  lasts. A server cannot end such a call itself: gRPC sends its status behind the data
  already queued. With no PINGs the connection of a caller that is gone lasted until it
  broke (~15 min of retransmissions for a host that died; never, for a stopped process);
  now the server pings every connection (keepalive_s) and closes one whose client does
  not answer within keepalive_timeout_s, and its calls end;
- a caller that answers the PINGs but reads nothing keeps its calls: those are bounded by
  max_calls_per_tenant, as every call of a tenant is."""

from __future__ import annotations

import asyncio

import grpc
import torch
from support.attack import TOKENS, auth, tenants
from support.common import make_namespace, prompt_tokens
from support.h2raw import H2, grpc_frame

from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.hashing import pack_ids
from kvstore.v1 import agent_pb2, agent_pb2_grpc

CAP = 2  # max_calls_per_tenant
GET = "/kvstore.v1.NodeAgent/Get"
NS = make_namespace(num_layers=16, num_kv_heads=8, head_dim=128)  # 1 MiB blocks
BLOCKS = 16  # one Get: 16 MiB, 8 messages; a caller that reads nothing takes 64 KiB
# keepalive_timeout_s: the connections that answer do so from this test's event loop,
# which a loaded host may stall for a while
PING_TIMEOUT_S = 3.0


def _agent(spawn_agent, keepalive_s: float):
    """An agent holding BLOCKS of acme's blocks, and the Get request that reads them."""
    agent = spawn_agent(
        allow_unauthenticated=False,
        tenants=tenants(),
        max_calls_per_tenant=CAP,
        keepalive_s=keepalive_s,
        keepalive_timeout_s=PING_TIMEOUT_S,
        pool_bytes="32MiB",
        slot_bytes="1MiB",
    )
    g = torch.Generator().manual_seed(5)
    blocks = [
        torch.randn(block_shape(NS), generator=g).to(torch_dtype(NS.kv_dtype))
        for _ in range(BLOCKS)
    ]
    with KVClient(agent.address, use_shm=False, token=TOKENS["acme"], tenant_secret=b"s") as c:
        ns = c.open_namespace(NS)
        ids = c.block_ids(ns, prompt_tokens(9, BLOCKS * NS.block_size))
        assert c.put(ns, ids, blocks).stored == BLOCKS
    request = agent_pb2.GetRequest(
        ns=agent_pb2.NamespaceRef(namespace_id=NS.namespace_id), block_ids=pack_ids(ids)
    )
    return agent, grpc_frame(request.SerializeToString())


async def _gets(address: str, body: bytes, n: int, answer_pings: bool) -> tuple[H2, list[int]]:
    """`n` Gets of acme on one connection that reads none of their responses, each
    answered (the agent started sending it) before this returns; `answer_pings` False:
    from then on the connection answers no PING, as one whose client is gone (it answered
    them until then, as a live client does)."""
    host, port = address.rsplit(":", 1)
    h2 = await H2(host, int(port)).connect()
    sids = []
    for _ in range(n):
        sid = await h2.open(GET, auth("acme"))
        await h2.send(sid, body, end=True)
        sids.append(sid)
    for sid in sids:
        assert await h2.answered_or_ended(sid) and sid not in h2.closed, h2.endings
    h2.answer_pings = answer_pings
    return h2, sids


async def _stats(address: str, who: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            await agent_pb2_grpc.NodeAgentStub(ch).Stats(
                agent_pb2.StatsRequest(), metadata=auth(who), timeout=30
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def _closed_and_acme_served(gone: H2, address: str) -> None:
    """Until the agent has closed `gone`'s connection and then serves acme again."""
    async with asyncio.timeout(60):
        async with gone.cond:
            await gone.cond.wait_for(lambda: gone.gone)
    async with asyncio.timeout(30):
        while await _stats(address, "acme") != grpc.StatusCode.OK:
            await asyncio.sleep(0.1)


def test_the_gets_of_a_caller_that_is_gone_end_when_it_stops_answering_pings(spawn_agent):
    """Before keepalive_s, acme stayed refused on both agents until the connection was
    closed from the client's side."""
    pinging, _ = _agent(spawn_agent, keepalive_s=1.0)
    silent, body = _agent(spawn_agent, keepalive_s=0)  # as every agent was before

    async def run() -> None:
        gone, _ = await _gets(pinging.address, body, CAP, answer_pings=False)
        held, _ = await _gets(silent.address, body, CAP, answer_pings=False)
        try:
            # Every call of acme's is held on both: its next one is refused.
            for agent in (pinging, silent):
                assert await _stats(agent.address, "acme") == grpc.StatusCode.RESOURCE_EXHAUSTED
            await _closed_and_acme_served(gone, pinging.address)
            # Without PINGs nothing ended the other connection, nor gave acme its calls.
            assert not held.gone and not held.closed
            assert await _stats(silent.address, "acme") == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await _stats(silent.address, "globex") == grpc.StatusCode.OK
        finally:
            await gone.close()
            await held.close()

    asyncio.run(run())


def test_a_caller_that_answers_pings_keeps_its_calls_within_its_tenants_cap(spawn_agent):
    """keepalive_s ends the connections of callers that are gone, not of slow readers:
    a live caller that reads nothing keeps its Get, counted against acme's cap, while
    another connection of acme's that stopped answering is closed beside it."""
    agent, body = _agent(spawn_agent, keepalive_s=1.0)

    async def run() -> None:
        live, live_sids = await _gets(agent.address, body, 1, answer_pings=True)
        gone, _ = await _gets(agent.address, body, 1, answer_pings=False)
        try:
            assert await _stats(agent.address, "acme") == grpc.StatusCode.RESOURCE_EXHAUSTED
            await _closed_and_acme_served(gone, agent.address)
            pinged = live.pings
            async with asyncio.timeout(60):  # three more PINGs answered
                async with live.cond:
                    await live.cond.wait_for(lambda: live.pings >= pinged + 3)
            assert not live.gone and not live.closed.intersection(live_sids), live.endings
            # Its one call still counts: acme has one call left.
            third, _ = await _gets(agent.address, body, 1, answer_pings=True)
            try:
                assert await _stats(agent.address, "acme") == grpc.StatusCode.RESOURCE_EXHAUSTED
            finally:
                await third.close()
        finally:
            await live.close()
            await gone.close()

    asyncio.run(run())


def test_a_router_closes_a_connection_whose_client_stopped_answering(etcd, start_router):
    """A router pings its connections as an agent does, idle ones included."""
    router = start_router(
        config={
            "tenants": tenants(),
            "allow_unauthenticated": False,
            "keepalive_s": 1.0,
            "keepalive_timeout_s": PING_TIMEOUT_S,
        }
    )

    async def run() -> None:
        host, port = router.address.rsplit(":", 1)
        gone = await H2(host, int(port), answer_pings=False).connect()
        live = await H2(host, int(port)).connect()
        try:
            async with asyncio.timeout(60):
                async with gone.cond:
                    await gone.cond.wait_for(lambda: gone.gone)
            assert gone.pings >= 1
            async with asyncio.timeout(60):
                async with live.cond:
                    await live.cond.wait_for(lambda: live.pings >= 3)
            assert not live.gone
        finally:
            await gone.close()
            await live.close()

    asyncio.run(run())
