"""Calls that hold an agent's or a router's memory without being counted, against real
processes (docs/security.md, "Calls at once" and "Memory before authentication"), sent
by a bare HTTP/2 client (tests/support/h2raw.py) as no gRPC library would send them:

- grpc.aio starts a unary method's handler only once its whole message has arrived, and
  the edge counted a tenant's call (max_calls_per_tenant) in that handler: a Lookup (or
  a router's Route) that sent part of its message, or none, was never counted and never
  timed out, so one tenant could make the agent hold any number of messages of up to
  max_message_bytes. Now every call is counted from its headers and ended when its
  message has not arrived whole after stream_idle_timeout_s, its call given back;
- a request that did not decode kept its tenant's call for good (the edge counted it,
  then raised before keeping the release): after max_calls_per_tenant of them the tenant
  was refused everything until a restart;
- Health.Watch, open to anyone, opened any number of streams that never end: now at
  most max_health_watches on the port and max_health_watches_per_peer per address, while
  Health.Check stays open to all."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.attack import auth, tenants
from support.h2raw import H2, grpc_frame

from kvstore.v1 import agent_pb2, agent_pb2_grpc, router_pb2, router_pb2_grpc

CAP = 2
IDLE_S = 15.0  # stream_idle_timeout_s: the checks made while the calls are held take
# milliseconds; this leaves room for a loaded host
LOOKUP = "/kvstore.v1.NodeAgent/Lookup"
ROUTE = "/kvstore.v1.Router/Route"
WATCH = "/grpc.health.v1.Health/Watch"
DECLARED = 64 * 1024  # what a partial message announces; half of it is sent

BODIES = {
    "no message": b"",
    "part of a message": grpc_frame(b"\x0a" * (DECLARED // 2), declared=DECLARED),
}


async def _held(address: str, path: str, who: str, n: int, body: bytes) -> tuple[H2, list]:
    """`n` calls of `who` on one connection, each sending `body` and then nothing."""
    host, port = address.rsplit(":", 1)
    h2 = await H2(host, int(port)).connect()
    sids = [await h2.open(path, auth(who)) for _ in range(n)]
    for sid in sids:
        await h2.send(sid, body)
    return h2, sids


async def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def _held_calls_count_until_they_time_out(
    address: str, path: str, body: bytes, call, server_log=lambda: ""
):
    """`call(who)`: one ordinary call of `who`; `server_log()`: the server's log, shown
    when a check fails. acme opens CAP + 1 calls that send `body` and then nothing: the
    server refuses one of them at once, naming max_calls_per_tenant, and holds the
    others; then acme's next call is refused too, globex's is not; once the server ends
    the held calls (stream_idle_timeout_s), acme's next call is served again.

    (No call of acme is made until the server has refused the extra one, that is until
    it has counted the held ones: a call made while they were still arriving could take
    one of acme's calls and have a held one refused in its place.)"""
    h2, sids = await _held(address, path, "acme", CAP + 1, body)

    def state() -> str:
        return (
            f"ended {sorted(h2.closed)} of {sids}, answered {sorted(h2.answered)}, "
            f"connection gone {h2.gone}, endings {h2.endings}; server log:\n"
            f"{server_log()[-3000:]}"
        )

    try:
        async with asyncio.timeout(60):
            async with h2.cond:
                await h2.cond.wait_for(lambda: h2.gone or h2.closed)
        assert len(h2.closed) == 1 and not h2.gone and not h2.answered, state()
        (refused,) = h2.closed
        assert b"max_calls_per_tenant" in h2.endings[refused], state()
        held = [sid for sid in sids if sid != refused]
        code, details = await _code(call("acme"))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details, state())
        assert "max_calls_per_tenant" in details, details
        code, details = await _code(call("globex"))
        assert code != grpc.StatusCode.RESOURCE_EXHAUSTED, details
        async with asyncio.timeout(120):
            await h2.ended(held)
        assert not h2.gone and not h2.answered, state()  # ended with a status, no answer
        assert all(b"stream_idle_timeout_s" in h2.endings[sid] for sid in held), state()
        code, details = await _code(call("acme"))
        assert code != grpc.StatusCode.RESOURCE_EXHAUSTED, details
    finally:
        await h2.close()


