"""What the client hands its callers: its own frozen records, never protobuf messages, so
callers depend on the client's API and not on the wire format behind it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LookupResult:
    matched: int  # leading blocks present on the node, any tier
    hbm: int  # of those, held in the device pool
    nvme: int  # of those, held only on NVMe
    generation: int

    @classmethod
    def from_proto(cls, msg) -> LookupResult:
        return cls(msg.matched, msg.hbm, msg.nvme, msg.generation)


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: int  # blocks newly stored
    already_present: int  # blocks the node held already (skipped)
    # why the other blocks of the call were not stored ("" when every block is stored
    # or present): an orphan, a chain shorter than min_prefix_blocks, a full pool/quota
    not_stored: str = ""

    @classmethod
    def from_proto(cls, msg) -> PutResult:
        return cls(msg.stored, msg.already_present, msg.not_stored)


@dataclass(frozen=True, slots=True)
class PinResult:
    blocks: int  # blocks whose pin state changed
    pinned_bytes: int  # the namespace's pinned bytes after the call (a pool slot per block)

    @classmethod
    def from_proto(cls, msg) -> PinResult:
        return cls(msg.blocks, msg.pinned_bytes)


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    present: int  # leading blocks of the request the agent holds now
    fetched: int  # of those, moved by this call's transfers
    waited: int  # of those, brought by a concurrent call for the same blocks
    transport: str  # "", "ucx", "grpc" or "ucx+grpc"
    stopped: str  # why the rest is a miss; "" when every block is present

    @classmethod
    def from_proto(cls, msg) -> PrefetchResult:
        return cls(msg.present, msg.fetched, msg.waited, msg.transport, msg.stopped)


@dataclass(frozen=True, slots=True)
class TierUsage:
    tier: int  # kvstore.events.Tier value (HBM, NVME)
    capacity_bytes: int
    used_bytes: int
    blocks: int
    slots_total: int
    slots_free: int
    condition: str = ""  # '' when healthy; else e.g. "writes failing since 12s: …"
    unflushed_bytes: int = 0  # NVMe: of used_bytes, only in memory yet (kill -9 loses it)


@dataclass(frozen=True, slots=True)
class TenantUsage:
    tenant: str
    hbm_bytes: int
    nvme_bytes: int
    hbm_limit_bytes: int
    nvme_limit_bytes: int
    lookups: int
    lookup_hits: int  # lookups with at least one matched block
    lookup_blocks: int  # blocks asked for
    lookup_hit_blocks: int  # blocks matched


@dataclass(frozen=True, slots=True)
class AgentStats:
    """One agent's occupancy per tier and tenant and its counters (Stats)."""

    node_id: str
    device: str
    tiers: tuple[TierUsage, ...]
    tenants: tuple[TenantUsage, ...]
    counters: dict[str, int]  # evictions by reason, corrupt drops, promotions, ...
    in_flight: int
    utilization: float  # device pool occupancy 0..1
    native_accel: str  # what hashes and checksums run on ("native avx2", "python (...)")

    @classmethod
    def from_proto(cls, msg) -> AgentStats:
        tiers = tuple(
            TierUsage(
                t.tier,
                t.capacity_bytes,
                t.used_bytes,
                t.blocks,
                t.slots_total,
                t.slots_free,
                t.condition,
                t.unflushed_bytes,
            )
            for t in msg.tiers
        )
        tenants = tuple(
            TenantUsage(
                t.tenant,
                t.hbm_bytes,
                t.nvme_bytes,
                t.hbm_limit_bytes,
                t.nvme_limit_bytes,
                t.lookups,
                t.lookup_hits,
                t.lookup_blocks,
                t.lookup_hit_blocks,
            )
            for t in msg.tenants
        )
        return cls(
            msg.node_id,
            msg.device,
            tiers,
            tenants,
            dict(msg.counters),
            msg.in_flight,
            msg.utilization,
            msg.native_accel,
        )
