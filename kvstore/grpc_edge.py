"""The gRPC edge shared by the agent and the router: what every handler gets before and
after the servicer runs, so that bad input reads the same on every method.

- Request bytes that do not decode get INVALID_ARGUMENT with a short message. grpc.aio
  runs the request deserializer itself and, when it raises, logs a full traceback and
  answers UNKNOWN; so the deserializer is replaced by one that never raises but hands the
  handler an `Undecodable` marker, which the wrapped handler refuses (for a request
  stream, at the message that does not decode).
- The core's error hierarchy (kvstore.errors.KvError) becomes one status code each.
- A method the servicer does not implement (NotImplementedError, as generated stubs
  raise) is UNIMPLEMENTED. Any other exception is a bug: logged once, on one line (the
  innermost frames, no traceback), and answered INTERNAL, never UNKNOWN.

- Every method is served as a request stream, unary ones included, so that its handler
  starts (and its caller is counted, `CallGate`) when the call's headers arrive. grpc.aio
  starts a unary-request handler only once the whole message has arrived: a call that
  sent part of its message, or none, was held in memory, uncounted, for as long as its
  caller kept the connection open. A unary method's one message is read by the wrapper
  (`_one_message`) and handed to the real handler as grpc.aio would have. (A caller of
  the interceptors that hands them whole messages, the agent's local lane, says so in
  the call details, `message_whole`: its unary methods stay unary.)
- A request that sends no message for `idle_s` seconds is ended with DEADLINE_EXCEEDED:
  a unary call whose message has not arrived whole, a request stream between messages
  (a client stream has no server deadline of its own: an idle one would hold its call,
  and its caller's share of calls, for ever).

`authenticated` adds authentication on top of this (the agent's EdgeInterceptor in
node_agent/interceptors.py, the router's AuthEdge in router/access.py), and a `CallGate`
counts each caller's calls in flight.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import grpc

from kvstore import errors

_CODES = {
    name: getattr(grpc.StatusCode, name)
    for name in (
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "FAILED_PRECONDITION",
        "RESOURCE_EXHAUSTED",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "UNAVAILABLE",
        "DATA_LOSS",
        "DEADLINE_EXCEEDED",
        "INTERNAL",
    )
}
_DETAIL_CHARS = 200


def status_for(exc: errors.KvError) -> grpc.StatusCode:
    return _CODES.get(exc.code, grpc.StatusCode.INTERNAL)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a safe deserializer returns for bytes that are not the request message."""

    message: str


def safe_deserializer(deserialize, method: str):
    """`deserialize`, returning Undecodable instead of raising."""
    what = method.rsplit("/", 1)[-1] or method

    def decode(raw: bytes):
        try:
            return deserialize(raw)
        except Exception as exc:  # DecodeError, and whatever else a parser may raise
            reason = str(exc).split(":")[-1].strip() or type(exc).__name__
            return Undecodable(
                f"{what} request of {len(raw)} bytes does not parse: {reason}"[:_DETAIL_CHARS]
            )

    return decode


def check_decoded(request) -> None:
    if isinstance(request, Undecodable):
        raise errors.InvalidArgument(request.message)


_ENDED = object()  # what _next returns at the end of a request stream


async def _next(it, method: str, idle_s: float, what: str):
    """The next request message of `it`, checked, or _ENDED; DeadlineExceeded when it
    does not arrive whole within `idle_s` seconds (0: no limit)."""
    try:
        if idle_s > 0:
            async with asyncio.timeout(idle_s):
                request = await anext(it)
        else:
            request = await anext(it)
    except StopAsyncIteration:
        return _ENDED
    except TimeoutError:
        name = method.rsplit("/", 1)[-1]
        raise errors.DeadlineExceeded(
            f"{name} {what} for {idle_s:g} s (stream_idle_timeout_s): ended"
        ) from None
    check_decoded(request)
    return request


async def _checked_stream(requests, method: str, idle_s: float):
    """The request stream, each message checked; DeadlineExceeded when none comes for
    `idle_s` seconds (0: no limit)."""
    it = aiter(requests)
    while (request := await _next(it, method, idle_s, "stream sent no message")) is not _ENDED:
        yield request


