"""What each serving engine holds in its own KV cache (vLLM's prefix cache), as kvstore chain
ids. Pure, no I/O; fed by router/engine_feed.py from the engines' KV events.

Kept apart from router/index.py (the agents' index): engines' caches evict on their own
terms (vLLM frees LRU blocks, not leaves first), so a prompt's prefix there is found by a
scan that stops at the first block the engine lacks, not by a binary search that assumes
prefix consistency. The scan costs one dict probe per block the longest engine holds.

Layout: one dict, chain id -> bit mask of engine slots (masks interned as in
router/index.py), plus a per-slot count. ~100 bytes per distinct block.
"""

from __future__ import annotations

from collections.abc import Iterable

ID = 16


class EngineIndex:
    def __init__(self) -> None:
        self._map: dict[bytes, int] = {}
        self._intern: dict[int, int] = {}
        self._slot_of: dict[str, int] = {}
        self._engine_of: list[str | None] = []
        self._free: list[int] = []
        self._held: list[int] = []

    # ----------------------------------------------------------------- engines
    def add_engine(self, engine_id: str) -> int:
        slot = self._slot_of.get(engine_id)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._engine_of)
            self._engine_of.append(None)
            self._held.append(0)
        self._slot_of[engine_id] = slot
        self._engine_of[slot] = engine_id
        return slot

    def drop_engine(self, engine_id: str) -> int:
        """Forget an engine and its entries. O(indexed blocks): engines leave rarely."""
        slot = self._slot_of.pop(engine_id, None)
        if slot is None:
            return 0
        n = self._clear_slot(slot)
        self._engine_of[slot] = None
        self._free.append(slot)
        self._free.sort(reverse=True)  # low slots first: smaller masks
        return n

    def clear_engine(self, engine_id: str) -> int:
        """Drop an engine's entries, keep the engine (a resync)."""
        slot = self._slot_of.get(engine_id)
        return 0 if slot is None else self._clear_slot(slot)

    def _clear_slot(self, slot: int) -> int:
        n = self._held[slot]
        if not n:
            return 0
        bit = 1 << slot
        emptied: list[bytes] = []
        intern: dict[int, int] = {}
        m = self._map
        for k, v in m.items():
            if v & bit:
                v &= ~bit
                if not v:
                    emptied.append(k)
                    continue
                m[k] = intern.setdefault(v, v)
            else:
                intern.setdefault(v, v)
        for k in emptied:
            del m[k]
        self._intern = intern
        self._held[slot] = 0
        return n

    def engine_blocks(self, engine_id: str) -> int:
        slot = self._slot_of.get(engine_id)
        return 0 if slot is None else self._held[slot]

    @property
    def engines(self) -> list[str]:
        return sorted(self._slot_of)

    # ------------------------------------------------------------------ events
    def store(self, engine_id: str, ids: Iterable[bytes]) -> int:
        """Blocks now in the engine's cache; returns how many were new there."""
        bit = 1 << self.add_engine(engine_id)
        m, intern, new = self._map, self._intern, 0
        for bid in ids:
            v = m.get(bid, 0)
            if v & bit:
                continue
            new += 1
            v |= bit
            m[bid] = intern.setdefault(v, v)
        self._held[self._slot_of[engine_id]] += new
        return new

    def remove(self, engine_id: str, ids: Iterable[bytes]) -> int:
        """Blocks the engine evicted; returns how many it held."""
        slot = self._slot_of.get(engine_id)
        if slot is None:
            return 0
        bit = 1 << slot
        m, intern, gone = self._map, self._intern, 0
        for bid in ids:
            v = m.get(bid, 0)
            if not v & bit:
                continue
            gone += 1
            v &= ~bit
            if v:
                m[bid] = intern.setdefault(v, v)
            else:
                del m[bid]
        self._held[slot] -= gone
        return gone

    # ------------------------------------------------------------------- reads
    def holds(self, engine_id: str, block_id: bytes) -> bool:
        slot = self._slot_of.get(engine_id)
        return slot is not None and bool(self._map.get(bytes(block_id), 0) >> slot & 1)

    def prefix_lengths(self, packed: bytes) -> dict[str, int]:
        """Per engine holding block 0 of `packed` (16-byte ids, prefix order): how many
        leading blocks it holds, up to its first missing one. Others are absent."""
        n = len(packed) // ID
        get = self._map.get
        out: dict[str, int] = {}
        cur = get(packed[:ID], 0) if n else 0
        i = 0
        while cur:
            i += 1
            nxt = get(packed[i * ID : i * ID + ID], 0) & cur if i < n else 0
            lost = cur & ~nxt
            while lost:
                low = lost & -lost
                engine = self._engine_of[low.bit_length() - 1]
                if engine is not None:
                    out[engine] = i
                lost ^= low
            cur = nxt
        return out

    def __len__(self) -> int:
        return len(self._map)
