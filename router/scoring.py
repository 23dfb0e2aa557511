"""Routing cost: a pure function over a snapshot (prefix lengths per node, load per node),
weights from RouterConfig with a per-request override. Lower cost wins; ties go to the
smaller node id so every router replica with the same snapshot picks the same node.
Costs are in units of one block recomputed (Pricing.recompute_s seconds), so every term
is a time on the chosen node:

    cost(n) = w_recompute x blocks n must recompute
            + w_peer x (pull_fixed + peer_price x blocks n fetches from a peer)
            + space_price x blocks n would duplicate
            + w_load x requests in flight on n (as assigned by this router)
            + w_queue x prefill work queued on n (blocks, of those requests)
            + w_util x n's pool utilization (0..1, reported by the agent)

Peer blocks are the blocks past n's own prefix that the node with the longest prefix
(other than n) holds. A pull costs what the agents measured (kvstore/pullcost.py: a fixed
part per Prefetch call, pull_fixed, plus peer_price per block; both / recompute_s), and it
is made only when it is cheaper than recomputing the same blocks:
w_peer x (pull_fixed + peer_price x k) < w_recompute x k. Otherwise those blocks are
recomputed. Before any agent has measured a pull, peer_price comes from block bytes and
the configured peer bandwidth and pull_fixed is 0.

Duplicates are those same blocks again: fetched or recomputed, n stores a second copy of
blocks another node already holds, and in a full pool (the steady state of a cache) each
copy evicts a block that may be wanted later. Without this term an idle node always takes
a hot prefix from a busy holder, hot prefixes end up on every node and the copies push the
rest of the working set out. It is the same for every node that holds none of the prompt,
so those still rank by load alone (score_ranked).

What a copy displaces depends on how full the whole store is (Pricing.space_price): while
the NVMe tier has room, the block it pushes out of the pool is demoted and costs a read
when wanted again (DUPLICATE_PRICE); once the store is full it is dropped and costs a
recompute. The router measures the store's fill (Pricing.store_fill: blocks its index
holds over the agents' device-pool plus NVMe capacity) and prices a copy between the two.
On the timestamp-first replay on a busy host (docs/benchmarks.md) the flat 0.15 had the
router store 1.35 x the blocks consistent hashing stored, drop 5 x as many from NVMe and
lose those prefixes later.

Queued work is the recompute blocks (plus the pull, priced as above) of the requests in
flight on n: a request waits behind that prefill, so one queued block weighs what one
block recomputed here does (w_queue 1). The per-request term covers what does not scale
with prompt length (scheduling, decode).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import NamedTuple

# Used when the router does not know a namespace's layout (no namespaces/ record in
# etcd): Llama-3-8B in fp16 at 16 tokens per block, the brief's reference.
DEFAULT_BLOCK_BYTES = 2 << 20
DEFAULT_BLOCK_TOKENS = 16
DEFAULT_QUEUE_WEIGHT = 1.0  # RouterConfig.weight_queue's default
# What a block pushed out of a full pool costs later, in recomputes, while the NVMe tier
# has room: it moves there (a read instead of a recompute when wanted again). Not
# measured: a judgement, the value the router charged before pulls were priced by
# measurement (0.5 x the old default peer_fetch weight 0.3). Once the store is full the
# block pushed out is dropped and costs a recompute (1): Pricing.space_price goes from
# this to 1 with the store's measured fill.
DUPLICATE_PRICE = 0.15


@dataclass(frozen=True, slots=True)
class Weights:
    recompute: float = 1.0
    # 1: a pull is priced at its measured time, no discount (kvstore/pullcost.py).
    peer_fetch: float = 1.0
    load: float = 4.0
    utilization: float = 2.0
    queue: float = DEFAULT_QUEUE_WEIGHT  # per block of prefill queued on the node

    def __post_init__(self) -> None:
        for name in ("recompute", "peer_fetch", "load", "utilization", "queue"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf"):
                raise ValueError(f"weight {name} must be a finite number >= 0, got {v!r}")

    @classmethod
    def from_config(cls, cfg) -> "Weights":
        return cls(
            cfg.weight_recompute,
            cfg.weight_peer_fetch,
            cfg.weight_load,
            cfg.weight_utilization,
            cfg.weight_queue,
        )

    def override(
        self,
        recompute: float = 0.0,
        peer_fetch: float = 0.0,
        load: float = 0.0,
        utilization: float = 0.0,
        queue: float = 0.0,
    ) -> "Weights":
        """Per-request override: fields left at 0 keep this object's value (proto3 cannot
        tell 0 from unset, so a weight cannot be zeroed per request)."""
        given = {
            k: v
            for k, v in (
                ("recompute", recompute),
                ("peer_fetch", peer_fetch),
                ("load", load),
                ("utilization", utilization),
                ("queue", queue),
            )
            if v
        }
        return replace(self, **given) if given else self


@dataclass(frozen=True, slots=True)
class Pricing:
    """What recomputing and pulling blocks takes. `peer_fixed_s` and `peer_s_per_byte`
    are the agents' measured pull cost (kvstore/pullcost.py); `peer_s_per_byte` None:
    none measured yet, a block moves at `peer_gbps`."""

    prefill_tokens_per_s: float = 8000.0
    peer_gbps: float = 1.0
    block_bytes: int = DEFAULT_BLOCK_BYTES
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    peer_fixed_s: float = 0.0  # per Prefetch call, whatever its size
    peer_s_per_byte: float | None = None
    # Blocks held over the blocks the agents' pools and NVMe tiers can hold, 0..1
    # (RouterCore measures it): how likely a copy's block pushes one out of the store.
    store_fill: float = 0.0
    # Derived once (every route reads them): seconds to recompute one block, the unit
    # every cost is counted in; one more block pulled / one recomputed; one pull's fixed
    # part in blocks recomputed.
    recompute_s: float = field(init=False, repr=False, compare=False)
    peer_price: float = field(init=False, repr=False, compare=False)
    pull_fixed: float = field(init=False, repr=False, compare=False)
    space_price: float = field(init=False, repr=False, compare=False)  # per copied block

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.peer_gbps <= 0:
            raise ValueError("prefill_tokens_per_s and peer_gbps must be > 0")
        if self.block_bytes <= 0 or self.block_tokens <= 0:
            raise ValueError("block_bytes and block_tokens must be > 0")
        for name in ("peer_fixed_s", "peer_s_per_byte"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and v != float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not 0.0 <= self.store_fill <= 1.0:
            raise ValueError(f"store_fill must be in [0, 1], got {self.store_fill!r}")
        recompute_s = self.block_tokens / self.prefill_tokens_per_s
        if self.peer_s_per_byte is not None:
            transfer_s = self.block_bytes * self.peer_s_per_byte
        else:
            transfer_s = self.block_bytes * 8 / (self.peer_gbps * 1e9)
        object.__setattr__(self, "recompute_s", recompute_s)
        object.__setattr__(self, "peer_price", transfer_s / recompute_s)
        object.__setattr__(self, "pull_fixed", self.peer_fixed_s / recompute_s)
        # A copy's block pushes one out of the pool: demoted while the store has room,
        # dropped (recomputed when wanted) once it is full.
        fill = self.store_fill
        object.__setattr__(self, "space_price", DUPLICATE_PRICE + (1 - DUPLICATE_PRICE) * fill)

    def pull_blocks(self, n: int) -> float:
        """A pull of `n` blocks, in blocks recomputed (0 for none)."""
        return self.pull_fixed + self.peer_price * n if n > 0 else 0.0

    def min_pull(self, w_pull: float, saved_per_block: float) -> float:
        """Pulling k blocks beats recomputing them when
        w_pull (pull_fixed + peer_price k) < saved_per_block k, i.e. k > this (never when
        a pulled block costs what it saves or more)."""
        gain = saved_per_block - w_pull * self.peer_price
        return w_pull * self.pull_fixed / gain if gain > 0 else math.inf


class NodeLoad(NamedTuple):
    """A node's prompt-independent state; rebuilt whenever its in-flight count moves,
    i.e. on every route, hence a NamedTuple (cheap to build) like Score."""

    node_id: str
    in_flight: int = 0
    utilization: float = 0.0
    queued: float = 0.0  # prefill work of the in-flight requests, in blocks


class Score(NamedTuple):
    """One node's cost and its terms. A NamedTuple, not a frozen dataclass: a route
    builds up to a dozen of these and a frozen dataclass costs 4x more to construct."""

    node_id: str
    local_blocks: int
    peer_blocks: int
    peer_node_id: str
    recompute_blocks: int
    in_flight: int
    utilization: float
    cost: float
    recompute_cost: float
    peer_cost: float
    load_cost: float  # per-request and queued-work terms together
    utilization_cost: float
    queued: float
    space_cost: float  # pool space taken by duplicates (included in cost)


def load_cost(n: NodeLoad, weights: Weights) -> float:
    """The part of a node's cost that does not depend on the prompt."""
    # By index (in_flight, utilization, queued): LoadBoard costs every load it ranks.
    return weights.load * n[1] + weights.queue * n[3] + weights.utilization * n[2]


