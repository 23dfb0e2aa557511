"""The id table under the router's index (router/index.py): 16-byte block id -> uint32
mask id (0: absent), driven with packed ids (concatenated 16-byte ids, as events carry
them). The C table `kvstore._native.IdTable` (kvstore/native/idtable.c: 20 bytes a slot,
open addressing, keyed slot choice) or, without the extension, `DictIdTable` here: the
same operations and results over a dict, several times larger and slower.

Operations (both tables):
  get(packed, i)               value of the i-th id
  distinct(packed)             sorted distinct values of the ids (0 for absent ones)
  transition(packed, old, new) each id whose value is old[j] gets new[j] (0 deletes);
                               returns how many ids had each old value (a repeated id
                               meets its new value the second time: transitions must be
                               idempotent)
  prefix(packed, cls, off, mem, names)
                               {names[s]: leading ids slot s holds} for the holders of
                               id 0: cls[value] is a value's class, class c's holder
                               slots are mem[off[c]:off[c + 1]] (ascending); each point
                               where the class changes is found by a WAYS-ary search
                               (kvstore/native/idwalk.c), until no holder is left
  used(n)                      bytes flagging the values < n some id holds
  remap(trans)                 every value v becomes trans[v] (0 deletes)
  nbytes                       memory the table holds
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Protocol

from kvstore import native

ID = 16
WAYS = 8  # idwalk.c's K: probes per search round + 1


class IdTable(Protocol):
    def get(self, packed: bytes, i: int, /) -> int: ...
    def distinct(self, packed: bytes, /) -> list[int]: ...
    def transition(self, packed: bytes, old: list[int], new: list[int], /) -> list[int]: ...
    def prefix(
        self,
        packed: bytes,
        cls: Sequence[int],
        off: Sequence[int],
        mem: Sequence[int],
        names: list[str | None],
        /,
    ) -> dict[str, int]: ...
    def used(self, n: int, /) -> bytes: ...
    def remap(self, trans: Sequence[int], /) -> int: ...
    def __len__(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


def _check(packed: bytes) -> None:
    if len(packed) % ID:
        raise ValueError(f"packed ids length must be a multiple of 16, got {len(packed)}")


class DictIdTable:
    """The fallback: what kvstore._native.IdTable does, over a dict of bytes keys."""

    def __init__(self) -> None:
        self._d: dict[bytes, int] = {}

    def get(self, packed: bytes, i: int, /) -> int:
        if not 0 <= i < len(packed) // ID:
            raise IndexError("id index out of range")
        return self._d.get(bytes(packed[i * ID : i * ID + ID]), 0)

    def distinct(self, packed: bytes, /) -> list[int]:
        _check(packed)
        get = self._d.get
        return sorted({get(bytes(packed[i : i + ID]), 0) for i in range(0, len(packed), ID)})

    def transition(self, packed: bytes, old: list[int], new: list[int], /) -> list[int]:
        _check(packed)
        if len(old) != len(new):
            raise ValueError("old and new must have the same length")
        pos = {v: j for j, v in enumerate(old)}
        counts = [0] * len(old)
        d = self._d
        for i in range(0, len(packed), ID):
            key = bytes(packed[i : i + ID])
            j = pos.get(d.get(key, 0))
            if j is None:
                continue
            counts[j] += 1
            if new[j]:
                d[key] = new[j]
            else:
                d.pop(key, None)
        return counts

    def prefix(
        self,
        packed: bytes,
        cls: Sequence[int],
        off: Sequence[int],
        mem: Sequence[int],
        names: list[str | None],
        /,
    ) -> dict[str, int]:
        _check(packed)
        n = len(packed) // ID
        get = self._d.get

        def at(i: int) -> int:
            return cls[get(bytes(packed[i * ID : i * ID + ID]), 0)]

        out: dict[str, int] = {}
        cur, lo = (at(0) if n else 0), 0
        held = list(mem[off[cur] : off[cur + 1]])
        while held:
            hi = _next_change(at, lo, n, cur)
            cur = at(hi) if hi < n else 0
            nxt = set(mem[off[cur] : off[cur + 1]])
            for s in held:
                name = names[s]
                if s not in nxt and name is not None:
                    out[name] = hi
            held = [s for s in held if s in nxt]
            lo = hi
        return out

    def used(self, n: int, /) -> bytes:
        flags = bytearray(n)
        for v in set(self._d.values()):
            if v < n:
                flags[v] = 1
        return bytes(flags)

    def remap(self, trans: Sequence[int], /) -> int:
        d = self._d
        gone = [k for k, v in d.items() if not trans[v]]
        for k in gone:
            del d[k]
        for k, v in d.items():
            d[k] = trans[v]
        return len(gone)

    def __len__(self) -> int:
        return len(self._d)

    @property
    def nbytes(self) -> int:
        # The dict and its keys (each key's own bytes object: one per id).
        return sys.getsizeof(self._d) + len(self._d) * sys.getsizeof(bytes(ID))


def _next_change(at: Callable[[int], int], lo: int, n: int, cur: int) -> int:
    """The first index past `lo` (of class `cur`) whose class differs, by idwalk.c's
    WAYS-ary search: the same probes, so the same answer where classes do not form runs."""
    hi = n
    while hi - lo > 1:
        pts: list[int] = []
        for j in range(1, WAYS):
            q = lo + (hi - lo) * j // WAYS
            if lo < q < hi and (not pts or q > pts[-1]):
                pts.append(q)
        new_lo, new_hi = lo, hi
        for q in pts:
            if at(q) != cur:
                new_hi = q
                break
            new_lo = q
        lo, hi = new_lo, new_hi
    return hi


def new_table(prefer_native: bool = True) -> IdTable:
    """The C table when the extension is there (and wanted), else the dict fallback. The
    C table's slot choice is keyed with a fresh random seed per table."""
    module = native.load().module if prefer_native else None
    if module is not None:
        table: IdTable = module.IdTable(os.urandom(16))
        return table
    return DictIdTable()
