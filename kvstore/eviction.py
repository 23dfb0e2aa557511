"""Eviction strategies. A strategy maps a block's metadata to a priority: the block with
the lowest priority among the evictable ones goes first.

Priorities must stay comparable over time without being recomputed for every block at
every eviction, so each strategy's priority changes only when the block is touched: the
store re-files a block in its heap on each access. Which blocks are evictable at all
(leaves first, never pinned, never while being read) is the store's job, not the
strategy's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class EvictionMeta(Protocol):
    hits: int
    last_access: float
    depth: int


class EvictionPolicy(Protocol):
    @property
    def name(self) -> str: ...  # read-only: the strategies are frozen dataclasses

    def priority(self, meta: EvictionMeta, charged: int) -> float:
        """`charged`: the bytes holding the block costs in the tier it would leave, what
        that tier's accounting charges: a whole slot in the pool (every block takes one,
        whatever its payload), its payload bytes on NVMe."""
        ...


@dataclass(frozen=True, slots=True)
class LRUPolicy:
    """Least recently used first: the baseline to compare against."""

    name: str = "lru"

    def priority(self, meta: EvictionMeta, charged: int) -> float:
        return meta.last_access


@dataclass(frozen=True, slots=True)
class ValueAwarePolicy:
    """Estimated prefill compute saved per byte charged, decayed by age.

    value = (hits + 1) x prefill_cost(depth) / charged x 2^(-age / half_life)

    `charged` is what the tier charges for the block: in the pool a whole slot, so blocks
    there compete by value per slot (a tiny block keeps out as much as a full one); on
    NVMe its stored bytes, so value per byte there.

    prefill_cost(depth) is relative: every block pays its MLP/projection work (1) and
    attention over everything before it (depth x attention_weight), so a deep block that
    does get hit saves more than a shallow one. Taking log2 turns the decay into an additive
    `last_access / half_life` term, which is fixed between touches, so heap order stays
    valid as time passes.
    """

    half_life_s: float = 300.0
    attention_weight: float = 0.05
    name: str = "value"

    def priority(self, meta: EvictionMeta, charged: int) -> float:
        cost = 1.0 + self.attention_weight * meta.depth
        value = (meta.hits + 1) * cost / max(charged, 1)
        return math.log2(value) + meta.last_access / self.half_life_s


def make_policy(
    name: str, half_life_s: float = 300.0, attention_weight: float = 0.05
) -> EvictionPolicy:
    """The strategy named `name`; the tuning arguments are ValueAwarePolicy's."""
    if name == "lru":
        return LRUPolicy()
    if name == "value":
        return ValueAwarePolicy(half_life_s=half_life_s, attention_weight=attention_weight)
    raise ValueError(f"unknown eviction policy {name!r}: choose 'value' or 'lru'")
