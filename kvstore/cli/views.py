"""What `kvctl status`, `kvctl nodes` and `kvctl stats` show, gathered from etcd (membership,
kill switch, namespaces, quotas) and from each agent's Stats RPC. Plain data, no printing:
kvstore/cli/control_cmd.py renders it as tables or JSON.

Hit rates are kept apart and never mixed:
- request-weighted = lookups with at least one matched block / lookups;
- token-weighted   = matched blocks / blocks asked for. Every block is `block_size` tokens
  and only full blocks are looked up, so within a namespace this is exactly cached
  tokens / cacheable prompt tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.coord.admin_records import ROUTERS, Quota
from kvstore.coord.etcd import (
    KILLSWITCH,
    NAMESPACES,
    TENANTS,
    EtcdClient,
    NodeRecord,
    killswitch_enabled,
)
from kvstore.coord.seen import list_seen
from kvstore.config import TLSConfig
from kvstore.events import Tier
from kvstore.tls import aio_channel
from kvstore.v1 import agent_pb2, agent_pb2_grpc

# Counters of the store that say why blocks left (kvstore/store.py).
EVICTION_REASONS = {
    "evict_hbm_capacity": "hbm full (demoted or dropped)",
    "evict_hbm_quota": "hbm over tenant quota",
    "evict_nvme": "nvme full or over quota",
    "evict_nvme_quota": "nvme over tenant quota (quota change)",
    "removed_expired": "ttl expired",
    "removed_corrupt": "checksum mismatch",
    "blocks_dropped_flush": "namespace flushed",
}
# Node-wide counters of Stats that `kvctl stats` shows (every tenant's calls: an agent
# gives them to the cluster identity only, in a Stats without a tenant); also every
# nvme_open_failed_<why>.
NODE_COUNTERS = {
    "fenced_lookups": "lookups answered as misses: etcd lease not confirmed",
    "fenced_gets": "gets answered as misses: etcd lease not confirmed",
    "killswitch_lookups": "lookups answered as misses: kill switch on",
    "killswitch_gets": "gets answered as misses: kill switch on",
    "killswitch_puts": "puts refused: kill switch on",
    "nvme_quarantined": "agents whose NVMe tier started empty (unreadable files moved aside)",
    "nvme_write_outages": "NVMe write outages (disk full, I/O errors)",
    "nvme_writes_refused": "spills refused while NVMe could not write",
    "nvme_write_errors": "NVMe write errors",
    "nvme_seal_refused": "spills refused for want of an encryption key",
}
_NODE_COUNTER_PREFIX = "nvme_open_failed_"  # records dropped at reading, by why


def node_counter_meaning(name: str) -> str:
    if name in NODE_COUNTERS:
        return NODE_COUNTERS[name]
    return f"NVMe records that did not open: {name.removeprefix(_NODE_COUNTER_PREFIX)}"


@dataclass(frozen=True, slots=True)
class TierView:
    tier: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    condition: str = ""  # '' when healthy; else e.g. "writes failing since 12s: …"
    unflushed_bytes: int = 0  # NVMe: of used_bytes, only in memory yet (kill -9 loses it)


@dataclass(frozen=True, slots=True)
class TenantView:
    tenant: str
    hbm_bytes: int = 0
    nvme_bytes: int = 0
    hbm_limit_bytes: int = 0  # largest per-node limit seen (0: none)
    nvme_limit_bytes: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    # hbm_bytes/nvme_bytes are summed over nodes; these are the largest on one node
    # (what a per-node quota compares with)
    hbm_node_max_bytes: int = 0
    nvme_node_max_bytes: int = 0
    nodes: int = 1  # nodes summed

    @property
    def request_hit_rate(self) -> float | None:
        return self.lookup_hits / self.lookups if self.lookups else None

    @property
    def token_hit_rate(self) -> float | None:
        return self.lookup_hit_blocks / self.lookup_blocks if self.lookup_blocks else None

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "request_hit_rate": self.request_hit_rate,
            "token_hit_rate": self.token_hit_rate,
        }

    def plus(self, o: "TenantView") -> "TenantView":
        return TenantView(
            self.tenant,
            self.hbm_bytes + o.hbm_bytes,
            self.nvme_bytes + o.nvme_bytes,
            max(self.hbm_limit_bytes, o.hbm_limit_bytes),
            max(self.nvme_limit_bytes, o.nvme_limit_bytes),
            self.lookups + o.lookups,
            self.lookup_hits + o.lookup_hits,
            self.lookup_blocks + o.lookup_blocks,
            self.lookup_hit_blocks + o.lookup_hit_blocks,
            max(self.hbm_node_max_bytes, o.hbm_node_max_bytes),
            max(self.nvme_node_max_bytes, o.nvme_node_max_bytes),
            self.nodes + o.nodes,
        )


@dataclass(frozen=True, slots=True)
class NodeView:
    node_id: str
    address: str
    device: str
    reachable: bool
    error: str = ""
    utilization: float = 0.0
    in_flight: int = 0
    tiers: tuple[TierView, ...] = ()
    tenants: tuple[TenantView, ...] = ()
    evictions: dict = field(default_factory=dict)
    native_accel: str = ""  # Stats' native_accel: "python (...)" is the slow fallback
    counters: dict = field(default_factory=dict)  # NODE_COUNTERS it reported
    # It answered, refusing kvctl's credential (UNAUTHENTICATED): up, but unread.
    auth_refused: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tenants"] = [t.to_dict() for t in self.tenants]
        return d


SEEN_WINDOW_S = 24 * 3600.0


def ago(at: float, now: float | None = None) -> str:
    """How long ago unix time `at` was, for people: 42s ago, 7m ago, 3h05m ago."""
    s = max(0, int((time.time() if now is None else now) - at))
    if s < 120:
        return f"{s}s ago"
    if s < 7200:
        return f"{s // 60}m ago"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m ago"


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


@dataclass(frozen=True, slots=True)
class MissingMember:
    """An agent or router seen (seen/<kind>/<id>, kvstore/coord/seen.py) within the
    window but not live now, that did not stop cleanly: dead, frozen, cut off."""

    kind: str  # agent | router
    member_id: str
    last_seen: float  # unix seconds
    address: str = ""

    def ago(self, now: float | None = None) -> str:
        return ago(self.last_seen, now)

    def describe(self) -> str:
        at = f" at {self.address}" if self.address else ""
        return (
            f"{self.kind} {self.member_id}{at} missing: last seen {self.ago()} "
            f"({_utc(self.last_seen)})"
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "last_seen_ago_s": round(time.time() - self.last_seen, 1)}


@dataclass(frozen=True, slots=True)
class StoppedMember:
    """An agent seen within the window that stopped cleanly (SIGTERM: it left etcd
    itself and marked its seen record) and has not come back: not expected, not a
    problem; listed so that an operator sees it went."""

    kind: str  # agent | router
    member_id: str
    stopped_at: float  # unix seconds
    address: str = ""

    def ago(self, now: float | None = None) -> str:
        return ago(self.stopped_at, now)

    def describe(self) -> str:
        at = f" at {self.address}" if self.address else ""
        return (
            f"{self.kind} {self.member_id}{at} stopped cleanly {self.ago()} "
            f"({_utc(self.stopped_at)})"
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "stopped_ago_s": round(time.time() - self.stopped_at, 1)}


@dataclass(frozen=True, slots=True)
class ClusterView:
    etcd_endpoints: tuple[str, ...]
    etcd: dict  # version, revision, db size, leader
    killswitch: bool
    killswitch_info: dict
    nodes: tuple[NodeView, ...]
    routers: tuple[dict, ...]
    namespaces: int
    quotas: dict  # tenant -> Quota fields
    missing: tuple[MissingMember, ...] = ()  # seen within the window, not live now
    stopped: tuple[StoppedMember, ...] = ()  # stopped cleanly within the window, not back
    quotas_unreadable: tuple[str, ...] = ()  # tenants/ records that do not read (ignored)

    @property
    def degraded_tiers(self) -> list[str]:
        """'node/tier: condition' for every tier that reports a problem."""
        return [
            f"{n.node_id}/{t.tier}: {t.condition}"
            for n in self.nodes
            for t in n.tiers
            if t.condition
        ]

    @property
    def unreachable(self) -> list[str]:
        return [n.node_id for n in self.nodes if not n.reachable and not n.auth_refused]

    @property
    def auth_refused(self) -> list[str]:
        """Agents that answered but refused kvctl's credential (their Stats are unread)."""
        return [n.node_id for n in self.nodes if n.auth_refused]

    @property
    def unreachable_routers(self) -> list[dict]:
        """Registered routers whose gRPC health did not answer SERVING (their lease
        outlives a killed router by up to its TTL)."""
        return [r for r in self.routers if r.get("reachable") is False]

    @property
    def missing_agents(self) -> list[MissingMember]:
        return [m for m in self.missing if m.kind == "agent"]

    @property
    def stopped_agents(self) -> list[StoppedMember]:
        return [m for m in self.stopped if m.kind == "agent"]

    @property
    def expected_agents(self) -> int:
        """Agents live now plus agents seen within the window that are not."""
        return len(self.nodes) + len(self.missing_agents)

    @property
    def members_down(self) -> list[str]:
        """Why membership is short: unreachable or missing members, no router. Empty when
        every member expected is here (status exits 4 otherwise)."""
        out = [f"agent {n} unreachable" for n in self.unreachable]
        out += [
            f"router {r.get('router_id', '?')} at {r.get('address')} unreachable: {r['error']}"
            for r in self.unreachable_routers
        ]
        out += [m.describe() for m in self.missing]
        if not self.routers and (self.nodes or self.missing):
            out.append("no router registered in etcd: engines cannot route")
        return out

    @property
    def health(self) -> str:
        if not self.nodes and not self.missing:
            return "no agents"
        if self.members_down or self.degraded_tiers:
            return "degraded"
        if self.auth_refused:
            return "unknown (agents refused the credential)"
        return "kill switch on" if self.killswitch else "healthy"

    def tenants(self, only: str | None = None) -> list[TenantView]:
        total: dict[str, TenantView] = {}
        for n in self.nodes:
            for t in n.tenants:
                if only is None or t.tenant == only:
                    total[t.tenant] = total[t.tenant].plus(t) if t.tenant in total else t
        return [total[k] for k in sorted(total)]

    def evictions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            for k, v in n.evictions.items():
                out[k] = out.get(k, 0) + v
        return dict(sorted(out.items()))

    def node_counters(self) -> dict[str, int]:
        """NODE_COUNTERS summed over the agents that reported them (none: a tenant's
        view, or a Stats of one tenant)."""
        out: dict[str, int] = {}
        for n in self.nodes:
            for k, v in n.counters.items():
                out[k] = out.get(k, 0) + v
        return dict(sorted(out.items()))

    def to_dict(self, tenant: str | None = None) -> dict:
        return {
            "health": self.health,
            "etcd_endpoints": list(self.etcd_endpoints),
            "etcd": self.etcd,
            "killswitch": self.killswitch,
            "killswitch_info": self.killswitch_info,
            "nodes": [n.to_dict() for n in self.nodes],
            "routers": list(self.routers),
            "unreachable": self.unreachable,
            "auth_refused": self.auth_refused,
            "missing": [m.to_dict() for m in self.missing],
            "stopped": [m.to_dict() for m in self.stopped],
            "problems": self.members_down,
            "degraded_tiers": self.degraded_tiers,
            "namespaces": self.namespaces,
            "quotas": self.quotas,
            "quotas_unreadable": list(self.quotas_unreadable),
            "tenants": [t.to_dict() for t in self.tenants(tenant)],
            "evictions": self.evictions(),
        }


