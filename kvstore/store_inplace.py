"""In-place transfers on pool slots, for transports that move payloads themselves (peer
transfer over UCX): a two-phase write whose payloads land straight in reserved slots
(reserve -> the transport fills `views` -> commit verifies in place / abort), and a borrowed
read that hands out verified read-only slot views instead of copies (borrow -> release).

Same guarantees as put and get: nothing is visible before its checksum was verified, a
reserved slot is never reused before commit or abort, a borrowed block is never evicted
(nor its slot reused) before release, and a corrupt block found by a borrow is dropped
with its descendants. Host pools, and device pools that verify in device memory
(DevicePool.in_place: the payloads are hashed where they lie by kvstore.device_hash);
callers keep the copying put/get for other device pools.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from kvstore.errors import DataLoss, InvalidArgument, ResourceExhausted
from kvstore.events import Tier
from kvstore.store_copy import BatchCopier
from kvstore.store_killswitch import KillSwitch
from kvstore.store_reads import Reads
from kvstore.store_residency import Residency
from kvstore.store_types import (
    ID_BYTES,
    BlockMeta,
    Borrowed,
    NsState,
    Payload,
    PlannedSlot,
    PutItem,
    Reservation,
    ServedBlock,
    Written,
)
from kvstore.store_writes import Writes
from kvstore.tiers.pool import DevicePool


class InPlaceTransfers:
    """BlockStore's reserve / trim / commit / abort and borrow / release. Holds no state
    of its own beyond what it is given: every reservation and borrow is a record the
    caller keeps (Reservation, Borrowed)."""

    def __init__(
        self,
        pool: DevicePool,
        lock: threading.RLock,
        namespace: Callable[[bytes, int], NsState],
        killswitch: KillSwitch,
        writes: Writes,
        reads: Reads,
        residency: Residency,
        copier: BatchCopier,
        counters: Counter[str],
    ) -> None:
        self.pool = pool
        self.lock = lock
        self.namespace = namespace  # BlockStore.namespace: known, and at this generation
        self.killswitch = killswitch
        self.writes = writes
        self.reads = reads
        self.residency = residency
        self.copier = copier
        self.counters = counters

    @property
    def supported(self) -> bool:
        return self.pool.in_place

    def _digests(self, views: list[Payload]) -> list[int]:
        """XXH64 of slot views: the device kernel over tensor views, else on the copy
        threads when the batch is big enough to pay."""
        if self.pool.tensor_views:
            return self.pool.digests(views)
        return self.copier.checksums(views)

    def _fill(self, plan: list[PlannedSlot], sources: list[Payload]) -> list[int]:
        """Copy `sources` into the reserved slots of `plan` and hash what landed (one
        fused pass). On a host pool straight into the slot views reserve() made (each
        checked RESERVED then, and only commit, abort and trim end a reservation), not
        into views made again per slot."""
        if self.pool.host and not self.pool.tensor_views:  # the views are host arrays
            return self.copier.copy_into([p.item.data for p in plan], sources)
        return self.copier.write(self.pool, [p.slot for p in plan], sources)

    # ----------------------------------------------------------------- writes
    def reserve(
        self,
        ns_id: bytes,
        generation: int,
        ids: list[bytes],
        parent_id: bytes,
        root: bytes,
        after: Reservation | None = None,
    ) -> Reservation:
        """Reserve slots for `ids`, a run of one chain whose first block's parent is
        `parent_id`: held here, the chain `root` (a chain that starts at block 0), or the
        last block of `after`, an earlier reservation not committed yet (pipelined
        transfers reserve batch k+1 while batch k is still on the wire).

        Keeps the leading blocks that fit; a shorter result says why in `reason` (pool or
        quota full, orphan, cold parent, block already present, chain below the namespace's
        minimum). Raises ResourceExhausted when not one slot can be had, like put."""
        if not self.supported:
            raise InvalidArgument("in-place writes need a pool that verifies in place")
        with self.lock:
            st = self.namespace(ns_id, generation)
            if self.killswitch.on:
                raise self.killswitch.refuse_write("kill switch is on: writes are refused")
            res = Reservation(st, generation, [])
            parent = st.blocks.get(parent_id)
            lead = None  # `after`, when the run attaches under its last block (not stored yet)
            if parent is not None:
                depth = parent.depth + 1
            elif after is not None and after.plan and after.plan[-1].item.block_id == parent_id:
                depth = after.last_depth + 1
                lead = after
            elif parent_id == root:
                depth = 0
            else:
                self.counters["put_orphan"] += 1
                res.reason = "orphan: the parent block is not held here"
                return res
            if depth + len(ids) < st.policy.min_prefix_blocks:
                self.counters["below_min_prefix"] += 1
                res.reason = "chain shorter than the namespace's min_prefix_blocks"
                return res
            if parent is not None and parent.slot < 0 and not self.residency.promote_chain(parent):
                self.counters["put_parent_cold"] += 1
                res.reason = "the parent block could not be brought into the pool"
                return res
            self._plan_in_place(st, res, ids, parent_id, parent, depth)
            if lead is not None and res.plan:
                lead.follower = res
            return res

    def _plan_in_place(
        self,
        st: NsState,
        res: Reservation,
        ids: list[bytes],
        parent_id: bytes,
        parent: BlockMeta | None,
        depth: int,
    ) -> None:
        size = st.spec.block_bytes
        try:
            for bid in ids:
                if len(bid) != ID_BYTES:
                    raise InvalidArgument(f"block ids must be {ID_BYTES} bytes")
                if bid in st.blocks:
                    res.reason = f"block {bid.hex()[:12]} is already held (stored meanwhile)"
                    break
                # Counts `after`'s slots and every other write in flight against the quota.
                planned = self.writes.plan_slot(st, PutItem(bid, parent_id, b""), depth, parent)
                if planned is None:
                    if not res.plan:
                        raise ResourceExhausted(
                            f"device pool cannot take more blocks for tenant {st.tenant}: "
                            "every slot is pinned, in use or over the tenant's quota"
                        )
                    self.counters["put_truncated"] += 1
                    res.reason = "pool or quota full"
                    break
                res.plan.append(planned)  # freed with the others if the view fails
                view = self.pool.slot_view(planned.slot, size, writable=True)
                # (built anew: NamedTuple._replace costs several times a construction)
                res.plan[-1] = PlannedSlot(PutItem(bid, parent_id, view), *planned[1:])
                parent_id, parent, depth = bid, None, depth + 1
        except BaseException:
            self.writes.abort_plan(res.plan)
            res.plan = []
            raise

    def trim(self, res: Reservation, n: int) -> None:
        """Keep the first `n` slots of `res` and free the others (nothing wrote into them:
        a transport reserved ahead for more blocks than the sender then announced). Kept
        to none, it has ended: a commit or abort of it after that changes nothing."""
        if n < len(res.plan):
            rest, res.plan = res.plan[n:], res.plan[:n]
            with self.lock:
                self.writes.abort_plan(rest)
                if not res.plan:  # nothing left to commit: it ends here
                    self._end(res)

    def commit(
        self,
        res: Reservation,
        checksums: list[int],
        n: int | None = None,
        sources: list[Payload] | None = None,
        digests: list[int] | None = None,
    ) -> int:
        """Verify the first `n` (default all) reserved payloads in place against
        `checksums`, make the verified leading run visible, free the rest. Returns the
        number stored; raises DataLoss (after storing the blocks before it) when a payload
        does not match. Blocks whose parent left meanwhile, or whose namespace was flushed,
        are not stored.

        With `sources` the payloads are not in the slots yet: each slot is filled from
        `sources[i]` by one fused copy + checksum pass (transports that move small
        blocks a batch per message, into one staging buffer). With `digests` the caller
        already hashed the payloads in the slots, after the last write into them (a
        transport that verifies each message as it lands, while later ones arrive)."""
        plan, res.plan = res.plan, []
        n = len(plan) if n is None else min(n, len(plan))
        try:
            if digests is not None:  # hashed by the caller; blocks past them are not stored
                digests = list(digests[:n])
            elif sources is not None:
                n = min(n, len(sources))
                digests = self._fill(plan[:n], sources[:n])
            else:
                digests = self._digests([p.item.data for p in plan[:n]])
        except BaseException:
            with self.lock:
                self.writes.abort_plan(plan)
                self._end(res)
            raise
        written: list[Written] = []
        bad: PutItem | None = None
        for p, digest, want in zip(plan, digests, checksums):
            if digest != want:
                bad = p.item
                break
            written.append(Written(p, digest))
        with self.lock:
            stored = self.writes.commit(res.ns, res.generation, plan, written).stored
            self._end(res)
        if bad is not None:
            raise DataLoss(f"block {bad.block_id.hex()[:12]} payload does not match its checksum")
        return stored

    def abort(self, res: Reservation) -> None:
        """Free every slot of `res` (the transfer failed). Only once nothing writes into
        its views any more: the slots go straight back to the free list."""
        plan, res.plan = res.plan, []
        with self.lock:
            self.writes.abort_plan(plan)
            self._end(res)

    def _end(self, res: Reservation) -> None:
        """`res` is committed or aborted (under the lock): drop the parents held for it,
        and hold its last block, if stored, for the run reserved after it (`follower`)
        until that one ends too. Without the hold, making room for a later run could
        evict that block, a leaf until the follower commits under it: the value policy
        ranks the shallow, never-hit tail of a chain being written below the leaf of an
        older, deeper chain, and a transfer into a full pool then evicted itself."""
        held, res.held = res.held, []
        follower, res.follower = res.follower, None
        # Read once: the follower's commit or abort empties its plan (outside the lock)
        # before it ends; an empty plan means it ended or is ending: nothing to hold.
        rest = follower.plan if follower is not None else []
        last = res.ns.blocks.get(rest[0].item.parent_id) if rest else None
        if follower is not None and last is not None and last.slot >= 0:
            last.readers += 1
            follower.held.append(last)
        for m in held:
            self.residency.done_reading(m)

    # ------------------------------------------------------------------ reads
    def borrow(
        self, ns_id: bytes, generation: int, ids: list[bytes], parent_id: bytes, verify: bool = True
    ) -> Borrowed:
        """Verified read-only views of the leading blocks of `ids` held in the pool (it
        stops at the first block that is missing, mis-chained, corrupt or only on NVMe:
        get copies those). Counts as a get (hits, expiry, statistics).

        verify=False skips the checksum pass, for a sender whose receiver verifies every
        block against the checksum sent with it (peer transfer): a corrupt block then
        fails there and is never stored, and this node finds it on its own next read."""
        with self.lock:
            st = self.namespace(ns_id, generation)
            why = self.killswitch.refuses_hits()
            if why or not self.supported:
                if why:
                    self.killswitch.get_miss(why)
                return Borrowed(st, [], [], [])
            metas = []
            for m in self.reads.leading(st, ids, parent_id):
                if m.slot < 0:
                    break
                metas.append(m)
            slots = [m.slot for m in metas]
            for m in metas:
                m.readers += 1
        served: list[ServedBlock] = []
        corrupt: BlockMeta | None = None
        try:
            views = [self.pool.slot_view(s, m.nbytes, writable=False) for s, m in zip(slots, metas)]
            digests = self._digests(views) if verify else [m.checksum for m in metas]
            for m, digest in zip(metas, digests):
                if digest != m.checksum:
                    corrupt = m
                    break
                served.append(ServedBlock(m.block_id, Tier.HBM, m.checksum))
        finally:
            with self.lock:
                for m in metas[: len(served)]:
                    m.readers += 1  # the borrow's own hold, past _finish_get's release
                held = len(served)
                self.reads.finish(st, metas, served, [], corrupt)
                for m in metas[len(served) : held]:  # removed while verified: not served
                    self.residency.done_reading(m)
        return Borrowed(st, metas[: len(served)], views[: len(served)], served)

    def release(self, b: Borrowed) -> None:
        """End a borrow: its blocks may be evicted and their slots reused again."""
        metas, b.metas, b.views = b.metas, [], []
        if metas:
            with self.lock:
                for m in metas:
                    self.residency.done_reading(m)
