"""Health.Watch on a real agent and a real router: before the fix the shared edge
iterated every server-streaming handler, but grpc_health's aio Watch is a coroutine that
writes its answers itself (context.write), so Watch failed INTERNAL ("'async for'
requires an object with __aiter__ method, got coroutine") on both. Now a handler that
writes its own responses is awaited, and Watch streams the serving status."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def first_watched(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stream = health_pb2_grpc.HealthStub(ch).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=30
        )
        try:
            return next(stream).status
        finally:
            stream.cancel()


def test_watch_streams_the_agents_status(spawn_agent):
    agent = spawn_agent()
    assert first_watched(agent.address, "") == SERVING
    assert first_watched(agent.address, "kvstore.v1.NodeAgent") == SERVING


def test_watch_streams_the_routers_status(start_router):
    router = start_router()
    assert first_watched(router.address, "") == SERVING
    assert first_watched(router.address, "kvstore.v1.Router") == SERVING
