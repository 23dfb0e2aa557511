"""gRPC edge of the agent: authentication (per-tenant bearer tokens) on top of the shared
edge (kvstore/grpc_edge.py), the one place where undecodable requests and the core's error
hierarchy become gRPC status codes."""

from __future__ import annotations

import contextvars
import logging

import grpc

from kvstore import errors
from kvstore.grpc_edge import refusal, wrap_handler
from node_agent.tokens import TokenTable

log = logging.getLogger("kvstore.agent")

# The authenticated tenant of the current request; None when unauthenticated mode allows it.
current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "current_tenant", default=None
)

_OPEN_METHODS = ("/grpc.health.v1.Health/",)


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    """Resolves the caller's tenant from `authorization: Bearer <token>`, then the shared
    edge maps errors to status codes. Token hashes come from the agent config."""

    def __init__(self, token_hashes: dict[str, str], allow_unauthenticated: bool) -> None:
        self._tokens = TokenTable(token_hashes, allow_unauthenticated)

    def resolve(self, metadata) -> str | None:
        md = dict(metadata or ())
        return self._tokens.tenant(md.get("authorization", ""))

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        # Health checks are open to all; every method gets the shared edge (bad bytes ->
        # INVALID_ARGUMENT, KvError -> its status, anything else INTERNAL, logged once).
        if details.method.startswith(_OPEN_METHODS):
            return wrap_handler(handler, details.method, log)
        # The caller is resolved from the metadata alone, before its request is read: a
        # refused caller's message is never received whole (grpc_edge.refusal).
        try:
            tenant = self.resolve(details.invocation_metadata)
        except errors.Unauthenticated as exc:
            return refusal(handler, details.method, exc)
        return wrap_handler(handler, details.method, log, lambda _ctx: current_tenant.set(tenant))
