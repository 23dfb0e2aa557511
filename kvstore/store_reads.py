"""The bookkeeping around a read of the block store (a get, or a borrow of slot views):
which leading blocks a read may take, and, once their payloads were copied outside the
lock, what counts as served (hits, TTL, promotion of NVMe blocks, dropping corrupt ones).
Runs under the store's lock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.events import EventKind, EventQueue, Tier
from kvstore.store_residency import Residency
from kvstore.store_types import BlockMeta, NsState, Promotion, ServedBlock, raise_expiry


class Reads:
    def __init__(
        self,
        residency: Residency,
        counters: Counter[str],
        events: EventQueue,
        clock: Callable[[], float],
    ) -> None:
        self.residency = residency
        self.counters = counters
        self.events = events
        self.clock = clock

    def leading(self, st: NsState, ids: Sequence[bytes], parent_id: bytes) -> list[BlockMeta]:
        """The leading blocks of `ids` held and unexpired, each the child of the one
        before (the first of `parent_id`, unless that is empty)."""
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

    def finish(
        self,
        st: NsState,
        metas: list[BlockMeta],
        served: list[ServedBlock],
        promote: list[Promotion],
        corrupt: BlockMeta | None,
    ) -> None:
        """End a read of `metas` (each held with readers + 1): trims `served` to what is
        still the same block, touches it, promotes, releases the holds, drops `corrupt`."""
        # A block removed while it was copied (flush, expiry, corruption found by another
        # reader) is no hit, and neither is anything after it.
        live = next(
            (i for i, sb in enumerate(served) if st.blocks.get(sb.block_id) is not metas[i]),
            len(served),
        )
        del served[live:]
        self._touch(st, metas, served)
        promoted = []
        for p in promote:  # prefix order: a child only after its parent made it
            if not self.residency.promote(p.meta, p.src):
                break
            promoted.append(p.meta.block_id)
        for m in metas:  # readers kept until now so promotion cannot evict the chain
            self.residency.done_reading(m)
        if promoted:
            self.events.append(EventKind.TIER_CHANGED, st.ns_id, tuple(promoted), tier=Tier.HBM)
        # By identity: the block may have been dropped meanwhile (another reader found it
        # corrupt too) and put again, good, in another slot.
        if corrupt is not None and st.blocks.get(corrupt.block_id) is corrupt:
            self.counters["corrupt_dropped"] += 1
            self.residency.remove_subtrees(st, {corrupt.block_id}, "corrupt")
        self.counters["get_blocks"] += len(served)
        self.counters["get_bytes"] += sum(m.nbytes for m in metas[: len(served)])

    def _touch(self, st: NsState, metas: list[BlockMeta], served: list[ServedBlock]) -> None:
        """A hit: counted, recent, its TTL (and its ancestors') refreshed."""
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
            raise_expiry(st.blocks.get(metas[0].parent_id), now + ttl)
