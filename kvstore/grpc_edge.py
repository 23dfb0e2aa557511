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

`EdgeInterceptor` in node_agent/interceptors.py and `AuthEdge` in router/access.py add
authentication on top of this.
"""

from __future__ import annotations

import logging
import traceback
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


async def _checked_stream(requests):
    async for request in requests:
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
    """One method's wrapping: `before(context)` runs first (authentication)."""

    def __init__(self, method: str, log: logging.Logger, before=None) -> None:
        self.method, self.log, self.before = method, log, before

    async def _fail(self, context, exc: Exception):
        if isinstance(exc, grpc.aio.AbortError):
            raise exc  # the servicer aborted with its own status: already answered
        if isinstance(exc, errors.KvError):
            await context.abort(status_for(exc), str(exc))
        if isinstance(exc, NotImplementedError):  # a generated stub's unimplemented method
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.method} is not implemented")
        await context.abort(grpc.StatusCode.INTERNAL, log_unexpected(self.log, self.method, exc))

    def unary(self, fn, stream_request: bool):
        async def handler(request, context):
            try:
                if self.before is not None:
                    self.before(context)
                if stream_request:
                    request = _checked_stream(request)
                else:
                    check_decoded(request)
                return await fn(request, context)
            except Exception as exc:
                await self._fail(context, exc)

        return handler

    def stream(self, fn, stream_request: bool):
        async def handler(request, context):
            try:
                if self.before is not None:
                    self.before(context)
                if stream_request:
                    request = _checked_stream(request)
                else:
                    check_decoded(request)
                async for item in fn(request, context):
                    yield item
            except Exception as exc:
                await self._fail(context, exc)

        return handler


def wrap_handler(
    handler: grpc.RpcMethodHandler, method: str, log: logging.Logger, before=None
) -> grpc.RpcMethodHandler:
    """`handler` with a safe deserializer and the error mapping above."""
    call = _Call(method, log, before)
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