def score_nodes(
    total_blocks: int,
    local: Mapping[str, int],
    nodes: Sequence[NodeLoad],
    weights: Weights,
    pricing: Pricing,
    limit: int | None = None,
) -> list[Score]:
    """Every node in `nodes` (any order) scored, cheapest first, ties by node id; at most
    `limit` of them. `local` maps a node to the leading blocks of the prompt it holds
    (absent: none)."""
    ranked = sorted(nodes, key=lambda n: (load_cost(n, weights), n.node_id))
    return score_ranked(total_blocks, local, ranked, weights, pricing, limit)


def score_ranked(
    total_blocks: int,
    local: Mapping[str, int],
    ranked: Sequence[NodeLoad],
    weights: Weights,
    pricing: Pricing,
    limit: int | None = None,
    by_id: Mapping[str, NodeLoad] | None = None,
) -> list[Score]:
    """`score_nodes` for `ranked` already sorted by (load_cost under `weights`, node id);
    `by_id` optionally indexes the same loads by node id.

    Why this is enough: every node holding none of the prompt has the same recompute and
    peer terms (its best peer is the longest holder overall), so among those nodes cost
    order is load order. Only the prefix holders (a handful: blocks live on 1-3 nodes)
    and the first `limit` other nodes need scoring, whatever the cluster size."""
    if total_blocks < 0:
        raise ValueError("total_blocks must be >= 0")
    limit = len(ranked) if limit is None else limit
    if by_id is None:  # only holders are looked up: none without a local prefix
        by_id = {n.node_id: n for n in ranked} if local else {}
    # Holders, longest prefix first, ties by node id; each one's best peer is the longest
    # other holder: the first one, or the second for the first itself.
    # A list, not a generator into sorted(): a generator's frame costs more than the
    # 1-3 holders it yields. min(v, total) without min's call.
    held = [
        (-(v if v < total_blocks else total_blocks), k)
        for k, v in local.items()
        if v and k in by_id
    ]
    held.sort()
    best = (-held[0][0], held[0][1]) if held else (0, "")
    second = (-held[1][0], held[1][1]) if len(held) > 1 else (0, "")
    price, fixed = pricing.peer_price, pricing.pull_fixed
    w_pull, w_rc = weights.peer_fetch, weights.recompute
    min_pull = pricing.min_pull(w_pull, w_rc)  # a pull pays for more blocks than this

    # One tuple of the route's weights and prices, unpacked by _row and _others: cheaper
    # than passing them as 8 more arguments (or *args) on every call.
    args = (
        total_blocks,
        w_rc,
        w_pull * price,
        w_pull * fixed,
        pricing.space_price,
        weights.load,
        weights.queue,
        weights.utilization,
    )
    out = []
    for neg, node_id in held:
        plen, pnode = second if node_id == best[1] else best
        own = -neg
        dup = plen - own if plen > own else 0
        pb = dup if dup > min_pull else 0
        out.append(_row(by_id[node_id], own, pb, pnode if pb else "", dup, args))
    pb0 = best[0] if best[0] > min_pull else 0
    out.extend(_others(ranked, local, limit, best, pb0, args))
    out.sort(key=_ORDER)
    return out[:limit]