async def _one_message(requests, method: str, idle_s: float):
    """A unary method's request: the first message of its stream, checked, when it has
    arrived whole within `idle_s` seconds (anything sent after it is never read)."""
    request = await _next(aiter(requests), method, idle_s, "request did not arrive whole")
    if request is _ENDED:
        name = method.rsplit("/", 1)[-1]
        raise errors.InvalidArgument(f"{name} call sent no request message")
    return request


def log_unexpected(log: logging.Logger, method: str, exc: BaseException) -> str:
    """One ERROR line naming the exception and the innermost frames it came through
    (no multi-line traceback); returns the short details the caller is told."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames))
    text = f"{type(exc).__name__}: {exc}"[:_DETAIL_CHARS]
    log.error("%s failed unexpectedly: %s (at %s)", method, text, where or "?")
    return f"internal error in {method.rsplit('/', 1)[-1]}: {text}"


class _Call:
    """One method's wrapping: `before(context)` runs first, as the call starts and before
    its request is read (authentication, admission), and may return a function to run
    once the call is over (its release), whatever ends it."""

    def __init__(
        self, method: str, log: logging.Logger, before=None, idle_s: float = 0.0, whole=False
    ):
        self.method, self.log, self.before, self.idle_s = method, log, before, idle_s
        self.whole = whole  # a unary method's handler gets its message, not a stream

    async def _fail(self, context, exc: Exception):
        if isinstance(exc, grpc.aio.AbortError):
            raise exc  # the servicer aborted with its own status: already answered
        if isinstance(exc, errors.KvError):
            await context.abort(status_for(exc), str(exc))
        if isinstance(exc, NotImplementedError):  # a generated stub's unimplemented method
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.method} is not implemented")
        await context.abort(grpc.StatusCode.INTERNAL, log_unexpected(self.log, self.method, exc))

    async def _request(self, requests, stream_request: bool):
        """The request as the servicer's handler takes it, from the request stream."""
        if stream_request:
            return _checked_stream(requests, self.method, self.idle_s)
        if self.whole:
            check_decoded(requests)
            return requests
        return await _one_message(requests, self.method, self.idle_s)

    def unary(self, fn, stream_request: bool):
        async def handler(requests, context):
            release = None
            try:
                if self.before is not None:
                    release = self.before(context)
                request = await self._request(requests, stream_request)
                return await fn(request, context)
            except Exception as exc:
                await self._fail(context, exc)
            finally:
                if release is not None:
                    release()

        return handler

    def stream(self, fn, stream_request: bool):
        if not inspect.isasyncgenfunction(fn):
            # A handler that writes its responses itself (context.write), as grpc_health's
            # aio Watch does: awaited, not iterated.
            return self.unary(fn, stream_request)

        async def handler(requests, context):
            release = None
            try:
                if self.before is not None:
                    release = self.before(context)
                request = await self._request(requests, stream_request)
                async for item in fn(request, context):
                    yield item
            except Exception as exc:
                await self._fail(context, exc)
            finally:
                if release is not None:
                    release()

        return handler


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    method: str,
    log: logging.Logger,
    before=None,
    idle_s: float = 0.0,
    whole: bool = False,
) -> grpc.RpcMethodHandler:
    """`handler` with a safe deserializer and the error mapping above, served as a request
    stream whatever its kind (`before` runs as the call starts); `idle_s`: how long a
    request may go without a message (0: no limit). `whole`: the caller hands unary
    methods their message whole (the local lane): they stay unary."""
    call = _Call(method, log, before, idle_s, whole)
    deser = handler.request_deserializer
    if deser is not None:
        deser = safe_deserializer(deser, method)
    ser = handler.response_serializer
    unary_kinds = (
        (grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler)
        if whole
        else (grpc.stream_unary_rpc_method_handler, grpc.stream_stream_rpc_method_handler)
    )
    if handler.unary_unary:
        return unary_kinds[0](call.unary(handler.unary_unary, False), deser, ser)
    if handler.unary_stream:
        return unary_kinds[1](call.stream(handler.unary_stream, False), deser, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            call.unary(handler.stream_unary, True), deser, ser
        )
    return grpc.stream_stream_rpc_method_handler(
        call.stream(handler.stream_stream, True), deser, ser
    )


