"""Where each block of the store lives, and its moves between tiers: pool slots attached
and given back, demotion to NVMe, promotion into the pool, eviction, removal.

Owns the bytes held on NVMe and the slots parked under readers; the tier accounts
(kvstore/accounting.py) it keeps in step are shared with the quotas: a block in the pool
is charged a whole slot (pool.slot_bytes, what it keeps every other block out of,
however small its payload), a block on NVMe the payload bytes stored there. Every method runs
under the store's lock. Only leaves leave the node and only pool-leaves leave the pool
(the eviction queue picks no other), so the store stays prefix-consistent.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict

from kvstore.accounting import TenantAccounts
from kvstore.errors import DataLoss
from kvstore.events import EventKind, EventQueue, Tier
from kvstore.payload import BlockHeader, block_shape, decode_block, encode_block
from kvstore.store_eviction import EvictionQueue
from kvstore.store_types import BlockMeta, NsState, Payload
from kvstore.tiers.pool import DevicePool
from kvstore.tiers.rocks import RocksTier, TierUnavailable

# Read once: a member read through its class costs ~0.3 us on Python 3.11, and the pool
# tier is named on every block a write reserves and attaches.
_HBM = Tier.HBM


class Residency:
    def __init__(
        self,
        pool: DevicePool,
        rocks: RocksTier | None,
        accounts: TenantAccounts,
        queue: EvictionQueue,
        counters: Counter[str],
        events: EventQueue,
    ) -> None:
        self.pool = pool
        self.rocks = rocks
        self.accounts = accounts
        self.queue = queue
        self.counters = counters
        self.events = events
        # The eviction counters (evict_*, removed_*, blocks_dropped_flush) per tenant too:
        # `kvctl stats --tenant T` shows the tenant's own (node_agent/stats.py).
        self.tenant_counters: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.nvme_used = 0
        # Slots of blocks removed while a get still copies out of them: freed by the last
        # reader, so a slot is never reused under a copy in flight.
        self._parked: dict[BlockMeta, int] = {}

    # ------------------------------------------------------------ making room

    def count(self, tenant: str, name: str, n: int = 1) -> None:
        """Count an eviction reason on the node and for its tenant."""
        self.counters[name] += n
        self.tenant_counters[tenant][name] += n

    def reserve_slot(
        self, tenant: str, extra: int = 0, protect: BlockMeta | None = None
    ) -> int | None:
        """A pool slot for `tenant`, evicting (its own blocks for its quota, anyone's for
        capacity) to make room for `extra` bytes of its quota (default: the one slot);
        None when no victim is left."""
        extra = extra or self.pool.slot_bytes
        kept: list[BlockMeta] = []  # victims that could not leave (NVMe full)
        try:
            while self.accounts.overflow(tenant, _HBM, extra):
                victim = self.queue.victim(_HBM, tenant, protect)
                if victim is None:
                    return None
                self._evict_or_keep(victim, "quota", kept)
            slot = self.pool.reserve()
            while slot is None:
                victim = self.queue.victim(Tier.HBM, None, protect)
                if victim is None:
                    return None
                self._evict_or_keep(victim, "capacity", kept)
                slot = self.pool.reserve()
            return slot
        finally:
            for m in kept:  # popped from the heaps: put them back, or they never leave
                self.queue.refile(m)

    def _evict_or_keep(self, victim: BlockMeta, reason: str, kept: list[BlockMeta]) -> None:
        """Evict a victim popped from the heaps; one that stays (or whose eviction
        failed) joins `kept`, to be filed again."""
        try:
            if self.evict_hbm(victim, reason):
                return
        except BaseException:
            kept.append(victim)
            raise
        kept.append(victim)

    def evict_hbm(self, m: BlockMeta, reason: str) -> bool:
        """Demote or drop `m`; False when it has to stay (children, and NVMe is full)."""
        self.count(m.ns.tenant, f"evict_hbm_{reason}")
        if m.children == 0 and not (m.ns.policy.persist and self.rocks is not None):
            self._remove_one(m)
            return True
        if not m.on_nvme:
            self._persist_ancestors(m)
            if m.ns.blocks.get(m.block_id) is not m:
                return True  # an ancestor was found corrupt: m went with it
        if not m.on_nvme and not self.write_nvme(m):
            if m.ns.blocks.get(m.block_id) is not m:
                return True  # found corrupt and dropped
            if m.children:
                return False
            self._remove_one(m)
            return True
        self.detach_slot(m)
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
                if b.ns.blocks.get(b.block_id) is not b or not self.write_nvme(b):
                    break
                self.counters["nvme_prefix_copies"] += 1
        finally:
            for b in chain:
                self.done_reading(b)

    def write_nvme(self, m: BlockMeta) -> bool:
        """Spill `m` to NVMe; False when it could not (full, failing, or found corrupt)."""
        st = m.ns
        rocks = self.rocks
        # Backing off, or no encryption key for the tenant: neither evict nor read for it.
        if rocks is None or not rocks.may_write(st.tenant):
            self.counters["nvme_spill_failed"] += 1
            return False
        while self.nvme_used + m.nbytes > rocks.capacity_bytes or self.accounts.overflow(
            st.tenant, Tier.NVME, m.nbytes
        ):
            tenant = st.tenant if self.accounts.overflow(st.tenant, Tier.NVME, m.nbytes) else None
            victim = self.queue.victim(Tier.NVME, tenant, protect=m)
            if victim is None:
                self.counters["nvme_full"] += 1
                return False
            self.evict_nvme(victim, quota=tenant is not None)
        payload, digest = self.pool.read_bytes(m.slot, m.nbytes)
        if digest != m.checksum:  # never spill a corrupt block: drop it and its descendants
            self.counters["corrupt_dropped"] += 1
            self.remove_subtrees(st, {m.block_id}, "corrupt")
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
            rocks.put_batch([(st.ns_id + m.block_id, encode_block(hdr, payload))], st.tenant)
        except TierUnavailable:  # disk full or failing: counted and logged by the tier
            self.counters["nvme_spill_failed"] += 1
            return False
        m.on_nvme = True
        self.nvme_used += m.nbytes
        self.accounts.add(st.tenant, Tier.NVME, m.nbytes)
        self.queue.refile(m)
        return True

    def evict_nvme(self, m: BlockMeta, quota: bool = False) -> None:
        """Drop a block's NVMe copy (and the block, if that was its only copy); `quota`:
        evicted for its tenant's NVMe quota, which is counted apart as well."""
        self.count(m.ns.tenant, "evict_nvme")
        if quota:
            self.count(m.ns.tenant, "evict_nvme_quota")
        if m.slot >= 0:
            self._drop_nvme_copy(m)
        else:
            self._remove_one(m)

    def _drop_nvme_copy(self, m: BlockMeta) -> None:
        if m.on_nvme and self.rocks is not None:  # on NVMe only where there is a tier
            self.rocks.delete_batch([m.ns.ns_id + m.block_id])
            m.on_nvme = False
            self.nvme_used -= m.nbytes
            self.accounts.sub(m.ns.tenant, Tier.NVME, m.nbytes)

    # ------------------------------------------------------------- promotion
    def read_nvme(self, m: BlockMeta, dst: Payload) -> bool:
        """Read m's NVMe copy into `dst`, checked against its header and checksum."""
        raw = self.rocks.get(m.ns.ns_id + m.block_id, m.ns.tenant) if self.rocks else None
        if raw is None:
            return False
        try:
            hdr, payload = decode_block(raw)
        except DataLoss:
            return False
        if hdr.block_id != m.block_id or hdr.checksum != m.checksum:
            return False
        memoryview(dst).cast("B")[: m.nbytes] = payload
        return True

    def promote(self, m: BlockMeta, src: Payload) -> bool:
        """Copy an NVMe-only block into the pool, only if its parent is in the pool (or it
        starts a chain): the pool stays prefix-closed."""
        if m.slot >= 0 or m.ns.blocks.get(m.block_id) is not m:
            return False
        parent = m.ns.blocks.get(m.parent_id) if m.depth else None
        if parent is not None and parent.slot < 0:
            return False
        if parent is not None:  # making room must not demote the parent from under m
            parent.readers += 1
        try:
            slot = self.reserve_slot(m.ns.tenant, protect=m)
        finally:
            if parent is not None:
                self.done_reading(parent)
        if slot is None:
            return False
        if m.ns.blocks.get(m.block_id) is not m or (parent is not None and parent.slot < 0):
            self.pool.abort(slot)  # making room dropped m or its parent (found corrupt)
            return False
        # `src` may be a client's shared memory: what lands in the pool must still match.
        if self.pool.write(slot, memoryview(src).cast("B")[: m.nbytes]) != m.checksum:
            self.pool.abort(slot)
            self.counters["promote_mismatch"] += 1
            return False
        self.pool.commit(slot)
        self.attach_slot(m, slot)
        self.counters["promotions"] += 1
        return True

    def promote_chain(self, m: BlockMeta) -> bool:
        """Bring `m` and its NVMe-only ancestors into the pool (rare: a child is put while
        its parent sits on NVMe). Returns whether `m` is in the pool afterwards."""
        chain = []
        b: BlockMeta | None = m
        while b is not None and b.slot < 0:
            chain.append(b)
            b = b.ns.blocks.get(b.parent_id) if b.depth else None
        for b in chain:
            b.readers += 1
        try:
            for b in reversed(chain):
                buf = bytearray(b.nbytes)
                if not self.read_nvme(b, buf) or not self.promote(b, buf):
                    return False
            return True
        finally:
            for b in chain:
                self.done_reading(b)

    # ------------------------------------------------------ slot bookkeeping
    def refiles_deferred(self) -> contextlib.AbstractContextManager[None]:
        """Around bookkeeping that evicts nothing (a commit): each block changed inside is
        re-filed for eviction once, at the end (EvictionQueue.deferred)."""
        return self.queue.deferred()

    def attach_slot(
        self, m: BlockMeta, slot: int, parent: BlockMeta | None = None, charge: bool = True
    ) -> None:
        """`parent`: m's parent, where the caller has it at hand (else looked up).
        `charge=False`: the caller charges the slot itself (charge_slots, for a batch)."""
        m.slot = slot
        if charge:
            self.accounts.add(m.ns.tenant, _HBM, self.pool.slot_bytes)
        if parent is None and m.depth:
            parent = m.ns.blocks.get(m.parent_id)
        if parent is not None:
            parent.hbm_children += 1
            self.queue.refile(parent)
        self.queue.refile(m)

    def charge_slots(self, tenant: str, n: int) -> None:
        """Charge `tenant` n pool slots attached with attach_slot(charge=False)."""
        if n:
            self.accounts.add(tenant, _HBM, n * self.pool.slot_bytes, n)

    def _give_back_slot(self, m: BlockMeta) -> None:
        """Free m's slot, or park it while a get still copies out of it."""
        if m.readers:
            self._parked[m] = m.slot
        else:
            self.pool.release(m.slot)
        m.slot = -1

    def done_reading(self, m: BlockMeta) -> None:
        """Drop one hold on `m` (a reader, or a write's parent); the last one frees a slot
        parked under it."""
        m.readers -= 1
        if m.readers:
            return
        slot = self._parked.pop(m, None)
        if slot is not None:
            self.pool.release(slot)
        self.queue.refile(m)  # eligibility changed; heap entries popped meanwhile are gone

    def detach_slot(self, m: BlockMeta) -> None:
        self._give_back_slot(m)
        self.accounts.sub(m.ns.tenant, Tier.HBM, self.pool.slot_bytes)
        parent = m.ns.blocks.get(m.parent_id) if m.depth else None
        if parent is not None:
            parent.hbm_children -= 1
            self.queue.refile(parent)
        self.queue.refile(m)

    def free_resources(self, m: BlockMeta) -> None:
        """Give back whatever `m` holds in each tier, for a namespace dropped whole (its
        NVMe records go with a prefix delete)."""
        if m.slot >= 0:
            self.accounts.sub(m.ns.tenant, Tier.HBM, self.pool.slot_bytes)
            self._give_back_slot(m)
        if m.on_nvme:
            self.nvme_used -= m.nbytes
            self.accounts.sub(m.ns.tenant, Tier.NVME, m.nbytes)
            m.on_nvme = False

    def recovered(self, m: BlockMeta) -> None:
        """Count a block found on NVMe at recovery as held there."""
        self.nvme_used += m.nbytes
        self.accounts.add(m.ns.tenant, Tier.NVME, m.nbytes)

    # ---------------------------------------------------------------- pins
    @property
    def pin_charge(self) -> int:
        """What one pinned block is charged against its namespace's and its tenant's pin
        budgets: a whole pool slot, which it keeps from every other block while pinned
        (an NVMe-only pinned block takes one when it is read back)."""
        return self.pool.slot_bytes

    def unpinned(self, st: NsState, n: int) -> None:
        """`n` pinned blocks of `st` left the node (or their pins went with a flush)."""
        charge = n * self.pin_charge
        st.pinned_bytes -= charge
        self.accounts.add_pinned(st.tenant, -charge)

    # --------------------------------------------------------------- removal
    def _remove_one(self, m: BlockMeta) -> None:
        self.remove(m)
        self.events.append(EventKind.REMOVED, m.ns.ns_id, (m.block_id,))

    def remove(self, m: BlockMeta) -> None:
        """Drop a leaf from the node, every tier."""
        if m.children:
            raise AssertionError("prefix consistency: removing a block that has children")
        if m.slot >= 0:
            self.detach_slot(m)
        self._drop_nvme_copy(m)
        st = m.ns
        del st.blocks[m.block_id]
        if m.pinned:
            self.unpinned(st, 1)
        parent = st.blocks.get(m.parent_id) if m.depth else None
        if parent is not None:
            parent.children -= 1
            self.queue.refile(parent)
        m.version += 1

    def remove_subtrees(self, st: NsState, roots: set[bytes], reason: str) -> int:
        doomed = set(roots)
        for m in sorted(st.blocks.values(), key=lambda b: b.depth):
            if m.parent_id in doomed:
                doomed.add(m.block_id)
        gone = sorted((st.blocks[b] for b in doomed if b in st.blocks), key=lambda b: -b.depth)
        for m in gone:
            self.remove(m)
        if gone:
            self.events.append(EventKind.REMOVED, st.ns_id, tuple(m.block_id for m in gone))
            self.count(st.tenant, f"removed_{reason}", len(gone))
        return len(gone)
