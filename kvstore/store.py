"""BlockStore: what one node holds, across the device pool and the NVMe tier.

Invariants the store keeps:
- Prefix consistency: a block never stays on the node without its parent, so eviction
  and removal take leaves first (a block with children on the node is never dropped).
- A block is served from the pool when it has a slot, else from NVMe (and promoted).
  It may have both (a demoted-then-promoted block keeps its NVMe copy until NVMe evicts it).
- Every served payload is checked against its XXH64 during the copy; a mismatch drops the
  block and its descendants and turns it into a miss.
- Bulk copies run outside the lock: a block being read has `readers > 0` and a slot being
  written is RESERVED, and neither can be evicted or reused meanwhile.

The store is a facade over collaborators that each declare their own state, all under
the one lock here: the eviction queue (store_eviction.py), the residency of blocks in the
tiers and their moves (store_residency.py), the two-phase writes (store_writes.py), the
bookkeeping of reads (store_reads.py), in-place transfers (store_inplace.py), tenant
quotas (store_quotas.py), the kill switch (store_killswitch.py) and what survives a
restart (store_recovery.py). The namespace table is the store's own.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.accounting import TenantAccounts
from kvstore.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StaleGeneration,
    Unavailable,
)
from kvstore.eviction import EvictionPolicy, ValueAwarePolicy
from kvstore.events import EventKind, EventQueue, Tier
from kvstore.namespace import Namespace
from kvstore.policy import NamespacePolicy
from kvstore.store_copy import BatchCopier
from kvstore.store_eviction import EvictionQueue
from kvstore.store_inplace import InPlaceTransfers
from kvstore.store_killswitch import KillSwitch
from kvstore.store_quotas import TenantQuotas
from kvstore.store_reads import Reads
from kvstore.store_recovery import Persistence
from kvstore.store_residency import Residency
from kvstore.store_writes import Writes
from kvstore.store_types import (
    ID_BYTES,
    NS_META_PREFIX,
    BlockMeta,
    Borrowed,
    CommitResult,
    HeldBlock,
    LookupResult,
    NsSnapshot,
    NsState,
    PackedIds,
    Payload,
    PinResult,
    Promotion,
    PutItem,
    PutResult,
    Reservation,
    ServedBlock,
    StoreSnapshot,
    Written,
    _first_false,
)
from kvstore.tiers.pool import DevicePool, fill_tensor, is_tensor
from kvstore.tiers.rocks import RocksTier

__all__ = [
    "BlockStore",
    "PendingGet",
    "PendingPut",
    "BlockMeta",
    "NsState",
    "PutItem",
    "LookupResult",
    "ServedBlock",
    "PackedIds",
    "ID_BYTES",
]


class BlockStore:
    def __init__(
        self,
        pool: DevicePool,
        rocks: RocksTier | None,
        eviction: EvictionPolicy | None = None,
        accounts: TenantAccounts | None = None,
        policy_for: Callable[[Namespace], NamespacePolicy] | None = None,
        clock: Callable[[], float] = time.time,
        copy_threads: int = 1,
        tenant_pin_bytes: int | None = None,
    ) -> None:
        """`tenant_pin_bytes`: what one tenant may pin on this node across all its
        namespaces (None: no cap but its HBM quota; the agent passes its config's
        tenant_pin_fraction of the pool, AgentConfig.tenant_pin_bytes)."""
        self._pool = pool
        self.tenant_pin_bytes = tenant_pin_bytes
        self._rocks = rocks
        self.accounts = accounts or TenantAccounts()
        self.policy_for = policy_for or (lambda ns: NamespacePolicy())
        self.clock = clock
        self.events = EventQueue()
        self.counters: Counter[str] = Counter()
        self.lock = threading.RLock()
        self._ns: dict[bytes, NsState] = {}
        spills = rocks is not None
        self._copier = BatchCopier(copy_threads)
        policy: EvictionPolicy = eviction or ValueAwarePolicy()
        self._queue = EvictionQueue(policy, spills, pool.slot_bytes)
        self._residency = Residency(
            pool, rocks, self.accounts, self._queue, self.counters, self.events
        )
        # evictions by reason of each tenant (the node's are in `counters`)
        self.tenant_counters = self._residency.tenant_counters
        self._writes = Writes(pool, self._residency, self.counters, self.events, clock)
        self._reads = Reads(self._residency, self.counters, self.events, clock)
        self._killswitch = KillSwitch(self.counters)
        self._quotas = TenantQuotas(self.accounts, self._queue, self._residency, spills)
        self._persistence = Persistence(
            rocks, self._residency, self._queue, self.lock, self.counters, self.policy_for, clock
        )
        self._in_place = InPlaceTransfers(
            pool,
            self.lock,
            self.namespace,
            self._killswitch,
            self._writes,
            self._reads,
            self._residency,
            self._copier,
            self.counters,
        )

    @property
    def pool(self) -> DevicePool:
        return self._pool

    @pool.setter
    def pool(self, pool: DevicePool) -> None:
        """Swap the pool object for one over the same slots (tests wrap it to inject
        faults): every collaborator uses the new one."""
        self._pool = self._residency.pool = self._writes.pool = self._in_place.pool = pool

    @property
    def rocks(self) -> RocksTier | None:
        return self._rocks

    @rocks.setter
    def rocks(self, tier: RocksTier | None) -> None:
        """Swap the NVMe tier (node_agent/server.py does, after quarantining one it could
        not read, and then recovers the new one): every collaborator uses the new tier."""
        self._rocks = tier
        self._residency.rocks = tier
        self._persistence.rocks = tier
        self._queue.spills = self._quotas.spills = tier is not None

    @property
    def killed(self) -> bool:
        """The global kill switch (store_killswitch.py), set by node_agent/control.py."""
        return self._killswitch.on

    @killed.setter
    def killed(self, on: bool) -> None:
        self._killswitch.on = on

    @property
    def fence(self) -> Callable[[], bool] | None:
        """True while the agent's etcd lease may have lapsed (kvstore/coord/fence.py):
        lookups, gets and borrows (peer serving) miss; writes go on (a write of an old
        generation is dropped when the generations are re-read, before hits resume)."""
        return self._killswitch.fence

    @fence.setter
    def fence(self, fence: Callable[[], bool] | None) -> None:
        self._killswitch.fence = fence

    @property
    def nvme_used(self) -> int:
        return self._residency.nvme_used

    # ----------------------------------------------------------------- namespaces
    def open_namespace(self, spec: Namespace, generation: int = 0) -> NsState:
        """Register `spec` (idempotent). `generation` is the one in force cluster-wide (from
        etcd); a namespace known locally at an older one is cleared up to it."""
        if spec.block_bytes > self.pool.slot_bytes:
            raise InvalidArgument(
                f"namespace blocks are {spec.block_bytes} bytes but this node's pool slots "
                f"hold {self.pool.slot_bytes}: raise pool.slot_bytes or shrink block_size"
            )
        with self.lock:
            st = self._ns.get(spec.namespace_id)
            if st is None:
                st = NsState(spec, spec.namespace_id, generation, self.policy_for(spec))
                self._ns[st.ns_id] = st
                self._save_ns(st)
            elif generation > st.generation:
                self.set_generation(st.ns_id, generation)
            return st

    def spec_of(self, ns_id: bytes) -> Namespace | None:
        """The spec of a namespace known here (None: unknown), whatever its generation:
        what access checks decide on before anything else is looked at."""
        st = self._ns.get(ns_id)
        return None if st is None else st.spec

    def namespace(self, ns_id: bytes, generation: int) -> NsState:
        st = self._ns.get(ns_id)
        if st is None:
            raise NotFound(
                f"unknown namespace {ns_id.hex() if ns_id else '(empty id)'}: "
                "call OpenNamespace first"
            )
        if generation < st.generation:
            raise StaleGeneration(
                f"namespace {st.spec.key} generation {generation} is stale "
                f"(current {st.generation})"
            )
        if generation > st.generation:
            raise FailedPrecondition(
                f"namespace {st.spec.key} generation {generation} is "
                f"ahead of this node ({st.generation}); retry shortly"
            )
        return st

    def namespaces(self) -> list[NsState]:
        return list(self._ns.values())

    def set_policy(self, ns_id: bytes, policy: NamespacePolicy) -> None:
        with self.lock:
            st = self._ns[ns_id]
            st.policy = policy
            self._save_ns(st)

    def set_generation(self, ns_id: bytes, generation: int) -> int:
        """Move a namespace to `generation`, dropping every block of older ones.
        Returns the number of blocks dropped."""
        with self.lock:
            st = self._ns.get(ns_id)
            if st is None:
                raise NotFound(f"unknown namespace {ns_id.hex()}")
            if generation <= st.generation:
                return 0
            dropped = len(st.blocks)
            for meta in list(st.blocks.values()):
                self._residency.free_resources(meta)
            st.blocks.clear()
            self.accounts.add_pinned(st.tenant, -st.pinned_bytes)
            st.pinned_bytes = 0
            st.generation = generation
            if self.rocks is not None:
                self.rocks.delete_prefix(ns_id)
            self._save_ns(st)
            self._residency.count(st.tenant, "blocks_dropped_flush", dropped)
            self.events.append(EventKind.NAMESPACE_CLEARED, ns_id, generation=generation)
            return dropped

    def _save_ns(self, st: NsState) -> None:
        if self.rocks is None:
            return
        rec = {
            "spec": st.spec.to_dict(),
            "generation": st.generation,
            "policy": st.policy.to_dict(),
        }
        self.rocks.meta_put(NS_META_PREFIX + st.ns_id, json.dumps(rec).encode())

    # --------------------------------------------------------------------- lookup
    def lookup(self, ns_id: bytes, generation: int, ids: Sequence[bytes]) -> LookupResult:
        """`ids` is any sequence of block ids (a list, or PackedIds over the wire bytes).

        Cost is O(log n) dict probes, not O(n): presence on the node is prefix-closed
        (leaves go first), presence in the pool is prefix-closed (a block enters the pool
        only after its parent, and leaves the pool before it), and expiry is monotone
        (a parent never expires before its child), so both lengths are binary searches."""
        with self.lock:
            st = self.namespace(ns_id, generation)
            if why := self._killswitch.refuses_hits():
                return self._killswitch.lookup_miss(st, len(ids), why)
            now = self.clock()
            get = st.blocks.get

            def live(i: int) -> bool:
                m = get(ids[i])
                return m is not None and not (m.expires_at and m.expires_at <= now)

            matched = _first_false(live, 0, len(ids))

            def in_pool(i: int) -> bool:
                m = get(ids[i])  # None only for a sequence that is not one chain
                return m is not None and m.slot >= 0

            hbm = _first_false(in_pool, 0, matched)
            # Node-wide; per tenant, requests are counted at the agent's edge, each once
            # (node_agent/request_tally.py).
            c = self.counters
            c["lookups"] += 1
            c["lookup_hits"] += matched > 0
            c["lookup_blocks"] += len(ids)
            c["lookup_hit_blocks"] += matched
            return LookupResult(matched, hbm, matched - hbm, st.generation)

    # ------------------------------------------------------------------------ get
    def get(
        self,
        ns_id: bytes,
        generation: int,
        ids: list[bytes],
        parent_id: bytes,
        dst_for: Callable[[int, int], Payload | None],
        deadline_ns: int | None = None,
    ) -> list[ServedBlock]:
        """Copy the leading present blocks into `dst_for(i, nbytes)` buffers, verified.
        When `dst_for` returns None the payload comes back as bytes in ServedBlock.data
        (the gRPC path needs bytes objects). Stops at the first missing, mis-chained or
        corrupt block. `deadline_ns` (CLOCK_MONOTONIC): the caller's, past which nothing
        is copied into its buffers (DeadlineExceeded; see PendingGet.prepare)."""
        return self.get_begin(
            ns_id, generation, ids, parent_id, dst_for, False, deadline_ns
        ).finish()

    def get_begin(
        self,
        ns_id: bytes,
        generation: int,
        ids: list[bytes],
        parent_id: bytes,
        dst_for: Callable[[int, int], Payload | None],
        background: bool = True,
        deadline_ns: int | None = None,
    ) -> PendingGet:
        """`get` in two steps, for a caller on an event loop: the blocks are taken now
        (held, under the lock) and, with `background`, the copy of their leading run in
        the pool is started on threads of its own where that can be had
        (BatchCopier.read_start); PendingGet.fileno() turns readable when it is done.
        finish() verifies and serves (and copies, where nothing ran in the background)."""
        with self.lock:
            st = self.namespace(ns_id, generation)
            if why := self._killswitch.refuses_hits():
                self._killswitch.get_miss(why)
                metas: list[BlockMeta] = []
            else:
                metas = self._reads.leading(st, ids, parent_id)
            slots = [m.slot for m in metas]  # read once, under the lock (see _parked)
            for m in metas:
                m.readers += 1
        pending = PendingGet(self, st, metas, slots, deadline_ns)
        try:
            pending.prepare(dst_for, background)
        except BaseException:
            pending.finish_with([])
            raise
        return pending

    # ------------------------------------------------------------------------ put
    def put(
        self,
        ns_id: bytes,
        generation: int,
        items: list[PutItem],
        root: bytes | None = None,
        deadline_ns: int | None = None,
        gone: threading.Event | None = None,
    ) -> PutResult:
        """Store blocks (parent before child). Returns (stored, already_present).

        With `root` given (what clients send), a block whose parent is neither held, nor
        earlier in this put, nor the chain root is refused as an orphan (its parent was
        evicted meanwhile, or the client is wrong): the node then never holds a block
        without its whole prefix, which the router's binary searches rely on. `root=None`
        is for trusted in-process callers (peer transfer copies whole chains).
        `deadline_ns`: see put_begin; `gone`: see PendingPut.finish."""
        return self.put_begin(ns_id, generation, items, root, False, deadline_ns).finish(gone)

    def put_begin(
        self,
        ns_id: bytes,
        generation: int,
        items: list[PutItem],
        root: bytes | None = None,
        background: bool = True,
        deadline_ns: int | None = None,
    ) -> PendingPut:
        """`put` in two steps, for a caller on an event loop: the slots are planned now
        (under the lock; planning may touch NVMe, see put_begin_if_fits) and, with
        `background`, the copy is started on threads of its own where that can be had
        (BatchCopier.write_start); PendingPut.fileno() turns readable when it is done.
        finish() checks and commits (and copies, where nothing ran in the background).

        `deadline_ns` (CLOCK_MONOTONIC): the caller's. Past it already, nothing is
        planned (DeadlineExceeded); a copy that ends past it stores nothing (see
        PendingPut.finish)."""
        pending = self._put_plan(ns_id, generation, items, root, False, deadline_ns)
        assert pending is not None
        if background:
            pending.start()
        return pending

    def put_begin_if_fits(
        self,
        ns_id: bytes,
        generation: int,
        items: list[PutItem],
        root: bytes | None = None,
        deadline_ns: int | None = None,
    ) -> PendingPut | None:
        """put_begin, only where planning touches no NVMe: the items fit in free pool
        slots within the tenant's quota (else it evicts, which may demote to NVMe) and
        no parent of theirs is held on NVMe only (else it is read back into the pool
        first). None, nothing planned, otherwise: for the caller to plan on a thread of
        its own. Decided under the plan's own lock: no other writer takes the room in
        between."""
        pending = self._put_plan(ns_id, generation, items, root, True, deadline_ns)
        if pending is not None:
            pending.start()
        return pending

    def _put_plan(
        self,
        ns_id: bytes,
        generation: int,
        items: list[PutItem],
        root: bytes | None,
        only_if_fits: bool,
        deadline_ns: int | None = None,
    ) -> PendingPut | None:
        with self.lock:
            st = self.namespace(ns_id, generation)
            if self._killswitch.on:
                raise self._killswitch.refuse_write(
                    "kill switch is on: writes are refused "
                    "(`kvctl killswitch off` to resume caching)"
                )
            if deadline_ns is not None and time.monotonic_ns() >= deadline_ns:
                self.counters["put_past_deadline"] += 1
                raise DeadlineExceeded(
                    "the caller's deadline passed before its Put began: nothing copied"
                )
            if only_if_fits and not self._writes.fits(st, items):
                return None
            planned = self._writes.plan_put(st, items, root)
        return PendingPut(self, st, generation, planned, deadline_ns)

    # --------------------------------------------------------------------- pinning
    def pin(self, ns_id: bytes, generation: int, ids: list[bytes], pin: bool) -> PinResult:
        """Pin (or unpin) the leading held blocks of `ids`. Each pinned block is charged
        a whole pool slot (what it keeps from every other block, however small its
        payload) against two budgets: its namespace's policy pin_budget_bytes, and its
        tenant's on this node across all its namespaces (tenant_pin_limit)."""
        with self.lock:
            st = self.namespace(ns_id, generation)
            metas = [m for m in self._reads.leading(st, ids, b"") if m.pinned != pin]
            charge = self._residency.pin_charge
            delta = len(metas) * charge
            what = f"pinning {len(metas)} blocks ({delta} bytes: a {charge}-byte pool slot each)"
            if pin and st.pinned_bytes + delta > st.policy.pin_budget_bytes:
                raise ResourceExhausted(
                    f"{what} exceeds namespace {st.spec.key} pin budget of "
                    f"{st.policy.pin_budget_bytes} bytes ({st.pinned_bytes} already pinned)"
                )
            if pin and delta:
                limit, source = self.tenant_pin_limit(st.tenant)
                held = self.accounts.pinned(st.tenant)
                if limit is not None and held + delta > limit:
                    raise ResourceExhausted(
                        f"{what} exceeds tenant {st.tenant}'s pin limit on this node of "
                        f"{limit} bytes ({source}; {held} already pinned across its "
                        "namespaces)"
                    )
            for m in metas:
                m.pinned = pin
                self._queue.refile(m)
            if pin:
                st.pinned_bytes += delta
                self.accounts.add_pinned(st.tenant, delta)
            else:
                self._residency.unpinned(st, len(metas))
            return PinResult(len(metas), st.pinned_bytes)

    def tenant_pin_limit(self, tenant: str) -> tuple[int | None, str]:
        """The bytes `tenant` may pin on this node across all its namespaces, and where
        that limit comes from: the node's tenant_pin_bytes, or the tenant's HBM quota
        where that is lower (pinned blocks are never evicted for it). None: no limit."""
        cap = self.tenant_pin_bytes
        quota = self.accounts.limit(tenant, Tier.HBM)
        if quota is not None and (cap is None or quota < cap):
            return quota, "its HBM quota"
        if cap is None:
            return None, ""
        return cap, "the agent's tenant_pin_fraction of the pool"

    # ------------------------------------------------------- in-place transfers
    @property
    def supports_in_place(self) -> bool:
        return self._in_place.supported

    def copy_threads_for(self, nbytes: int) -> int:
        """Threads a bulk copy (or read) of `nbytes` is split over (copy_threads)."""
        return self._copier.threads_for(nbytes)

    def reserve(
        self,
        ns_id: bytes,
        generation: int,
        ids: list[bytes],
        parent_id: bytes,
        root: bytes,
        after: Reservation | None = None,
    ) -> Reservation:
        """Slots for an in-place write of `ids` (see InPlaceTransfers.reserve)."""
        return self._in_place.reserve(ns_id, generation, ids, parent_id, root, after)

    def trim(self, res: Reservation, n: int) -> None:
        self._in_place.trim(res, n)

    def commit(
        self,
        res: Reservation,
        checksums: list[int],
        n: int | None = None,
        sources: list[Payload] | None = None,
        digests: list[int] | None = None,
    ) -> int:
        """Verify and make visible an in-place write (see InPlaceTransfers.commit)."""
        return self._in_place.commit(res, checksums, n, sources, digests)

    def abort(self, res: Reservation) -> None:
        self._in_place.abort(res)

    def borrow(
        self, ns_id: bytes, generation: int, ids: list[bytes], parent_id: bytes, verify: bool = True
    ) -> Borrowed:
        """Verified read-only slot views (see InPlaceTransfers.borrow)."""
        return self._in_place.borrow(ns_id, generation, ids, parent_id, verify)

    def release(self, b: Borrowed) -> None:
        self._in_place.release(b)

    # ------------------------------------------------------------ maintenance
    def recover(self, verify: bool = True) -> dict[str, int]:
        """Rebuild the index from RocksDB after a restart (see Persistence.recover)."""
        return self._persistence.recover(self._ns, verify)

    def persist_pool(self, deadline_s: float | None = None) -> int:
        """Copy the pool's blocks of persistent namespaces to NVMe before a clean shutdown
        (see Persistence.persist_pool). Returns the number of blocks written."""
        return self._persistence.persist_pool(self._ns, deadline_s)

    def expire(self) -> int:
        """Drop blocks whose TTL ran out (with their descendants)."""
        now = self.clock()
        total = 0
        with self.lock:
            for st in self._ns.values():
                if not st.policy.ttl_seconds:
                    continue
                dead = {
                    b
                    for b, m in st.blocks.items()
                    if m.expires_at and m.expires_at <= now and not m.readers
                }
                if dead:
                    total += self._residency.remove_subtrees(st, dead, "expired")
        return total

    def set_tenant_limits(self, tenant: str, hbm: int | None, nvme: int | None) -> int:
        """Apply a tenant's quota and evict its own blocks until it fits (see
        TenantQuotas.set_limits). Returns the number of evictions."""
        with self.lock:
            return self._quotas.set_limits(tenant, hbm, nvme)

    def snapshot(self) -> StoreSnapshot:
        """Every block held, per namespace, and the last event sequence it includes."""
        with self.lock:
            out = [
                NsSnapshot(
                    st.ns_id,
                    [
                        HeldBlock(m.block_id, m.tier)
                        for m in sorted(st.blocks.values(), key=lambda b: b.depth)
                    ],
                )
                for st in self._ns.values()
            ]
            return StoreSnapshot(self.events.last_seq, out)

    def block_count(self) -> int:
        return sum(len(st.blocks) for st in self._ns.values())


