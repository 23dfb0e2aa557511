"""Peer pulls priced by measurement (kvstore/pullcost.py, router/scoring.py): the fit the
agents publish, the router's use of it, and the decisions it leads to."""

from __future__ import annotations

import json

import pytest

from kvstore.coord.etcd import NodeRecord
from kvstore.hashing import hash_chain, pack_ids
from kvstore.pullcost import PullCostEstimator
from router.routing import RouterCore
from router.scoring import (
    DUPLICATE_PRICE,
    NodeLoad,
    Pricing,
    Weights,
    score_nodes,
    score_ranked,
)

NS = bytes(range(16))
BLOCK = 8192  # the replay's tiny-Llama block
MIB = 1 << 20
# What the reference replay measured on this host (2026-12-01): a Prefetch paid ~36 ms
# whatever its size plus ~0.38 ms per 8 KiB block; a block recomputed ~1 ms.
FIXED_S, PER_BLOCK_S = 0.036, 0.00038
MEASURED = Pricing(16_000, 1.0, BLOCK, 16, FIXED_S, PER_BLOCK_S / BLOCK)
W = Weights(recompute=1, peer_fetch=1, load=0, utilization=0, queue=1)


def by_node(scores):
    return {s.node_id: s for s in scores}


# ------------------------------------------------------------------ the estimator
def test_estimator_recovers_fixed_and_per_byte_cost():
    est = PullCostEstimator()
    assert est.estimate() is None
    for n in [8, 35, 136, 20, 60, 250] * 10:
        est.add(n * BLOCK, FIXED_S + n * PER_BLOCK_S)
    fit = est.estimate()
    assert fit is not None and fit.samples == 60
    assert fit.fixed_s == pytest.approx(FIXED_S, rel=1e-6)
    assert fit.s_per_byte * BLOCK == pytest.approx(PER_BLOCK_S, rel=1e-6)
    assert fit.seconds(100 * BLOCK) == pytest.approx(FIXED_S + 100 * PER_BLOCK_S)


def test_estimator_follows_recent_pulls_and_skips_empty_ones():
    est = PullCostEstimator()
    for n in (10, 100) * 20:
        est.add(n * BLOCK, 0.001 + n * 0.0001)
    for n in (10, 100) * 60:  # the host got busy: every pull pays 30 ms more
        est.add(n * BLOCK, 0.031 + n * 0.0001)
    est.add(0, 99.0)  # moved nothing: not a pull
    est.add(10 * BLOCK, float("nan"))
    fit = est.estimate()
    assert fit is not None and fit.samples == 160
    assert fit.fixed_s == pytest.approx(0.031, rel=0.05)


def test_estimator_with_one_pull_size_charges_it_as_fixed_cost():
    """An undetermined slope must not price bigger pulls out: after one slow pull of 20
    blocks, a pull of 500 is priced at that same time (and then measured)."""
    est = PullCostEstimator()
    est.add(20 * BLOCK, 0.772)
    fit = est.estimate()
    assert fit is not None and (fit.fixed_s, fit.s_per_byte) == (pytest.approx(0.772), 0.0)
    for _ in range(5):
        est.add(20 * BLOCK, 0.772)
    fit = est.estimate()
    assert (
        fit is not None and fit.s_per_byte == 0 and fit.seconds(500 * BLOCK) == pytest.approx(0.772)
    )
    est.add(500 * BLOCK, 0.772 + 480 * 0.001)  # a big one measured: now the slope shows
    fit = est.estimate()
    assert fit is not None and fit.s_per_byte * BLOCK == pytest.approx(0.001, rel=0.01)


def test_node_record_carries_the_fit_and_old_records_still_decode():
    rec = NodeRecord("a", "h:1", pull_fixed_ms=36.0, pull_ms_per_mib=48.6, pull_samples=12)
    assert NodeRecord.from_json(rec.to_json()) == rec
    old = json.loads(rec.to_json())
    for k in ("pull_fixed_ms", "pull_ms_per_mib", "pull_samples"):
        del old[k]
    assert NodeRecord.from_json(json.dumps(old).encode()).pull_samples == 0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="pull_fixed_ms"):
            NodeRecord("a", "h:1", pull_fixed_ms=bad)


# -------------------------------------------------------------------- the decision
def test_pricing_in_blocks_recomputed():
    assert MEASURED.recompute_s == pytest.approx(0.001)
    assert MEASURED.pull_fixed == pytest.approx(36.0)
    assert MEASURED.peer_price == pytest.approx(0.38)
    assert MEASURED.pull_blocks(0) == 0
    assert MEASURED.pull_blocks(100) == pytest.approx(36 + 38)
    with pytest.raises(ValueError, match="peer_fixed_s"):
        Pricing(peer_fixed_s=-1)


