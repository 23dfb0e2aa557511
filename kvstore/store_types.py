"""Records of the block store: per-block metadata, per-namespace state, request and
result types, and the packed-id view used by Lookup."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvstore.errors import InvalidArgument
from kvstore.events import Tier
from kvstore.hashing import BLOCK_ID_BYTES
from kvstore.namespace import Namespace
from kvstore.policy import NamespacePolicy

ID_BYTES = BLOCK_ID_BYTES  # one definition: kvstore.hashing
NS_META_PREFIX = b"ns:"

# A block payload in flight: bytes, a bytearray, a memoryview over a client's shared
# memory, or a slot view (a memoryview of a host pool, a torch tensor of a device pool).
# No one static type covers them all; the pool and kvstore.checksum check them at run time.
Payload = Any


@dataclass(slots=True, eq=False)
class BlockMeta:
    ns: "NsState"
    block_id: bytes
    parent_id: bytes
    depth: int
    nbytes: int
    checksum: int
    slot: int = -1
    on_nvme: bool = False
    hits: int = 0
    last_access: float = 0.0
    expires_at: float = 0.0
    pinned: bool = False
    readers: int = 0
    children: int = 0
    hbm_children: int = 0
    version: int = 0

    @property
    def tier(self) -> Tier:
        return Tier.HBM if self.slot >= 0 else Tier.NVME


@dataclass(slots=True, eq=False)
class NsState:
    spec: Namespace
    ns_id: bytes
    generation: int
    policy: NamespacePolicy
    blocks: dict[bytes, BlockMeta] = field(default_factory=dict)
    pinned_bytes: int = 0
    # spec.block_bytes, read per block on the hot paths (a property that multiplies
    # five fields each time)
    block_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.block_bytes = self.spec.block_bytes

    @property
    def tenant(self) -> str:
        return self.spec.tenant


# PutItem, PlannedSlot, Written and ServedBlock are made per block of every put and get:
# NamedTuples, as immutable as a frozen dataclass and a third of its construction cost
# (~0.5 us against ~1.2-1.6 us on the hosts measured; ~0.25 ms of a 64-block put).
class PutItem(NamedTuple):
    block_id: bytes
    parent_id: bytes
    data: Payload  # any buffer of exactly the namespace's block bytes
    checksum: int | None = None


class PlannedSlot(NamedTuple):
    """One block of a write in flight: the pool slot reserved for it, its depth in the
    chain, the parent held (readers + 1) so it is not evicted before the child commits,
    and the tenant whose quota counts the slot's `nbytes` while it is in flight."""

    item: PutItem
    slot: int
    depth: int
    parent: "BlockMeta | None"
    tenant: str
    nbytes: int


class Written(NamedTuple):
    """A planned block whose payload is in its slot, with the checksum computed there."""

    planned: PlannedSlot
    digest: int


class CommitResult(NamedTuple):
    """What committing a write made of its planned slots."""

    stored: int
    raced: int  # committed meanwhile by a concurrent writer of the same chain


# The public results below are NamedTuples, not dataclasses: callers unpack them
# (`stored, already = store.put(...)`) and compare them with plain tuples.
class PutResult(NamedTuple):
    stored: int
    already: int  # present before, or committed meanwhile by another writer


class PinResult(NamedTuple):
    changed: int  # blocks whose pin state changed
    pinned_bytes: int  # the namespace's pinned bytes afterwards (a pool slot per block)


class HeldBlock(NamedTuple):
    block_id: bytes
    tier: Tier


class NsSnapshot(NamedTuple):
    ns_id: bytes
    blocks: list[HeldBlock]  # parents before children


class StoreSnapshot(NamedTuple):
    last_seq: int  # the last event sequence the snapshot includes
    namespaces: list[NsSnapshot]


@dataclass(frozen=True, slots=True)
class Promotion:
    """A block a get read from NVMe into `src`, to be copied into the pool afterwards."""

    meta: BlockMeta
    src: Payload


@dataclass(frozen=True, slots=True)
class LookupResult:
    matched: int
    hbm: int
    nvme: int
    generation: int


class ServedBlock(NamedTuple):
    block_id: bytes
    tier: Tier
    checksum: int
    data: bytes | None = None  # set when the caller asked for bytes (dst_for returned None)


@dataclass(slots=True, eq=False)
class Reservation:
    """Pool slots reserved for a run of a chain whose payloads land in place
    (BlockStore.reserve): `views[i]` is where block i goes. Ends in exactly one of
    BlockStore.commit or BlockStore.abort; `reason` says why it holds fewer blocks than
    asked for ('' when it holds them all)."""

    ns: NsState
    generation: int
    plan: list[PlannedSlot]  # items are PutItems over the slot views
    reason: str = ""
    # The next run of the chain, reserved (`after=` this one) before this one committed:
    # this one's commit holds its last block for it, as plan_slot holds a parent that is
    # already stored, so that making room meanwhile cannot evict what it will attach to.
    follower: Reservation | None = None
    held: list[BlockMeta] = field(default_factory=list)  # parents held for this one

    @property
    def views(self) -> list[Payload]:
        return [p.item.data for p in self.plan]

    @property
    def last_depth(self) -> int:
        return self.plan[-1].depth if self.plan else -1

    def __len__(self) -> int:
        return len(self.plan)


@dataclass(slots=True, eq=False)
class Borrowed:
    """Verified, read-only views of pool slots (BlockStore.borrow). The blocks stay
    readable (not evicted, their slots not reused) until BlockStore.release."""

    ns: NsState
    metas: list[BlockMeta]
    views: list[Payload]
    served: list[ServedBlock]

    def __len__(self) -> int:
        return len(self.served)


class PackedIds:
    """Read-only sequence view over packed 16-byte ids: slices on demand, so a lookup that
    probes 11 of 2,000 ids never splits the other 1,989."""

    __slots__ = ("buf", "n")

    def __init__(self, packed: bytes) -> None:
        if len(packed) % ID_BYTES:
            raise InvalidArgument(f"block_ids is {len(packed)} bytes, not a multiple of {ID_BYTES}")
        self.buf = bytes(packed)
        self.n = len(packed) // ID_BYTES

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.buf[i * ID_BYTES : (i + 1) * ID_BYTES]


def _first_false(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """Smallest i in [lo, hi) with pred(i) false, given pred is true then false."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def raise_expiry(m: BlockMeta | None, until: float) -> None:
    """Keep expiry monotone along the chain: no ancestor of (nor) `m` expires before `until`."""
    while m is not None and m.expires_at and m.expires_at < until:
        m.expires_at = until
        m = m.ns.blocks.get(m.parent_id) if m.depth else None