class PendingPut:
    """A put between its plan and its commit (BlockStore.put_begin)."""

    __slots__ = ("_store", "_st", "_generation", "_planned", "_deadline_ns", "_job", "_done")

    def __init__(
        self,
        store: BlockStore,
        st: NsState,
        generation: int,
        planned,
        deadline_ns: int | None = None,
    ) -> None:
        self._store = store
        self._st = st
        self._generation = generation
        self._planned = planned
        self._deadline_ns = deadline_ns
        self._job: Any = None
        self._done = False

    @property
    def not_stored(self) -> str:
        """Why blocks of this put are neither stored nor held ("" when none is left out)."""
        return self._planned.not_stored

    def _batch(self) -> tuple[DevicePool, list[int], list[Any]]:
        """What the copy moves: into these slots of the pool, from these payloads."""
        plan = self._planned.slots
        return self._store.pool, [p.slot for p in plan], [p.item.data for p in plan]

    def start(self) -> None:
        """Start the copy in the background where that can be had."""
        try:
            self._job = self._store._copier.write_start(*self._batch())
        except BaseException:
            self._commit([])  # nothing was copied: every slot goes back
            raise

    def fileno(self) -> int | None:
        """A descriptor readable once the background copy is done; None when none runs
        (finish() copies, on the caller's thread)."""
        return self._job.fileno() if self._job is not None else None

    def finish(self, gone: threading.Event | None = None) -> PutResult:
        """Wait for the copy (or make it), check each block's checksum where the client
        sent one, commit what was written and return (stored, already_present).

        The caller's deadline (put_begin's `deadline_ns`): a copy that ended past it stores
        nothing (DeadlineExceeded): a caller told its call failed may have been writing
        its buffers again while they were read, and a block committed from those bytes
        would carry a checksum of them, served as valid. Checked once the copy is over:
        one that ended before the deadline read nothing the caller wrote after it.
        `gone`: set by a caller that gave up on this put while a worker thread finishes
        it (its call was cancelled): checked at the same point, nothing stored either."""
        if self._done:
            raise RuntimeError("this put was finished already")
        written: list[Written] = []
        late = False
        try:
            if self._job is not None:
                digests = self._job.result()
            else:
                digests = self._store._copier.write(*self._batch())
            deadline_ns = self._deadline_ns
            if deadline_ns is not None and time.monotonic_ns() >= deadline_ns:
                late = True
                raise DeadlineExceeded(
                    f"the copy of {len(digests)} blocks ended past the caller's deadline: "
                    "nothing stored (the caller may be writing those buffers again)"
                )
            if gone is not None and gone.is_set():
                raise Unavailable("the caller gave up on this put: nothing stored")
            for p, digest in zip(self._planned.slots, digests):
                if p.item.checksum is not None and digest != p.item.checksum:
                    raise DataLoss(
                        f"block {p.item.block_id.hex()[:12]} payload does not match its checksum"
                    )
                written.append(Written(p, digest))
        finally:
            done = self._commit(written, late)
        # A block another writer committed while this one copied is present, not stored.
        return PutResult(done.stored, self._planned.already + done.raced)

    def abandon(self) -> None:
        """The caller is gone (cancelled): wait for the copy, store nothing, give every
        slot back. What the copy read is not to be trusted: a client told its call failed
        may already be writing its next blocks into the same staging slots, and a block
        committed from those bytes would carry a checksum of them, served as valid."""
        if self._done:
            return
        try:
            if self._job is not None:
                self._job.result()  # the slots are not free to reuse before
        finally:
            self._commit([])

    def _commit(self, written: list[Written], late: bool = False) -> CommitResult:
        self._done = True
        store = self._store
        with store.lock:
            done = store._writes.commit(self._st, self._generation, self._planned.slots, written)
            if late:
                store.counters["put_past_deadline"] += 1
            # Blocks sent that the node held already: a client re-sending what it could
            # have known was here (its Lookup said so) shows up as this counter growing.
            store.counters["put_already_present"] += self._planned.already + done.raced
        return done