def _others(
    ranked: Sequence[NodeLoad],
    local: Mapping[str, int],
    limit: int,
    best: tuple[int, str],
    pb0: int,
    args: tuple[int, float, float, float, float, float, float, float],
) -> list[Score]:
    """The first `limit` nodes of `ranked` holding none of the prompt, scored: `_row`
    unrolled, since their prompt terms are the same (this runs on every route)."""
    total, w_recompute, w_peer_priced, w_pull_fixed, w_space, w_load, w_queue, w_util = args
    pnode0 = best[1] if pb0 else ""
    rc = w_recompute * (total - pb0)
    pc = w_pull_fixed + w_peer_priced * pb0 if pb0 else 0.0
    sc = w_space * best[0]
    base = rc + pc + sc  # summed in _row's order: the same float
    rows: list[Score] = []
    if limit <= 0:
        return rows
    skip = local.get if local else None
    # NodeLoad fields by index (node_id, in_flight, utilization, queued): a tuple
    # subscript is cheaper than a NamedTuple attribute, and this runs on every route.
    for n in ranked:
        if skip is not None and skip(n[0]):
            continue
        lc = w_load * n[1] + w_queue * n[3]
        uc = w_util * n[2]
        row = (n[0], 0, pb0, pnode0, total - pb0, n[1], n[2], base + lc + uc, rc, pc, lc, uc)
        rows.append(_new(Score, (*row, n[3], sc)))
        if len(rows) >= limit:
            break
    return rows


def _row(
    n: NodeLoad,
    own: int,
    peer_blocks: int,
    peer: str,
    dup: int,
    args: tuple[int, float, float, float, float, float, float, float],
) -> Score:
    total, w_recompute, w_peer_priced, w_pull_fixed, w_space, w_load, w_queue, w_util = args
    rc = w_recompute * (total - own - peer_blocks)
    pc = w_pull_fixed + w_peer_priced * peer_blocks if peer_blocks else 0.0
    sc = w_space * dup
    lc = w_load * n[1] + w_queue * n[3]  # NodeLoad by index, as in _others
    uc = w_util * n[2]
    return _new(
        Score,
        (
            n[0],
            own,
            peer_blocks,
            peer,
            total - own - peer_blocks,
            n[1],
            n[2],
            rc + pc + sc + lc + uc,
            rc,
            pc,
            lc,
            uc,
            n[3],
            sc,
        ),
    )


_ORDER = itemgetter(7, 0)  # (cost, node_id)
_new = tuple.__new__  # builds a Score without the Python-level NamedTuple __new__ frame
