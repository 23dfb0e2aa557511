"""Who may ask the router what (least privilege), checked before any side effect.

- Callers authenticate as to the agents: `authorization: Bearer <token>`, resolved by the
  shared rule (kvstore/auth.py) against RouterConfig.tenants (the agents' tenants.json).
  A missing or unknown token is UNAUTHENTICATED before the method runs.
- The cluster identity ("_cluster": routers, agents, kvctl) is trusted: it lists nodes
  with their addresses, routes any namespace and may override weights. With
  `allow_unauthenticated` (development), callers without a token act as it.
- A tenant routes only its own namespaces and public ones. The router learns a
  namespace's tenant from its etcd record (router/follower.py) or from a spec sent with
  the Route that hashes to the namespace id (the id is a hash of the spec, tenant
  included, so a spec proves ownership). Unknown and foreign namespaces get the same
  PERMISSION_DENIED, decided before the index is consulted: no hit oracle, no probing
  (every refusal takes one path: a spec sent along is hashed whether or not the id is
  known; a spec of another namespace is the same refusal).
- Per-request weight overrides are reserved to the cluster identity (a tenant's override
  would steer its load onto the nodes other tenants' prefixes live on); from a tenant
  they are PERMISSION_DENIED.
- Request ids are scoped to the tenant (router/routing.py InFlight); a tenant's requests
  in flight are capped (RESOURCE_EXHAUSTED), and so is the prefill work they are counted
  with, per request and per node (`work_caps`: work beyond is not counted).
"""

from __future__ import annotations

import contextvars
import logging
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from kvstore import errors
from kvstore.auth import CLUSTER_TENANT, NOT_YOURS, TokenTable
from kvstore.grpc_edge import Admission, CallGate, WatchGate, authenticated, check_gate
from kvstore.config import RouterConfig
from kvstore.wire import namespace_from_proto

# NOT_YOURS (kvstore/auth.py): one message for an unknown namespace and another tenant's,
# the agents' too: they must not be told apart.
MAX_LEARNED = 1 << 16  # namespaces admitted from specs, beyond those in etcd


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str | None  # None: unauthenticated, admitted by allow_unauthenticated

    @property
    def trusted(self) -> bool:
        return self.tenant is None or self.tenant == CLUSTER_TENANT

    @property
    def scope(self) -> str:
        """What request ids are scoped to (router/routing.py InFlight)."""
        return self.tenant or ""


@dataclass(frozen=True, slots=True)
class Owner:
    tenant: str
    public: bool


current_caller: contextvars.ContextVar[Caller] = contextvars.ContextVar("router_caller")


class NamespaceOwners:
    """Namespace id -> tenant: from etcd records (authoritative, follow add and delete)
    and from specs verified on Route (bounded, oldest dropped first)."""

    def __init__(self, max_learned: int = MAX_LEARNED) -> None:
        self._etcd: dict[bytes, Owner] = {}
        self._learned: OrderedDict[bytes, Owner] = OrderedDict()
        self._max_learned = max_learned

    def set(self, ns_id: bytes, tenant: str, public: bool) -> None:
        self._etcd[ns_id] = Owner(tenant, public)

    def forget(self, ns_id: bytes) -> None:
        self._etcd.pop(ns_id, None)

    def get(self, ns_id: bytes) -> Owner | None:
        return self._etcd.get(ns_id) or self._learned.get(ns_id)

    def learn(self, owner: Owner, ns_id: bytes) -> None:
        self._learned[ns_id] = owner
        while len(self._learned) > self._max_learned:
            self._learned.popitem(last=False)


class RouterAccess:
    def __init__(self, cfg: RouterConfig, owners: NamespaceOwners) -> None:
        self.tokens = TokenTable.from_config(cfg)
        self.owners = owners
        self._default_cap = cfg.max_inflight_per_tenant
        self._caps = {t: c.max_inflight for t, c in cfg.tenants.items() if c.max_inflight}
        self._work_caps = (
            float(cfg.max_route_work_blocks),
            float(cfg.max_queued_blocks_per_tenant),
        )

    def caller(self, metadata) -> Caller:
        """The caller an RPC's invocation metadata names (Unauthenticated when none)."""
        md = dict(metadata or ())
        return Caller(self.tokens.tenant(md.get("authorization", "")))

    def inflight_cap(self, caller: Caller) -> int:
        """0: no cap (the cluster identity and development callers are not capped)."""
        if caller.trusted:
            return 0
        return self._caps.get(caller.scope, self._default_cap)

    def work_caps(self, caller: Caller) -> tuple[float, float]:
        """(per request, per tenant and node) caps on the prefill work a tenant's routes
        are counted with (router/routing.py RouterCore.route); 0: none. The cluster
        identity and development callers are not capped."""
        return (0.0, 0.0) if caller.trusted else self._work_caps

    @staticmethod
    def require_cluster(caller: Caller, what: str) -> None:
        if not caller.trusted:
            raise errors.PermissionDenied(f"{what} is reserved to the cluster identity")

    def check_route(self, caller: Caller, request) -> None:
        """Raise unless `caller` may route `request` (a RouteRequest) as it is."""
        if caller.trusted:
            return
        if request.HasField("weights"):
            self.require_cluster(caller, "overriding routing weights")
        owner = self.owners.get(request.namespace_id)
        if _may_route(owner, caller):
            return  # the hot path: a namespace of the caller's known here
        # Every refusal takes the same path, known namespace or not: a spec, when sent, is
        # hashed either way, so neither the answer nor the work tells whether it exists.
        proven = self._verified(request) if request.HasField("spec") else None
        if proven is None or not _may_route(proven, caller):
            raise errors.PermissionDenied(NOT_YOURS)
        self.owners.learn(proven, request.namespace_id)  # learned only when it grants

    @staticmethod
    def _verified(request) -> Owner | None:
        """The owner a RouteRequest's spec proves (the id is the spec's hash); None when
        the spec is of another namespace."""
        spec = namespace_from_proto(request.spec)
        if spec.namespace_id != request.namespace_id:
            return None
        return Owner(spec.tenant, spec.public)


def _may_route(owner: Owner | None, caller: Caller) -> bool:
    return owner is not None and (owner.public or owner.tenant == caller.tenant)


class AuthEdge(grpc.aio.ServerInterceptor):
    """The shared edge (kvstore/grpc_edge.py) on every method, with the caller resolved
    into `current_caller` before a Router method runs (health checks are open, Watch
    streams capped): an unauthenticated call is refused before the request is even
    looked at; a tenant's calls in flight are counted from their start, before their
    message has arrived (max_calls_per_tenant; the cluster identity and development
    callers are not capped), and a call whose message has not arrived whole after
    stream_idle_timeout_s is ended."""

    def __init__(self, access: RouterAccess, log: logging.Logger, cfg: RouterConfig) -> None:
        self.access = access
        self._log = log
        self.gate = CallGate(
            cfg.max_calls_per_tenant,
            "max_calls_per_tenant",
            (Caller(None), Caller(CLUSTER_TENANT)),
        )
        self._admission = Admission(
            access.caller,
            current_caller.set,
            self.gate,
            cfg.stream_idle_timeout_s,
            WatchGate(cfg.max_health_watches, cfg.max_health_watches_per_peer),
            check_gate(cfg.max_health_checks_per_peer),
        )

    async def intercept_service(self, continuation, details):
        return await authenticated(continuation, details, self._log, self._admission)