def test_a_pull_is_made_only_when_it_takes_less_than_the_recompute_it_saves():
    """36 ms + 0.38 ms per block against 1 ms per block recomputed: a pull pays from
    36 / 0.62 = 58 blocks on. A bandwidth-only price (the old one) pulled any size."""
    nodes = [NodeLoad("a", queued=1000.0), NodeLoad("b")]  # a holds, and is swamped
    small = by_node(score_nodes(60, {"a": 30}, nodes, W, MEASURED))["b"]
    assert small.peer_blocks == 0 and small.recompute_blocks == 60
    big = by_node(score_nodes(260, {"a": 200}, nodes, W, MEASURED))["b"]
    assert big.peer_blocks == 200 and big.peer_node_id == "a"
    assert big.peer_cost == pytest.approx(36 + 0.38 * 200)
    at, above = 58, 59  # 36 + 0.38 k < k from k > 58.06
    assert by_node(score_nodes(at, {"a": at}, nodes, W, MEASURED))["b"].peer_blocks == 0
    assert by_node(score_nodes(above, {"a": above}, nodes, W, MEASURED))["b"].peer_blocks == above
    cheap = Pricing(16_000, 100.0, BLOCK, 16)  # nothing measured: bandwidth alone
    assert by_node(score_nodes(60, {"a": 30}, nodes, W, cheap))["b"].peer_blocks == 30


def test_the_holder_is_left_only_for_a_queue_longer_than_the_pull_and_its_copies():
    """b pulls a's 200 blocks (36 + 76 ms) and stores 200 copies (0.15 each): b wins
    once a's queue exceeds 112 + 30 = 142 blocks of prefill."""
    pull = MEASURED.pull_blocks(200) + DUPLICATE_PRICE * 200
    for queued, chosen in ((pull - 1, "a"), (pull + 1, "b")):
        nodes = [NodeLoad("a", queued=queued), NodeLoad("b")]
        top = score_nodes(210, {"a": 200}, nodes, W, MEASURED)[0]
        assert top.node_id == chosen, (queued, top)
        assert top.cost == pytest.approx(
            top.recompute_cost + top.peer_cost + top.space_cost + top.load_cost
        )


def test_ranked_scoring_equals_full_scoring_with_a_fixed_pull_cost():
    nodes = [NodeLoad(f"n{i}", in_flight=i % 3, queued=float(i * 17 % 90)) for i in range(12)]
    w = Weights(recompute=1, peer_fetch=1, load=2, utilization=0, queue=1)
    ranked = sorted(nodes, key=lambda n: (2 * n.in_flight + n.queued, n.node_id))
    for local in ({"n3": 50}, {"n1": 120, "n7": 20}, {"n2": 300, "n5": 299}):
        full = score_nodes(320, local, nodes, w, MEASURED)
        assert score_ranked(320, local, ranked, w, MEASURED, 4) == full[:4]


# -------------------------------------------------------------------- the router
def test_router_prices_with_the_agents_measured_pulls():
    core = RouterCore(Weights(), prefill_tokens_per_s=16_000, peer_gbps=1.0)
    for n in ("a", "b", "c"):
        core.upsert_node(NodeRecord(n, f"h:{ord(n)}"))
        core.mark_synced(n)
    core.set_namespace_layout(NS, BLOCK, 16)
    assert core.pull_cost is None and core.pricing(NS).pull_fixed == 0
    # a and b measured pulls (c has not pulled yet and does not count).
    core.upsert_node(NodeRecord("a", "h:97", pull_fixed_ms=30, pull_ms_per_mib=40, pull_samples=9))
    core.upsert_node(NodeRecord("b", "h:98", pull_fixed_ms=42, pull_ms_per_mib=56, pull_samples=3))
    p = core.pricing(NS)
    assert p.peer_fixed_s == pytest.approx(0.036)
    assert p.peer_price * p.recompute_s == pytest.approx(0.048 * BLOCK / MIB)
    ids = hash_chain(bytes(16), list(range(16 * 300)), 16)
    core.index.store("a", ids[:30])
    for i in range(3):  # a queues up; a 30-block pull never pays, so nobody pulls
        d = core.route(NS, pack_ids(ids), request_id=f"r{i}")
        assert d.chosen.peer_blocks == 0
        assert d.pricing == p
    for i in range(3):
        core.release(f"r{i}")
    core.index.store("a", ids[:290])
    core.hold("busy", "a", 500.0)  # a's queue: 500 blocks, against a pull of ~145
    d = core.route(NS, pack_ids(ids), request_id="big")
    assert d.chosen.node_id != "a" and d.chosen.peer_blocks == 290
    # The pull occupies the chosen node: its queued work counts the pull's time.
    assert core.inflight.work(d.chosen.node_id) == pytest.approx(
        d.chosen.recompute_blocks + p.pull_blocks(290)
    )
    core.remove_node("a")
    core.remove_node("b")
    assert core.pull_cost is None and core.pricing(NS).pull_fixed == 0


