"""The shared gRPC edge (kvstore/grpc_edge.py) on a real grpc.aio server, with a servicer
that injects faults: an unexpected exception is INTERNAL with short details and one log
line (no traceback), an unimplemented method UNIMPLEMENTED, a servicer's own abort and a
KvError keep their status, and undecodable bytes are INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvstore.grpc_edge import ErrorEdge
from kvstore import errors
from kvstore.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger("kvstore.test.edge")


class Faulty(router_pb2_grpc.RouterServicer):
    """Route raises by request id; Release is left unimplemented (the base class)."""

    async def Route(self, request, context):
        if request.request_id == "bug":
            raise KeyError("no such thing")
        if request.request_id == "kv":
            raise errors.FailedPrecondition("stale generation 3")
        if request.request_id == "abort":
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "own status")
        return router_pb2.RouteResponse(node_id="n")


async def _calls() -> list[tuple[grpc.StatusCode, str]]:
    server = grpc.aio.server(interceptors=[ErrorEdge(log)])
    router_pb2_grpc.add_RouterServicer_to_server(Faulty(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            raw = ch.unary_unary("/kvstore.v1.Router/Route")
            calls = [
                lambda rid=rid: stub.Route(router_pb2.RouteRequest(request_id=rid), timeout=10)
                for rid in ("bug", "kv", "abort", "ok")
            ]
            calls += [
                lambda: stub.Release(router_pb2.ReleaseRequest(), timeout=10),
                lambda: raw(b"\xff\xff\xff", timeout=10),
            ]
            for call in calls:
                try:
                    await call()
                    out.append((grpc.StatusCode.OK, ""))
                except grpc.aio.AioRpcError as exc:
                    out.append((exc.code(), exc.details()))
    finally:
        await server.stop(0)
    return out


def test_edge_statuses_and_one_brief_log_line(caplog):
    with caplog.at_level(logging.DEBUG):
        got = asyncio.run(_calls())
    codes = [c for c, _ in got]
    assert codes == [
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.OK,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]
    assert got[0][1] == "internal error in Route: KeyError: 'no such thing'"
    assert got[1][1] == "stale generation 3" and got[2][1] == "own status"
    assert got[5][1].startswith("Route request of 3 bytes does not parse")
    mine = [r for r in caplog.records if r.name == log.name]
    assert len(mine) == 1 and mine[0].levelno == logging.ERROR  # the bug, once
    assert "KeyError" in mine[0].getMessage() and "test_grpc_edge.py" in mine[0].getMessage()
    assert mine[0].exc_info is None and "\n" not in mine[0].getMessage()
    grpc_logs = [
        r for r in caplog.records if r.name.startswith("grpc") and r.levelno >= logging.WARNING
    ]
    assert not grpc_logs, [r.getMessage() for r in grpc_logs]
