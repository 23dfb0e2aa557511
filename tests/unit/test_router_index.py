"""Pure tests of the router's index, cost function and in-flight bookkeeping."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from kvstore.coord.etcd import NodeRecord
from kvstore import errors
from kvstore.config import RouterConfig
from kvstore.events import Tier
from kvstore.hashing import NATIVE, hash_chain, hash_chain_packed, pack_ids, split_ids
from router.index import BlockIndex
from router.routing import InFlight, RouterCore
from router.scoring import NodeLoad, Pricing, Weights, score_nodes, score_ranked

ROOT = bytes(16)
NS = bytes(range(16))


def chain(n: int, seed: int = 0) -> list[bytes]:
    return hash_chain(ROOT, [seed * 1000 + i for i in range(n * 4)], 4)


# --------------------------------------------------------------------------- index
def test_store_remove_and_counts():
    idx = BlockIndex()
    ids = chain(10)
    assert idx.store("a", ids) == 10
    assert idx.store("a", ids[:3]) == 0  # idempotent
    assert idx.store("b", ids[:4], Tier.NVME) == 4
    assert len(idx) == 10 and idx.entries == 14
    assert idx.holders(ids[0]) == {"a": Tier.HBM, "b": Tier.NVME}
    assert idx.node_blocks("b") == (4, 4)
    assert idx.remove("a", ids[5:]) == 5
    assert idx.remove("a", ids[5:]) == 0
    assert idx.node_blocks("a") == (5, 0)
    assert idx.holders(ids[7]) == {}
    assert len(idx) == 5  # blocks nobody holds leave the dict


def test_store_batch_mixing_new_repeated_and_indexed_ids():
    """One STORED batch with ids no node holds, ids repeated within the batch, ids this
    node holds and ids only another node holds: counts and masks as if applied one by one."""
    idx = BlockIndex()
    ids = chain(12)
    idx.store("a", ids[:4])
    idx.store("b", ids[2:6], Tier.NVME)
    batch = ids[8:] + ids[:3] + ids[8:10] + ids[4:8]  # b holds 2..5; 8 and 9 twice
    assert idx.store("b", batch, Tier.NVME) == 8  # 0, 1, 6, 7 (a's or nobody's), 8..11
    assert idx.node_blocks("b") == (12, 12)
    assert idx.node_blocks("a") == (4, 0)
    assert idx.holders(ids[0]) == {"a": Tier.HBM, "b": Tier.NVME}
    assert idx.holders(ids[11]) == {"b": Tier.NVME}
    assert idx.store("a", ids[3:9], Tier.HBM) == 5
    assert idx.node_blocks("a") == (9, 0)
    assert len(idx) == 12 and idx.entries == 21
    assert idx.store("a", []) == 0


def test_tier_changes_track_nvme_counts():
    idx = BlockIndex()
    ids = chain(6)
    idx.store("a", ids)
    idx.set_tier("a", ids[3:], Tier.NVME)
    assert idx.node_blocks("a") == (6, 3)
    assert idx.holders(ids[4]) == {"a": Tier.NVME}
    idx.set_tier("a", ids[3:], Tier.NVME)  # no double counting
    assert idx.node_blocks("a") == (6, 3)
    idx.store("a", ids[4:5], Tier.HBM)  # promoted by a STORED event
    assert idx.node_blocks("a") == (6, 2)
    idx.set_tier("zzz", ids, Tier.NVME)  # unknown node: ignored
    idx.set_tier("a", chain(2, seed=9), Tier.NVME)  # blocks it does not hold: ignored
    assert idx.node_blocks("a") == (6, 2)


def test_prefix_lengths_finds_every_drop_point():
    idx = BlockIndex()
    ids = chain(100)
    idx.store("a", ids[:100])
    idx.store("b", ids[:37])
    idx.store("c", ids[:1])
    idx.store("d", chain(50, seed=3))  # another prompt entirely
    assert idx.prefix_lengths(pack_ids(ids)) == {"a": 100, "b": 37, "c": 1}
    longer = ids + chain(20, seed=5)
    assert idx.prefix_lengths(pack_ids(longer)) == {"a": 100, "b": 37, "c": 1}
    assert idx.prefix_lengths(pack_ids(ids[:20])) == {"a": 20, "b": 20, "c": 1}
    assert idx.prefix_lengths(pack_ids(chain(5, seed=7))) == {}
    assert idx.prefix_lengths(b"") == {}


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 2048])
def test_prefix_lengths_matches_a_linear_scan(n):
    idx = BlockIndex()
    ids = chain(n)
    cuts = {f"n{k}": (k * 7919) % (n + 1) for k in range(12)}
    for node, cut in cuts.items():
        idx.store(node, ids[:cut])
    expect = {node: cut for node, cut in cuts.items() if cut}
    assert idx.prefix_lengths(pack_ids(ids)) == expect


def test_drop_node_clears_entries_and_reuses_the_slot():
    idx = BlockIndex()
    ids = chain(8)
    idx.store("a", ids)
    idx.store("b", ids[:4])
    assert idx.drop_node("a") == 8
    assert idx.nodes == ["b"]
    assert idx.prefix_lengths(pack_ids(ids)) == {"b": 4}
    assert len(idx) == 4
    idx.store("c", ids[:2])  # reuses a's slot: must not inherit its bits
    assert idx.prefix_lengths(pack_ids(ids)) == {"b": 4, "c": 2}
    assert idx.drop_node("missing") == 0


def test_clear_node_keeps_membership():
    idx = BlockIndex()
    ids = chain(5)
    idx.store("a", ids)
    idx.store("b", ids)
    assert idx.clear_node("a") == 5
    assert idx.nodes == ["a", "b"]
    assert idx.node_blocks("a") == (0, 0)
    assert idx.prefix_lengths(pack_ids(ids)) == {"b": 5}


def test_masks_are_interned():
    idx = BlockIndex()
    for seed in range(50):
        ids = chain(20, seed)
        idx.store("a", ids)
        idx.store("b", ids)
    assert idx.distinct_masks <= 3
    # The memory claim itself: the C table holds 20 bytes a slot at 35-70% load.
    if NATIVE:
        assert idx.nbytes <= 60 * len(idx)


@pytest.mark.skipif(not NATIVE, reason="kvstore._native is not built")
def test_index_memory_per_block():
    """What the index holds per block, measured by tracemalloc: at most 60 bytes (20-byte
    slots at >= 35% load) where the dict of bytes keys it replaced held ~100."""
    packed = hash_chain_packed(ROOT, list(range(50_000 * 4)), 4)
    gc.collect()
    tracemalloc.start()
    try:
        idx = BlockIndex()
        # Ids split as the events arrive: what the index keeps of them counts.
        idx.store("a", split_ids(packed))
        idx.store("b", split_ids(packed[: len(packed) // 2]), Tier.NVME)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(idx) == 50_000 and idx.entries == 75_000
    assert used <= 60 * len(idx)


def test_malformed_batches_are_value_errors():
    """What the follower resyncs on: packed ids that are not whole 16-byte ids, or listed
    ids of another length, change nothing."""
    idx = BlockIndex()
    ids = chain(4)
    idx.store("a", ids)
    for bad in (pack_ids(ids)[:-1], [ids[0], b"short"]):
        with pytest.raises(ValueError):
            idx.store("a", bad)
        with pytest.raises(ValueError):
            idx.remove("a", bad)
        with pytest.raises(ValueError):
            idx.set_tier("a", bad, Tier.NVME)
    assert idx.node_blocks("a") == (4, 0) and len(idx) == 4
    assert idx.prefix_lengths(pack_ids(ids) + b"xyz") == {"a": 4}  # a ragged tail is ignored


# ------------------------------------------------------------------------- scoring
def test_peer_price():
    slow = Pricing(prefill_tokens_per_s=8000, peer_gbps=1, block_bytes=2 << 20, block_tokens=16)
    assert slow.peer_price == pytest.approx((2 << 20) * 8 / 1e9 / (16 / 8000))
    assert slow.peer_price > 1
    fast = Pricing(prefill_tokens_per_s=8000, peer_gbps=100, block_bytes=2 << 20, block_tokens=16)
    assert fast.peer_price < 1
    with pytest.raises(ValueError):
        Pricing(peer_gbps=0)


def test_scoring_prefers_the_holder_then_load():
    w = Weights(recompute=1, peer_fetch=0.3, load=4, utilization=2)
    nodes = [NodeLoad("a"), NodeLoad("b"), NodeLoad("c")]
    s = score_nodes(100, {"b": 60}, nodes, w, Pricing())
    assert s[0].node_id == "b" and s[0].local_blocks == 60 and s[0].recompute_blocks == 40
    assert s[0].cost == pytest.approx(40)
    # 1 Gbps for 2 MiB blocks is slower than recomputing: no peer blocks for a and c.
    assert [x.peer_blocks for x in s] == [0, 0, 0]
    assert [x.node_id for x in s[1:]] == ["a", "c"]  # equal cost: by node id
    # 20 requests in flight on b cost 80, more than the 60 blocks its prefix saves.
    busy = [NodeLoad("a"), NodeLoad("b", in_flight=20), NodeLoad("c")]
    s = score_nodes(100, {"b": 60}, busy, w, Pricing())
    assert [x.node_id for x in s] == ["a", "c", "b"]
    # a recomputes all 100 and its copy of b's 60 blocks takes pool space (0.15 each)
    assert s[0].cost == pytest.approx(109) and s[-1].cost == pytest.approx(120)
    assert s[0].space_cost == pytest.approx(9) and s[-1].space_cost == 0
    assert s[-1].load_cost == pytest.approx(80)


def test_scoring_counts_peer_blocks_only_when_cheaper_than_recompute():
    fast = Pricing(prefill_tokens_per_s=8000, peer_gbps=100)
    w = Weights(recompute=1, peer_fetch=1, load=4, utilization=0)
    nodes = [NodeLoad("a"), NodeLoad("b", in_flight=5)]
    s = {x.node_id: x for x in score_nodes(100, {"b": 80}, nodes, w, fast)}
    assert s["a"].peer_blocks == 80 and s["a"].peer_node_id == "b"
    assert s["a"].recompute_blocks == 20
    assert s["a"].peer_cost == pytest.approx(80 * fast.peer_price)
    assert s["b"].peer_blocks == 0 and s["b"].peer_node_id == ""
    slow = Pricing(prefill_tokens_per_s=8000, peer_gbps=1)
    s = {x.node_id: x for x in score_nodes(100, {"b": 80}, nodes, w, slow)}
    assert s["a"].peer_blocks == 0 and s["a"].recompute_blocks == 100


def test_peer_of_the_longest_holder_is_the_second_longest():
    fast = Pricing(peer_gbps=400)
    w = Weights()
    nodes = [NodeLoad(x) for x in "abcd"]
    s = {x.node_id: x for x in score_nodes(50, {"a": 40, "b": 10, "c": 40}, nodes, w, fast)}
    assert (s["a"].peer_node_id, s["a"].peer_blocks) == ("", 0)  # c has no more than a
    assert (s["b"].peer_node_id, s["b"].peer_blocks) == ("a", 30)  # ties: smaller id
    assert (s["d"].peer_node_id, s["d"].peer_blocks) == ("a", 40)


def test_weights_override_and_validation():
    base = Weights(recompute=1, peer_fetch=0.3, load=4, utilization=2)
    assert base.override() is base
    o = base.override(load=0.5, utilization=7, queue=3)
    assert (o.recompute, o.peer_fetch, o.load, o.utilization, o.queue) == (1, 0.3, 0.5, 7, 3)
    assert Weights.from_config(RouterConfig(weight_queue=0.25)).queue == 0.25
    with pytest.raises(ValueError, match="weight_queue"):
        RouterConfig(weight_queue=-1)
    with pytest.raises(ValueError):
        base.override(load=-1)
    with pytest.raises(ValueError):
        Weights(recompute=float("nan"))
    nodes = [NodeLoad("a", in_flight=4), NodeLoad("b")]  # 16 against 10 + 1.5 for space
    assert score_nodes(10, {"a": 10}, nodes, base, Pricing())[0].node_id == "b"
    assert score_nodes(10, {"a": 10}, nodes, base.override(load=0.1), Pricing())[0].node_id == "a"


def test_duplicates_pay_for_pool_space_and_queued_work_counts_per_block():
    fast = Pricing(prefill_tokens_per_s=8000, peer_gbps=100)  # a copy: 8% of a recompute
    w = Weights(recompute=1, peer_fetch=0.3, load=4, utilization=0, queue=1)
    # b holds 80 of 100 blocks. a would fetch the 80 (cheap to move) but then hold a
    # second copy of them: 0.3 x 0.5 each for the pool space, on top of the transfer.
    idle = [NodeLoad("a"), NodeLoad("b")]
    s = {x.node_id: x for x in score_nodes(100, {"b": 80}, idle, w, fast)}
    assert s["a"].peer_blocks == 80 and s["a"].space_cost == pytest.approx(12)
    assert s["a"].cost == pytest.approx(20 + 80 * 0.3 * fast.peer_price + 12)
    assert s["b"].cost == 20 and s["b"].space_cost == 0
    # One request in flight on b: it counts 4, plus 1 per block of prefill it queued.
    for queued, winner in ((5, "b"), (15, "a")):
        busy = [NodeLoad("a"), NodeLoad("b", in_flight=1, queued=queued)]
        s = {x.node_id: x for x in score_nodes(100, {"b": 80}, busy, w, fast)}
        assert s["b"].load_cost == pytest.approx(4 + queued) and s["b"].queued == queued
        assert min(s.values(), key=lambda x: (x.cost, x.node_id)).node_id == winner
    # Without a faster peer path the duplicates are recomputed: still charged for space.
    slow = Pricing(prefill_tokens_per_s=8000, peer_gbps=1)
    s = {x.node_id: x for x in score_nodes(100, {"b": 80}, idle, w, slow)}
    assert s["a"].peer_blocks == 0 and s["a"].cost == pytest.approx(100 + 12)


def test_inflight_tracks_queued_work_per_node():
    inf = InFlight(10.0)
    inf.add("r1", "a", 12.5)
    inf.add("r2", "a", 3.0)
    inf.add("r3", "b", 7.0)
    assert (inf.work("a"), inf.work("b"), inf.work("c")) == (15.5, 7.0, 0.0)
    inf.add("r2", "b", 3.0)  # a retried id moves its work too
    assert (inf.work("a"), inf.work("b")) == (12.5, 10.0)
    inf.release("r1")
    assert inf.work("a") == 0.0 and inf.count("a") == 0
    inf.forget_node("b")
    assert inf.work("b") == 0.0 and len(inf) == 0


def test_prefill_done_drops_the_queued_work_and_keeps_the_request():
    inf = InFlight(10.0)
    inf.add("r1", "a", 12.0)
    inf.add("r2", "a", 3.0)
    assert inf.prefill_done("r1") and inf.prefill_done("r1")  # idempotent
    assert (inf.count("a"), inf.work("a")) == (2, 3.0)  # r1 decodes on: still in flight
    assert not inf.prefill_done("never-routed")
    inf.release("r1")
    assert (inf.count("a"), inf.work("a")) == (1, 3.0)
    core = make_core(peer_gbps=100)
    ids = chain(40)
    core.index.store("c", ids[:30])
    core.route(NS, pack_ids(ids), request_id="r0")
    assert core.release("r0", prefill_done=True)
    assert core.inflight.work("c") == 0.0 and core.inflight.count("c") == 1
    assert core.release("r0") and core.inflight.count("c") == 0


def test_core_counts_the_prefill_a_route_queues():
    core = make_core(peer_gbps=100)
    ids = chain(40)
    core.index.store("c", ids[:30])
    d = core.route(NS, pack_ids(ids), request_id="r0")
    assert d.chosen.node_id == "c" and d.chosen.recompute_blocks == 10
    assert core.inflight.work("c") == pytest.approx(10)
    # The next identical prompt sees c's queue: 4 + 10 + its own 10 = 24, against
    # 10 + 30 copied (transfer + 0.15 pool space each) on an idle node: ~15.
    d = core.route(NS, pack_ids(ids), request_id="r1")
    assert d.chosen.node_id == "a" and d.chosen.peer_blocks == 30
    price = core.pricing(NS).peer_price
    assert core.inflight.work("a") == pytest.approx(10 + 30 * price)
    assert {s.node_id: s.queued for s in d.scores}["c"] == pytest.approx(10)
    core.release("r0")
    core.release("r1")
    assert core.inflight.work("a") == core.inflight.work("c") == 0


def test_a_tenants_queued_work_on_a_node_is_capped_and_freed_with_its_requests():
    """Route ids are the caller's word: a tenant's requests hold at most `cap` blocks of
    work per node; beyond it they are counted, their work is not. Others are not capped
    by it, and releasing (or prefill_done) frees the room again."""
    inf = InFlight(10.0)
    assert inf.add("r1", "a", 60.0, "acme", cap=100.0) == 60.0
    assert inf.add("r2", "a", 60.0, "acme", cap=100.0) == 40.0  # 100 held: the rest dropped
    assert inf.add("r3", "a", 60.0, "acme", cap=100.0) == 0.0
    assert (inf.count("a"), inf.work("a"), inf.tenant_work("acme", "a")) == (3, 100.0, 100.0)
    assert inf.add("r4", "b", 60.0, "acme", cap=100.0) == 60.0  # per node
    assert inf.add("g1", "a", 60.0, "globex", cap=100.0) == 60.0  # per tenant
    assert inf.work("a") == 160.0
    inf.release("r1", "acme")
    assert inf.tenant_work("acme", "a") == 40.0
    assert inf.add("r5", "a", 500.0, "acme", cap=100.0) == 60.0
    assert inf.prefill_done("r5", "acme") and inf.tenant_work("acme", "a") == 40.0
    for rid in ("r2", "r3", "r5"):
        inf.release(rid, "acme")
    assert inf.tenant_work("acme", "a") == 0.0 and inf.work("a") == 60.0
    assert inf.add("r6", "a", 500.0, "acme") == 500.0  # no cap given: counted whole


def test_a_route_counts_at_most_the_callers_work_caps_and_is_still_routed():
    core = make_core(nodes=("a",))
    huge = pack_ids(chain(300, seed=7))
    d = core.route(NS, huge, request_id="r0", tenant="acme", max_request_work=128.0)
    assert d.chosen.node_id == "a" and d.chosen.recompute_blocks == 300
    assert core.inflight.work("a") == 128.0 and core.inflight.count("a") == 1
    core.route(NS, huge, request_id="r1", tenant="acme", max_request_work=128.0,
               max_tenant_work=200.0)  # fmt: skip
    assert core.inflight.work("a") == 200.0 and core.inflight.count("a") == 2
    core.route(NS, huge, request_id="r2", tenant="")  # no caps (the cluster identity)
    assert core.inflight.work("a") == 500.0
    assert core.release("r0", tenant="acme") and core.inflight.work("a") == 372.0


def test_ranked_scoring_equals_full_scoring():
    w = Weights(recompute=1, peer_fetch=0.5, load=3, utilization=2)
    pricing = Pricing(peer_gbps=50)
    nodes = [
        NodeLoad(
            f"n{i:02d}",
            in_flight=i % 4,
            utilization=(i * 37 % 10) / 10,
            queued=float(i * 13 % 7) * (i % 4 > 0),
        )
        for i in range(30)
    ]
    ranked = sorted(
        nodes, key=lambda n: (3 * n.in_flight + n.queued + 2 * n.utilization, n.node_id)
    )
    for local in ({}, {"n05": 90}, {"n07": 30, "n11": 100, "n29": 100}, {"n03": 0}):
        full = score_nodes(100, local, nodes, w, pricing)
        for limit in (1, 4, None):
            assert score_ranked(100, local, ranked, w, pricing, limit) == full[:limit]
            by_id = {n.node_id: n for n in nodes}
            assert score_ranked(100, local, ranked, w, pricing, limit, by_id) == full[:limit]


def test_zero_blocks_routes_by_load():
    s = score_nodes(0, {}, [NodeLoad("b"), NodeLoad("a", utilization=0.5)], Weights(), Pricing())
    assert [x.node_id for x in s] == ["b", "a"]


# ------------------------------------------------------------------ core + in-flight
def test_inflight_expiry_and_release():
    now = [0.0]
    inf = InFlight(10.0, clock=lambda: now[0])
    inf.add("r1", "a")
    inf.add("r2", "a")
    inf.add("r3", "b")
    assert inf.count("a") == 2
    assert inf.release("r1") and not inf.release("r1")
    inf.add("r3", "a")  # a retried id moves rather than doubles
    assert (inf.count("a"), inf.count("b")) == (2, 0)
    now[0] = 10.5
    assert inf.expire() == 2 and len(inf) == 0 and inf.count("a") == 0


def make_core(nodes=("a", "b", "c"), **kw) -> RouterCore:
    core = RouterCore(Weights(), **kw)
    for n in nodes:
        core.upsert_node(NodeRecord(n, f"127.0.0.1:{1000 + ord(n[0])}"))
        core.mark_synced(n)
    return core


def test_core_spreads_load_when_nobody_holds_the_prefix():
    core = make_core()
    packed = hash_chain_packed(ROOT, list(range(64)), 16)
    chosen = [core.route(NS, packed, request_id=f"r{i}").chosen.node_id for i in range(6)]
    assert chosen == ["a", "b", "c", "a", "b", "c"]
    for i in range(6):
        core.release(f"r{i}")
    assert [core.inflight.count(n) for n in "abc"] == [0, 0, 0]


def test_core_routes_to_holder_and_respects_killswitch():
    core = make_core()
    ids = chain(32)
    core.index.store("c", ids)
    d = core.route(NS, pack_ids(ids), dry_run=True)
    assert d.chosen.node_id == "c" and d.chosen.local_blocks == 32
    assert len(core.inflight) == 0
    core.killswitch = True
    assert core.route(NS, pack_ids(ids), dry_run=True).chosen.local_blocks == 0


def test_core_candidates_follow_sync_and_membership():
    core = make_core()
    core.mark_unsynced("a")
    packed = pack_ids(chain(4))
    assert [s.node_id for s in core.route(NS, packed, dry_run=True).scores] == ["b", "c"]
    core.remove_node("b")
    core.remove_node("c")
    # Nothing in sync: fall back to every registered node rather than refusing.
    assert core.route(NS, packed, dry_run=True).chosen.node_id == "a"
    core.remove_node("a")
    with pytest.raises(errors.Unavailable):
        core.route(NS, packed)


def test_core_rejects_malformed_requests():
    core = make_core()
    with pytest.raises(errors.InvalidArgument):
        core.route(b"short", b"")
    with pytest.raises(errors.InvalidArgument):
        core.route(NS, b"x" * 17)


def test_replicas_fed_in_different_orders_decide_identically():
    streams = {
        n: [chain(40, seed=s)[: 10 + 7 * s] for s in range(5) if (s + ord(n)) % 2] for n in "abcd"
    }
    a, b = make_core("abcd"), make_core("dcba")
    for core, order in ((a, "abcd"), (b, "dcba")):
        for n in order:
            for ids in streams[n]:
                core.index.store(n, ids)
    for s in range(6):
        packed = pack_ids(chain(60, seed=s))
        assert (
            a.route(NS, packed, request_id=f"x{s}").scores
            == b.route(NS, packed, request_id=f"x{s}").scores
        )
