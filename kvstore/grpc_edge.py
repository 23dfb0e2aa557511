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

- A request stream that sends no message for `idle_s` seconds is ended with
  DEADLINE_EXCEEDED (a client stream has no server deadline of its own: an idle one would
  hold its call, and its caller's share of calls, for ever).

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


async def _checked_stream(requests, method: str, idle_s: float):
    """The request stream, each message checked; DeadlineExceeded when none comes for
    `idle_s` seconds (0: no limit)."""
    it = aiter(requests)
    while True:
        try:
            if idle_s > 0:
                async with asyncio.timeout(idle_s):
                    request = await anext(it)
            else:
                request = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            what = method.rsplit("/", 1)[-1]
            raise errors.DeadlineExceeded(
                f"{what} stream sent no message for {idle_s:g} s (stream_idle_timeout_s): ended"
            ) from None
        check_decoded(request)
        yield request


def log_unexpected(log: logging.Logger, method: str, exc: BaseException) -> str:
    """One ERROR line naming the exception and the innermost frames it came through
    (no multi-line traceback); returns the short details the caller is told."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames))
    text = f"{type(exc).__name__}: {exc}"[:_DETAIL_CHARS]
    log.error("%s failed unexpectedly: %s (at %s)", method, text, where or "?")
    return f"internal error in {method.rsplit('/', 1)[-1]}: {text}"


class _Call:
    """One method's wrapping: `before(context)` runs first (authentication, admission) and
    may return a function to run once the call is over (its release)."""

    def __init__(self, method: str, log: logging.Logger, before=None, idle_s: float = 0.0):
        self.method, self.log, self.before, self.idle_s = method, log, before, idle_s

    async def _fail(self, context, exc: Exception):
        if isinstance(exc, grpc.aio.AbortError):
            raise exc  # the servicer aborted with its own status: already answered
        if isinstance(exc, errors.KvError):
            await context.abort(status_for(exc), str(exc))
        if isinstance(exc, NotImplementedError):  # a generated stub's unimplemented method
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.method} is not implemented")
        await context.abort(grpc.StatusCode.INTERNAL, log_unexpected(self.log, self.method, exc))

    def _admit(self, request, context, stream_request: bool):
        """(the request as the handler gets it, the release to run when the call ends)."""
        release = self.before(context) if self.before is not None else None
        if stream_request:
            return _checked_stream(request, self.method, self.idle_s), release
        check_decoded(request)
        return request, release

    def unary(self, fn, stream_request: bool):
        async def handler(request, context):
            release = None
            try:
                request, release = self._admit(request, context, stream_request)
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

        async def handler(request, context):
            release = None
            try:
                request, release = self._admit(request, context, stream_request)
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
) -> grpc.RpcMethodHandler:
    """`handler` with a safe deserializer and the error mapping above; `idle_s`: how long
    a request stream may go without a message (0: no limit)."""
    call = _Call(method, log, before, idle_s)
    deser = handler.request_deserializer
    if deser is not None:
        deser = safe_deserializer(deser, method)
    ser = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            call.unary(handler.unary_unary, False), deser, ser
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            call.stream(handler.unary_stream, False), deser, ser
        )
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


OPEN_METHODS = ("/grpc.health.v1.Health/",)  # served to anyone, never counted


class CallGate:
    """Calls in flight per caller, at most `cap` each (0: no cap), so that one caller
    cannot hold every call a server serves at once; callers in `exempt` (None: a
    development caller without a token) are not counted. `setting` names the cap in
    the refusal."""

    def __init__(self, cap: int, setting: str, exempt: tuple = (None,)) -> None:
        self.cap, self.setting, self.exempt = cap, setting, exempt
        self._held: dict[Hashable, int] = {}

    def enter(self, caller: Hashable) -> Callable[[], None] | None:
        """Count one call of `caller`: its release, or ResourceExhausted at the cap."""
        if not self.cap or caller in self.exempt:
            return None
        held = self._held.get(caller, 0)
        if held >= self.cap:
            raise errors.ResourceExhausted(
                f"this caller has {held} calls in progress here, its limit ({self.setting}: "
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


@dataclass(frozen=True, slots=True)
class Admission:
    """How an authenticating edge admits a call: `resolve(metadata)` names the caller
    (Unauthenticated when it cannot), `bind(caller)` hands it to the servicer (a context
    variable); `gate` counts its calls in flight; `idle_s` as in wrap_handler."""

    resolve: Callable
    bind: Callable
    gate: CallGate | None = None
    idle_s: float = 0.0


async def authenticated(continuation, details, log: logging.Logger, admission: Admission):
    """What an authenticating interceptor's intercept_service returns: health checks open
    to all, any other method's caller resolved from the metadata alone, before its
    request is read (a refused caller's message is never received whole: `refusal`),
    then bound and counted as the call starts, released when it ends."""
    handler = await continuation(details)
    if handler is None:
        return None
    if details.method.startswith(OPEN_METHODS):
        return wrap_handler(handler, details.method, log)
    try:
        caller = admission.resolve(details.invocation_metadata)
    except errors.Unauthenticated as exc:
        return refusal(handler, details.method, exc)
    gate = admission.gate

    def before(_ctx):
        admission.bind(caller)
        return None if gate is None else gate.enter(caller)

    return wrap_handler(handler, details.method, log, before, admission.idle_s)
