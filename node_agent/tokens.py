"""Bearer tokens: which tenant an `authorization` value names. One rule for the gRPC edge
(node_agent/interceptors.EdgeInterceptor) and the UCX peer path, which bypasses the edge
(node_agent/peer/ucx/serve.py checks the token a fetching agent forwards)."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping

from kvstore import errors
from kvstore.config import AgentConfig


class TokenTable:
    """Tenants by the SHA-256 of their bearer token (the agent config holds only hashes)."""

    def __init__(self, token_hashes: Mapping[str, str], allow_unauthenticated: bool) -> None:
        self._tenant_by_hash = {h.lower(): t for t, h in token_hashes.items() if h}
        self._allow_unauth = allow_unauthenticated

    @classmethod
    def from_config(cls, cfg: AgentConfig) -> "TokenTable":
        return cls({t: tc.token_sha256 for t, tc in cfg.tenants.items()},
                   cfg.allow_unauthenticated)

    def tenant(self, authorization: str) -> str | None:
        """The tenant of `authorization` ("Bearer <token>"); None when it is empty and
        unauthenticated requests are allowed. Unauthenticated otherwise."""
        if not authorization:
            if self._allow_unauth:
                return None
            raise errors.Unauthenticated("missing 'authorization: Bearer <token>' metadata")
        if not authorization.startswith("Bearer "):
            raise errors.Unauthenticated("authorization metadata must be 'Bearer <token>'")
        digest = hashlib.sha256(authorization[7:].strip().encode()).hexdigest()
        tenant = self._tenant_by_hash.get(digest)
        if tenant is None:
            raise errors.Unauthenticated("unknown token")
        return tenant
