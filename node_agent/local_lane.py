"""The agent's end of the same-host local lane (frames in kvstore/lane.py).

Each call goes through the gRPC server's own interceptor chain (RpcTelemetry: timing,
spans, observers; EdgeInterceptor: tenant from the bearer token, KvError -> status) and
the same AgentServicer method, so a Lookup over the lane is authorised, counted, traced
and answered exactly as over gRPC. The socket lives next to the clients' shared-memory
regions (/dev/shm): a client reaches it exactly when the agent could map its region.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from typing import NamedTuple

import grpc

from kvstore.grpc_edge import Undecodable, log_unexpected
from kvstore import lane
from kvstore.v1 import agent_pb2
from node_agent.shm import SHM_DIR

log = logging.getLogger("kvstore.agent")


class _Details(NamedTuple):  # what grpc.HandlerCallDetails carries
    method: str
    invocation_metadata: tuple


class _Abort(grpc.aio.AbortError):  # what context.abort raises, so the edge passes it on
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LaneContext:
    """The part of grpc.aio.ServicerContext the interceptors and servicer use."""

    __slots__ = ("_meta",)

    def __init__(self, meta: tuple) -> None:
        self._meta = meta

    def invocation_metadata(self) -> tuple:
        return self._meta

    def peer(self) -> str:
        return "unix:local-lane"

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        raise _Abort(code, details)


async def _once(item):
    yield item


class LocalLane:
    """Serves Lookup, shared-memory Get and Put on a Unix socket."""

    def __init__(self, servicer, interceptors: list, directory: str = SHM_DIR) -> None:
        self.path = os.path.join(
            directory, f"kvstore-agent-{os.getpid()}-{secrets.token_hex(4)}.sock"
        )
        self._interceptors = list(interceptors)
        self._handlers = {
            "Lookup": grpc.unary_unary_rpc_method_handler(
                servicer.Lookup, agent_pb2.LookupRequest.FromString, _serialize
            ),
            "Get": grpc.unary_stream_rpc_method_handler(
                servicer.Get, agent_pb2.GetRequest.FromString, _serialize
            ),
            "Put": grpc.stream_unary_rpc_method_handler(
                servicer.Put, agent_pb2.PutRequest.FromString, _serialize
            ),
        }
        self._server: asyncio.AbstractServer | None = None
        self.calls = 0  # framed calls answered (Stats counters: local_lane_calls)
        self.connections = 0  # connections accepted

    async def start(self) -> None:
        stale = remove_stale_sockets(os.path.dirname(self.path))
        if stale:
            log.info("removed %d local-lane sockets of agents that are gone", stale)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        # Anyone who can reach /dev/shm may connect, as anyone may reach the gRPC port:
        # every call still authenticates with the tenant's bearer token.
        os.chmod(self.path, 0o666)
        log.info("local lane on %s", self.path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ serving
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections += 1
        try:
            while True:
                head = await reader.readexactly(lane.REQUEST_HEADER.size)
                n, method, meta_len = lane.REQUEST_HEADER.unpack(head)
                if n > lane.MAX_FRAME_BYTES or meta_len > n:
                    writer.write(
                        lane.response_frame(
                            grpc.StatusCode.INVALID_ARGUMENT.value[0],
                            f"local-lane frame of {n} bytes (meta {meta_len}) refused; the "
                            f"limit is {lane.MAX_FRAME_BYTES}".encode(),
                        )
                    )
                    await writer.drain()
                    return  # the stream cannot be resynchronised: drop the connection
                body = await reader.readexactly(n)
                status, out = await self.call(method, body[:meta_len], body[meta_len:])
                writer.write(lane.response_frame(status, out))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            writer.close()

    async def call(self, method: int, raw_meta: bytes, message: bytes) -> tuple[int, bytes]:
        """One framed call -> (status number, response bytes or UTF-8 details)."""
        self.calls += 1
        name = lane.METHODS.get(method)
        if name is None:
            return _error(grpc.StatusCode.UNIMPLEMENTED, f"local-lane method {method} unknown")
        try:
            meta = lane.decode_meta(raw_meta)
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(grpc.StatusCode.INVALID_ARGUMENT, f"local-lane metadata: {exc}")
        handler = await self._intercepted(0, _Details(lane.SERVICE + name, meta))
        # The edge's deserializer (kvstore/grpc_edge.py) never raises: bad bytes come back
        # as Undecodable, refused here before any check below reads the request.
        request = handler.request_deserializer(message)
        if isinstance(request, Undecodable):
            return _error(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if name == "Get" and not request.HasField("shm"):
            return _error(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the local lane serves shared-memory Gets only (set shm)",
            )
        ctx = LaneContext(meta)
        try:
            if handler.unary_unary:
                response = await handler.unary_unary(request, ctx)
            elif handler.unary_stream:
                responses = [r async for r in handler.unary_stream(request, ctx)]
                response = responses[-1]  # a shared-memory Get answers once
            else:
                response = await handler.stream_unary(_once(request), ctx)
        except _Abort as exc:
            return _error(exc.code, exc.details)
        except Exception as exc:  # a bug: the edge answers the servicer's own errors
            return _error(grpc.StatusCode.INTERNAL, log_unexpected(log, f"local-lane {name}", exc))
        return lane.OK, handler.response_serializer(response)

    async def _intercepted(self, i: int, details: _Details):
        """The handler after interceptors i.. (the order grpc.aio.server applies them)."""
        if i == len(self._interceptors):
            return self._handlers[details.method.rsplit("/", 1)[-1]]
        return await self._interceptors[i].intercept_service(
            lambda d: self._intercepted(i + 1, d), details
        )


def _error(code: grpc.StatusCode, details: str) -> tuple[int, bytes]:
    return code.value[0], details.encode()


def _serialize(msg) -> bytes:
    return msg.SerializeToString()


def remove_stale_sockets(directory: str) -> int:
    """Unlink local-lane sockets nobody listens on (their agent was killed, so it could
    not remove its own); a live agent's socket accepts the probe and stays."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not (name.startswith("kvstore-agent-") and name.endswith(".sock")):
            continue
        path = os.path.join(directory, name)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.5)
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                try:
                    os.unlink(path)
                    removed += 1
                except OSError:
                    pass
            except OSError:
                pass  # not ours to judge (permissions, a slow agent): leave it
    return removed
