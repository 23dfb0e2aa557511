"""The route's prefix walk (IdTable.prefix: kvstore/native/idwalk.c, and the dict
fallback in router/idtable.py) against the computation it replaced (a bisection walk
returning the class change points, then set operations in Python), and the C table's
huge-page mapping against tracemalloc.

Property: on prefix-consistent holder sets (what agents keep) the new walk returns what
the old one did, in the same order; on any holder sets the C walk and the dict fallback
agree (they make the same probes).
"""

from __future__ import annotations

import os
import tracemalloc
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvstore import native
from kvstore.hashing import NATIVE, hash_chain_packed
from router.idtable import DictIdTable, IdTable, new_table

ID = 16
ROOT = bytes(range(16))
SLOTS = 6


def _old_walk(tbl: DictIdTable, packed: bytes, cls: array) -> list[int]:
    """The bisection walk the route used before: [c0, hi1, c1, hi2, c2, ...]."""
    n = len(packed) // ID
    if not n:
        return [0]

    def at(i: int) -> int:
        return cls[tbl.get(packed, i)]

    cur, lo, out = at(0), 0, []
    out.append(cur)
    while cur:
        hi = n
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if at(mid) == cur:
                lo = mid
            else:
                hi = mid
        nxt = at(hi) if hi < n else 0
        out += (hi, nxt)
        lo, cur = hi, nxt
    return out


def _old_prefix(
    tbl: DictIdTable, packed: bytes, cls: array, sets: list[frozenset[int]], names: list
) -> dict[str, int]:
    """The old router/index.py:prefix_lengths over the old walk."""
    seq = _old_walk(tbl, packed, cls)
    cur, out = sets[seq[0]], {}
    for k in range(1, len(seq), 2):
        if not cur:
            break
        nxt = sets[seq[k + 1]] & cur
        for s in sorted(cur - nxt) if len(cur) - len(nxt) > 1 else cur - nxt:
            if names[s] is not None:
                out[names[s]] = seq[k]
        cur = nxt
    return out


class Layout:
    """Values (mask ids) -> classes -> holder slots, as router/index.py:Masks lays
    them out: class 0 holds nothing, class c's slots are mem[off[c]:off[c + 1]]."""

    def __init__(self, sets: list[frozenset[int]], value_cls: list[int]) -> None:
        self.sets = [frozenset(), *sets]
        self.cls = array("I", [0] + [c + 1 for c in value_cls])
        self.off, self.mem = array("I", [0, 0]), array("I")
        for s in sets:
            self.mem.extend(sorted(s))
            self.off.append(len(self.mem))


def _tables(packed: bytes, values: list[int]) -> list[IdTable]:
    """The C table (when built) and the dict one, holding value values[i] for id i."""
    out: list[IdTable] = [DictIdTable()]
    if NATIVE:
        out.append(new_table(True))
    for t in out:
        for v in sorted(set(values) - {0}):
            ids = b"".join(packed[i * ID : i * ID + ID] for i, x in enumerate(values) if x == v)
            t.transition(ids, [0], [v])
    return out


@hs.composite
def consistent(draw):
    """A prompt whose holder sets only lose slots along it, each run's ids spread over
    several values of the same class (tiers differ, holders do not)."""
    n = draw(hs.integers(0, 90))
    first = draw(hs.frozensets(hs.integers(0, SLOTS - 1), min_size=1))
    drops = sorted(draw(hs.lists(hs.integers(1, max(n, 1)), max_size=5, unique=True)))
    sets, cur = [first], first
    for _ in drops:
        cur = frozenset(draw(hs.sampled_from([cur, *[cur - {s} for s in cur]])))
        sets.append(cur)
    distinct = sorted({s for s in sets if s}, key=sorted)
    value_cls = [distinct.index(s) for s in distinct for _ in range(2)]  # 2 values a class
    lay = Layout(distinct, value_cls)
    values = []
    for i in range(n):
        s = sets[sum(1 for d in drops if d <= i)]
        pick = draw(hs.integers(0, 1))
        values.append(0 if not s else 1 + 2 * distinct.index(s) + pick)
    return n, lay, values


