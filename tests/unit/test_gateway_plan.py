"""The gateway's routing decision (router/gateway/plan.py, engines.py) over the router's
engine pricing (RouterCore.route_engines): pure, no processes. Engines' caches are fed
through their event streams with vLLM-format frames; agents' blocks through the index."""

from __future__ import annotations

import pytest

from kvstore.coord.engines import EngineRecord
from kvstore.coord.etcd import NodeRecord
from kvstore.integrations.vllm_peer import PeerHint, hint_from_params
from router.gateway.engines import EngineSet
from router.gateway.plan import Planner
from router.routing import RouterCore
from router.scoring import Pricing, Weights
from tests.support.common import make_namespace
from tests.support.vllm_events import batch, stored

BS = 4
SECRET = "engines-secret"
NS = make_namespace(tenant="engines", block_size=BS)
TOKENS = list(range(100, 121))  # 5 full blocks and one token


def record(engine_id: str, node_id: str) -> EngineRecord:
    port = 8000 + int(engine_id[-1])
    return EngineRecord(engine_id, f"http://127.0.0.1:{port}", ("tiny",), node_id,
                        NS.to_dict(), BS, f"tcp://*:{port + 100}")  # fmt: skip


def world(*records: EngineRecord) -> tuple[RouterCore, Planner, EngineSet]:
    core = RouterCore(Weights(), tenant_secrets={NS.tenant: SECRET})
    engines = EngineSet(max_inflight=2, suspend_s=5.0)
    for r in records:
        core.engines.upsert(r)  # what the router's EngineFeed does from etcd
        engines.upsert(r)  # what the gateway's follower does
    return core, Planner(core, {NS.tenant: SECRET}, b"salt-key"), engines


def engine_caches(core: RouterCore, planner: Planner, engine_id: str, tenant: str) -> None:
    """The engine prefilled TOKENS for `tenant` (its cache_salt) and published it."""
    stream = core.engines.engines[engine_id].stream
    assert stream is not None
    stream.live(0, batch(stored(TOKENS, BS, planner.salt(tenant))))


def test_a_prompt_goes_to_the_engine_whose_own_cache_holds_it():
    e1, e2 = record("e1", "n1"), record("e2", "n2")
    core, planner, engines = world(e1, e2)
    engine_caches(core, planner, "e2", "acme")
    plan = planner.plan(e1, TOKENS, "acme", "tiny")
    assert plan.engines[0] == "e2"  # e1 sorts first and is as idle: the cache decided
    assert plan.score_of("e2").engine_blocks == 5  # type: ignore[union-attr]
    assert engines.pick("tiny", "cache", plan.engines).engine.record.engine_id == "e2"  # type: ignore[union-attr]
    # Another tenant's salt names other chain ids: e2's cache is not its cache.
    other = planner.plan(e1, TOKENS, "globex", "tiny")
    assert all(s.engine_blocks == 0 for s in other.scores)
    # e2 at its in-flight cap: the next engine of the ranking takes it, no 429.
    st2 = engines.engines["e2"]
    st2.inflight = engines.max_inflight
    assert engines.pick("tiny", "cache", plan.engines).engine.record.engine_id == "e1"  # type: ignore[union-attr]


def test_holding_on_the_chosen_engine_is_seen_by_the_next_plan_until_released():
    e1, e2 = record("e1", "n1"), record("e2", "n2")
    core, planner, _ = world(e1, e2)
    first = planner.plan(e1, TOKENS, "acme", "tiny")
    assert first.engines[0] == "e1"  # nothing cached anywhere: ties go to the smaller id
    planner.hold(first, e1)
    busy = planner.plan(e1, TOKENS, "acme", "tiny")
    s1 = busy.score_of("e1")
    assert s1 is not None and (s1.in_flight, s1.queued) == (1, 5.0)
    assert busy.engines[0] == "e2"
    planner.prefill_done(first)
    s1 = planner.plan(e1, TOKENS, "acme", "tiny").score_of("e1")
    assert s1 is not None and (s1.in_flight, s1.queued) == (1, 0.0)
    planner.release(first)
    s1 = planner.plan(e1, TOKENS, "acme", "tiny").score_of("e1")
    assert s1 is not None and s1.in_flight == 0


def test_peer_hint_names_the_peer_agent_the_way_the_connector_reads_it():
    e1, e2 = record("e1", "n1"), record("e2", "n2")
    core, planner, engines = world(e1, e2)
    for node, port in (("n1", 50051), ("n2", 50052)):
        core.upsert_node(NodeRecord(node, f"127.0.0.1:{port}", f"ucx-{node}"))
        core.mark_synced(node)
    ns_id, packed = planner.chain(e1, TOKENS, "acme")  # type: ignore[misc]
    core.index.store("n1", [packed[i : i + 16] for i in range(0, len(packed), 16)])
    pricing = Pricing(block_bytes=8192, block_tokens=BS)  # a peer copy pays
    core.set_namespace_layout(ns_id, pricing.block_bytes, pricing.block_tokens)
    plan = planner.plan(e1, TOKENS, "acme", "tiny")
    assert plan.engines[0] == "e1"  # its node's agent holds the prefix
    assert planner.peer_hint(plan, "e1") is None  # nothing to pull there
    engines.engines["e1"].inflight = engines.max_inflight  # e1 saturated: e2 serves
    chosen = engines.pick("tiny", "cache", plan.engines).engine
    assert chosen is not None and chosen.record.engine_id == "e2"
    s2 = plan.score_of("e2")
    assert s2 is not None and (s2.peer_blocks, s2.peer_node_id) == (5, "n1")
    hint = planner.peer_hint(plan, "e2")
    # What the connector parses out of the forwarded request's kv_transfer_params.
    assert hint_from_params(hint) == PeerHint("127.0.0.1:50051", "ucx-n1")
    core.remove_node("n1")  # the peer left since the plan: no hint rather than a dead one
    assert planner.peer_hint(plan, "e2") is None


