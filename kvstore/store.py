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
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from collections.abc import Callable

from kvstore.accounting import TenantAccounts
from kvstore.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StaleGeneration,
)
from kvstore.eviction import EvictionPolicy, ValueAwarePolicy
from kvstore.events import EventKind, EventQueue, Tier
from kvstore.namespace import Namespace
from kvstore.payload import decode_block
from kvstore.policy import NamespacePolicy
from kvstore.tiers.pool import DevicePool
from kvstore.store_eviction import EvictionMixin
from kvstore.store_inplace import InPlaceMixin
from kvstore.store_maintenance import MaintenanceMixin
from kvstore.store_types import (
    ID_BYTES,
    NS_META_PREFIX,
    BlockMeta,
    LookupResult,
    NsState,
    PackedIds,
    PlannedSlot,
    PutItem,
    ServedBlock,
    Written,
    _first_false,
)
from kvstore.tiers.rocks import RocksTier

__all__ = [
    "BlockStore",
    "BlockMeta",
    "NsState",
    "PutItem",
    "LookupResult",
    "ServedBlock",
    "PackedIds",
    "ID_BYTES",
]


class BlockStore(EvictionMixin, MaintenanceMixin, InPlaceMixin):
    def __init__(
        self,
        pool: DevicePool,
        rocks: RocksTier | None,
        eviction: EvictionPolicy | None = None,
        accounts: TenantAccounts | None = None,
        policy_for: Callable[[Namespace], NamespacePolicy] | None = None,
        clock: Callable[[], float] = time.time,
        copy_threads: int = 1,
    ) -> None:
        self.pool = pool
        # Bulk copies of a batch are split across threads (the native copy releases the
        # GIL): one core's copy-and-checksum is below what the memory bus can do.
        self._copier = (
            ThreadPoolExecutor(copy_threads, thread_name_prefix="kv-copy")
            if copy_threads > 1
            else None
        )
        self._copy_threads = copy_threads
        self.rocks = rocks
        self.eviction = eviction or ValueAwarePolicy()
        self.accounts = accounts or TenantAccounts()
        self.policy_for = policy_for or (lambda ns: NamespacePolicy())
        self.clock = clock
        self.events = EventQueue()
        self.counters: Counter[str] = Counter()
        self.lock = threading.RLock()
        self._ns: dict[bytes, NsState] = {}
        self._heaps: dict[tuple[str, Tier], list] = {}
        self._tick = 0
        self.nvme_used = 0
        # Slots of blocks removed while a get still copies out of them: freed by the last
        # reader, so a slot is never reused under a copy in flight.
        self._parked: dict[BlockMeta, int] = {}
        # Bytes of pool slots reserved for writes in flight (planned, not yet committed or
        # freed), per tenant: not in the accounts before commit, so each new reservation
        # counts them, or writes open at once would together overshoot the tenant's quota.
        self._inflight: Counter[str] = Counter()
        # Global kill switch (etcd `killswitch`, applied by node_agent/control.py): every
        # lookup and get misses and every put is refused while it is on; nothing is dropped.
        self.killed = False

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
                self._free_resources(meta)
            st.blocks.clear()
            st.pinned_bytes = 0
            st.generation = generation
            if self.rocks is not None:
                self.rocks.delete_prefix(ns_id)
            self._save_ns(st)
            self.counters["blocks_dropped_flush"] += dropped
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
    def lookup(self, ns_id: bytes, generation: int, ids) -> LookupResult:
        """`ids` is any sequence of block ids (a list, or PackedIds over the wire bytes).

        Cost is O(log n) dict probes, not O(n): presence on the node is prefix-closed
        (leaves go first), presence in the pool is prefix-closed (a block enters the pool
        only after its parent, and leaves the pool before it), and expiry is monotone
        (a parent never expires before its child), so both lengths are binary searches."""
        with self.lock:
            st = self.namespace(ns_id, generation)
            if self.killed:
                return self._killed_lookup(st, len(ids))
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
        dst_for: Callable[[int, int], object],
    ) -> list[ServedBlock]:
        """Copy the leading present blocks into `dst_for(i, nbytes)` buffers, verified.
        When `dst_for` returns None the payload comes back as bytes in ServedBlock.data
        (the gRPC path needs bytes objects). Stops at the first missing, mis-chained or
        corrupt block."""
        with self.lock:
            st = self.namespace(ns_id, generation)
            if self.killed:
                self.counters["killswitch_gets"] += 1
                return []
            metas = self._leading(st, ids, parent_id)
            slots = [m.slot for m in metas]  # read once, under the lock (see _parked)
            for m in metas:
                m.readers += 1
        served: list[ServedBlock] = []
        promote: list[tuple[BlockMeta, object]] = []
        corrupt: BlockMeta | None = None
        try:
            dsts = [dst_for(i, m.nbytes) for i, m in enumerate(metas)]
            # The pool is prefix-closed: pool blocks lead, so copy that run in parallel.
            n_pool = next(
                (i for i, (s, d) in enumerate(zip(slots, dsts)) if s < 0 or d is None), len(metas)
            )
            digests = self._copy_all(
                lambda i: self.pool.read_into(slots[i], metas[i].nbytes, dsts[i]),
                range(n_pool),
                sum(m.nbytes for m in metas[:n_pool]),
            )
            for i, (m, slot) in enumerate(zip(metas, slots)):
                dst = dsts[i]
                data = None
                if i < n_pool:
                    ok = digests[i] == m.checksum
                    tier = Tier.HBM
                elif slot >= 0 and dst is None:
                    data, digest = self.pool.read_bytes(slot, m.nbytes)
                    ok = digest == m.checksum
                    tier = Tier.HBM
                elif slot >= 0:
                    ok = self.pool.read_into(slot, m.nbytes, dst) == m.checksum
                    tier = Tier.HBM
                else:
                    buf = bytearray(m.nbytes) if dst is None else dst
                    ok = self._read_nvme(m, buf)
                    tier = Tier.NVME
                    if ok:
                        promote.append((m, buf))
                        data = bytes(buf) if dst is None else None
                if not ok:
                    corrupt = m
                    break
                served.append(ServedBlock(m.block_id, tier, m.checksum, data))
        finally:
            with self.lock:
                self._finish_get(st, metas, served, promote, corrupt)
        return served

    def _copy_all(self, fn, args, nbytes: int) -> list:
        """fn over args, on the copy threads when the batch is big enough to pay."""
        args = list(args)
        if self._copier is None or len(args) < 2 or nbytes < (8 << 20):
            return [fn(a) for a in args]
        # One task per thread over a contiguous share: a task per block costs more in
        # hand-offs (~20 us each, far more on a busy host) than it gains in balance.
        step = -(-len(args) // self._copy_threads)
        shares = self._copier.map(
            lambda part: [fn(a) for a in part],
            [args[i : i + step] for i in range(0, len(args), step)],
        )
        return [r for part in shares for r in part]

    def _leading(self, st: NsState, ids: list[bytes], parent_id: bytes) -> list[BlockMeta]:
        now = self.clock()
        out = []
        prev = parent_id
        for bid in ids:
            m = st.blocks.get(bid)
            if m is None or (m.expires_at and m.expires_at <= now):
                break
            if prev and m.parent_id != prev:
                self.counters["chain_mismatch"] += 1
                break
            out.append(m)
            prev = bid
        return out

    def _read_nvme(self, m: BlockMeta, dst) -> bool:
        raw = self.rocks.get(m.ns.ns_id + m.block_id) if self.rocks else None
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

    def _finish_get(self, st, metas, served, promote, corrupt) -> None:
        # A block removed while it was copied (flush, expiry, corruption found by another
        # reader) is no hit, and neither is anything after it.
        live = next(
            (i for i, sb in enumerate(served) if st.blocks.get(sb.block_id) is not metas[i]),
            len(served),
        )
        del served[live:]
        now = self.clock()
        ttl = st.policy.ttl_seconds
        for sb in served:
            m = st.blocks.get(sb.block_id)
            if m is None:
                continue
            m.hits += 1
            m.last_access = now
            if ttl:
                m.expires_at = now + ttl
        if ttl and served and metas[0].depth:
            self._raise_expiry(st.blocks.get(metas[0].parent_id), now + ttl)
        promoted = []
        for m, dst in promote:  # prefix order: a child only after its parent made it
            if not self._promote(m, dst):
                break
            promoted.append(m.block_id)
        for m in metas:  # readers kept until now so promotion cannot evict the chain
            self._done_reading(m)
        if promoted:
            self.events.append(EventKind.TIER_CHANGED, st.ns_id, tuple(promoted), tier=Tier.HBM)
        # By identity: the block may have been dropped meanwhile (another reader found it
        # corrupt too) and put again, good, in another slot.
        if corrupt is not None and st.blocks.get(corrupt.block_id) is corrupt:
            self.counters["corrupt_dropped"] += 1
            self._remove_subtrees(st, {corrupt.block_id}, "corrupt")
        self.counters["get_blocks"] += len(served)
        self.counters["get_bytes"] += sum(m.nbytes for m in metas[: len(served)])

    def _raise_expiry(self, m: BlockMeta | None, until: float) -> None:
        """Keep expiry monotone along the chain: no ancestor expires before `until`."""
        while m is not None and m.expires_at and m.expires_at < until:
            m.expires_at = until
            m = m.ns.blocks.get(m.parent_id) if m.depth else None

    def _promote(self, m: BlockMeta, src) -> bool:
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
            slot = self._reserve_slot(m.ns.tenant, extra=m.nbytes, protect=m)
        finally:
            if parent is not None:
                self._done_reading(parent)
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
        self._attach_slot(m, slot)
        self.counters["promotions"] += 1
        return True

    def _promote_chain(self, m: BlockMeta) -> bool:
        """Bring `m` and its NVMe-only ancestors into the pool (rare: a child is put while
        its parent sits on NVMe). Returns whether `m` is in the pool afterwards."""
        chain = []
        while m is not None and m.slot < 0:
            chain.append(m)
            m = m.ns.blocks.get(m.parent_id) if m.depth else None
        for b in chain:
            b.readers += 1
        try:
            for b in reversed(chain):
                buf = bytearray(b.nbytes)
                if not self._read_nvme(b, buf) or not self._promote(b, buf):
                    return False
            return True
        finally:
            for b in chain:
                self._done_reading(b)

    # ------------------------------------------------------------------------ put
    def put(
        self, ns_id: bytes, generation: int, items: list[PutItem], root: bytes | None = None
    ) -> tuple[int, int]:
        """Store blocks (parent before child). Returns (stored, already_present).

        With `root` given (what clients send), a block whose parent is neither held, nor
        earlier in this put, nor the chain root is refused as an orphan (its parent was
        evicted meanwhile, or the client is wrong): the node then never holds a block
        without its whole prefix, which the router's binary searches rely on. `root=None`
        is for trusted in-process callers (peer transfer copies whole chains)."""
        with self.lock:
            st = self.namespace(ns_id, generation)
            if self.killed:
                self.counters["killswitch_puts"] += 1
                raise FailedPrecondition(
                    "kill switch is on: writes are refused "
                    "(`kvctl killswitch off` to resume caching)"
                )
            plan, already = self._plan_put(st, items, root)
        written: list[Written] = []
        try:
            digests = self._copy_all(
                lambda p: self.pool.write(p.slot, p.item.data),
                plan,
                len(plan) * st.spec.block_bytes,
            )
            for p, digest in zip(plan, digests):
                if p.item.checksum is not None and digest != p.item.checksum:
                    raise DataLoss(
                        f"block {p.item.block_id.hex()[:12]} payload does not match its checksum"
                    )
                written.append(Written(p, digest))
        finally:
            with self.lock:
                stored, raced = self._commit_put(st, generation, plan, written)
        # A block another writer committed while this one copied is present, not stored.
        return stored, already + raced

    def _plan_put(self, st: NsState, items: list[PutItem], root: bytes | None = None):
        size = st.spec.block_bytes
        for i, it in enumerate(items):
            if len(it.block_id) != ID_BYTES or len(it.parent_id) != ID_BYTES:
                raise InvalidArgument(f"block {i}: block_id and parent_id must be 16 bytes")
            n = memoryview(it.data).nbytes
            if n != size:
                raise InvalidArgument(
                    f"block {i} is {n} bytes; namespace {st.spec.key} blocks are {size} bytes"
                )
        depths: dict[bytes, int] = {}
        for it in items:
            parent = st.blocks.get(it.parent_id)
            depths[it.block_id] = parent.depth + 1 if parent else depths.get(it.parent_id, -1) + 1
        if items and max(depths.values()) + 1 < st.policy.min_prefix_blocks:
            self.counters["below_min_prefix"] += 1
            return [], 0
        plan, already, skipped, planned = [], 0, set(), set()
        try:
            for it in items:
                known = st.blocks.get(it.block_id)
                if known is not None or it.block_id in planned:
                    already += 1
                    if known is not None and st.policy.ttl_seconds:  # a re-put is a touch
                        self._raise_expiry(known, self.clock() + st.policy.ttl_seconds)
                    continue
                parent = st.blocks.get(it.parent_id)
                if (
                    root is not None
                    and parent is None
                    and it.parent_id != root
                    and it.parent_id not in planned
                ):
                    skipped.add(it.block_id)
                    self.counters["put_orphan"] += 1
                    continue
                if it.parent_id in skipped or (
                    parent is not None and parent.slot < 0 and not self._promote_chain(parent)
                ):
                    skipped.add(it.block_id)  # keep the pool prefix-closed: not cached
                    self.counters["put_parent_cold"] += 1
                    continue
                planned_slot = self._plan_slot(st, it, depths[it.block_id], parent)
                if planned_slot is None:
                    if plan:  # keep the leading blocks that fit; the rest would be orphans
                        self.counters["put_truncated"] += 1
                        break
                    raise ResourceExhausted(
                        f"device pool cannot take more blocks for tenant {st.tenant}: "
                        "every slot is pinned, in use or over the tenant's quota"
                    )
                plan.append(planned_slot)
                planned.add(it.block_id)
        except BaseException:
            self._abort_plan(plan)
            raise
        return plan, already

    def _plan_slot(
        self, st: NsState, item: PutItem, depth: int, parent: BlockMeta | None
    ) -> PlannedSlot | None:
        """Reserve a pool slot for one block of a write, within the tenant's quota counting
        every slot already in flight for it (this write's and concurrent ones'), and hold
        the parent so making room later cannot evict it. None when no slot can be had."""
        size = st.spec.block_bytes
        if parent is not None:
            parent.readers += 1
        slot = self._reserve_slot(st.tenant, extra=size + self._inflight[st.tenant])
        if slot is None:
            if parent is not None:
                self._done_reading(parent)
            return None
        self._inflight[st.tenant] += size
        return PlannedSlot(item, slot, depth, parent, st.tenant, size)

    def _end_planned(self, p: PlannedSlot) -> None:
        """A planned slot was committed or freed: no longer in flight, nor its parent held."""
        self._inflight[p.tenant] -= p.nbytes
        if p.parent is not None:
            self._done_reading(p.parent)

    def _abort_plan(self, plan: list[PlannedSlot]) -> None:
        for p in plan:
            self.pool.abort(p.slot)
            self._end_planned(p)

    def _commit_put(
        self, st: NsState, generation: int, plan: list[PlannedSlot], written: list[Written]
    ) -> tuple[int, int]:
        """Make the written blocks visible (under the lock); free every other planned slot.
        Planning and copying ran apart from here, so each block is checked again: its
        namespace not flushed, its parent still held and still in the pool, and the block
        itself not committed meanwhile by a concurrent writer of the same chain (that copy
        wins; this slot is freed, or it would leak with nothing pointing at it). A parent
        committed by another writer (or by the previous batch of a pipelined transfer)
        is not held by this plan and may have been demoted since: a child in the pool
        under it would break the pool's prefix closure, so it is not stored.
        Returns (stored, raced)."""
        done = {id(w.planned) for w in written}
        self._abort_plan([p for p in plan if id(p) not in done])
        now = self.clock()
        stored: list[BlockMeta] = []
        raced = 0
        for w in written:
            item, slot = w.planned.item, w.planned.slot
            self._end_planned(w.planned)
            parent_meta = st.blocks.get(item.parent_id)
            depth = parent_meta.depth + 1 if parent_meta else w.planned.depth
            if st.generation != generation or (depth and not parent_meta):
                self.pool.abort(slot)  # flushed meanwhile, or the parent left: not stored
                continue
            if item.block_id in st.blocks:
                self.pool.abort(slot)
                self.counters["put_raced"] += 1
                raced += 1
                continue
            if parent_meta is not None and parent_meta.slot < 0:
                self.pool.abort(slot)
                self.counters["put_parent_cold"] += 1
                continue
            self.pool.commit(slot)
            ttl = st.policy.ttl_seconds
            m = BlockMeta(
                st,
                item.block_id,
                item.parent_id,
                depth,
                st.spec.block_bytes,
                w.digest,
                last_access=now,  # checked by _plan_*
                expires_at=now + ttl if ttl else 0,
            )
            st.blocks[m.block_id] = m
            if parent_meta is not None:
                parent_meta.children += 1
                if ttl:
                    self._raise_expiry(parent_meta, m.expires_at)
            self._attach_slot(m, slot)
            stored.append(m)
        self._stored_events(st, stored)
        return len(stored), raced

    def _stored_events(self, st: NsState, stored: list[BlockMeta]) -> None:
        """One STORED event per parent-to-child run: each names the parent of its first
        block, even when blocks before it were skipped or already present."""
        runs: list[tuple[bytes, list[bytes]]] = []
        for m in stored:
            if runs and runs[-1][1][-1] == m.parent_id:
                runs[-1][1].append(m.block_id)
            else:
                runs.append((m.parent_id, [m.block_id]))
        for parent_id, ids in runs:
            self.events.append(
                EventKind.STORED, st.ns_id, tuple(ids), parent_id=parent_id, tier=Tier.HBM
            )
        self.counters["put_blocks"] += len(stored)

    # --------------------------------------------------------------------- pinning
    def pin(self, ns_id: bytes, generation: int, ids: list[bytes], pin: bool) -> tuple[int, int]:
        with self.lock:
            st = self.namespace(ns_id, generation)
            metas = [m for m in self._leading(st, ids, b"") if m.pinned != pin]
            delta = sum(m.nbytes for m in metas)
            if pin and st.pinned_bytes + delta > st.policy.pin_budget_bytes:
                raise ResourceExhausted(
                    f"pinning {len(metas)} blocks ({delta} bytes) exceeds namespace "
                    f"{st.spec.key} pin budget of {st.policy.pin_budget_bytes} bytes "
                    f"({st.pinned_bytes} already pinned)"
                )
            for m in metas:
                m.pinned = pin
                self._refile(m)
            st.pinned_bytes += delta if pin else -delta
            return len(metas), st.pinned_bytes