def refusal(handler: grpc.RpcMethodHandler, method: str, exc: errors.KvError):
    """A handler for `method` that answers `exc`'s status without reading the request.

    grpc.aio hands a unary-request handler its message whole, so a call refused inside it
    (authentication included) has already been received and held in memory, up to
    max_receive_message_length per call. A request-streaming handler that never iterates
    its requests leaves them unread: the transport's flow-control window (per stream) is
    all that is taken off the wire before the status ends the call. Always stream-unary:
    with no message sent, the status reads the same to every kind of caller."""
    code, details = status_for(exc), str(exc)

    async def refuse(requests, context):
        await context.abort(code, details)

    deser = handler.request_deserializer
    return grpc.stream_unary_rpc_method_handler(
        refuse,
        None if deser is None else safe_deserializer(deser, method),
        handler.response_serializer,
    )


class ErrorEdge(grpc.aio.ServerInterceptor):
    """wrap_handler on every method of a server (health checks included). Put it last
    in the interceptor list, so the ones before it see the statuses it answers."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        return wrap_handler(handler, details.method, self._log)


# Served to anyone, never counted against a caller; Watch streams are counted by peer
# address and on the whole port (WatchGate), Check calls in progress by peer address only
# (check_gate): a cap on the whole port would let one caller crowd out the probes.
OPEN_METHODS = ("/grpc.health.v1.Health/",)
WATCH_METHOD = "/grpc.health.v1.Health/Watch"
CHECK_METHOD = "/grpc.health.v1.Health/Check"


def keepalive_options(every_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """A server's options for pinging its clients (keepalive_s, keepalive_timeout_s): a
    PING every `every_s` on every connection, idle or not, whether or not the server has
    sent data since the last one; a connection whose client does not answer within
    `timeout_s` is closed and its calls cancelled. No options (no pings) when `every_s`
    is 0."""
    if every_s <= 0:
        return []
    return [
        ("grpc.keepalive_time_ms", max(1, round(every_s * 1000))),
        ("grpc.keepalive_timeout_ms", max(1, round(timeout_s * 1000))),
        # Any PING, the transport's own (BDP) included: one unanswered holds back the
        # keepalive PINGs, and gRPC's default wait for it is a minute.
        ("grpc.http2.ping_timeout_ms", max(1, round(timeout_s * 1000))),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def connection_options(max_connections: int, handshake_timeout_s: float) -> list[tuple[str, int]]:
    """A server's options for its TCP connections (max_connections, handshake_timeout_s):
    at most `max_connections` open at once (gRPC closes one over it as it arrives; 0: no
    cap), and each closed unless its handshake (TLS, HTTP/2's preface) is done within
    `handshake_timeout_s`. A connection that sends nothing costs its client nothing and
    the server a file descriptor: uncapped, a stranger's took all of an agent's."""
    options = [("grpc.server_handshake_timeout_ms", max(1, round(handshake_timeout_s * 1000)))]
    if max_connections > 0:
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    return options


class CallGate:
    """Calls in flight per caller, at most `cap` each (0: no cap), so that one caller
    cannot hold every call a server serves at once; callers in `exempt` (None: a
    development caller without a token) are not counted. `setting` names the cap in
    the refusal, `who` whose calls they are."""

    def __init__(
        self, cap: int, setting: str, exempt: tuple = (None,), who: str = "this caller"
    ) -> None:
        self.cap, self.setting, self.exempt, self.who = cap, setting, exempt, who
        self._held: dict[Hashable, int] = {}

    def enter(self, caller: Hashable) -> Callable[[], None] | None:
        """Count one call of `caller`: its release, or ResourceExhausted at the cap."""
        if not self.cap or caller in self.exempt:
            return None
        held = self._held.get(caller, 0)
        if held >= self.cap:
            raise errors.ResourceExhausted(
                f"{self.who} has {held} calls in progress here, its limit ({self.setting}: "
                f"{self.cap}); retry once some have ended"
            )
        self._held[caller] = held + 1
        return lambda: self._leave(caller)

    def _leave(self, caller: Hashable) -> None:
        left = self._held.get(caller, 0) - 1
        if left > 0:
            self._held[caller] = left
        else:
            self._held.pop(caller, None)

    def held(self, caller: Hashable) -> int:
        return self._held.get(caller, 0)


def peer_host(peer: str) -> str:
    """A gRPC peer string's address without its port ("ipv4:10.0.0.5:41234" ->
    "ipv4:10.0.0.5", "ipv6:[::1]:5" -> "ipv6:[::1]"); others ("unix:...") as they are."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


