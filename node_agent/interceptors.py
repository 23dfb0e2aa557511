"""gRPC edge: authentication (per-tenant bearer tokens) and the one place where the core's
error hierarchy becomes gRPC status codes."""
from __future__ import annotations

import contextvars
import hashlib
import logging

import grpc

from kvstore import errors

log = logging.getLogger("kvstore.agent")

# The authenticated tenant of the current request; None when unauthenticated mode allows it.
current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "current_tenant", default=None)

_CODES = {name: getattr(grpc.StatusCode, name) for name in (
    "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION",
    "RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "UNAUTHENTICATED", "UNAVAILABLE", "DATA_LOSS",
    "INTERNAL")}
_OPEN_METHODS = ("/grpc.health.v1.Health/",)


def status_for(exc: errors.KvError) -> grpc.StatusCode:
    return _CODES.get(exc.code, grpc.StatusCode.INTERNAL)


def _wrap_unary(fn, resolve):
    async def handler(request, context):
        try:
            current_tenant.set(resolve(context))
            return await fn(request, context)
        except errors.KvError as exc:
            await context.abort(status_for(exc), str(exc))
    return handler


def _wrap_stream(fn, resolve):
    async def handler(request, context):
        try:
            current_tenant.set(resolve(context))
            async for item in fn(request, context):
                yield item
        except errors.KvError as exc:
            await context.abort(status_for(exc), str(exc))
    return handler


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    """Resolves the caller's tenant from `authorization: Bearer <token>` and maps
    KvError subclasses to status codes. Token hashes come from the agent config."""

    def __init__(self, token_hashes: dict[str, str], allow_unauthenticated: bool) -> None:
        self._tenant_by_hash = {h.lower(): t for t, h in token_hashes.items() if h}
        self._allow_unauth = allow_unauthenticated

    def resolve(self, context) -> str | None:
        md = dict(context.invocation_metadata() or ())
        auth = md.get("authorization", "")
        if not auth:
            if self._allow_unauth:
                return None
            raise errors.Unauthenticated("missing 'authorization: Bearer <token>' metadata")
        if not auth.startswith("Bearer "):
            raise errors.Unauthenticated("authorization metadata must be 'Bearer <token>'")
        digest = hashlib.sha256(auth[7:].strip().encode()).hexdigest()
        tenant = self._tenant_by_hash.get(digest)
        if tenant is None:
            raise errors.Unauthenticated("unknown token")
        return tenant

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_METHODS):
            return handler
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, self.resolve),
                handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, self.resolve),
                handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, self.resolve),
                handler.request_deserializer, handler.response_serializer)
        return handler


def check_access(owner: str, public: bool, write: bool) -> None:
    """Tenants touch their own namespaces; public ones are readable by everyone."""
    tenant = current_tenant.get()
    if tenant is None or tenant == owner or (public and not write):
        return
    raise errors.PermissionDenied(f"tenant {tenant!r} may not {'write' if write else 'read'} "
                                  f"namespaces of tenant {owner!r}")
