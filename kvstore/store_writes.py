"""Writes into the block store in two phases: plan (reserve a pool slot per new block,
under the lock) -> copy (outside it) -> commit (under the lock again: check, make visible,
free the rest). Shared by BlockStore.put and the in-place transfers.

Owns the bytes of slots reserved for writes in flight, per tenant.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.events import EventKind, EventQueue, Tier
from kvstore.store_residency import Residency
from kvstore.store_types import (
    ID_BYTES,
    BlockMeta,
    CommitResult,
    NsState,
    PlannedSlot,
    PutItem,
    Written,
    raise_expiry,
)
from kvstore.tiers.pool import DevicePool


@dataclass(slots=True)
class PutPlan:
    slots: list[PlannedSlot] = field(default_factory=list)
    already: int = 0  # blocks held before (or earlier in the same put)
    # Why blocks of the put are neither planned nor held ("" when none is left out): the
    # first reason, for the caller (PutResponse.not_stored)
    not_stored: str = ""


@dataclass(slots=True)
class StoredRun:
    """A parent-to-child run of stored blocks: one STORED event."""

    parent_id: bytes
    ids: list[bytes]


class Writes:
    def __init__(
        self,
        pool: DevicePool,
        residency: Residency,
        counters: Counter[str],
        events: EventQueue,
        clock: Callable[[], float],
    ) -> None:
        self.pool = pool
        self.residency = residency
        self.counters = counters
        self.events = events
        self.clock = clock
        # Bytes of pool slots (slot_bytes each) reserved for writes in flight (planned, not
        # yet committed or freed), per tenant: not in the accounts before commit, so each
        # new reservation counts them, or writes open at once would together overshoot
        # the tenant's quota.
        self._inflight: Counter[str] = Counter()

    def fits(self, st: NsState, items: list[PutItem]) -> bool:
        """Whether planning `items` would evict nothing and read nothing from NVMe: free
        slots for all of them within the tenant's quota (counting the writes in flight),
        and every parent held either in the pool or not at all (a parent on NVMe only is
        promoted by the plan)."""
        blocks = len(items)
        extra = blocks * self.pool.slot_bytes + self._inflight[st.tenant]
        if self.pool.free_slots < blocks or self.residency.accounts.overflow(
            st.tenant, Tier.HBM, extra
        ):
            return False
        get = st.blocks.get
        for it in items:
            parent = get(it.parent_id)
            if parent is not None and parent.slot < 0:
                return False
        return True

    def plan_put(self, st: NsState, items: list[PutItem], root: bytes | None = None) -> PutPlan:
        """Validate `items` and reserve a slot for each new block (see BlockStore.put)."""
        size = st.block_bytes
        for i, it in enumerate(items):
            if len(it.block_id) != ID_BYTES or len(it.parent_id) != ID_BYTES:
                raise InvalidArgument(f"block {i}: block_id and parent_id must be 16 bytes")
            n = memoryview(it.data).nbytes
            if n != size:
                raise InvalidArgument(
                    f"block {i} is {n} bytes; namespace {st.spec.key} blocks are {size} bytes"
                )
        depths: dict[bytes, int] = {}
        get = st.blocks.get
        parents = [get(it.parent_id) for it in items]  # as held now, for _plan_items too
        for it, parent in zip(items, parents):
            depths[it.block_id] = parent.depth + 1 if parent else depths.get(it.parent_id, -1) + 1
        if items and max(depths.values()) + 1 < st.policy.min_prefix_blocks:
            self.counters["below_min_prefix"] += 1
            return PutPlan(
                not_stored=f"the chain is {max(depths.values()) + 1} blocks deep, shorter "
                f"than namespace {st.spec.key}'s min_prefix_blocks "
                f"({st.policy.min_prefix_blocks}): nothing stored"
            )
        out = PutPlan()
        try:
            self._plan_items(st, items, parents, root, depths, out)
        except BaseException:
            self.abort_plan(out.slots)
            raise
        return out

    def _plan_items(
        self,
        st: NsState,
        items: list[PutItem],
        parents: list[BlockMeta | None],
        root: bytes | None,
        depths: dict[bytes, int],
        out: PutPlan,
    ) -> None:
        """`parents`: each item's parent as st.blocks held it before planning."""
        skipped: set[bytes] = set()
        planned: set[bytes] = set()
        get = st.blocks.get
        # fits(): every block has a free slot within the tenant's quota and no parent is
        # to be brought back from NVMe, so nothing below evicts or promotes: each block
        # takes a free slot directly and the parents looked up before stay as they were.
        # Otherwise making room for one block may evict another's parent: each parent is
        # looked up again when its block is planned.
        roomy = self.fits(st, items)
        for i, it in enumerate(items):
            parent = parents[i] if roomy else get(it.parent_id)
            known = get(it.block_id)
            if known is not None or it.block_id in planned:
                out.already += 1
                if known is not None and st.policy.ttl_seconds:  # a re-put is a touch
                    raise_expiry(known, self.clock() + st.policy.ttl_seconds)
                continue
            if (
                root is not None
                and parent is None
                and it.parent_id != root
                and it.parent_id not in planned
            ):
                skipped.add(it.block_id)
                self.counters["put_orphan"] += 1
                out.not_stored = out.not_stored or (
                    f"block {i}: its parent {it.parent_id.hex()[:12]} is not held here "
                    "(evicted meanwhile, or not this chain's): not stored, nor what hangs "
                    "under it"
                )
                continue
            if it.parent_id in skipped:
                skipped.add(it.block_id)  # its parent was refused: so is it
                self.counters["put_parent_cold"] += 1
                continue
            if parent is not None and parent.slot < 0 and not self.residency.promote_chain(parent):
                skipped.add(it.block_id)  # keep the pool prefix-closed: not cached
                self.counters["put_parent_cold"] += 1
                out.not_stored = out.not_stored or (
                    f"block {i}: its parent could not be brought back into the pool: not "
                    "stored, nor what hangs under it"
                )
                continue
            planned_slot = self.plan_slot(st, it, depths[it.block_id], parent, roomy)
            if planned_slot is None:
                if out.slots:  # keep the leading blocks that fit; the rest would be orphans
                    self.counters["put_truncated"] += 1
                    out.not_stored = out.not_stored or (
                        f"the pool has no room for block {i} within tenant {st.tenant}'s "
                        f"quota: the {len(out.slots)} new blocks before it stored, not the rest"
                    )
                    break
                raise ResourceExhausted(
                    f"device pool cannot take more blocks for tenant {st.tenant}: "
                    "every slot is pinned, in use or over the tenant's quota"
                )
            out.slots.append(planned_slot)
            planned.add(it.block_id)

    def plan_slot(
        self,
        st: NsState,
        item: PutItem,
        depth: int,
        parent: BlockMeta | None,
        roomy: bool = False,
    ) -> PlannedSlot | None:
        """Reserve a pool slot for one block of a write, within the tenant's quota counting
        every slot already in flight for it (this write's and concurrent ones'), and hold
        the parent so making room later cannot evict it. None when no slot can be had.
        The quota is charged the whole slot (Residency.attach_slot does the same).
        `roomy`: the caller checked that a free slot within the quota is there (nothing
        to evict), under the same lock."""
        size = self.pool.slot_bytes
        if parent is not None:
            parent.readers += 1
        if roomy:
            slot = self.pool.reserve()
        else:
            slot = self.residency.reserve_slot(st.tenant, extra=size + self._inflight[st.tenant])
        if slot is None:
            if parent is not None:
                self.residency.done_reading(parent)
            return None
        self._inflight[st.tenant] += size
        return PlannedSlot(item, slot, depth, parent, st.tenant, size)

    def _end_planned(self, p: PlannedSlot) -> None:
        """A planned slot was committed or freed: no longer in flight, nor its parent held."""
        self._inflight[p.tenant] -= p.nbytes
        if p.parent is not None:
            self.residency.done_reading(p.parent)

    def abort_plan(self, plan: list[PlannedSlot]) -> None:
        for p in plan:
            self.pool.abort(p.slot)
            self._end_planned(p)

    def commit(
        self, st: NsState, generation: int, plan: list[PlannedSlot], written: list[Written]
    ) -> CommitResult:
        """Make the written blocks visible (under the lock); free every other planned slot.
        Planning and copying ran apart from here, so each block is checked again: its
        namespace not flushed, its parent still held and still in the pool, and the block
        itself not committed meanwhile by a concurrent writer of the same chain (that copy
        wins; this slot is freed, or it would leak with nothing pointing at it). A parent
        committed by another writer (or by the previous batch of a pipelined transfer)
        is not held by this plan and may have been demoted since: a child in the pool
        under it would break the pool's prefix closure, so it is not stored."""
        with self.residency.refiles_deferred():  # nothing here evicts
            return self._commit(st, generation, plan, written)

    def _commit(
        self, st: NsState, generation: int, plan: list[PlannedSlot], written: list[Written]
    ) -> CommitResult:
        done = {id(w.planned) for w in written}
        self.abort_plan([p for p in plan if id(p) not in done])
        now = self.clock()
        stored: list[BlockMeta] = []
        raced = 0
        blocks, pool, residency = st.blocks, self.pool, self.residency
        flushed = st.generation != generation
        try:
            for w in written:
                planned = w.planned
                item, slot = planned.item, planned.slot
                if planned.parent is not None:  # no longer held for this write
                    residency.done_reading(planned.parent)
                parent_meta = blocks.get(item.parent_id)
                depth = parent_meta.depth + 1 if parent_meta else planned.depth
                if flushed or (depth and not parent_meta):
                    pool.abort(slot)  # flushed meanwhile, or the parent left: not stored
                    continue
                if item.block_id in blocks:
                    pool.abort(slot)
                    self.counters["put_raced"] += 1
                    raced += 1
                    continue
                if parent_meta is not None and parent_meta.slot < 0:
                    pool.abort(slot)
                    self.counters["put_parent_cold"] += 1
                    continue
                pool.commit(slot)
                stored.append(self._visible(st, w, depth, parent_meta, now))
        finally:  # every written slot is out of flight, stored or not (the lock is held)
            self._inflight[st.tenant] -= sum(w.planned.nbytes for w in written)
            residency.charge_slots(st.tenant, len(stored))
        self._stored_events(st, stored)
        return CommitResult(len(stored), raced)

    def _visible(
        self, st: NsState, w: Written, depth: int, parent_meta: BlockMeta | None, now: float
    ) -> BlockMeta:
        """Index a committed block and attach its slot (charged by the caller, for the
        whole commit at once: Residency.charge_slots)."""
        item = w.planned.item
        ttl = st.policy.ttl_seconds
        m = BlockMeta(
            st,
            item.block_id,
            item.parent_id,
            depth,
            st.block_bytes,
            w.digest,
            last_access=now,  # checked by _plan_*
            expires_at=now + ttl if ttl else 0,
        )
        st.blocks[m.block_id] = m
        if parent_meta is not None:
            parent_meta.children += 1
            if ttl:
                raise_expiry(parent_meta, m.expires_at)
        self.residency.attach_slot(m, w.planned.slot, parent_meta, charge=False)
        return m

    def _stored_events(self, st: NsState, stored: list[BlockMeta]) -> None:
        """One STORED event per parent-to-child run: each names the parent of its first
        block, even when blocks before it were skipped or already present."""
        runs: list[StoredRun] = []
        for m in stored:
            if runs and runs[-1].ids[-1] == m.parent_id:
                runs[-1].ids.append(m.block_id)
            else:
                runs.append(StoredRun(m.parent_id, [m.block_id]))
        for run in runs:
            self.events.append(
                EventKind.STORED, st.ns_id, tuple(run.ids), parent_id=run.parent_id, tier=Tier.HBM
            )
        self.counters["put_blocks"] += len(stored)