def check_gate(per_peer: int) -> CallGate:
    """Health.Check calls in progress from one peer address (its host), at most
    `per_peer` (max_health_checks_per_peer; 0: no cap). A Check is answered at once once
    its message has arrived, but one whose message arrives slowly holds up to
    max_message_bytes for up to stream_idle_timeout_s. The kubelet's probes make one call
    per probe at a time, from the node's address (gRPC probes) or the pod's loopback
    (the chart's exec probes with TLS): a caller sharing that address (a host-network
    pod, a process of the node) shares the cap with them."""
    return CallGate(per_peer, "max_health_checks_per_peer", (), "this address")


class WatchGate:
    """Health.Watch streams open at once: at most `total` (max_health_watches) on the
    server and `per_peer` (max_health_watches_per_peer) from one peer address; 0: no
    cap. Watch is open to anyone and a stream lasts as long as its caller wants."""

    def __init__(self, total: int, per_peer: int) -> None:
        self._all = CallGate(total, "max_health_watches", (), "this server")
        self._peer = CallGate(per_peer, "max_health_watches_per_peer", (), "this address")

    def enter(self, context) -> Callable[[], None] | None:
        first = self._all.enter("")
        try:
            second = self._peer.enter(peer_host(context.peer()))
        except errors.ResourceExhausted:
            if first is not None:
                first()
            raise
        releases = [r for r in (first, second) if r is not None]

        def release() -> None:
            for r in releases:
                r()

        return release


@dataclass(frozen=True, slots=True)
class Admission:
    """How an authenticating edge admits a call: `resolve(metadata)` names the caller
    (Unauthenticated when it cannot), `bind(caller)` hands it to the servicer (a context
    variable); `gate` counts its calls in flight, `watches` the open Health.Watch
    streams, `checks` the Health.Check calls in progress per address (check_gate);
    `idle_s` as in wrap_handler (stream_idle_timeout_s)."""

    resolve: Callable
    bind: Callable
    gate: CallGate | None = None
    idle_s: float = 0.0
    watches: WatchGate | None = None
    checks: CallGate | None = None


def _open_gate(method: str, admission: Admission) -> Callable | None:
    """What counts an open (health) call as it starts: Watch streams, Check calls by peer
    address; None: not counted."""
    if method == WATCH_METHOD and admission.watches is not None:
        return admission.watches.enter
    checks = admission.checks
    if method == CHECK_METHOD and checks is not None:
        return lambda context: checks.enter(peer_host(context.peer()))
    return None


async def authenticated(continuation, details, log: logging.Logger, admission: Admission):
    """What an authenticating interceptor's intercept_service returns: health checks open
    to all (Watch streams, and Check calls per address, capped), any other method's
    caller resolved from the metadata alone, before its request is read (a refused
    caller's message is never received whole: `refusal`), then bound and counted as the
    call starts (its headers), before its message is read, and released when it ends,
    however it ends."""
    handler = await continuation(details)
    if handler is None:
        return None
    whole = getattr(details, "message_whole", False)  # the local lane's (whole frames)
    if details.method.startswith(OPEN_METHODS):
        return wrap_handler(
            handler,
            details.method,
            log,
            _open_gate(details.method, admission),
            admission.idle_s,
            whole,
        )
    try:
        caller = admission.resolve(details.invocation_metadata)
    except errors.Unauthenticated as exc:
        return refusal(handler, details.method, exc)
    gate = admission.gate

    def admit(_ctx):
        admission.bind(caller)
        return None if gate is None else gate.enter(caller)

    return wrap_handler(handler, details.method, log, admit, admission.idle_s, whole)
