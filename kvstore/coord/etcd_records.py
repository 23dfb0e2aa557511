"""The etcd module's key names and the records kept under them (kvstore/coord/etcd.py)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from kvstore.coord.records import record_from_json

NODES = "nodes/"
NAMESPACES = "namespaces/"
TENANTS = "tenants/"
KILLSWITCH = "killswitch"
FLUSHES = "flushes/"
NS_COUNTS = "ns-counts/"


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What an agent publishes about itself under nodes/<node_id>."""

    node_id: str
    address: str  # gRPC data plane host:port
    peer_address: str = ""  # peer-transfer endpoint (empty until peer transfer exists)
    device: str = ""
    hbm_capacity_bytes: int = 0
    nvme_capacity_bytes: int = 0
    utilization: float = 0.0  # device pool occupancy 0..1
    blocks: int = 0  # blocks held, every tier
    epoch: str = ""  # changes when the agent process restarts
    # Measured cost of this agent's peer pulls (kvstore/pullcost.py): seconds = fixed +
    # bytes x per byte, fitted over `pull_samples` pulls (0: none yet, use the router's
    # configured peer_gbps).
    pull_fixed_ms: float = 0.0
    pull_ms_per_mib: float = 0.0
    pull_samples: int = 0
    # The agent's proof that an agent wrote node_id and its addresses: HMAC-SHA256 under a
    # key derived from the agent token (node_agent/peer/credential.py). Only agents check
    # it, to decide where a pull may show the agent credential; every other reader
    # (router, kvctl) ignores it. "": an agent without an agent token.
    signature: str = ""

    def __post_init__(self) -> None:
        if not self.node_id or "/" in self.node_id:
            raise ValueError(f"node_id must be non-empty without '/', got {self.node_id!r}")
        if not self.address:
            raise ValueError(f"node {self.node_id}: address is empty")
        if not (
            isinstance(self.utilization, (int, float))
            and math.isfinite(self.utilization)
            and 0.0 <= self.utilization <= 1.0
        ):
            raise ValueError(f"node {self.node_id}: utilization must be in [0, 1]")
        for name in ("pull_fixed_ms", "pull_ms_per_mib", "pull_samples"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"node {self.node_id}: {name} must be a finite number >= 0")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "NodeRecord":
        # Newer agents may add fields; an older router ignores what it does not know.
        return record_from_json(cls, raw, "node record")


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str  # relative to the client's prefix
    value: bytes
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class WatchEvent:
    key: str  # relative to the client's prefix
    value: bytes  # empty for deletes
    mod_revision: int
    deleted: bool


@dataclass(frozen=True, slots=True)
class NamespaceClaim:
    """What `EtcdClient.claim_namespace` found or wrote."""

    generation: int  # recorded in etcd now (0 and nothing written when flushed_at > seen)
    created: bool  # this claim created the record
    flushed_at: int  # mod revision of the name's flush marker (0: never flushed)
    count: int  # the tenant's namespace records, as of the claim


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    """One namespaces/<tenant>/<id> record, as operators list them."""

    tenant: str
    ns_hex: str
    name: str
    model_name: str
    generation: int


@dataclass(frozen=True, slots=True)
class _NsSnapshot:
    record: KeyValue | None
    flushed_at: int
    count: int
    count_mod: int  # mod revision of the tenant's counter (0: none yet)


def namespace_key(tenant: str, ns_id: bytes) -> str:
    return f"{NAMESPACES}{tenant}/{ns_id.hex()}"


def ns_count_key(tenant: str) -> str:
    return f"{NS_COUNTS}{tenant}"


def flush_marker_key(tenant: str, name: str) -> str:
    return f"{FLUSHES}{tenant}/{name}"


def killswitch_enabled(raw: bytes) -> bool:
    """A present, parseable killswitch key with enabled=true; garbage counts as on, since
    a half-written switch is more likely a pollution alarm than a typo worth ignoring."""
    if not raw:
        return False
    try:
        return bool(json.loads(raw).get("enabled", True))
    except (ValueError, AttributeError):
        return True
