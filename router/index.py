"""Global block index: block id -> which nodes hold it, and in which tier. Pure, no I/O;
fed only by the agents' event streams (router/follower.py).

Memory layout. An id table (router/idtable.py; in C, 20 bytes a slot at 35-70% load)
maps the 16-byte block id to a small mask id. A mask is an int: bit 2s is set when the
node in slot s holds the block, bit 2s+1 when that copy is on NVMe only; masks are
interned (a million blocks replicated on the same few nodes share one mask id), so what a
block costs is its table slot: ~20 bytes per (block, node) entry at 1.6 replicas, against
~59 for the dict of bytes keys this replaced (loadtest/bench_router.py measures it).
Block ids are chained hashes rooted in the namespace, so they are globally unique and the
namespace is not part of the key.

Events apply as set operations: a batch's distinct old masks are few, so each gets its
new mask once in Python and the table moves every id of the batch in C.

Route cost. Agents keep their stores prefix-consistent (a block never stays on a node
without its parent), so "node n holds block i of a prompt" is monotone in i: the holder
set only loses nodes along a prompt. Each mask has a class, its holder set without tiers;
`prefix_lengths` searches (in C, K-ary so a round's cache misses overlap) for the few
points where the class changes instead of scanning the prompt: O(drop points x
log(prompt blocks)) probes, independent of how many blocks are indexed and of how many
nodes there are, and names each holder's length in the same call.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from kvstore.events import Tier
from router.idtable import IdTable, new_table

ID = 16


def _packed(ids: Iterable[bytes] | bytes) -> bytes:
    """Packed ids from packed bytes (what events carry) or an iterable of 16-byte ids."""
    if isinstance(ids, (bytes, bytearray, memoryview)):
        return bytes(ids)
    lst = ids if isinstance(ids, list) else list(ids)
    packed = b"".join(lst)
    if len(packed) != ID * len(lst):
        raise ValueError("block ids must be 16 bytes each")
    return packed


def _slots(held: int) -> list[int]:
    """The slots whose held bit (2s) is set, lowest first."""
    out = []
    while held:
        low = held & -held
        out.append((low.bit_length() - 1) >> 1)
        held ^= low
    return out


class Masks:
    """Interned holder masks (id 0: the empty mask) and their classes (the held bits
    alone; class 0: held nowhere). `cls`, `off` and `mem` are what the C walk reads."""

    def __init__(self) -> None:
        self.mask: list[int] = [0]
        self.ids: dict[int, int] = {0: 0}
        self.cls = array("I", [0])
        self.cls_bits: list[int] = [0]
        # The slots of each class's holders, ascending: class c's are
        # mem[off[c]:off[c + 1]]. A route works on these small sets (in C), whose cost
        # does not grow with the node count as the bits' does.
        self.off = array("I", [0, 0])
        self.mem = array("I")
        self._cls_ids: dict[int, int] = {0: 0}

    def intern(self, mask: int, even: int) -> int:
        i = self.ids.get(mask)
        if i is None:
            i = self.ids[mask] = len(self.mask)
            self.mask.append(mask)
            held = mask & even
            c = self._cls_ids.get(held)
            if c is None:
                c = self._cls_ids[held] = len(self.cls_bits)
                self.cls_bits.append(held)
                self.mem.extend(_slots(held))
                self.off.append(len(self.mem))
            self.cls.append(c)
        return i

    def __len__(self) -> int:
        return len(self.mask)


class BlockIndex:
    def __init__(self, native: bool = True) -> None:
        """`native`: the C id table when the extension is built (False: the dict one)."""
        self._tbl: IdTable = new_table(native)
        self._m = Masks()
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
        keep = ~(3 << (2 * slot))
        old, fresh = self._m, Masks()
        # Masks are renumbered from the live ones: masks nobody uses now are dropped.
        trans = array("I", bytes(4 * len(old)))
        for u, live in enumerate(self._tbl.used(len(old))):
            if live:
                trans[u] = fresh.intern(old.mask[u] & keep, self._even)
        self._tbl.remap(trans)
        self._m = fresh
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
    def store(self, node_id: str, ids: Iterable[bytes] | bytes, tier: Tier | int = Tier.HBM) -> int:
        """Blocks now on the node in `tier` (`ids`: 16-byte ids, or packed). Returns how
        many were new to the node."""
        packed = _packed(ids)
        slot = self.add_node(node_id)
        held, nv = 1 << (2 * slot), 2 << (2 * slot)
        to_nvme = int(int(tier) == Tier.NVME)
        want, keep = held | (nv if to_nvme else 0), ~(held | nv)
        m, even = self._m, self._even
        olds = self._tbl.distinct(packed)
        news = [m.intern((m.mask[u] & keep) | want, even) for u in olds]
        new = nvme_delta = 0
        for u, c in zip(olds, self._tbl.transition(packed, olds, news)):
            v = m.mask[u]
            if not v & held:
                new += c
                nvme_delta += c * to_nvme
            else:  # the NVMe bit is only ever set with held
                nvme_delta += c * (to_nvme - bool(v & nv))
        self._held[slot] += new
        self._nvme[slot] += nvme_delta
        return new

    def remove(self, node_id: str, ids: Iterable[bytes] | bytes) -> int:
        """Blocks that left the node (every tier). Returns how many it held."""
        slot = self._slot_of.get(node_id)
        if slot is None:
            return 0
        packed = _packed(ids)
        held, nv = 1 << (2 * slot), 2 << (2 * slot)
        keep = ~(held | nv)
        m, even = self._m, self._even
        olds = [u for u in self._tbl.distinct(packed) if m.mask[u] & held]
        if not olds:
            return 0
        news = [m.intern(m.mask[u] & keep, even) for u in olds]
        gone = gone_nvme = 0
        for u, c in zip(olds, self._tbl.transition(packed, olds, news)):
            gone += c
            gone_nvme += c * bool(m.mask[u] & nv)
        self._held[slot] -= gone
        self._nvme[slot] -= gone_nvme
        return gone

    def set_tier(self, node_id: str, ids: Iterable[bytes] | bytes, tier: Tier | int) -> None:
        """Blocks the node moved between tiers; ids it does not hold are ignored."""
        slot = self._slot_of.get(node_id)
        if slot is None:
            return
        packed = _packed(ids)
        held, nv = 1 << (2 * slot), 2 << (2 * slot)
        to_nvme = int(tier) == Tier.NVME
        m, even = self._m, self._even
        olds = [
            u
            for u in self._tbl.distinct(packed)
            if m.mask[u] & held and bool(m.mask[u] & nv) != to_nvme
        ]
        if not olds:
            return
        news = [m.intern((m.mask[u] | nv) if to_nvme else (m.mask[u] & ~nv), even) for u in olds]
        moved = sum(self._tbl.transition(packed, olds, news))
        self._nvme[slot] += moved if to_nvme else -moved

    # ------------------------------------------------------------------- reads
    def holders(self, block_id: bytes) -> dict[str, Tier]:
        if len(block_id) != ID:
            return {}
        v = self._m.mask[self._tbl.get(bytes(block_id), 0)]
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
        how many leading blocks it holds. Nodes holding nothing are absent. One C call
        (router/idtable.py: prefix) walks the prompt and names the nodes."""
        if len(packed) % ID:
            packed = bytes(packed[: len(packed) - len(packed) % ID])
        m = self._m
        return self._tbl.prefix(packed, m.cls, m.off, m.mem, self._node_of)

    def __len__(self) -> int:
        """Distinct blocks indexed."""
        return len(self._tbl)

    @property
    def entries(self) -> int:
        """(block, node) pairs indexed."""
        return sum(self._held)

    @property
    def distinct_masks(self) -> int:
        """Masks interned since the last node was cleared (live ones and a few that were)."""
        return len(self._m) - 1

    @property
    def nbytes(self) -> int:
        """Memory of the id table (the per-block part of the index)."""
        return self._tbl.nbytes
