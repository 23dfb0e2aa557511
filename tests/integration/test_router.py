"""The router as a real process over real agents and etcd: the index follows the agents'
event streams (puts, evictions, restarts), routing decisions over gRPC, router restarts
and replicas."""

from __future__ import annotations

import asyncio
import hashlib
import signal

import grpc
import pytest
import torch
from support.cluster import RouterProc, agent_config, settle, spawn_many
from support.common import TEST_SECRET, make_namespace, prompt_tokens, wait_for

from kvstore.coord.etcd import EtcdClient
from kvstore.client import KVClient
from kvstore.client.cluster import ClusterClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.hashing import hash_chain, pack_ids
from kvstore.v1 import agent_pb2, agent_pb2_grpc, router_pb2

SPEC = make_namespace()
BS = SPEC.block_size
NS_ID = SPEC.namespace_id
ROOT = SPEC.root(0, TEST_SECRET)


def ids_for(seed: int, n_blocks: int) -> list[bytes]:
    return hash_chain(ROOT, prompt_tokens(seed, n_blocks * BS), BS)


def put_blocks(client: KVClient, ids: list[bytes], first: int = 0) -> None:
    """Store ids[first:] (ids[:first] must already be on the node)."""
    ns = client.open_namespace(SPEC)
    g = torch.Generator().manual_seed(len(ids))
    blocks = [
        torch.randn(block_shape(SPEC), generator=g).to(torch_dtype(SPEC.kv_dtype))
        for _ in ids[first:]
    ]
    r = client.put(ns, ids[first:], blocks, ids[first - 1] if first else None)
    assert r.stored + r.already_present == len(ids) - first


def local_of(resp: router_pb2.RouteResponse) -> dict[str, int]:
    return {c.node_id: c.local_blocks for c in resp.candidates}


def decision(resp: router_pb2.RouteResponse) -> tuple:
    """Everything in a response except the request id."""
    return (
        resp.node_id,
        resp.address,
        resp.matched_blocks,
        resp.peer_hint,
        tuple(
            (
                c.node_id,
                c.local_blocks,
                c.peer_blocks,
                c.peer_node_id,
                c.recompute_blocks,
                c.in_flight,
                round(c.cost, 9),
            )
            for c in resp.candidates
        ),
    )


def test_index_follows_puts_and_evictions(etcd, spawn_agent, start_router):
    # 16 slots and no NVMe tier: the third prompt evicts, and evicted blocks leave the node.
    agent = spawn_agent(**agent_config(etcd, pool_bytes="1MiB", nvme_bytes=0))
    router = start_router()
    router.wait_nodes({"agent-0": 0})
    prompts = [ids_for(s, 8) for s in (1, 2, 3)]
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        put_blocks(c, prompts[0])
        router.wait_nodes({"agent-0": 8})
        resp = router.route(NS_ID, pack_ids(prompts[0] + ids_for(9, 4)), dry_run=True)
        assert (resp.node_id, resp.matched_blocks) == ("agent-0", 8)
        assert resp.candidates[0].recompute_blocks == 4
        put_blocks(c, prompts[1])
        put_blocks(c, prompts[2])
        router.wait_nodes({"agent-0": 16})

        def index_matches_agent():
            for ids in prompts:
                held = c.lookup(ns, ids).matched
                if router.route(NS_ID, pack_ids(ids), dry_run=True).matched_blocks != held:
                    return False
            return True

        wait_for(index_matches_agent, 15, what="router index to match the agent")
        assert sum(c.lookup(ns, ids).matched for ids in prompts) == 16  # something went


