"""Engine routing cost: a pure function, like router/scoring.py, over the engines' own
caches (router/engine_index.py), the agents' index and each engine's load. Costs are in
units of one block recomputed; per candidate engine e on node n:

    cost(e) = 0                              x blocks in e's own cache (free)
            + w_recompute x local_price      x further blocks n's agent holds
            + w_peer x (pull_fixed + peer_price x k)
              + w_recompute x local_price x k  for the k further blocks a peer agent holds
            + w_recompute                    x the blocks left to recompute
            + w_load x requests in flight on e + w_queue x prefill work queued on e

so a prefix in the engine's cache beats one on its node's agent, which beats one on a
peer, which beats recompute. `local_price` is a load from the node's agent (shared
memory) against a recompute; `pull_fixed` and `peer_price` are router/scoring.py's
Pricing, the agents' measured pull cost (kvstore/pullcost.py: a fixed part per pull plus
a part per block), as for nodes. A peer block pays the local price on top (it crosses the
network, then is loaded from the agent). The pull is made only when it is cheaper than
recomputing the same k blocks; else they are recomputed. Without the fixed part a pull
of 2 blocks looked nearly free, and the gateway sent a conversation's next turn away from
the engine holding it to wait for one (bench_gateway_vllm: its 6 hinted requests, pulls
of 2-4 blocks, took 2.2-4.5 s to the first token against 1.96 s for the median other).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.scoring import Pricing, Weights

DEFAULT_LOCAL_PRICE = 0.05  # a block loaded from the node's agent vs. recomputed


@dataclass(frozen=True, slots=True)
class EngineLoad:
    engine_id: str
    node_id: str
    # requests in flight and their prefill work queued (in blocks) where the engine
    # computes: on its device when it shares one with other engines (EngineRecord.device)
    in_flight: int = 0
    queued: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineScore:
    """One engine's cost and every term of it (the gateway prints these)."""

    engine_id: str
    node_id: str
    engine_blocks: int  # leading blocks in the engine's own cache
    agent_blocks: int  # the next ones, on its node's agent
    peer_blocks: int  # the next ones, on a peer agent
    peer_node_id: str
    recompute_blocks: int
    in_flight: int
    queued: float
    cost: float
    agent_cost: float
    peer_cost: float
    recompute_cost: float
    load_cost: float
    work: float  # prefill it brings, in blocks recomputed: recompute plus the pull

    def terms(self) -> dict[str, float | int | str]:
        return {k: getattr(self, k) for k in self.__slots__}


def score_engines(
    total_blocks: int,
    engine_prefix: Mapping[str, int],
    node_prefix: Mapping[str, int],
    engines: Sequence[EngineLoad],
    weights: Weights,
    pricing: Pricing,
    local_price: float = DEFAULT_LOCAL_PRICE,
) -> list[EngineScore]:
    """Every engine scored, cheapest first, ties by engine id. `engine_prefix`: leading
    blocks of the prompt in each engine's cache; `node_prefix`: on each node's agent."""
    if total_blocks < 0:
        raise ValueError("total_blocks must be >= 0")
    held = sorted(((-min(v, total_blocks), k) for k, v in node_prefix.items() if v))
    # a pulled block is still loaded from the agent: it saves a recompute less that load
    min_pull = pricing.min_pull(weights.peer_fetch, weights.recompute * (1.0 - local_price))
    out = []
    for e in engines:
        own = min(engine_prefix.get(e.engine_id, 0), total_blocks)
        agent = max(0, min(node_prefix.get(e.node_id, 0), total_blocks) - own)
        covered = own + agent
        peer_len, peer_node = next(((-n, k) for n, k in held if k != e.node_id), (0, ""))
        peer = max(0, peer_len - covered)
        peer = peer if peer > min_pull else 0
        rec = total_blocks - covered - peer
        pull = pricing.pull_blocks(peer)
        ac = weights.recompute * local_price * agent
        pc = weights.peer_fetch * pull + weights.recompute * local_price * peer
        rc = weights.recompute * rec
        lc = weights.load * e.in_flight + weights.queue * e.queued
        out.append(
            EngineScore(
                e.engine_id,
                e.node_id,
                own,
                agent,
                peer,
                peer_node if peer else "",
                rec,
                e.in_flight,
                e.queued,
                ac + pc + rc + lc,
                ac,
                pc,
                rc,
                lc,
                rec + pull,
            )
        )
    out.sort(key=lambda s: (s.cost, s.engine_id))
    return out