@hs.composite
def arbitrary(draw):
    """Any values, any classes: runs need not form, sets need not shrink."""
    n = draw(hs.integers(0, 90))
    sets = draw(hs.lists(hs.frozensets(hs.integers(0, SLOTS - 1)), min_size=1, max_size=5))
    value_cls = draw(hs.lists(hs.integers(0, len(sets) - 1), min_size=1, max_size=8))
    values = draw(hs.lists(hs.integers(0, len(value_cls)), min_size=n, max_size=n))
    return n, Layout(sets, value_cls), values


NAMES = [f"n{s}" for s in range(SLOTS - 1)] + [None]  # the last slot is free


@settings(max_examples=300, deadline=None)
@given(consistent())
def test_the_walk_returns_what_the_bisection_walk_did(case):
    n, lay, values = case
    packed = hash_chain_packed(ROOT, list(range(n * 4)), 4)
    tables = _tables(packed, values)
    old = _old_prefix(tables[0], packed, lay.cls, lay.sets, NAMES)
    for t in tables:
        got = t.prefix(packed, lay.cls, lay.off, lay.mem, NAMES)
        assert list(got.items()) == list(old.items())


@settings(max_examples=300, deadline=None)
@given(arbitrary())
def test_the_c_walk_and_the_dict_walk_agree_on_any_holders(case):
    n, lay, values = case
    packed = hash_chain_packed(ROOT, list(range(n * 4)), 4)
    results = [
        list(t.prefix(packed, lay.cls, lay.off, lay.mem, NAMES).items())
        for t in _tables(packed, values)
    ]
    assert all(r == results[0] for r in results)


@pytest.mark.skipif(not NATIVE, reason="kvstore._native is not built")
def test_walk_refuses_malformed_layouts():
    packed = hash_chain_packed(ROOT, list(range(8)), 4)
    (t,) = _tables(packed, [1, 1])[1:]
    lay = Layout([frozenset({0})], [0])
    with pytest.raises(ValueError, match="multiple of 16"):
        t.prefix(packed[:-1], lay.cls, lay.off, lay.mem, NAMES)
    with pytest.raises(ValueError, match="no class"):
        t.prefix(packed, array("I", [0]), lay.off, lay.mem, NAMES)
    with pytest.raises(ValueError, match="no holders"):
        t.prefix(packed, lay.cls, array("I", [0, 0]), lay.mem, NAMES)
    with pytest.raises(ValueError, match="no name"):
        t.prefix(packed, lay.cls, lay.off, lay.mem, [])
    with pytest.raises(TypeError):
        t.prefix(packed, lay.cls, lay.off, lay.mem, tuple(NAMES))


@pytest.mark.skipif(not NATIVE, reason="kvstore._native is not built")
def test_a_huge_page_table_is_counted_by_tracemalloc_and_survives_growth():
    """Tables past 2 MiB live in their own mapping (idtable.c): tracemalloc must still
    see it (bench_router's bytes per entry reads tracemalloc), and growing and shrinking
    across the threshold keeps every id."""
    packed = os.urandom(ID * 150_000)
    tracemalloc.start()
    try:
        t = native.load().module.IdTable(os.urandom(16))
        t.transition(packed, [0], [7])
        used, _ = tracemalloc.get_traced_memory()
        assert t.nbytes >= 2 << 20
        assert used >= t.nbytes - 4096
        assert len(t) == 150_000 and t.distinct(packed) == [7]
        trans = array("I", [0] * 8)
        trans[7] = 3
        t.remap(trans)
        assert t.distinct(packed) == [3]
        t.transition(packed[: ID * 149_000], [3], [0])  # most go: back under 2 MiB
        assert len(t) == 1000 and t.distinct(packed[ID * 149_000 :]) == [3]
        trans[3] = 0
        assert t.remap(trans) == 1000 and len(t) == 0
        del t
        after, _ = tracemalloc.get_traced_memory()
        assert after < used // 10  # the mapping was untracked when freed
    finally:
        tracemalloc.stop()