def test_routing_decisions_over_grpc(etcd, spawn_agent, start_router):
    agents = spawn_many(spawn_agent, 3, **agent_config(etcd))
    # Two replicas that differ only in peer bandwidth: on `slow` a peer fetch never beats
    # recompute, on `fast` it always does (4 KiB blocks at 100 Gbps). Utilization is
    # weighted 0 so agents' reports cannot reorder near-ties mid-test.
    slow = start_router("slow", config={"peer_gbps": 0.0001, "weight_utilization": 0})
    fast = start_router("fast", config={"peer_gbps": 100, "weight_utilization": 0})
    prefix = ids_for(7, 10)
    with KVClient(agents[2].address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        put_blocks(c, prefix)  # opening the namespace publishes its layout in etcd
    for r in (slow, fast):
        r.wait_nodes({"agent-0": 0, "agent-1": 0, "agent-2": 10})
    prompt = pack_ids(prefix + ids_for(8, 5))
    resp = slow.route(NS_ID, prompt, dry_run=True)
    assert (resp.node_id, resp.matched_blocks, resp.address) == ("agent-2", 10, agents[2].address)
    assert local_of(resp) == {"agent-0": 0, "agent-1": 0, "agent-2": 10}
    assert all(c.peer_blocks == 0 for c in resp.candidates)
    assert [c.recompute_blocks for c in resp.candidates] == [5, 15, 15]

    # The holder wins until its load outweighs the 10 blocks it saves plus the pool space
    # (0.15 per block) a second copy of them would take: 4 per request in flight and 1 per
    # block of prefill they queued there (5 each). Then the others take turns.
    chosen = [slow.route(NS_ID, prompt, request_id=f"p{i}").node_id for i in range(4)]
    assert chosen == ["agent-2", "agent-2", "agent-0", "agent-1"]
    busy = slow.route(NS_ID, prompt, dry_run=True)
    assert {c.node_id: c.in_flight for c in busy.candidates}["agent-2"] == 2
    assert {c.node_id: c.cost for c in busy.candidates}["agent-2"] == pytest.approx(23)
    # The answer explains itself: terms that add up to each cost, in blocks recomputed,
    # and the prices (no pull measured yet: nothing fixed per pull).
    for c in busy.candidates:
        terms = c.recompute_cost + c.peer_cost + c.space_cost + c.load_cost + c.utilization_cost
        assert c.cost == pytest.approx(terms)
    holder = {c.node_id: c for c in busy.candidates}["agent-2"]
    assert (holder.recompute_cost, holder.load_cost, holder.queued_blocks) == (5, 18, 10)
    assert busy.recompute_ms > 0 and busy.pull_fixed_ms == 0 and busy.decide_us > 0
    light = slow.route(NS_ID, prompt, dry_run=True, weights=router_pb2.RouteWeights(load=0.5))
    assert light.node_id == "agent-2"  # per-request weights override the config
    # Their prefill done, p0 and p1 decode on: agent-2 still counts them, not their work.
    for i in range(2):
        slow.release(f"p{i}", prefill_done=True)
    decoding = {c.node_id: c for c in slow.route(NS_ID, prompt, dry_run=True).candidates}
    assert decoding["agent-2"].in_flight == 2
    assert decoding["agent-2"].cost == pytest.approx(23 - 2 * 5)
    for i in range(4):
        slow.release(f"p{i}")

    # Nobody holds a cold prompt: load spreads them evenly.
    cold = [
        slow.route(NS_ID, pack_ids(ids_for(100 + i, 6)), request_id=f"c{i}").node_id
        for i in range(6)
    ]
    assert sorted(cold) == ["agent-0", "agent-0", "agent-1", "agent-1", "agent-2", "agent-2"]
    for i in range(6):
        slow.release(f"c{i}")
    assert all(c.in_flight == 0 for c in slow.route(NS_ID, prompt, dry_run=True).candidates)

    # With cheap peer transfers the others could fetch the prefix from agent-2 ...
    def peer_priced():
        r = fast.route(NS_ID, prompt, dry_run=True)
        other = {c.node_id: c for c in r.candidates}["agent-0"]
        return other.peer_blocks == 10 and other.peer_node_id == "agent-2" and r

    resp = wait_for(peer_priced, 15, what="peer pricing from the etcd namespace record")
    assert resp.node_id == "agent-2" and resp.peer_hint == ""
    # ... so one request in flight on the holder sends the next one elsewhere, hinted.
    fast.route(NS_ID, prompt, request_id="f0")
    resp = fast.route(NS_ID, prompt, dry_run=True)
    assert (resp.node_id, resp.peer_hint, resp.matched_blocks) == ("agent-0", "agent-2", 0)
    assert resp.candidates[0].peer_blocks == 10 and resp.candidates[0].recompute_blocks == 5


def test_cluster_client_pulls_the_peer_hinted_blocks_onto_the_chosen_node(
    etcd, spawn_agent, start_router
):
    """The router sends a request away from a busy holder with a peer hint; the cluster
    client has the chosen agent pull the hinted blocks first, so they are a hit there."""
    agents = spawn_many(spawn_agent, 2, **agent_config(etcd))
    router = start_router(config={"peer_gbps": 100, "weight_utilization": 0})
    tokens = prompt_tokens(21, 15 * BS)
    prefix = ids_for(21, 10)  # the first 10 blocks of `tokens`
    with KVClient(agents[1].address, tenant_secret=TEST_SECRET, use_shm=False) as holder:
        put_blocks(holder, prefix)
        expected = holder.get(holder.open_namespace(SPEC), prefix)
    router.wait_nodes({"agent-0": 0, "agent-1": 10})
    prompt = pack_ids(hash_chain(ROOT, tokens, BS))
    wait_for(
        lambda: (
            {
                c.node_id: c.peer_blocks
                for c in router.route(NS_ID, prompt, dry_run=True).candidates
            }["agent-0"]
            == 10
        ),
        15,
        what="peer pricing from the etcd namespace record",
    )
    router.route(NS_ID, prompt, request_id="busy")  # the holder has a request in flight
    with ClusterClient(router.address, tenant_secret=TEST_SECRET, use_shm=False) as cc:
        ns = cc.open_namespace(SPEC)
        skipped = cc.fetch(ns, tokens, prefetch=False)  # hinted, but told not to pull
        assert (skipped.node_id, skipped.route.peer_hint) == ("agent-0", "agent-1")
        assert skipped.prefetch is None and skipped.cached_blocks == 0
        cc.release(skipped)
        hit = cc.fetch(ns, tokens)
        assert (hit.node_id, hit.route.peer_hint) == ("agent-0", "agent-1")
        p = hit.prefetch
        assert (p.present, p.fetched, p.stopped) == (10, 10, ""), p
        assert p.transport in ("ucx", "grpc")
        assert hit.cached_blocks == 10
        assert all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(hit.blocks, expected)
        )
        cc.release(hit)
    router.release("busy")
    bandwidth_ms = 8 * 1e3 * SPEC.block_bytes / 100e9  # what 100 Gbps prices a block at

    def priced():
        r = router.route(NS_ID, prompt, dry_run=True)
        return (r.pull_fixed_ms, r.pull_ms_per_block)

    # That first pull from agent-1 also opened agent-0's connections to it, a cost later
    # pulls do not pay: it stays out of the fit, so the router still prices peer_gbps.
    settle(3.0)  # the node record is rewritten within a lease TTL (2 s) of a change
    assert priced() == (0.0, pytest.approx(bandwidth_ms))
    # A second pull from the same peer is timed; agent-0 publishes the fit in its node
    # record and the router prices pulls with it instead (kvstore/pullcost.py).
    more = ids_for(22, 10)
    with KVClient(agents[1].address, tenant_secret=TEST_SECRET, use_shm=False) as holder:
        put_blocks(holder, more)
    with KVClient(agents[0].address, tenant_secret=TEST_SECRET, use_shm=False) as puller:
        ns = puller.open_namespace(SPEC)
        p = puller.prefetch(ns, more, hit.route.peer_address, hit.route.peer_transfer_address)
        assert (p.present, p.fetched, p.stopped) == (10, 10, ""), p
    fixed, per_block = wait_for(
        lambda: priced()[1] != pytest.approx(bandwidth_ms) and priced(),
        20,
        what="the measured pull cost through etcd",
    )
    # One timed pull of 10 blocks: its whole time counts as fixed (no slope from one size).
    assert fixed > 0 and per_block == 0


