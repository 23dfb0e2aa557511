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
from kvstore.namespace import Namespace

# Reserved identities (tenant names in tenants.json). Least privilege (docs/security.md):
# the cluster identity (routers, kvctl) follows event streams, lists nodes and reads
# stats, but never a tenant's payloads; the agent identity (peer agents) moves blocks
# between agents (Peer.FetchBlocks, Peer.Prefetch) and nothing else.
CLUSTER_TENANT = "_cluster"
AGENT_TENANT = "_agent"
RESERVED_TENANTS = (CLUSTER_TENANT, AGENT_TENANT)
# One answer for a namespace that is unknown and one of another tenant's: a probe must not
# tell them apart (the router and the agents answer it alike).
NOT_YOURS = "namespace is unknown or not open to this tenant"


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

    def knows(self, tenant: str) -> bool:
        """Whether some token names `tenant` (e.g. the agent identity is configured)."""
        return tenant in self._tenant_by_hash.values()

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


def is_reader(caller: str | None, spec: Namespace) -> bool:
    """Whether `caller` uses `spec` as another tenant than its owner (the agent identity
    and unauthenticated development callers act for the owner)."""
    return caller not in (None, AGENT_TENANT, spec.tenant)


def check_creates(caller: str | None, spec: Namespace, exists: bool) -> None:
    """Raise FailedPrecondition when `caller`, another tenant than the owner of the public
    namespace `spec`, would create it (`exists`: registered in the cluster, or open on this
    node). A reader opens what the owner created: creating it would count against the
    owner's namespace cap, so another tenant could fill that cap with public names and
    lock the owner out. The owner, the agent identity (peer pulls for the owner's
    requests) and unauthenticated development callers create."""
    if exists or not is_reader(caller, spec):
        return
    raise errors.FailedPrecondition(
        f"public namespace {spec.name!r} of tenant {spec.tenant!r} is not open yet: only "
        f"{spec.tenant!r} creates it; open it after it has"
    )


def check_namespace(
    caller: str | None, spec: Namespace | None, write: bool, peer: bool = False
) -> None:
    """Raise PermissionDenied unless `caller` may use the namespace `spec` (None: not known
    on this node). Decided from the identity and the spec alone, before any block index,
    generation, registry or counter is touched, so a refusal changes nothing and reads the
    same whether or not the namespace exists or holds the prefix asked about.

    `peer`: a peer-transfer method (FetchBlocks, Prefetch), which the agent identity may
    use on any namespace. Unauthenticated callers (development) pass; an unknown namespace
    is then NOT_FOUND from the store."""
    if caller is None or (peer and caller == AGENT_TENANT):
        return
    if caller in RESERVED_TENANTS:
        raise errors.PermissionDenied(
            f"identity {caller!r} may not {'write' if write else 'read'} tenants' blocks"
        )
    if spec is None or (spec.tenant != caller and not spec.public):
        raise errors.PermissionDenied(NOT_YOURS)
    if write and spec.tenant != caller:
        raise errors.PermissionDenied(
            f"tenant {caller!r} may not write namespaces of tenant {spec.tenant!r}"
        )