def test_without_engines_followed_by_the_router_the_plan_routes_by_load():
    e1 = record("e1", "n1")
    core, planner, engines = world()
    engines.upsert(e1)  # the gateway saw the engine before the router's feed did
    plan = planner.plan(e1, TOKENS, "acme", "tiny")
    assert plan.scores == () and plan.first_block  # no pricing, but the hash key is there
    assert engines.pick("tiny", "cache", plan.engines).engine.record.engine_id == "e1"  # type: ignore[union-attr]
    planner.hold(plan, e1)  # neither the board nor the nodes know it: nothing to count
    planner.release(plan)


def test_two_revisions_of_one_namespace_name_get_their_own_chain_ids():
    """Engines rolling from one model revision to the next share the namespace's name
    (tenant/name) but not its spec: each one's chain ids are what its own connector
    derives, whichever was planned first (the planner caches per spec, not per name)."""
    from dataclasses import replace

    from kvstore.hashing import BlockId, hash_chain_packed
    from kvstore.salt import salt_secret, salted

    new = replace(NS, model_revision="r2")
    e1 = record("e1", "n1")
    e2 = EngineRecord("e2", "http://127.0.0.1:8002", ("tiny",), "n2", new.to_dict(), BS,
                      "tcp://*:8102")  # fmt: skip
    _, planner, _ = world(e1, e2)
    salt = planner.salt("acme")
    for rec, spec in ((e1, NS), (e2, new), (e1, NS)):
        got = planner.chain(rec, TOKENS, "acme")
        ns = salted(spec, salt)
        root = ns.root(0, salt_secret(SECRET, salt))
        assert got == (ns.namespace_id, hash_chain_packed(BlockId(root), TOKENS, BS))


def agents_pulled_before(
    core: RouterCore, planner: Planner, rec: EngineRecord, fixed_ms: float
) -> bytes:
    """Both agents have pulled before and published their fit (`fixed_ms` a pull); n1's
    agent holds TOKENS for acme. Returns the salted namespace id."""
    for node, port in (("n1", 50051), ("n2", 50052)):
        core.upsert_node(NodeRecord(node, f"127.0.0.1:{port}", f"ucx-{node}",
                                    pull_fixed_ms=fixed_ms, pull_samples=5))  # fmt: skip
        core.mark_synced(node)
    ns_id, packed = planner.chain(rec, TOKENS, "acme")  # type: ignore[misc]
    core.index.store("n1", [packed[i : i + 16] for i in range(0, len(packed), 16)])
    core.set_namespace_layout(ns_id, 8192, BS)
    return ns_id


def test_no_peer_hint_when_the_agents_measured_pull_costs_more_than_recomputing():
    e1, e2 = record("e1", "n1"), record("e2", "n2")
    core, planner, engines = world(e1, e2)
    # Both agents have pulled before and published their fit: 20 ms fixed per pull,
    # i.e. 40 blocks of 4 tokens recomputed at the router's 8000 tokens/s.
    agents_pulled_before(core, planner, e1, fixed_ms=20.0)
    plan = planner.plan(e1, TOKENS, "acme", "tiny")
    engines.engines["e1"].inflight = engines.max_inflight  # e1 saturated: e2 serves
    s2 = plan.score_of("e2")
    # Pulling 5 blocks would cost 40 recomputes of fixed part alone: e2 recomputes them,
    # and the engine is not told to wait for a pull.
    assert s2 is not None and (s2.peer_blocks, s2.recompute_blocks) == (0, 5)
    assert planner.peer_hint(plan, "e2") is None
    planner.hold(plan, e2)
    assert core.inflight.work("n2") == pytest.approx(5.0)


def test_holding_a_hinted_request_charges_the_pull_with_its_fixed_part():
    e1, e2 = record("e1", "n1"), record("e2", "n2")
    core, planner, _ = world(e1, e2)
    ns_id = agents_pulled_before(core, planner, e1, fixed_ms=0.5)
    pricing = core.pricing(ns_id)
    assert pricing.pull_fixed == pytest.approx(1.0)  # 0.5 ms: one block recomputed
    plan = planner.plan(e1, TOKENS, "acme", "tiny")
    s2 = plan.score_of("e2")
    assert s2 is not None and s2.peer_blocks == 5 and planner.peer_hint(plan, "e2")
    planner.hold(plan, e2)
    # The engine and its node wait for the whole pull, its fixed part included.
    assert core.inflight.work("n2") == pytest.approx(pricing.pull_blocks(5))
    assert planner.plan(e1, TOKENS, "acme", "tiny").score_of("e2").queued == pytest.approx(  # type: ignore[union-attr]
        pricing.pull_blocks(5)
    )