def test_router_restart_and_replicas_decide_identically(etcd, spawn_agent, start_router):
    agents = spawn_many(spawn_agent, 2, **agent_config(etcd))
    held = {0: ids_for(1, 12), 1: ids_for(2, 6)}
    for i, ids in held.items():
        with KVClient(agents[i].address, tenant_secret=TEST_SECRET, use_shm=False) as c:
            put_blocks(c, ids)
    with KVClient(agents[1].address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        put_blocks(c, held[0][:5])  # a shorter copy of prompt 1 on the other node
    expect = {"agent-0": 12, "agent-1": 11}
    a, b = start_router("router-a"), start_router("router-b")
    a.wait_nodes(expect)
    b.wait_nodes(expect)
    prompts = [
        pack_ids(held[0] + ids_for(50, 3)),
        pack_ids(held[1]),
        pack_ids(held[0][:7]),
        pack_ids(ids_for(51, 9)),
    ]

    # Each agent's present pool utilization, as its node record carries it (2 decimals,
    # rewritten within a heartbeat of a change); nothing is put from here on.
    now = {}
    for i, agent in enumerate(agents):
        with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
            now[f"agent-{i}"] = round(c.stats().utilization, 2)

    def reported(x: RouterProc) -> bool:
        """Whether `x` prices each agent's pool at its present utilization."""
        seen = x.route(NS_ID, prompts[3], dry_run=True).candidates
        return {c.node_id: round(c.utilization, 2) for c in seen} == now

    def same_decisions(x: RouterProc, y: RouterProc) -> None:
        # Utilization reaches each replica through its own etcd watch: equal once settled.
        # Both must hold the agents' present figure, not merely the same one: agreeing on
        # a stale figure, a record rewritten between x's and y's stateful routes below
        # would part them.
        wait_for(lambda: reported(x) and reported(y), 15, what="the present utilization")
        wait_for(
            lambda: all(
                decision(x.route(NS_ID, p, dry_run=True))
                == decision(y.route(NS_ID, p, dry_run=True))
                for p in prompts
            ),
            15,
            what="replicas to agree",
        )

    same_decisions(a, b)
    for i, p in enumerate(prompts * 2):  # stateful: identical load accounting too
        assert decision(a.route(NS_ID, p, request_id=f"s{i}")) == decision(
            b.route(NS_ID, p, request_id=f"s{i}")
        )
    for i in range(len(prompts) * 2):
        a.release(f"s{i}")
        b.release(f"s{i}")
    # A router that crashes and restarts rebuilds the same index from the agents.
    a.stop(signal.SIGKILL)
    a2 = start_router("router-a2")
    a2.wait_nodes(expect)
    same_decisions(a2, b)
    assert decision(a2.route(NS_ID, prompts[0], dry_run=True))[:3] == (
        "agent-0",
        agents[0].address,
        12,
    )


def test_agent_restart_resyncs_on_epoch_change(etcd, spawn_agent, start_router):
    cluster_token, tenant_token = "cluster-secret-token", "acme-token"
    tenants = {
        "_cluster": {"token_sha256": hashlib.sha256(cluster_token.encode()).hexdigest()},
        "acme": {"token_sha256": hashlib.sha256(tenant_token.encode()).hexdigest()},
    }
    # A long lease: the restarted agent comes back before its old record expires, so
    # only the event stream's epoch tells the router the node's contents changed.
    agent = spawn_agent(
        **agent_config(
            etcd, nvme_bytes=0, lease_ttl_s=30, tenants=tenants, allow_unauthenticated=False
        )
    )
    router = start_router(token=cluster_token)
    router.wait_nodes({"agent-0": 0})
    ids = ids_for(3, 8)
    with KVClient(agent.address, token=tenant_token, tenant_secret=TEST_SECRET, use_shm=False) as c:
        put_blocks(c, ids)
    router.wait_nodes({"agent-0": 8})
    agent.kill()
    agent.config["listen"] = agent.address  # same address, empty store (no NVMe tier)
    agent.start()
    router.wait_nodes({"agent-0": 0}, timeout=30)
    assert "restarted (epoch" in router.log
    with KVClient(agent.address, token=tenant_token, tenant_secret=TEST_SECRET, use_shm=False) as c:
        put_blocks(c, ids[:3])
    router.wait_nodes({"agent-0": 3})
    assert router.route(NS_ID, pack_ids(ids), dry_run=True).matched_blocks == 3


def test_router_rejects_malformed_requests(etcd, start_router):
    router = start_router()
    with pytest.raises(grpc.RpcError) as ei:  # no agents registered yet
        router.route(NS_ID, pack_ids(ids_for(1, 2)))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no node agents" in ei.value.details()
    for bad, what in (
        ({"namespace_id": b"x"}, "namespace_id"),
        ({"block_ids": b"y" * 17}, "multiple of 16"),
        ({"weights": router_pb2.RouteWeights(load=-1)}, "load"),
        ({"weights": router_pb2.RouteWeights(queue=-2)}, "queue"),
        # kept in the in-flight table until released or expired: bounded as on the agents
        ({"request_id": "r" * 257}, "request_id has 257 characters; the limit is 256"),
    ):
        req = {"namespace_id": NS_ID, "block_ids": b"", **bad}
        with pytest.raises(grpc.RpcError) as ei:
            router.stub.Route(router_pb2.RouteRequest(**req), timeout=5)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
        assert what in ei.value.details()
    router.release("never-routed")  # releasing an unknown id is harmless
    with pytest.raises(grpc.RpcError) as ei:
        router.stub.Release(router_pb2.ReleaseRequest(request_id="r" * 257), timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()

    # A flushed namespace: routes for its old generation are fenced off.
    async def flush():
        async with EtcdClient(etcd.endpoint) as e:
            await e.put_namespace(SPEC.tenant, NS_ID, SPEC.to_dict())
            return await e.bump_generation(SPEC.tenant, NS_ID)

    assert asyncio.run(flush()) == 1

    def fenced():
        try:
            router.route(NS_ID, pack_ids(ids_for(1, 1)), generation=0)  # (no ids: no fence)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale" in exc.details()
        return False

    wait_for(fenced, 15, what="the generation fence")


# ------------------------------------------------------- stream faults (injected)
class ScriptedAgent(agent_pb2_grpc.NodeAgentServicer):
    """Fault injection: an agent whose Subscribe streams replay scripts, one per
    connection (the last one repeats), then stay open."""

    def __init__(self, scripts: list[list[agent_pb2.EventBatch]]) -> None:
        self.scripts = scripts
        self.connections = 0

    async def Subscribe(self, request, context):
        script = self.scripts[min(self.connections, len(self.scripts) - 1)]
        self.connections += 1
        for batch in script:
            yield batch
        await asyncio.Event().wait()


def snapshot(epoch: str, seq: int, ids: list[bytes]) -> agent_pb2.EventBatch:
    ev = agent_pb2.Event(
        seq=seq, kind=agent_pb2.Event.STORED, namespace_id=NS_ID, block_ids=pack_ids(ids), tier=1
    )
    return agent_pb2.EventBatch(
        node_id="n", epoch=epoch, snapshot=True, snapshot_done=True, events=[ev] if ids else []
    )


def live(epoch: str, seq: int, ids: list[bytes], kind=agent_pb2.Event.STORED):
    ev = agent_pb2.Event(
        seq=seq, kind=kind, namespace_id=NS_ID, block_ids=pack_ids(ids), tier=1, generation=1
    )
    return agent_pb2.EventBatch(node_id="n", epoch=epoch, events=[ev])


async def follow_scripted(scripts, until_connections: int) -> tuple:
    from kvstore.coord.etcd import NodeRecord
    from router.follower import NodeStream
    from router.routing import RouterCore
    from router.scoring import Weights

    agent = ScriptedAgent(scripts)
    server = grpc.aio.server()
    agent_pb2_grpc.add_NodeAgentServicer_to_server(agent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    core = RouterCore(Weights())
    core.upsert_node(NodeRecord("n", f"127.0.0.1:{port}"))
    stream = NodeStream(core, "n", f"127.0.0.1:{port}", "test", None)
    try:
        for _ in range(200):
            if agent.connections >= until_connections and core.nodes["n"].synced:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # anything further the stream would (wrongly) apply
        return agent.connections, core
    finally:
        stream.cancel()
        await server.stop(0)


@pytest.mark.parametrize("fault", ["gap", "epoch", "cleared"])
def test_stream_faults_resync_from_a_fresh_snapshot(fault):
    a, b, c = ids_for(1, 4), ids_for(2, 3), ids_for(3, 2)
    bad = {
        "gap": live("e1", 8, c),  # seq 7 never came
        "epoch": live("e2", 7, c),  # another process answered mid-stream
        "cleared": live("e1", 7, [], agent_pb2.Event.NAMESPACE_CLEARED),
    }[fault]
    first = [snapshot("e1", 5, a), live("e1", 6, b), bad]
    second = [snapshot("e1" if fault != "epoch" else "e2", 9, a + c)]
    connections, core = asyncio.run(follow_scripted([first, second], 2))
    assert connections == 2
    # The index is exactly the second snapshot: b (applied before the fault) is gone.
    assert core.index.node_blocks("n") == (len(a + c), 0)
    assert core.index.prefix_lengths(pack_ids(a)) == {"n": 4}
    assert core.index.prefix_lengths(pack_ids(b)) == {}