# -------------------------------------------------------------------- gathering
def _tenant(t: agent_pb2.TenantStats) -> TenantView:
    return TenantView(
        t.tenant,
        t.hbm_bytes,
        t.nvme_bytes,
        t.hbm_limit_bytes,
        t.nvme_limit_bytes,
        t.lookups,
        t.lookup_hits,
        t.lookup_blocks,
        t.lookup_hit_blocks,
        t.hbm_bytes,
        t.nvme_bytes,
    )


async def node_view(
    rec: NodeRecord,
    token: str | None,
    timeout_s: float,
    tenant: str | None = None,
    tls: TLSConfig | None = None,
) -> NodeView:
    md = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        async with aio_channel(rec.address, tls) as channel:
            resp = await agent_pb2_grpc.NodeAgentStub(channel).Stats(
                agent_pb2.StatsRequest(tenant=tenant or ""), metadata=md, timeout=timeout_s
            )
    except grpc.aio.AioRpcError as exc:
        return NodeView(
            rec.node_id,
            rec.address,
            rec.device,
            False,
            f"{exc.code().name}: {exc.details() or ''}".rstrip(": "),
            auth_refused=exc.code() == grpc.StatusCode.UNAUTHENTICATED,
        )
    tiers = tuple(
        TierView(
            Tier(t.tier).name.lower() if t.tier in (1, 2) else str(t.tier),
            t.capacity_bytes,
            t.used_bytes,
            t.blocks,
            t.condition,
            t.unflushed_bytes,
        )
        for t in resp.tiers
    )
    evictions = {k: int(v) for k, v in resp.counters.items() if k in EVICTION_REASONS}
    counters = {
        k: int(v)
        for k, v in resp.counters.items()
        if k in NODE_COUNTERS or k.startswith(_NODE_COUNTER_PREFIX)
    }
    return NodeView(
        rec.node_id,
        rec.address,
        resp.device or rec.device,
        True,
        "",
        round(resp.utilization, 4),
        resp.in_flight,
        tiers,
        tuple(_tenant(t) for t in resp.tenants),
        evictions,
        resp.native_accel,
        counters,
    )


