"""One tenant's calls against every other's, on a real agent process (docs/security.md,
"Calls at once"):

- the agent's only cap on calls was one counter for its whole port (grpc.aio
  maximum_concurrent_rpcs, 256), health checks included, and a Put stream has no server
  deadline: a tenant that opened 256 Put streams and sent nothing had every other
  tenant's calls refused, and Health.Check too, which the chart's liveness probe asks
  (kubelet would restart the agent and its pool is lost). Now each tenant's calls in
  flight are counted (max_calls_per_tenant), health checks never, and the global cap is
  off by default;
- a client stream that sends nothing is now ended after stream_idle_timeout_s, its call
  given back to its tenant."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.attack import auth, tenants

from kvstore.v1 import agent_pb2, agent_pb2_grpc

OLD_GLOBAL_CAP = 256  # the agent's maximum_concurrent_rpcs before the fix


def secure_agent(spawn_agent, **cfg):
    return spawn_agent(allow_unauthenticated=False, tenants=tenants(), **cfg)


async def _idle_puts(stub, who: str, n: int, hold: asyncio.Event) -> list:
    """`n` Put streams of `who` that send nothing until `hold` is set."""

    async def nothing():
        await hold.wait()
        return
        yield  # an async generator that yields no message

    return [stub.Put(nothing(), metadata=auth(who), timeout=120) for _ in range(n)]


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_one_tenants_idle_put_streams_leave_other_tenants_and_health_served(spawn_agent):
    """acme opens as many idle Put streams as the agent used to serve calls at all (256).
    Before the fix globex's Stats and the health check got RESOURCE_EXHAUSTED. Now acme
    holds at most max_calls_per_tenant (default 128) calls, its next call is refused
    naming that key, and globex, the cluster identity and Health.Check are served."""
    agent = secure_agent(spawn_agent)

    async def run() -> None:
        hold = asyncio.Event()
        async with grpc.aio.insecure_channel(agent.address) as ch:
            stub = agent_pb2_grpc.NodeAgentStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            puts = await _idle_puts(stub, "acme", OLD_GLOBAL_CAP, hold)
            try:
                # acme's streams past its 128 are refused as they arrive, the rest held.
                # (acme makes no other call until they have all arrived: one made while
                # they were arriving could take a call and have a stream refused instead.)
                async def settled() -> list:
                    while sum(p.done() for p in puts) < OLD_GLOBAL_CAP - 128:
                        await asyncio.sleep(0.05)
                    return [p for p in puts if p.done()]

                ended = await asyncio.wait_for(settled(), 60)
                assert len(ended) == OLD_GLOBAL_CAP - 128, len(ended)
                assert {await _code(p) for p in ended} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
                # Before the fix nothing was refused above (the port's cap was 256), and
                # everyone's next call was.
                try:
                    await stub.Stats(agent_pb2.StatsRequest(), metadata=auth("acme"), timeout=10)
                    raise AssertionError("acme was served while it held 128 calls")
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    assert "max_calls_per_tenant" in exc.details(), exc.details()
                check = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert check.status == health_pb2.HealthCheckResponse.SERVING
                for who in ("globex", "_cluster"):
                    await stub.Stats(agent_pb2.StatsRequest(), metadata=auth(who), timeout=10)
            finally:
                hold.set()
                for p in puts:
                    p.cancel()

    asyncio.run(run())


def test_an_idle_put_stream_is_ended_and_its_call_given_back(spawn_agent):
    """Before the fix a Put stream that sent nothing was held open until its caller let
    go. Now it is ended with DEADLINE_EXCEEDED naming stream_idle_timeout_s (the client's
    own deadline is far later), and its tenant's call is given back: with
    max_calls_per_tenant 1, the tenant's next call is served."""
    agent = secure_agent(spawn_agent, max_calls_per_tenant=1, stream_idle_timeout_s=1.0)

    async def run() -> None:
        hold = asyncio.Event()
        async with grpc.aio.insecure_channel(agent.address) as ch:
            stub = agent_pb2_grpc.NodeAgentStub(ch)
            (put,) = await _idle_puts(stub, "acme", 1, hold)
            try:
                await put
                raise AssertionError("an idle Put stream was answered")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
                assert "stream_idle_timeout_s" in exc.details(), exc.details()
            finally:
                hold.set()
            await stub.Stats(agent_pb2.StatsRequest(), metadata=auth("acme"), timeout=10)

    asyncio.run(run())