@pytest.mark.parametrize("body", list(BODIES), ids=list(BODIES))
def test_a_tenants_unfinished_lookups_are_counted_and_ended(spawn_agent, body):
    """Before the fix acme's next call was served however many unfinished Lookups it
    held (p2_partial: 400 of them, +2 GiB in the agent), and none was ever ended."""
    agent = spawn_agent(
        allow_unauthenticated=False,
        tenants=tenants(),
        max_calls_per_tenant=CAP,
        stream_idle_timeout_s=IDLE_S,
    )

    async def run() -> None:
        async with grpc.aio.insecure_channel(agent.address) as ch:
            stub = agent_pb2_grpc.NodeAgentStub(ch)

            def stats(who: str):
                return stub.Stats(agent_pb2.StatsRequest(), metadata=auth(who), timeout=30)

            await _held_calls_count_until_they_time_out(
                agent.address, LOOKUP, BODIES[body], stats, lambda: agent.log
            )

    asyncio.run(run())


def test_a_tenants_unfinished_routes_are_counted_and_ended(etcd, start_router):
    """The router had no cap on a tenant's calls at all: unfinished Routes were held
    without bound (p2_router: 200 of them, +800 MiB). Now max_calls_per_tenant counts
    them from their start (ListNodes, reserved to the cluster identity, is refused
    PERMISSION_DENIED to a tenant it serves)."""
    router = start_router(
        config={
            "tenants": tenants(),
            "allow_unauthenticated": False,
            "max_calls_per_tenant": CAP,
            "stream_idle_timeout_s": IDLE_S,
        }
    )

    async def run() -> None:
        async with grpc.aio.insecure_channel(router.address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)

            def nodes(who: str):
                return stub.ListNodes(router_pb2.ListNodesRequest(), metadata=auth(who), timeout=30)

            body = BODIES["part of a message"]
            await _held_calls_count_until_they_time_out(
                router.address, ROUTE, body, nodes, lambda: router.log
            )

    asyncio.run(run())


def test_requests_that_do_not_decode_give_their_call_back(spawn_agent):
    """Before the fix each undecodable Lookup kept one of acme's calls: with
    max_calls_per_tenant 2 the third was refused RESOURCE_EXHAUSTED, and so was every
    call of acme after it. Now each is INVALID_ARGUMENT and acme is still served."""
    agent = spawn_agent(allow_unauthenticated=False, tenants=tenants(), max_calls_per_tenant=CAP)
    with grpc.insecure_channel(agent.address) as ch:
        raw = ch.unary_unary(
            LOOKUP, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        codes = []
        for _ in range(3 * CAP):
            try:
                raw(b"\xff\xff\xff", metadata=auth("acme"), timeout=30)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * (3 * CAP)
        stub = agent_pb2_grpc.NodeAgentStub(ch)
        stub.Stats(agent_pb2.StatsRequest(), metadata=auth("acme"), timeout=30)


def _watch(ch: grpc.aio.Channel):
    return health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=120)