async def router_problem(address: str, timeout_s: float, tls: TLSConfig | None) -> str:
    """'' when the router at `address` answers its gRPC health check SERVING, else why
    not (its health check needs no token)."""
    try:
        async with aio_channel(address, tls) as channel:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details() or ''}".rstrip(": ")
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return ""


async def _probe_routers(routers: list[dict], timeout_s: float, tls: TLSConfig | None) -> None:
    """Mark each router record (in place) `reachable`, with `error` when it is not."""
    probed = [r for r in routers if r.get("address")]
    problems = await asyncio.gather(*(router_problem(r["address"], timeout_s, tls) for r in probed))
    for r, problem in zip(probed, problems):
        r["reachable"] = not problem
        if problem:
            r["error"] = problem


async def etcd_status(etcd: EtcdClient) -> dict:
    """Server version, revision, db size and leader of the first endpoint that answers."""
    from etcd3aio.maintenance import MaintenanceService

    svc = MaintenanceService(etcd._channel, max_attempts=1)
    st = await etcd._call("status", svc.status())
    return {
        "version": st.version,
        "revision": st.header.revision,
        "db_size_bytes": st.dbSize,
        "leader": f"{st.leader:x}",
        "member": f"{st.header.member_id:x}",
    }


async def cluster_view(
    etcd: EtcdClient,
    token: str | None = None,
    timeout_s: float = 3.0,
    tenant: str | None = None,
    with_stats: bool = True,
    tls: TLSConfig | None = None,
    seen_window_s: float = SEEN_WINDOW_S,
) -> ClusterView:
    """Everything from etcd (raises kvstore.errors.Unavailable when it cannot be reached),
    then every registered agent's Stats in parallel (unreachable agents are marked).
    Members seen within `seen_window_s` (seen/, kvstore/coord/seen.py) without a live
    membership key now are `stopped` when their record says they stopped cleanly,
    `missing` otherwise."""
    info = await etcd_status(etcd)
    nodes = await etcd.list_nodes()
    _, routers = await etcd.list(ROUTERS)
    seen = await list_seen(etcd)
    switch = await etcd.get(KILLSWITCH)
    _, namespaces = await etcd.list(NAMESPACES)
    _, tenants = await etcd.list(TENANTS)
    quotas, unreadable = {}, []
    for kv in tenants:
        try:
            quotas[kv.key[len(TENANTS) :]] = json.loads(Quota.parse(kv.value).to_json())
        except (ValueError, TypeError):
            unreadable.append(kv.key[len(TENANTS) :])
    router_list = []
    for kv in routers:
        try:
            router_list.append(json.loads(kv.value))
        except ValueError:
            router_list.append({"router_id": kv.key[len(ROUTERS) :]})
    if with_stats:
        views, _ = await asyncio.gather(
            asyncio.gather(*(node_view(r, token, timeout_s, tenant, tls) for r in nodes)),
            _probe_routers(router_list, timeout_s, tls),
        )
    else:
        views = [NodeView(r.node_id, r.address, r.device, True) for r in nodes]
    live = {("agent", r.node_id) for r in nodes} | {
        ("router", kv.key[len(ROUTERS) :]) for kv in routers
    }
    since = time.time() - seen_window_s
    gone = sorted(
        (s for s in seen if (s.kind, s.member_id) not in live and s.at >= since),
        key=lambda s: (s.kind, s.member_id),
    )
    missing = tuple(
        MissingMember(s.kind, s.member_id, s.at, s.address) for s in gone if not s.stopped_at
    )
    stopped = tuple(
        StoppedMember(s.kind, s.member_id, s.stopped_at, s.address) for s in gone if s.stopped_at
    )
    switch_info: dict = {}
    if switch is not None:
        try:
            switch_info = json.loads(switch.value)
        except ValueError:
            switch_info = {}
    return ClusterView(
        tuple(etcd.endpoints),
        info,
        killswitch_enabled(switch.value if switch else b""),
        switch_info if isinstance(switch_info, dict) else {},
        tuple(sorted(views, key=lambda v: v.node_id)),
        tuple(router_list),
        len(namespaces),
        quotas,
        missing,
        stopped,
        tuple(unreadable),
    )
