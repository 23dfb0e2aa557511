"""Routing cost: a pure function over a snapshot (prefix lengths per node, load per node),
weights from RouterConfig with a per-request override. Lower cost wins; ties go to the
smaller node id so every router replica with the same snapshot picks the same node.

    cost(n) = w_recompute x blocks n must recompute
            + w_peer x peer_price x blocks n can fetch from a peer
            + w_load x requests in flight on n (as assigned by this router)
            + w_util x n's pool utilization (0..1, reported by the agent)

Peer blocks are the blocks past n's own prefix that the node with the longest prefix
(other than n) holds. They count only when moving one is cheaper than recomputing it:
peer_price = transfer time / recompute time of one block, from block bytes, peer
bandwidth and prefill speed, and it must be < 1; otherwise those blocks are recomputed.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import NamedTuple

# Used when the router does not know a namespace's layout (no namespaces/ record in
# etcd): Llama-3-8B in fp16 at 16 tokens per block, the brief's reference.
DEFAULT_BLOCK_BYTES = 2 << 20
DEFAULT_BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Weights:
    recompute: float = 1.0
    peer_fetch: float = 0.3
    load: float = 4.0
    utilization: float = 2.0

    def __post_init__(self) -> None:
        for name in ("recompute", "peer_fetch", "load", "utilization"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf"):
                raise ValueError(f"weight {name} must be a finite number >= 0, got {v!r}")

    @classmethod
    def from_config(cls, cfg) -> "Weights":
        return cls(cfg.weight_recompute, cfg.weight_peer_fetch, cfg.weight_load,
                   cfg.weight_utilization)

    def override(self, recompute: float = 0.0, peer_fetch: float = 0.0, load: float = 0.0,
                 utilization: float = 0.0) -> "Weights":
        """Per-request override: fields left at 0 keep this object's value (proto3 cannot
        tell 0 from unset, so a weight cannot be zeroed per request)."""
        given = {k: v for k, v in (("recompute", recompute), ("peer_fetch", peer_fetch),
                                   ("load", load), ("utilization", utilization)) if v}
        return replace(self, **given) if given else self


@dataclass(frozen=True, slots=True)
class Pricing:
    prefill_tokens_per_s: float = 8000.0
    peer_gbps: float = 1.0
    block_bytes: int = DEFAULT_BLOCK_BYTES
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.peer_gbps <= 0:
            raise ValueError("prefill_tokens_per_s and peer_gbps must be > 0")
        if self.block_bytes <= 0 or self.block_tokens <= 0:
            raise ValueError("block_bytes and block_tokens must be > 0")

    @property
    def peer_price(self) -> float:
        """Time to fetch one block from a peer / time to recompute it."""
        transfer_s = self.block_bytes * 8 / (self.peer_gbps * 1e9)
        recompute_s = self.block_tokens / self.prefill_tokens_per_s
        return transfer_s / recompute_s


class NodeLoad(NamedTuple):
    """A node's prompt-independent state; rebuilt whenever its in-flight count moves,
    i.e. on every route, hence a NamedTuple (cheap to build) like Score."""

    node_id: str
    in_flight: int = 0
    utilization: float = 0.0


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
    load_cost: float
    utilization_cost: float


def load_cost(n: NodeLoad, weights: Weights) -> float:
    """The part of a node's cost that does not depend on the prompt."""
    return weights.load * n.in_flight + weights.utilization * n.utilization


def score_nodes(total_blocks: int, local: Mapping[str, int], nodes: Sequence[NodeLoad],
                weights: Weights, pricing: Pricing, limit: int | None = None) -> list[Score]:
    """Every node in `nodes` (any order) scored, cheapest first, ties by node id; at most
    `limit` of them. `local` maps a node to the leading blocks of the prompt it holds
    (absent: none)."""
    ranked = sorted(nodes, key=lambda n: (load_cost(n, weights), n.node_id))
    return score_ranked(total_blocks, local, ranked, weights, pricing, limit)


def score_ranked(total_blocks: int, local: Mapping[str, int], ranked: Sequence[NodeLoad],
                 weights: Weights, pricing: Pricing, limit: int | None = None,
                 by_id: Mapping[str, NodeLoad] | None = None) -> list[Score]:
    """`score_nodes` for `ranked` already sorted by (load_cost under `weights`, node id);
    `by_id` optionally indexes the same loads by node id.

    Why this is enough: every node holding none of the prompt has the same recompute and
    peer terms (its best peer is the longest holder overall), so among those nodes cost
    order is load order. Only the prefix holders (a handful: blocks live on 1-3 nodes)
    and the first `limit` other nodes need scoring, whatever the cluster size."""
    if total_blocks < 0:
        raise ValueError("total_blocks must be >= 0")
    limit = len(ranked) if limit is None else limit
    if local and by_id is None:
        by_id = {n.node_id: n for n in ranked}
    # Holders, longest prefix first, ties by node id; each one's best peer is the longest
    # other holder: the first one, or the second for the first itself.
    held = sorted((-min(v, total_blocks), k) for k, v in local.items()
                  if v and k in by_id) if local else []
    best = (-held[0][0], held[0][1]) if held else (0, "")
    second = (-held[1][0], held[1][1]) if len(held) > 1 else (0, "")
    price = pricing.peer_price
    peer_ok = price < 1.0
    args = (total_blocks, weights.recompute, weights.peer_fetch * price, weights.load,
            weights.utilization)
    out = []
    for neg, node_id in held:
        plen, pnode = second if node_id == best[1] else best
        own = -neg
        pb = plen - own if peer_ok and plen > own else 0
        out.append(_row(by_id[node_id], own, pb, pnode if pb else "", *args))
    pb0 = best[0] if peer_ok else 0
    pnode0 = best[1] if pb0 else ""
    others = 0
    for n in ranked:
        if others >= limit:
            break
        if not local or not local.get(n.node_id):
            out.append(_row(n, 0, pb0, pnode0, *args))
            others += 1
    out.sort(key=_ORDER)
    return out[:limit]


def _row(n: NodeLoad, own: int, peer_blocks: int, peer: str, total: int, w_recompute: float,
         w_peer_priced: float, w_load: float, w_util: float) -> Score:
    rc = w_recompute * (total - own - peer_blocks)
    pc = w_peer_priced * peer_blocks
    lc = w_load * n.in_flight
    uc = w_util * n.utilization
    return _new(Score, (n.node_id, own, peer_blocks, peer, total - own - peer_blocks,
                        n.in_flight, n.utilization, rc + pc + lc + uc, rc, pc, lc, uc))


_ORDER = itemgetter(7, 0)  # (cost, node_id)
_new = tuple.__new__  # builds a Score without the Python-level NamedTuple __new__ frame
