"""The agent's end of the same-host local lane (frames in kvstore/lane.py).

Each call goes through the gRPC server's own interceptor chain (RpcTelemetry: timing,
spans, observers; EdgeInterceptor: tenant from the bearer token, KvError -> status) and
the same AgentServicer method, so a Lookup over the lane is authorised, counted, traced
and answered exactly as over gRPC. The socket lives next to where same-host clients share
memory (/dev/shm, which containers on one host share to talk to their agent).

The lane is a door into the agent's memory, so it is kept narrow: the socket is 0600 (0660
with `local_lane_group`) from the moment it exists; a connecting peer's credentials
(SO_PEERCRED) must be the agent's user, root or a member of that group; at most
`local_lane_max_connections` connections, of which one tenant holds at most
`local_lane_max_connections_per_tenant` (refused FAILED_PRECONDITION, which clients take
for "no lane" and go on over gRPC; a connection's tenant is its first frame's;
at the cap a new connection takes the place of the oldest that has sent no frame yet,
so connections that never authenticate cannot hold the lane either); a connection
holding no shared-memory region is closed after `local_lane_idle_timeout_s` without a
frame, one holding a region after `local_lane_region_idle_timeout_s` (the client
registers again on its next call), and a frame that has begun must arrive whole within
the first; a frame's header and metadata are read and its caller authenticated before
any of its message is read. Every refusal is answered with a status, logged and counted
(Stats counters local_lane_*).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from kvstore import errors, lane
from kvstore.auth import TokenTable
from kvstore.grpc_edge import Undecodable, log_unexpected
from kvstore.process import StartupError
from kvstore.v1 import agent_pb2
from node_agent.lane_socket import FrameReader, PeerCred, bind_listener, peer_allowed, peer_cred
from node_agent.shm import SHM_DIR, FdOffer, shm_offer

log = logging.getLogger("kvstore.agent")
MAX_REGIONS_PER_CONNECTION = 4  # a client registers one staging area
_ANY = object()  # a connection's tenant before its first frame


class _Details(NamedTuple):  # what grpc.HandlerCallDetails carries
    method: str
    invocation_metadata: tuple
    # A frame is read whole before its call starts (under the lane's own caps and idle
    # timeout): the shared edge keeps unary methods unary (kvstore/grpc_edge.py).
    message_whole: bool = True


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


@dataclass(frozen=True, slots=True)
class LaneLimits:
    group: str = ""  # "": socket 0600, the agent's user (and root) only
    max_connections: int = 80
    idle_timeout_s: float = 30.0
    # 0: all but a fifth of max_connections (at least 1 kept for the others): a lone
    # tenant keeps the 64 connections the lane had before per-tenant caps at the default
    max_connections_per_tenant: int = 0
    region_idle_timeout_s: float = 600.0

    @property
    def per_tenant(self) -> int:
        n = self.max_connections
        return self.max_connections_per_tenant or max(1, n - max(1, n // 5))


@dataclass(slots=True)
class LaneCounters:
    calls: int = 0  # framed calls answered
    connections: int = 0  # connections accepted
    refused_full: int = 0  # turned away at max_connections
    refused_tenant_full: int = 0  # first frame of a tenant at max_connections_per_tenant
    shed_unauthenticated: int = 0  # closed at max_connections to admit a new one
    refused_peer: int = 0  # peer credentials not allowed
    refused_frames: int = 0  # oversized or unauthenticated frames (connection closed)
    idle_closed: int = 0  # closed for idling or a frame that stalled
    fds_closed: int = 0  # descriptors past MAX_HELD_FDS, closed as they arrived
    accept_failed: int = 0  # accepts that failed (out of descriptors), retried

    def as_stats(self) -> dict[str, int]:
        return {
            "local_lane_calls": self.calls,
            "local_lane_connections": self.connections,
            "local_lane_refused_full": self.refused_full,
            "local_lane_refused_tenant_full": self.refused_tenant_full,
            "local_lane_shed_unauthenticated": self.shed_unauthenticated,
            "local_lane_refused_peer": self.refused_peer,
            "local_lane_refused_frames": self.refused_frames,
            "local_lane_idle_closed": self.idle_closed,
            "local_lane_fds_closed": self.fds_closed,
            "local_lane_accept_failed": self.accept_failed,
        }


# accept() errors that pass once descriptors or memory are free again
_ACCEPT_RETRY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(slots=True, eq=False)
class _Conn:
    sock: socket.socket
    reader: FrameReader
    cred: PeerCred
    tenant: Any = _ANY
    regions: set[int] = field(default_factory=set)
    task: asyncio.Task | None = None  # the one serving it


def lane_gid(group: str) -> int | None:
    """The gid of `local_lane_group` (a name or a number; None: none); StartupError
    naming a group this host lacks."""
    if not group:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise StartupError(f"local_lane_group {group!r}: no such group on this host") from None


class LocalLane:
    """Serves Lookup, shared-memory Get and Put, and RegisterShm on a Unix socket."""

    def __init__(
        self,
        servicer,
        interceptors: list,
        tokens: TokenTable,
        limits: LaneLimits = LaneLimits(),
        directory: str = SHM_DIR,
    ) -> None:
        self.path = os.path.join(
            directory, f"kvstore-agent-{os.getpid()}-{secrets.token_hex(4)}.sock"
        )
        self.lane_id = secrets.token_bytes(lane.LANE_ID_BYTES)  # LocalLaneResponse.lane_id
        self._interceptors = list(interceptors)
        self._tokens = tokens
        self._limits = limits
        self._gid = lane_gid(limits.group)
        self._shm = servicer.shm
        self._handlers = {
            name: fn(getattr(servicer, name), req.FromString, _serialize)
            for name, fn, req in (
                ("Lookup", grpc.unary_unary_rpc_method_handler, agent_pb2.LookupRequest),
                ("Get", grpc.unary_stream_rpc_method_handler, agent_pb2.GetRequest),
                ("Put", grpc.stream_unary_rpc_method_handler, agent_pb2.PutRequest),
                ("RegisterShm", grpc.unary_unary_rpc_method_handler, agent_pb2.RegisterShmRequest),
            )
        }
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._conns: dict[_Conn, None] = {}  # in the order they were admitted
        self.counters = LaneCounters()

    async def start(self) -> None:
        stale = remove_stale_sockets(os.path.dirname(self.path))
        if stale:
            log.info("removed %d local-lane sockets of agents that are gone", stale)
        mode = 0o600 if self._gid is None else 0o660
        self._listener = bind_listener(self.path, mode, self._gid)
        self._accepting = asyncio.create_task(self._accept())
        log.info("local lane on %s (mode %o)", self.path, mode)

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            self._accepting = None
        for conn in list(self._conns):
            conn.sock.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # ------------------------------------------------------------------ serving
    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task] = set()
        while self._listener is not None:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except ConnectionAbortedError:
                continue  # the caller left before its accept
            except OSError as exc:
                if exc.errno not in _ACCEPT_RETRY:
                    log.exception("local lane: accept failed; the lane takes no connections")
                    raise
                # Out of descriptors or memory: this loop is the lane's only way in, so it
                # waits and goes on (as asyncio's own servers do) rather than end, which
                # left the lane dead until the agent restarted.
                self.counters.accept_failed += 1
                log.warning("local lane: accept failed (%s); retrying in 1 s", exc)
                await asyncio.sleep(1.0)
                continue
            sock.setblocking(False)
            task = asyncio.create_task(self._serve(sock))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        conn = None
        try:
            conn = await self._admit(sock, loop)
            if conn is not None:
                await self._frames(conn, loop)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            if conn is not None:
                self._conns.pop(conn, None)
                for rid in conn.regions:  # a region lives as long as its connection
                    self._shm.drop(rid)
                conn.reader.close_fds()
            sock.close()

    async def _admit(self, sock: socket.socket, loop) -> _Conn | None:
        """Greet an allowed peer with the lane id; refuse anyone else, with a status."""
        cred = peer_cred(sock)
        refusal = None
        if len(self._conns) >= self._limits.max_connections and not self._shed_silent():
            self.counters.refused_full += 1
            refusal = _error(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the local lane holds its limit of {self._limits.max_connections} "
                "connections (local_lane_max_connections); use gRPC",
            )
        elif not peer_allowed(cred, self._gid):
            self.counters.refused_peer += 1
            refusal = _error(
                grpc.StatusCode.PERMISSION_DENIED,
                f"uid {cred.uid} may not use this agent's local lane (only uid "
                f"{os.getuid()}, root or local_lane_group members)",
            )
        if refusal is not None:
            why = refusal[1].decode()
            log.warning("local lane refused pid %d uid %d: %s", cred.pid, cred.uid, why)
            await loop.sock_sendall(sock, lane.response_frame(*refusal))
            return None
        self.counters.connections += 1
        await loop.sock_sendall(sock, lane.response_frame(lane.OK, self.lane_id))
        reader = FrameReader(sock, dropped=self._fds_closed)
        conn = _Conn(sock, reader, cred, task=asyncio.current_task())
        self._conns[conn] = None
        return conn

    def _fds_closed(self, n: int) -> None:
        self.counters.fds_closed += n

    def _shed_silent(self) -> bool:
        """Close the oldest connection that has sent no frame yet (its tenant unknown,
        so no per-tenant cap holds it), making room; False when every one has."""
        silent = next((c for c in self._conns if c.tenant is _ANY), None)
        if silent is None or silent.task is None:
            return False
        del self._conns[silent]
        silent.task.cancel()  # its _serve closes the socket
        self.counters.shed_unauthenticated += 1
        log.warning(
            "local lane full: closed a connection that sent no frame (pid %d)", silent.cred.pid
        )
        return True

    async def _frames(self, conn: _Conn, loop) -> None:
        idle = self._limits.idle_timeout_s
        while True:
            try:
                # A connection holding a region is a client's lifeline: it may idle far
                # longer (its client registers again when it finds it closed); others
                # for `idle` seconds, and a frame once begun must arrive within it.
                wait = self._limits.region_idle_timeout_s if conn.regions else idle
                async with asyncio.timeout(wait):
                    head = await conn.reader.read(lane.REQUEST_HEADER.size)
                async with asyncio.timeout(idle):
                    reply, keep = await self._frame(conn, *lane.REQUEST_HEADER.unpack(head))
            except TimeoutError:
                self.counters.idle_closed += 1
                log.info("local lane closed an idle connection (pid %d)", conn.cred.pid)
                return
            await loop.sock_sendall(conn.sock, reply)
            if not keep:
                return  # the stream cannot be resynchronised: drop the connection

    async def _frame(self, conn: _Conn, n: int, method: int, meta_len: int) -> tuple[bytes, bool]:
        """Read and answer one request -> (response frame, whether to read on)."""
        problem = lane.header_problem(n, meta_len)
        if problem is not None:
            return self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            meta = lane.decode_meta(bytes(await conn.reader.read(meta_len)))
        except (ValueError, UnicodeDecodeError) as exc:
            why = f"local-lane metadata: {exc}"
            return self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, why)
        try:  # before a byte of the message is read
            tenant = self._tokens.tenant(dict(meta).get("authorization", ""))
        except errors.Unauthenticated as exc:
            return self._refuse(conn, grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if conn.tenant is _ANY:
            if self._tenant_full(tenant):
                self.counters.refused_tenant_full += 1
                # FAILED_PRECONDITION: what clients (old ones too) take for "no lane
                # here" on RegisterShm, their first frame, and carry on over gRPC.
                return self._refuse(
                    conn,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"this tenant holds its limit of {self._limits.per_tenant} local-lane "
                    "connections (local_lane_max_connections_per_tenant); use gRPC",
                )
            conn.tenant = tenant
        elif conn.tenant != tenant:
            return self._refuse(
                conn, grpc.StatusCode.PERMISSION_DENIED, "a local-lane connection serves one tenant"
            )
        message = bytes(await conn.reader.read(n - meta_len))
        truncated = conn.reader.truncated
        fds = conn.reader.take_fds()
        try:
            status, out = await self.call(method, meta, message, conn, fds, truncated)
        finally:
            for fd in fds:
                os.close(fd)
        return lane.response_frame(status, out), True

    def _tenant_full(self, tenant: str | None) -> bool:
        """Whether `tenant` holds its share of connections already (development callers
        without a token, tenant None, are not capped: they may do anything anyway)."""
        if tenant is None:
            return False
        held = sum(1 for c in self._conns if c.tenant == tenant)
        return held >= self._limits.per_tenant

    def _refuse(self, conn: _Conn, code: grpc.StatusCode, details: str) -> tuple[bytes, bool]:
        self.counters.refused_frames += 1
        log.warning("local lane refused a frame from pid %d: %s", conn.cred.pid, details)
        return lane.response_frame(*_error(code, details)), False

    async def call(
        self, method: int, meta: tuple, message: bytes, conn: _Conn, fds: list[int], truncated: bool
    ) -> tuple[int, bytes]:
        """One framed call -> (status number, response bytes or UTF-8 details)."""
        self.counters.calls += 1
        name = lane.METHODS.get(method)
        if name is None:
            return _error(grpc.StatusCode.UNIMPLEMENTED, f"local-lane method {method} unknown")
        offer = self._offer(name, conn, fds, truncated)
        if isinstance(offer, tuple):
            return offer
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
        token = shm_offer.set(offer)
        try:
            response = await self._invoke(handler, request, LaneContext(meta))
        except _Abort as exc:
            return _error(exc.code, exc.details)
        except Exception as exc:  # a bug: the edge answers the servicer's own errors
            return _error(grpc.StatusCode.INTERNAL, log_unexpected(log, f"local-lane {name}", exc))
        finally:
            shm_offer.reset(token)
        if offer is not None:
            conn.regions.add(response.region_id)
        return lane.OK, handler.response_serializer(response)

    def _offer(
        self, name: str, conn: _Conn, fds: list[int], truncated: bool
    ) -> FdOffer | None | tuple[int, bytes]:
        """The descriptor a RegisterShm frame carries, or the error for what came with it."""
        if name != "RegisterShm":
            if fds or truncated:
                return _error(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "only RegisterShm frames may carry file descriptors",
                )
            return None
        if len(fds) != 1 or truncated:
            return _error(
                grpc.StatusCode.INVALID_ARGUMENT,
                "RegisterShm over the local lane carries exactly one file descriptor (the "
                f"staging memory, SCM_RIGHTS); got {'more than ' if truncated else ''}{len(fds)}",
            )
        if len(conn.regions) >= MAX_REGIONS_PER_CONNECTION:
            return _error(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a local-lane connection holds at most {MAX_REGIONS_PER_CONNECTION} regions",
            )
        return FdOffer(fds[0], conn.cred.pid, conn.cred.uid)

    @staticmethod
    async def _invoke(handler, request, ctx: LaneContext):
        if handler.unary_unary:
            return await handler.unary_unary(request, ctx)
        if handler.unary_stream:
            responses = [r async for r in handler.unary_stream(request, ctx)]
            return responses[-1]  # a shared-memory Get answers once
        return await handler.stream_unary(_once(request), ctx)

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