class PendingGet:
    """A get between taking its blocks and serving them (BlockStore.get_begin)."""

    __slots__ = (
        "_store",
        "_st",
        "_metas",
        "_slots",
        "_deadline_ns",
        "_dsts",
        "_n_pool",
        "_run",
        "_job",
        "_done",
    )

    def __init__(
        self,
        store: BlockStore,
        st: NsState,
        metas: list[BlockMeta],
        slots: list[int],
        deadline_ns: int | None = None,
    ) -> None:
        self._store = store
        self._st = st
        self._metas = metas
        self._slots = slots
        self._deadline_ns = deadline_ns
        self._dsts: list[Any] = []
        self._n_pool = 0
        self._run: tuple = (store.pool, [], [], [])  # BatchCopier.read's arguments
        self._job: Any = None
        self._done = False

    def prepare(self, dst_for: Callable[[int, int], Payload | None], background: bool) -> None:
        """The destinations, and the copy started in the background where it can be."""
        self._check_deadline()
        metas, slots = self._metas, self._slots
        self._dsts = dsts = [dst_for(i, m.nbytes) for i, m in enumerate(metas)]
        # The pool is prefix-closed: pool blocks lead, so that run is copied as a batch.
        self._n_pool = n = next(
            (i for i, (s, d) in enumerate(zip(slots, dsts)) if s < 0 or d is None), len(metas)
        )
        store = self._store
        self._run = (store.pool, slots[:n], [m.nbytes for m in metas[:n]], dsts[:n])
        if background and n:
            self._job = store._copier.read_start(*self._run, self._deadline_ns)

    def _check_deadline(self) -> None:
        """Nothing is copied into the caller's buffers once its deadline has passed: a
        caller told its call failed may be using them again (a copy already running
        stops at its next block, BatchCopier.read_start)."""
        if self._past_deadline():
            self._late("nothing written")

    def _late(self, done: str) -> None:
        with self._store.lock:
            self._store.counters["get_past_deadline"] += 1
        raise DeadlineExceeded(
            f"the caller's deadline passed before {len(self._metas)} blocks were copied "
            f"into its buffers: {done}"
        )

    def _past_deadline(self) -> bool:
        return self._deadline_ns is not None and time.monotonic_ns() >= self._deadline_ns

    def fileno(self) -> int | None:
        """A descriptor readable once the background copy is done; None when none runs."""
        return self._job.fileno() if self._job is not None else None

    @property
    def reads_beyond_pool(self) -> bool:
        """finish() reads blocks one by one (NVMe, or payloads returned as bytes): work
        for a thread, not an event loop."""
        return self._n_pool < len(self._metas)

    def finish(self) -> list[ServedBlock]:
        if self._done:
            raise RuntimeError("this get was finished already")
        store = self._store
        metas, slots, dsts, n_pool = self._metas, self._slots, self._dsts, self._n_pool
        served: list[ServedBlock] = []
        promote: list[Promotion] = []
        corrupt: BlockMeta | None = None
        try:
            if self._job is not None:
                digests = self._job.result()
                if None in digests:  # copies not made, the deadline passed: serve none
                    self._late("the copy stopped there, none served")
            else:
                self._check_deadline()  # prepare's check, again: a thread may start late
                digests = store._copier.read(*self._run)
            hbm = Tier.HBM  # read once: a member read through its class costs ~0.3 us
            for i, (m, slot) in enumerate(zip(metas, slots)):
                if i >= n_pool and self._past_deadline():  # read one by one past the pool
                    served.clear()  # run: none into a late caller's buffers, none served
                    promote.clear()
                    self._late("the rest not read, none served")
                dst = dsts[i]
                data: bytes | None = None
                if i < n_pool:
                    ok = digests[i] == m.checksum
                    tier = hbm
                elif slot >= 0 and dst is None:
                    data, digest = store.pool.read_bytes(slot, m.nbytes)
                    ok = digest == m.checksum
                    tier = hbm
                elif slot >= 0:
                    ok = store.pool.read_into(slot, m.nbytes, dst) == m.checksum
                    tier = hbm
                else:  # a device staging destination takes the block through the host
                    buf = bytearray(m.nbytes) if dst is None or is_tensor(dst) else dst
                    ok = store._residency.read_nvme(m, buf)
                    tier = Tier.NVME
                    if ok:
                        promote.append(Promotion(m, buf))
                        if dst is None:
                            data = bytes(buf)
                        elif buf is not dst:
                            fill_tensor(dst, buf)
                if not ok:
                    corrupt = m
                    break
                served.append(ServedBlock(m.block_id, tier, m.checksum, data))
        finally:
            self.finish_with(served, promote, corrupt)
        return served

    def abandon(self) -> None:
        """The caller is gone (cancelled): wait for the copy, serve nothing."""
        if not self._done:
            self.finish_with([])

    def finish_with(
        self,
        served: list[ServedBlock],
        promote: list[Promotion] | None = None,
        corrupt: BlockMeta | None = None,
    ) -> None:
        """End the read with `served` (the holds let go of; nothing served on an error)."""
        self._done = True
        store = self._store
        try:
            if self._job is not None:
                self._job.result()  # the copy must be over before the slots can be reused
        finally:
            with store.lock:
                store._reads.finish(self._st, self._metas, served, promote or [], corrupt)
