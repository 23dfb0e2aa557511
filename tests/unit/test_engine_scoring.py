"""The engine cost function (router/engine_scoring.py): a peer pull is priced with the
agents' measured fixed cost as well as per block, and made only when it beats
recomputing the same blocks; the work an engine is charged includes the pull."""

from __future__ import annotations

import pytest

from router.engine_scoring import EngineLoad, score_engines
from router.scoring import Pricing, Weights

# The dev cluster's tiny model: 128 KiB blocks of 32 tokens, recompute priced at the
# router's default 8000 tokens/s (4 ms a block); a pull measured at 50 ms fixed.
MEASURED = Pricing(block_bytes=128 << 10, block_tokens=32, peer_fixed_s=0.05, peer_s_per_byte=0.0)
UNMEASURED = Pricing(block_bytes=128 << 10, block_tokens=32)


def _next_turn(pricing: Pricing, total: int = 22, held: int = 20, shared: int = 18):
    """A conversation's next turn: e0 (node n0, busy with one request) holds its previous
    turn (`held` blocks, also on n0's agent); idle e1 (node n1) holds the tenant's shared
    system prompt only (`shared` blocks)."""
    loads = [EngineLoad("e0", "n0", in_flight=1, queued=2.0), EngineLoad("e1", "n1")]
    scores = score_engines(
        total, {"e0": held, "e1": shared}, {"n0": held, "n1": shared}, loads, Weights(), pricing
    )
    return {s.engine_id: s for s in scores}, scores[0].engine_id


def test_a_small_pull_whose_fixed_cost_exceeds_its_recompute_is_not_made():
    by_id, _ = _next_turn(MEASURED)
    e1 = by_id["e1"]
    # 2 blocks pulled would cost 50 ms fixed (12.5 recomputes) for 8 ms of recompute:
    # e1 recomputes them, so the gateway sends no peer hint and nobody waits for a pull.
    assert (e1.peer_blocks, e1.peer_node_id, e1.recompute_blocks) == (0, "", 4)
    assert e1.peer_cost == 0 and e1.cost == pytest.approx(4.0)
    assert e1.work == pytest.approx(4.0)


def test_a_pull_that_pays_is_priced_with_its_fixed_part_and_charged_as_work():
    # 60 blocks past what e1 holds: 12.5 + 60 x (peer + local price) < 60 recomputes.
    by_id, chosen = _next_turn(MEASURED, total=82, held=80)
    e1 = by_id["e1"]
    assert (e1.peer_blocks, e1.peer_node_id, e1.recompute_blocks) == (62, "n0", 2)
    pull = MEASURED.pull_fixed + MEASURED.peer_price * 62
    assert e1.peer_cost == pytest.approx(pull + 0.05 * 62)
    assert e1.work == pytest.approx(2 + pull)  # what the engine is held with
    assert MEASURED.pull_fixed == pytest.approx(12.5)
    # e0 holds it all: one request in flight there (4 + 2 queued) is cheaper than the pull.
    assert chosen == "e0" and by_id["e0"].cost == pytest.approx(2 + 4 + 2)


def test_before_any_pull_is_measured_a_pull_has_no_fixed_part():
    # The agents publish no fit before their first pull: the configured bandwidth alone
    # prices it (router/scoring.py), so the first pulls are made and then measured.
    by_id, _ = _next_turn(UNMEASURED)
    assert by_id["e1"].peer_blocks == 2
    assert by_id["e1"].work == pytest.approx(2 + 2 * UNMEASURED.peer_price)


def test_a_pulled_block_dearer_than_a_recompute_is_never_pulled():
    slow = Pricing(block_bytes=128 << 10, block_tokens=32, peer_s_per_byte=1e-6)
    by_id, _ = _next_turn(slow, total=82, held=80)
    assert slow.peer_price > 1 and by_id["e1"].peer_blocks == 0
