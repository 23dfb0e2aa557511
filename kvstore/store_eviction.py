"""Eviction and slot bookkeeping of the block store (mixed into BlockStore).

Per (tenant, tier) heaps hold (priority, tick, version, block); an entry is valid while the
block's version is unchanged and it is still evictable, so re-filing a block after any
change is one push and stale entries are skipped when popped. Only leaves leave the node,
and only pool-leaves leave the pool: the store stays prefix-consistent.
"""

from __future__ import annotations

import heapq

from kvstore.events import EventKind, Tier
from kvstore.payload import BlockHeader, block_shape, encode_block
from kvstore.store_types import BlockMeta, NsState
from kvstore.tiers.rocks import TierUnavailable


class EvictionMixin:
    # -------------------------------------------------------------------- eviction
    def _hbm_evictable(self, m: BlockMeta) -> bool:
        return (
            m.slot >= 0
            and not m.pinned
            and m.readers == 0
            and m.hbm_children == 0
            and (m.children == 0 or (m.ns.policy.persist and self.rocks is not None))
        )

    def _nvme_evictable(self, m: BlockMeta) -> bool:
        return m.on_nvme and not m.pinned and m.readers == 0 and (m.slot >= 0 or m.children == 0)

    def _refile(self, m: BlockMeta) -> None:
        """Re-enter a block in the eviction heaps after any change of its priority or of
        its eligibility; stale heap entries are skipped when popped."""
        m.version += 1
        if m.block_id not in m.ns.blocks:
            return
        prio = self.eviction.priority(m)
        for tier, ok in ((Tier.HBM, self._hbm_evictable(m)), (Tier.NVME, self._nvme_evictable(m))):
            if ok:
                self._tick += 1
                heap = self._heaps.setdefault((m.ns.tenant, tier), [])
                heapq.heappush(heap, (prio, self._tick, m.version, m))
                if len(heap) > 4 * len(m.ns.blocks) + 4096:
                    self._compact(heap, tier)

    def _compact(self, heap: list, tier: Tier) -> None:
        ok = self._hbm_evictable if tier == Tier.HBM else self._nvme_evictable
        heap[:] = [
            e for e in heap if e[2] == e[3].version and ok(e[3]) and e[3].block_id in e[3].ns.blocks
        ]
        heapq.heapify(heap)

    def _victim(self, tier: Tier, tenant: str | None, protect=None) -> BlockMeta | None:
        ok = self._hbm_evictable if tier == Tier.HBM else self._nvme_evictable
        best = None
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
        heapq.heappop(self._heaps[(best[3].ns.tenant, tier)])
        return best[3]

    def _reserve_slot(self, tenant: str, extra: int = 0, protect=None) -> int | None:
        extra = extra or self.pool.slot_bytes
        kept: list[BlockMeta] = []  # victims that could not leave (NVMe full)
        try:
            while self.accounts.overflow(tenant, Tier.HBM, extra):
                victim = self._victim(Tier.HBM, tenant, protect)
                if victim is None:
                    return None
                self._evict_or_keep(victim, "quota", kept)
            slot = self.pool.reserve()
            while slot is None:
                victim = self._victim(Tier.HBM, None, protect)
                if victim is None:
                    return None
                self._evict_or_keep(victim, "capacity", kept)
                slot = self.pool.reserve()
            return slot
        finally:
            for m in kept:  # popped from the heaps: put them back, or they never leave
                self._refile(m)

    def _evict_or_keep(self, victim: BlockMeta, reason: str, kept: list[BlockMeta]) -> None:
        """Evict a victim popped from the heaps; one that stays (or whose eviction
        failed) joins `kept`, to be filed again."""
        try:
            if self._evict_hbm(victim, reason):
                return
        except BaseException:
            kept.append(victim)
            raise
        kept.append(victim)

    def _evict_hbm(self, m: BlockMeta, reason: str) -> bool:
        """Demote or drop `m`; False when it has to stay (children, and NVMe is full)."""
        self.counters[f"evict_hbm_{reason}"] += 1
        if m.children == 0 and not (m.ns.policy.persist and self.rocks is not None):
            self._remove(m)
            self.events.append(EventKind.REMOVED, m.ns.ns_id, (m.block_id,))
            return True
        if not m.on_nvme:
            self._persist_ancestors(m)
            if m.ns.blocks.get(m.block_id) is not m:
                return True  # an ancestor was found corrupt: m went with it
        if not m.on_nvme and not self._write_nvme(m):
            if m.ns.blocks.get(m.block_id) is not m:
                return True  # found corrupt and dropped
            if m.children:
                return False
            self._remove(m)
            self.events.append(EventKind.REMOVED, m.ns.ns_id, (m.block_id,))
            return True
        self._detach_slot(m)
        self.counters["demotions"] += 1
        self.events.append(EventKind.TIER_CHANGED, m.ns.ns_id, (m.block_id,), tier=Tier.NVME)
        return True

    def _persist_ancestors(self, m: BlockMeta) -> None:
        """Give m's ancestors held only in the pool an NVMe copy too (they stay in the pool):
        recovery keeps a block only with its whole prefix, so without them a crash would
        orphan every block spilled below a chain head that lived in the pool. Best effort,
        root first; each ancestor is written once (later spills find it on NVMe)."""
        chain = []
        p = m.ns.blocks.get(m.parent_id) if m.depth else None
        while p is not None and not p.on_nvme and p.slot >= 0:
            chain.append(p)
            p = p.ns.blocks.get(p.parent_id) if p.depth else None
        for b in chain:
            b.readers += 1  # neither demoted nor dropped from NVMe while its chain is written
        try:
            for b in reversed(chain):
                if b.ns.blocks.get(b.block_id) is not b or not self._write_nvme(b):
                    break
                self.counters["nvme_prefix_copies"] += 1
        finally:
            for b in chain:
                self._done_reading(b)

    def _write_nvme(self, m: BlockMeta) -> bool:
        """Spill `m` to NVMe; False when it could not (full, failing, or found corrupt)."""
        st = m.ns
        # Backing off, or no encryption key for the tenant: neither evict nor read for it.
        if not self.rocks.may_write(st.tenant):
            self.counters["nvme_spill_failed"] += 1
            return False
        while self.nvme_used + m.nbytes > self.rocks.capacity_bytes or self.accounts.overflow(
            st.tenant, Tier.NVME, m.nbytes
        ):
            tenant = st.tenant if self.accounts.overflow(st.tenant, Tier.NVME, m.nbytes) else None
            victim = self._victim(Tier.NVME, tenant, protect=m)
            if victim is None:
                self.counters["nvme_full"] += 1
                return False
            self._evict_nvme(victim, quota=tenant is not None)
        payload, digest = self.pool.read_bytes(m.slot, m.nbytes)
        if digest != m.checksum:  # never spill a corrupt block: drop it and its descendants
            self.counters["corrupt_dropped"] += 1
            self._remove_subtrees(st, {m.block_id}, "corrupt")
            return False
        hdr = BlockHeader(
            st.ns_id,
            st.generation,
            m.block_id,
            m.parent_id,
            m.depth,
            st.spec.kv_dtype,
            block_shape(st.spec),
            m.nbytes,
            m.checksum,
        )
        try:
            self.rocks.put_batch([(st.ns_id + m.block_id, encode_block(hdr, payload))], st.tenant)
        except TierUnavailable:  # disk full or failing: counted and logged by the tier
            self.counters["nvme_spill_failed"] += 1
            return False
        m.on_nvme = True
        self.nvme_used += m.nbytes
        self.accounts.add(st.tenant, Tier.NVME, m.nbytes)
        self._refile(m)
        return True

    def _evict_nvme(self, m: BlockMeta, quota: bool = False) -> None:
        """Drop a block's NVMe copy (and the block, if that was its only copy); `quota`:
        evicted for its tenant's NVMe quota, which is counted apart as well."""
        self.counters["evict_nvme"] += 1
        if quota:
            self.counters["evict_nvme_quota"] += 1
        if m.slot >= 0:
            self._drop_nvme_copy(m)
        else:
            self._remove(m)
            self.events.append(EventKind.REMOVED, m.ns.ns_id, (m.block_id,))

    def _drop_nvme_copy(self, m: BlockMeta) -> None:
        if m.on_nvme:
            self.rocks.delete_batch([m.ns.ns_id + m.block_id])
            m.on_nvme = False
            self.nvme_used -= m.nbytes
            self.accounts.sub(m.ns.tenant, Tier.NVME, m.nbytes)

    # ---------------------------------------------------------- slot bookkeeping
    def _attach_slot(self, m: BlockMeta, slot: int) -> None:
        m.slot = slot
        self.accounts.add(m.ns.tenant, Tier.HBM, m.nbytes)
        parent = m.ns.blocks.get(m.parent_id) if m.depth else None
        if parent is not None:
            parent.hbm_children += 1
            self._refile(parent)
        self._refile(m)

    def _give_back_slot(self, m: BlockMeta) -> None:
        """Free m's slot, or park it while a get still copies out of it."""
        if m.readers:
            self._parked[m] = m.slot
        else:
            self.pool.release(m.slot)
        m.slot = -1

    def _done_reading(self, m: BlockMeta) -> None:
        m.readers -= 1
        if m.readers:
            return
        slot = self._parked.pop(m, None)
        if slot is not None:
            self.pool.release(slot)
        self._refile(m)  # eligibility changed; heap entries popped meanwhile are gone

    def _detach_slot(self, m: BlockMeta) -> None:
        self._give_back_slot(m)
        self.accounts.sub(m.ns.tenant, Tier.HBM, m.nbytes)
        parent = m.ns.blocks.get(m.parent_id) if m.depth else None
        if parent is not None:
            parent.hbm_children -= 1
            self._refile(parent)
        self._refile(m)

    def _free_resources(self, m: BlockMeta) -> None:
        if m.slot >= 0:
            self.accounts.sub(m.ns.tenant, Tier.HBM, m.nbytes)
            self._give_back_slot(m)
        if m.on_nvme:
            self.nvme_used -= m.nbytes
            self.accounts.sub(m.ns.tenant, Tier.NVME, m.nbytes)
            m.on_nvme = False

    def _remove(self, m: BlockMeta) -> None:
        """Drop a leaf from the node, every tier."""
        if m.children:
            raise AssertionError("prefix consistency: removing a block that has children")
        if m.slot >= 0:
            self._detach_slot(m)
        self._drop_nvme_copy(m)
        st = m.ns
        del st.blocks[m.block_id]
        if m.pinned:
            st.pinned_bytes -= m.nbytes
        parent = st.blocks.get(m.parent_id) if m.depth else None
        if parent is not None:
            parent.children -= 1
            self._refile(parent)
        m.version += 1

    def _remove_subtrees(self, st: NsState, roots: set[bytes], reason: str) -> int:
        doomed = set(roots)
        for m in sorted(st.blocks.values(), key=lambda b: b.depth):
            if m.parent_id in doomed:
                doomed.add(m.block_id)
        gone = sorted((st.blocks[b] for b in doomed if b in st.blocks), key=lambda b: -b.depth)
        for m in gone:
            self._remove(m)
        if gone:
            self.events.append(EventKind.REMOVED, st.ns_id, tuple(m.block_id for m in gone))
            self.counters[f"removed_{reason}"] += len(gone)
        return len(gone)