def test_health_watch_streams_are_capped_per_address_and_in_all(spawn_agent):
    """Before the fix anyone could hold any number of Watch streams (p4_watch: 19,000 in
    7 s, +380 MiB, none ever ended). Now 127.0.0.1 gets max_health_watches_per_peer (2)
    of them and its next is refused naming that key; another address (127.0.0.2) still
    gets one, and then the port's max_health_watches (3) refuses everyone's next. Check
    is served throughout."""
    agent = spawn_agent(max_health_watches=3, max_health_watches_per_peer=2)
    host, port = agent.address.rsplit(":", 1)

    async def run() -> None:
        async with grpc.aio.insecure_channel(agent.address) as ch:
            held = [_watch(ch) for _ in range(2)]
            for w in held:
                first = await w.read()
                assert first.status == health_pb2.HealthCheckResponse.SERVING
            code, details = await _code(_watch(ch).read())
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
            assert "max_health_watches_per_peer" in details, details
            other = await H2(host, int(port), local_host="127.0.0.2").connect()
            try:
                frame = grpc_frame(health_pb2.HealthCheckRequest().SerializeToString())
                served = await other.open(WATCH)
                await other.send(served, frame, end=True)
                assert await asyncio.wait_for(other.answered_or_ended(served), 60)
                refused = await other.open(WATCH)
                await other.send(refused, frame, end=True)
                assert not await asyncio.wait_for(other.answered_or_ended(refused), 60)
                code, details = await _code(_watch(ch).read())
                assert "max_health_watches" in details, (code, details)
                check = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=30
                )
                assert check.status == health_pb2.HealthCheckResponse.SERVING
                assert served not in other.closed  # the served one is still open
            finally:
                await other.close()
                for w in held:
                    w.cancel()

    asyncio.run(run())


CHECK = "/grpc.health.v1.Health/Check"
CHECK_CAP = 4  # the least max_health_checks_per_peer taken (the probes may overlap)


async def _checks_held_are_capped_per_address(address: str, server_log) -> None:
    """127.0.0.1 holds CHECK_CAP Checks whose message never arrives whole (each can hold up to
    max_message_bytes): its next Check is refused naming max_health_checks_per_peer,
    while another address (127.0.0.2) is still answered; once the server ends the held
    ones (stream_idle_timeout_s), 127.0.0.1 is answered again."""
    host, port = address.rsplit(":", 1)
    h2 = await H2(host, int(port)).connect()
    sids = [await h2.open(CHECK) for _ in range(CHECK_CAP)]
    for sid in sids:
        await h2.send(sid, BODIES["part of a message"])

    def state() -> str:
        return (
            f"ended {sorted(h2.closed)} of {sids}, answered {sorted(h2.answered)}, "
            f"endings {h2.endings}; server log:\n{server_log()[-3000:]}"
        )

    async def check(ch) -> tuple[grpc.StatusCode, str]:
        call = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
        return await _code(call)

    whole = grpc_frame(health_pb2.HealthCheckRequest().SerializeToString())
    other = await H2(host, int(port), local_host="127.0.0.2").connect()
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            # the held ones are counted as their headers arrive: until then a Check made
            # here may still be answered (it ends at once, and gives its count back)
            async def refused() -> str | None:
                code, details = await check(ch)
                return details if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None

            async with asyncio.timeout(60):
                while (details := await refused()) is None:
                    await asyncio.sleep(0.05)
            assert "max_health_checks_per_peer" in details and "this address" in details, details
            assert not h2.closed and not h2.answered, state()  # the held ones still held
            served = await other.open(CHECK)
            await other.send(served, whole, end=True)
            assert await asyncio.wait_for(other.answered_or_ended(served), 60), state()
            async with asyncio.timeout(120):
                await h2.ended(sids)
            assert not h2.answered, state()  # ended with a status, no answer
            assert all(b"stream_idle_timeout_s" in h2.endings[sid] for sid in sids), state()
            assert await check(ch) == (grpc.StatusCode.OK, "")
    finally:
        await other.close()
        await h2.close()


def test_health_checks_in_progress_are_capped_per_address(spawn_agent, etcd, start_router):
    """Check, open to anyone, had no cap at all: any number of Checks whose message never
    arrives whole, each holding up to max_message_bytes for stream_idle_timeout_s. Now
    max_health_checks_per_peer (CHECK_CAP here) per address, on an agent and on a router; no
    cap on the whole port, so one address cannot crowd out the kubelet's probes."""
    caps = {"max_health_checks_per_peer": CHECK_CAP, "stream_idle_timeout_s": IDLE_S}
    agent = spawn_agent(**caps)
    asyncio.run(_checks_held_are_capped_per_address(agent.address, lambda: agent.log))
    router = start_router(config=caps)
    asyncio.run(_checks_held_are_capped_per_address(router.address, lambda: router.log))
