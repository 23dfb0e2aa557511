"""Global block index: block id -> which nodes hold it, and in which tier. Pure, no I/O;
fed only by the agents' event streams (router/follower.py).

Memory layout. One dict maps the 16-byte block id to a small int: bit 2s is set when the
node in slot s holds the block, bit 2s+1 when that copy is on NVMe only. Equal masks are
interned, so a million blocks replicated on the same few nodes share a handful of int
objects; what remains per block is the bytes key and its dict slot (~100 bytes per block,
~50 per (block, node) entry at two replicas; loadtest/bench_router.py measures it).
Block ids are chained hashes rooted in the namespace, so they are globally unique and the
namespace is not part of the key.

Route cost. Agents keep their stores prefix-consistent (a block never stays on a node
without its parent), so "node n holds block i of a prompt" is monotone in i: the holder
mask only loses bits along a prompt. `prefix_lengths` therefore binary-searches for the few
points where the mask shrinks instead of scanning the prompt: O(holders x log(prompt
blocks)) dict probes, independent of how many blocks are indexed.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstore.events import Tier

ID = 16


class BlockIndex:
    def __init__(self) -> None:
        self._map: dict[bytes, int] = {}
        self._intern: dict[int, int] = {}
        self._slot_of: dict[str, int] = {}
        self._node_of: list[str | None] = []
        self._free: list[int] = []
        self._held: list[int] = []  # blocks per slot, every tier
        self._nvme: list[int] = []  # of those, on NVMe only
        self._even = 0  # the "held" bit of every slot ever allocated

    # ------------------------------------------------------------------- nodes
    def add_node(self, node_id: str) -> int:
        slot = self._slot_of.get(node_id)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._node_of)
            self._node_of.append(None)
            self._held.append(0)
            self._nvme.append(0)
            self._even |= 1 << (2 * slot)
        self._slot_of[node_id] = slot
        self._node_of[slot] = node_id
        return slot

    def drop_node(self, node_id: str) -> int:
        """Forget a node and every entry it had. O(indexed blocks): node loss is rare."""
        slot = self._slot_of.pop(node_id, None)
        if slot is None:
            return 0
        n = self._clear_slot(slot)
        self._node_of[slot] = None
        self._free.append(slot)
        self._free.sort(reverse=True)  # reuse low slots first: smaller masks
        return n

    def clear_node(self, node_id: str) -> int:
        """Drop a node's entries but keep it (before applying a fresh snapshot)."""
        slot = self._slot_of.get(node_id)
        return 0 if slot is None else self._clear_slot(slot)

    def _clear_slot(self, slot: int) -> int:
        if not self._held[slot]:
            return 0
        both = 3 << (2 * slot)
        keep = ~both
        emptied = []
        intern: dict[int, int] = {}
        m = self._map
        for k, v in m.items():
            if v & both:
                v &= keep
                if not v:
                    emptied.append(k)
                    continue
                m[k] = intern.setdefault(v, v)
            else:
                intern.setdefault(v, v)
        for k in emptied:
            del m[k]
        self._intern = intern  # rebuilt from live masks: drops masks nobody uses now
        n = self._held[slot]
        self._held[slot] = self._nvme[slot] = 0
        return n

    @property
    def nodes(self) -> list[str]:
        return sorted(self._slot_of)

    def node_blocks(self, node_id: str) -> tuple[int, int]:
        """(blocks held, of which on NVMe only) for one node."""
        slot = self._slot_of.get(node_id)
        return (0, 0) if slot is None else (self._held[slot], self._nvme[slot])

    # ------------------------------------------------------------------ events
    def store(self, node_id: str, ids: Iterable[bytes], tier: Tier | int = Tier.HBM) -> int:
        """Blocks now on the node in `tier`. Returns how many were new to the node."""
        slot = self.add_node(node_id)
        held, nv = 1 << (2 * slot), 2 << (2 * slot)
        want = held | (nv if int(tier) == Tier.NVME else 0)
        keep = ~(held | nv)
        m, intern = self._map, self._intern
        to_nvme = int(bool(want & nv))
        # Set algebra runs in C: ids no node holds yet (most of a snapshot) go in with one
        # dict update; only those already indexed take the per-block mask merge below.
        batch = set(ids)
        known = batch & m.keys()
        fresh = batch - known if known else batch
        if fresh:
            m.update(dict.fromkeys(fresh, intern.setdefault(want, want)))
        new, nvme_delta = len(fresh), to_nvme * len(fresh)
        for bid in known:
            v = m[bid]
            new += not v & held
            nvme_delta += to_nvme - bool(v & nv)  # the NVMe bit is only ever set with held
            v = (v & keep) | want
            m[bid] = intern.setdefault(v, v)
        self._held[slot] += new
        self._nvme[slot] += nvme_delta
        return new

    def remove(self, node_id: str, ids: Iterable[bytes]) -> int:
        """Blocks that left the node (every tier). Returns how many it held."""
        slot = self._slot_of.get(node_id)
        if slot is None:
            return 0
        held, nv = 1 << (2 * slot), 2 << (2 * slot)
        keep = ~(held | nv)
        m, intern = self._map, self._intern
        gone = gone_nvme = 0
        for bid in ids:
            v = m.get(bid, 0)
            if not v & held:
                continue
            gone += 1
            gone_nvme += bool(v & nv)
            v &= keep
            if v:
                m[bid] = intern.setdefault(v, v)
            else:
                del m[bid]
        self._held[slot] -= gone
        self._nvme[slot] -= gone_nvme
        return gone

    def set_tier(self, node_id: str, ids: Iterable[bytes], tier: Tier | int) -> None:
        """Blocks the node moved between tiers; ids it does not hold are ignored."""
        slot = self._slot_of.get(node_id)
        if slot is None:
            return
        held, nv = 1 << (2 * slot), 2 << (2 * slot)
        to_nvme = int(tier) == Tier.NVME
        m, intern = self._map, self._intern
        delta = 0
        for bid in ids:
            v = m.get(bid, 0)
            if not v & held or bool(v & nv) == to_nvme:
                continue
            v = (v | nv) if to_nvme else (v & ~nv)
            delta += 1 if to_nvme else -1
            m[bid] = intern.setdefault(v, v)
        self._nvme[slot] += delta

    # ------------------------------------------------------------------- reads
    def holders(self, block_id: bytes) -> dict[str, Tier]:
        v = self._map.get(bytes(block_id), 0)
        out = {}
        while v:
            low = v & -v
            bit = low.bit_length() - 1
            if not bit & 1:
                node = self._node_of[bit // 2]
                if node is not None:  # a set bit is a live slot: never None
                    out[node] = Tier.NVME if v & (low << 1) else Tier.HBM
            v ^= low
        return out

    def prefix_lengths(self, packed: bytes) -> dict[str, int]:
        """Per node holding block 0 of the prompt `packed` (16-byte ids, prefix order):
        how many leading blocks it holds. Nodes holding nothing are absent."""
        n = len(packed) // ID
        if not n:
            return {}
        get, even = self._map.get, self._even
        cur = get(packed[:ID], 0) & even
        out: dict[str, int] = {}
        lo = 0  # every node in `cur` holds blocks 0..lo
        while cur:
            # Binary search for the first block some node of `cur` lacks. (Plain bisection
            # beats galloping here: segments are long, and each probe is a cache miss.)
            hi = n
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if get(packed[mid * ID : mid * ID + ID], 0) & cur == cur:
                    lo = mid
                else:
                    hi = mid
            nxt = get(packed[hi * ID : hi * ID + ID], 0) & cur if hi < n else 0
            lost = cur & ~nxt
            while lost:
                low = lost & -lost
                node = self._node_of[(low.bit_length() - 1) >> 1]
                if node is not None:  # a set bit is a live slot: never None
                    out[node] = hi
                lost ^= low
            cur, lo = nxt, hi
        return out

    def __len__(self) -> int:
        """Distinct blocks indexed."""
        return len(self._map)

    @property
    def entries(self) -> int:
        """(block, node) pairs indexed."""
        return sum(self._held)

    @property
    def distinct_masks(self) -> int:
        return len(self._intern)
