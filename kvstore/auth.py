"""Bearer tokens: which tenant an `authorization` value names. The one rule for every edge
that authenticates: the agents' gRPC edge (node_agent/interceptors.py), their UCX peer path
(node_agent/peer/ucx/serve.py) and the router (router/access.py). No I/O: callers hand in
the metadata value; configuration lists each tenant's SHA-256 token hash
(kvstore/config.py TenantConfig), so no process holds a tenant's token at rest."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol

from kvstore import errors
from kvstore.config import TenantConfig

CLUSTER_TENANT = "_cluster"  # routers, peer agents and kvctl authenticate as this tenant


class _HasTenants(Protocol):  # AgentConfig, RouterConfig
    @property
    def tenants(self) -> Mapping[str, TenantConfig]: ...

    @property
    def allow_unauthenticated(self) -> bool: ...


class TokenTable:
    """Tenants by the SHA-256 of their bearer token (configs hold only hashes)."""

    def __init__(self, token_hashes: Mapping[str, str], allow_unauthenticated: bool) -> None:
        self._tenant_by_hash = {h.lower(): t for t, h in token_hashes.items() if h}
        self._allow_unauth = allow_unauthenticated

    @classmethod
    def from_config(cls, cfg: _HasTenants) -> "TokenTable":
        return cls({t: tc.token_sha256 for t, tc in cfg.tenants.items()}, cfg.allow_unauthenticated)

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
