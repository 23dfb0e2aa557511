"""The block store's eviction queue: which block leaves a tier next.

Per (tenant, tier) heaps hold (priority, tick, version, block); an entry is valid while the
block's version is unchanged and it is still evictable, so re-filing a block after any
change is one push and stale entries are skipped when popped. Only leaves leave the node,
and only pool-leaves leave the pool: the store stays prefix-consistent. A block's priority
in each tier is its value for what that tier charges for it: a whole slot in the pool,
its payload bytes on NVMe (kvstore/eviction.py).

The queue changes no block and moves nothing: kvstore/store_residency.py evicts what it
picks. It runs under the store's lock like everything the store's collaborators do.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable, Iterator
from typing import NamedTuple

from kvstore.eviction import EvictionPolicy
from kvstore.events import Tier
from kvstore.store_types import BlockMeta

# A heap entry stays a plain tuple: heapq compares tuples natively, the hot path of every
# eviction, and (priority, tick) is unique, so the BlockMeta is never compared.
HeapEntry = tuple[float, int, int, BlockMeta]


class HeapKey(NamedTuple):
    tenant: str
    tier: Tier


class EvictionQueue:
    def __init__(self, policy: EvictionPolicy, spills: bool, slot_bytes: int) -> None:
        self.policy = policy
        # What a block in the pool is charged, whatever its payload: the pool's slot size.
        self.slot_bytes = slot_bytes
        # Whether the node has an NVMe tier: a block with children may leave the pool only
        # by demotion, which needs one. Follows BlockStore.rocks.
        self.spills = spills
        self._heaps: dict[HeapKey, list[HeapEntry]] = {}
        self._tick = 0
        self._deferred: dict[int, BlockMeta] | None = None  # blocks to push (deferred())

    def hbm_evictable(self, m: BlockMeta) -> bool:
        return (
            m.slot >= 0
            and not m.pinned
            and m.readers == 0
            and m.hbm_children == 0
            and (m.children == 0 or (m.ns.policy.persist and self.spills))
        )

    @staticmethod
    def nvme_evictable(m: BlockMeta) -> bool:
        return m.on_nvme and not m.pinned and m.readers == 0 and (m.slot >= 0 or m.children == 0)

    def _evictable(self, tier: Tier) -> Callable[[BlockMeta], bool]:
        return self.hbm_evictable if tier == Tier.HBM else self.nvme_evictable

    def refile(self, m: BlockMeta) -> None:
        """Re-enter a block in the eviction heaps after any change of its priority or of
        its eligibility; stale heap entries are skipped when popped. Inside `deferred()`
        the entry is pushed once, when the block's last change is done."""
        m.version += 1  # now: entries filed before are stale from here on, deferred or not
        if self._deferred is not None:
            self._deferred[id(m)] = m
            return
        self._push(m)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Refiles inside push each block once, at the end: a chain's commit changes each
        block twice (attached, then its child attached), which would push two entries,
        one of them stale at once. Only around code that picks no victim: a block refiled
        inside is in no heap until the end."""
        if self._deferred is not None:  # nested: the outer one pushes
            yield
            return
        self._deferred = {}
        try:
            yield
        finally:
            pending, self._deferred = self._deferred, None
            for m in pending.values():
                self._push(m)

    def _push(self, m: BlockMeta) -> None:
        if m.block_id not in m.ns.blocks:
            return
        hbm, nvme = self.hbm_evictable(m), self.nvme_evictable(m)
        if not (hbm or nvme):  # most blocks of a chain: they have children in the pool
            return
        tenant = m.ns.spec.tenant
        for tier, ok, charged in ((Tier.HBM, hbm, self.slot_bytes), (Tier.NVME, nvme, m.nbytes)):
            if ok:
                self._tick += 1
                key = HeapKey(tenant, tier)
                heap = self._heaps.get(key)
                if heap is None:
                    heap = self._heaps[key] = []
                prio = self.policy.priority(m, charged)
                heapq.heappush(heap, (prio, self._tick, m.version, m))
                if len(heap) > 4 * len(m.ns.blocks) + 4096:
                    self._compact(heap, tier)

    def _compact(self, heap: list[HeapEntry], tier: Tier) -> None:
        ok = self._evictable(tier)
        heap[:] = [
            e for e in heap if e[2] == e[3].version and ok(e[3]) and e[3].block_id in e[3].ns.blocks
        ]
        heapq.heapify(heap)

    def victim(
        self, tier: Tier, tenant: str | None, protect: BlockMeta | None = None
    ) -> BlockMeta | None:
        """Pop the lowest-priority evictable block of `tier` (of `tenant` only, if given),
        never `protect`. A popped block that then stays must be re-filed by the caller."""
        ok = self._evictable(tier)
        best: HeapEntry | None = None
        for (t, tr), heap in self._heaps.items():
            if tr != tier or (tenant is not None and t != tenant):
                continue
            while heap:
                _, _, ver, m = heap[0]
                if ver == m.version and m is not protect and ok(m) and m.block_id in m.ns.blocks:
                    break
                heapq.heappop(heap)
            if heap and (best is None or heap[0] < best):
                best = heap[0]
        if best is None:
            return None
        heapq.heappop(self._heaps[HeapKey(best[3].ns.tenant, tier)])
        return best[3]