# ------------------------------------------------------------ a copy's pool space
def test_a_copy_costs_a_demotion_while_the_store_has_room_and_a_recompute_once_full():
    assert Pricing(store_fill=0.0).space_price == pytest.approx(DUPLICATE_PRICE)
    assert Pricing(store_fill=1.0).space_price == pytest.approx(1.0)
    half = Pricing(store_fill=0.5).space_price
    assert DUPLICATE_PRICE < half < 1.0
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="store_fill"):
            Pricing(store_fill=bad)


def test_the_router_measures_the_store_fill_from_its_index_and_the_agents_capacity():
    core = RouterCore(Weights(), prefill_tokens_per_s=16_000)
    cap = 100 * BLOCK  # pool and NVMe of each agent: 100 blocks in all
    for n in ("a", "b"):
        core.upsert_node(
            NodeRecord(
                n, f"h:{ord(n)}", hbm_capacity_bytes=cap // 4, nvme_capacity_bytes=cap - cap // 4
            )
        )
        core.mark_synced(n)
    core.set_namespace_layout(NS, BLOCK, 16)
    assert core.pricing(NS).store_fill == 0.0
    ids = hash_chain(bytes(16), list(range(16 * 150)), 16)
    core.index.store("a", ids[:100])
    core.index.store("b", ids[:50])
    core.upsert_node(
        NodeRecord(
            "a", "h:97", hbm_capacity_bytes=cap // 4, nvme_capacity_bytes=cap - cap // 4, blocks=100
        )
    )
    assert core.pricing(NS).store_fill == pytest.approx(150 / 200)
    # A layout of twice the block size counts the same blocks as twice the bytes.
    core.set_namespace_layout(b"\x01" * 16, 2 * BLOCK, 16)
    assert core.pricing(b"\x01" * 16).store_fill == 1.0
    core.remove_node("b")  # b's blocks and capacity go: a alone, full
    assert core.pricing(NS).store_fill == 1.0


def test_a_full_store_keeps_a_prefix_on_its_holder_where_an_empty_one_copies_it():
    """a holds 100 blocks of a 110-block prompt and has 150 blocks queued. With room in
    the store, b recomputing beside it wins (110 + 15 of space against 10 + 150); once the
    store is full, each copy drops a block and b's cost becomes 110 + 100: a keeps it."""
    nodes = [NodeLoad("a", queued=150.0), NodeLoad("b")]
    w = Weights(recompute=1, peer_fetch=1, load=0, utilization=0, queue=1)
    for fill, chosen in ((0.0, "b"), (1.0, "a")):
        pricing = Pricing(16_000, 1.0, BLOCK, 16, 1.0, 0.0, store_fill=fill)  # pulls cost 1 s
        top = score_nodes(110, {"a": 100}, nodes, w, pricing)[0]
        assert top.node_id == chosen, (fill, top)
        if chosen == "b":
            assert top.space_cost == pytest.approx(DUPLICATE_PRICE * 100)


def test_a_router_whose_agents_stores_are_full_leaves_a_prefix_with_its_holder():
    """The decision end to end: a holds 100 blocks of a 110-block prompt and a queue of
    150 blocks; pulls cost 1 s (never pay). With the stores full, b would recompute 110
    blocks and push 100 others out of the store: a keeps the request. (At the flat 0.15 a
    copy, b took it for 110 + 15 against a's 164.)"""
    core = RouterCore(Weights(), prefill_tokens_per_s=16_000)
    cap = 100 * BLOCK

    def record(n: str) -> NodeRecord:
        return NodeRecord(
            n,
            f"h:{ord(n)}",
            hbm_capacity_bytes=cap // 4,
            nvme_capacity_bytes=cap - cap // 4,
            pull_fixed_ms=1000,
            pull_samples=5,
        )

    for n in ("a", "b"):
        core.upsert_node(record(n))
        core.mark_synced(n)
    core.set_namespace_layout(NS, BLOCK, 16)
    ids = hash_chain(bytes(16), list(range(16 * 110)), 16)
    other = hash_chain(b"\x02" * 16, list(range(16 * 100)), 16)
    core.index.store("a", ids[:100])
    core.index.store("b", other)  # b is full of other prefixes
    core.upsert_node(record("a"))  # the next heartbeat: the router re-measures
    assert core.pricing(NS).store_fill == 1.0
    core.hold("busy", "a", 150.0)
    d = core.route(NS, pack_ids(ids), request_id="r")
    assert d.chosen.node_id == "a" and d.chosen.local_blocks == 100
    b = by_node(d.scores)["b"]
    assert b.space_cost == pytest.approx(100.0) and b.peer_blocks == 0
