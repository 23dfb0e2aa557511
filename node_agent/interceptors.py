"""gRPC edge of the agent: authentication (per-tenant bearer tokens) and each tenant's
calls in flight (max_calls_per_tenant) on top of the shared edge (kvstore/grpc_edge.py),
the one place where undecodable requests and the core's error hierarchy become gRPC
status codes."""

from __future__ import annotations

import contextvars
import logging

import grpc

from kvstore.auth import RESERVED_TENANTS
from kvstore.grpc_edge import Admission, CallGate, WatchGate, authenticated
from node_agent.tokens import TokenTable

log = logging.getLogger("kvstore.agent")

# The authenticated tenant of the current request; None when unauthenticated mode allows it.
current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "current_tenant", default=None
)


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    """Resolves the caller's tenant from `authorization: Bearer <token>` and counts its
    calls in flight, then the shared edge maps errors to status codes. Token hashes come
    from the agent config. Health checks are open and never counted; the cluster and
    agent identities (operators, peer agents) and development callers are not capped.
    A call is counted from its start, before its message has arrived; `stream_idle_s`: a
    call whose request sends no message this long (a unary message not whole, a Put
    stream between messages) is ended. `watches`: the open Health.Watch streams' caps;
    `checks`: the Health.Check calls in progress per address (grpc_edge.check_gate)."""

    def __init__(
        self,
        token_hashes: dict[str, str],
        allow_unauthenticated: bool,
        max_calls_per_tenant: int = 0,
        stream_idle_s: float = 0.0,
        watches: WatchGate | None = None,
        checks: CallGate | None = None,
    ) -> None:
        self._tokens = TokenTable(token_hashes, allow_unauthenticated)
        self.gate = CallGate(
            max_calls_per_tenant, "max_calls_per_tenant", (None, *RESERVED_TENANTS)
        )
        self._admission = Admission(
            self.resolve, current_tenant.set, self.gate, stream_idle_s, watches, checks
        )

    def resolve(self, metadata) -> str | None:
        md = dict(metadata or ())
        return self._tokens.tenant(md.get("authorization", ""))

    async def intercept_service(self, continuation, details):
        return await authenticated(continuation, details, log, self._admission)
