"""Router authentication and least privilege (issue 18, item 3), each test written as the
attack of a caller holding one tenant's valid token (or none), against a real router, etcd
and agents that know tenants acme (A), globex (B) and the cluster identity."""

from __future__ import annotations

import hashlib

import grpc
import pytest
import torch
from support.cluster import agent_config
from support.common import TEST_SECRET, make_namespace, prompt_tokens, wait_for

from kvstore.client.cluster import ClusterClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.hashing import hash_chain, pack_ids
from kvstore.v1 import common_pb2, router_pb2, router_pb2_grpc

TOKENS = {"_cluster": "cluster-token", "acme": "acme-token", "globex": "globex-token"}
A_SPEC = make_namespace(tenant="acme", name="secret-chat")
B_SPEC = make_namespace(tenant="globex", name="chat")
BS = A_SPEC.block_size
NOT_YOURS = "namespace is unknown or not open to this tenant"


def tenants(**extra) -> dict:
    return {
        t: {"token_sha256": hashlib.sha256(tok.encode()).hexdigest(), **extra.get(t, {})}
        for t, tok in TOKENS.items()
    }


def md(tenant: str | None) -> tuple:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),) if tenant else ()


class Caller:
    """A raw Router stub that sends one tenant's token (None: no token)."""

    def __init__(self, address: str, tenant: str | None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.md = md(tenant)

    def route(self, ns_id: bytes, ids: list[bytes], **kw) -> router_pb2.RouteResponse:
        return self.stub.Route(
            router_pb2.RouteRequest(namespace_id=ns_id, block_ids=pack_ids(ids), **kw),
            timeout=5,
            metadata=self.md,
        )

    def release(self, request_id: str) -> None:
        self.stub.Release(
            router_pb2.ReleaseRequest(request_id=request_id), timeout=5, metadata=self.md
        )

    def nodes(self) -> dict[str, router_pb2.NodeInfo]:
        resp = self.stub.ListNodes(router_pb2.ListNodesRequest(), timeout=5, metadata=self.md)
        return {n.node_id: n for n in resp.nodes}


def refused(fn, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        fn(*args, **kw)
    return ei.value


def start(etcd, spawn_agent, start_router, n_agents: int = 2, **router_cfg):
    """Agents and a router that authenticate (no anonymous access anywhere)."""
    for _ in range(n_agents):
        spawn_agent(**agent_config(etcd, tenants=tenants(), allow_unauthenticated=False))
    router = start_router(
        token=TOKENS["_cluster"],
        config={"tenants": tenants(), "allow_unauthenticated": False, **router_cfg},
    )
    cluster = Caller(router.address, "_cluster")
    wait_for(
        lambda: (
            len(cluster.nodes()) == n_agents and all(n.synced for n in cluster.nodes().values())
        ),
        30,
        what="router to follow every agent",
    )
    return router, cluster


def in_flight(cluster: Caller, ns_id: bytes) -> dict[str, int]:
    """Requests in flight per node, as the router prices them (a cluster dry run)."""
    resp = cluster.route(ns_id, [], dry_run=True)
    return {c.node_id: c.in_flight for c in resp.candidates}


def test_anonymous_callers_are_refused_and_the_cluster_lists_nodes(etcd, spawn_agent, start_router):
    router, cluster = start(etcd, spawn_agent, start_router, n_agents=1)
    anon = Caller(router.address, None)
    forged = Caller(router.address, None)
    forged.md = (("authorization", "Bearer guessed-token"),)
    for who in (anon, forged):
        for call, args in (
            (who.nodes, ()),
            (who.release, ("r-1",)),
            (who.route, (A_SPEC.namespace_id, [bytes(16)])),
        ):
            assert refused(call, *args).code() == grpc.StatusCode.UNAUTHENTICATED
    # Nothing an anonymous Route did is counted anywhere.
    assert set(in_flight(cluster, A_SPEC.namespace_id).values()) == {0}
    nodes = cluster.nodes()  # the cluster identity sees every node's addresses
    assert list(nodes) == ["agent-0"] and nodes["agent-0"].address
    # A tenant does not (gRPC and UCX addresses of every agent are for cluster members).
    err = refused(Caller(router.address, "globex").nodes)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED


def store_prompt(cc: ClusterClient, spec, tokens) -> str:
    """A's legitimate flow through ClusterClient (its token goes to router and agents)."""
    ns = cc.open_namespace(spec)
    hit = cc.fetch(ns, tokens)
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(
        spec.num_layers, 2, len(tokens), spec.num_kv_heads, spec.head_dim, generator=g
    ).to(torch_dtype(spec.kv_dtype))
    assert block_shape(spec)[2] == BS
    cc.store(ns, hit, tokens, kv)
    return hit.node_id


def test_tenant_cannot_reach_another_tenants_namespace_or_requests(etcd, spawn_agent, start_router):
    router, cluster = start(etcd, spawn_agent, start_router)
    tokens = prompt_tokens(5, 32 * BS)
    a_ids = hash_chain(A_SPEC.root(0, TEST_SECRET), tokens, BS)
    with ClusterClient(
        router.address, token=TOKENS["acme"], tenant_secret=TEST_SECRET, use_shm=False
    ) as cc_a:
        home = store_prompt(cc_a, A_SPEC, tokens)
        wait_for(
            lambda: cluster.nodes()[home].indexed_blocks == 32,
            15,
            what="the router to index A's 32 blocks",
        )
        a = Caller(router.address, "acme")
        b = Caller(router.address, "globex")
        mine = a.route(A_SPEC.namespace_id, a_ids, dry_run=True)
        assert (mine.node_id, mine.matched_blocks) == (home, 32)

        # Hit oracle: B routes A's namespace with A's ids (32 cached), with ids nothing
        # caches, and an id no namespace has: one answer, decided before any lookup.
        answers = set()
        for ns_id, ids in (
            (A_SPEC.namespace_id, a_ids),
            (A_SPEC.namespace_id, [bytes(16)]),
            (bytes(range(16)), a_ids),
        ):
            err = refused(b.route, ns_id, ids, dry_run=True)
            answers.add((err.code(), err.details()))
        assert answers == {(grpc.StatusCode.PERMISSION_DENIED, NOT_YOURS)}
        # A malformed id is no namespace at all: told so, whoever asks (the agents do too).
        err = refused(b.route, b"abc", a_ids, dry_run=True)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details() == "namespace_id must be 16 bytes, got 3"
        # Request ids stay in the router's in-flight table: their length is bounded.
        err = refused(a.route, A_SPEC.namespace_id, a_ids, request_id="x" * 3_000_000)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        # Nor with a spec naming A (of a namespace the router knows, or of one it does
        # not), nor with B's own spec sent along an id that is A's or nobody's.
        unopened = make_namespace(tenant="acme", name="not-opened")
        for ns_id, spec in (
            (A_SPEC.namespace_id, A_SPEC),
            (unopened.namespace_id, unopened),
            (A_SPEC.namespace_id, B_SPEC),
            (bytes(range(16)), B_SPEC),
        ):
            claim = common_pb2.Namespace(**spec.to_dict())
            err = refused(b.route, ns_id, a_ids, spec=claim)
            assert (err.code(), err.details()) == (grpc.StatusCode.PERMISSION_DENIED, NOT_YOURS)

        # Request ids: unguessable, and B's Release of A's live ids changes nothing.
        rids = [a.route(A_SPEC.namespace_id, a_ids).request_id for _ in range(5)]
        assert len(set(rids)) == 5 and all(len(r) >= 32 for r in rids)
        assert len({r[:8] for r in rids}) == 5  # no shared prefix plus a counter
        before = in_flight(cluster, A_SPEC.namespace_id)
        assert sum(before.values()) == 5
        for rid in rids:
            b.release(rid)  # the answer to an id B never routed, as for any unknown id
        b.release("never-routed")
        assert in_flight(cluster, A_SPEC.namespace_id) == before
        for rid in rids:
            a.release(rid)
        assert set(in_flight(cluster, A_SPEC.namespace_id).values()) == {0}

        # Weight overrides: B's 20 steering routes are refused and count nowhere, and A's
        # route for its 32 blocks stays on the node holding them.
        steer = router_pb2.RouteWeights(
            recompute=1e-9, peer_fetch=1e-9, load=1e-9, utilization=1e-9, queue=1e-9
        )
        b_ids = hash_chain(B_SPEC.root(0, TEST_SECRET), tokens, BS)
        with ClusterClient(
            router.address, token=TOKENS["globex"], tenant_secret=TEST_SECRET, use_shm=False
        ) as cc_b:
            cc_b.open_namespace(B_SPEC)  # B's own namespace: B may route it
        for _ in range(20):
            err = refused(
                b.route,
                B_SPEC.namespace_id,
                b_ids,
                weights=steer,
                spec=common_pb2.Namespace(**B_SPEC.to_dict()),
            )
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert set(in_flight(cluster, A_SPEC.namespace_id).values()) == {0}
        assert a.route(A_SPEC.namespace_id, a_ids, dry_run=True).node_id == home
        # B's own namespace routes fine, without overrides.
        assert b.route(B_SPEC.namespace_id, b_ids, dry_run=True).node_id


def test_per_tenant_in_flight_cap(etcd, spawn_agent, start_router):
    router, cluster = start(etcd, spawn_agent, start_router, n_agents=1, max_inflight_per_tenant=3)
    b = Caller(router.address, "globex")
    a = Caller(router.address, "acme")
    spec_b = common_pb2.Namespace(**B_SPEC.to_dict())
    spec_a = common_pb2.Namespace(**A_SPEC.to_dict())
    ids = [bytes([i]) * 16 for i in range(4)]
    rids = [b.route(B_SPEC.namespace_id, ids, spec=spec_b).request_id for _ in range(3)]
    err = refused(b.route, B_SPEC.namespace_id, ids, spec=spec_b)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert in_flight(cluster, B_SPEC.namespace_id) == {"agent-0": 3}  # the refused one: none
    b.route(B_SPEC.namespace_id, ids, spec=spec_b, dry_run=True)  # a dry run holds nothing
    # A retried id moves (it does not count twice), and other tenants are not held back.
    b.route(B_SPEC.namespace_id, ids, spec=spec_b, request_id=rids[0])
    a.route(A_SPEC.namespace_id, ids, spec=spec_a)
    b.release(rids[0])
    b.route(B_SPEC.namespace_id, ids, spec=spec_b)
    assert in_flight(cluster, B_SPEC.namespace_id) == {"agent-0": 4}


def test_a_tenants_route_answer_shows_no_load_to_watch_others_by(etcd, spawn_agent, start_router):
    """Every node's load is all tenants' requests: B, dry-running its own prompt while A
    routes 5 of 64 blocks, would watch A's traffic come and go (in_flight, queued blocks,
    and the costs that sum them). B's answer names the nodes and what they hold of B's
    prompt; the load terms are the cluster identity's (and the router's metrics')."""
    from router.server import LOAD_TERMS

    router, cluster = start(etcd, spawn_agent, start_router)
    a, b = Caller(router.address, "acme"), Caller(router.address, "globex")
    spec_a = common_pb2.Namespace(**A_SPEC.to_dict())
    spec_b = common_pb2.Namespace(**B_SPEC.to_dict())
    a_ids = [bytes([1, i]) * 8 for i in range(64)]
    b_ids = [bytes([2, i]) * 8 for i in range(4)]

    def terms(who: Caller, ns_id: bytes, **kw) -> dict[str, dict[str, float]]:
        resp = who.route(ns_id, b_ids, dry_run=True, **kw)
        assert all(c.address for c in resp.candidates), resp
        return {c.node_id: {n: getattr(c, n) for n in LOAD_TERMS} for c in resp.candidates}

    zero = dict.fromkeys(LOAD_TERMS, 0)
    quiet = terms(b, B_SPEC.namespace_id, spec=spec_b)
    assert quiet == {"agent-0": zero, "agent-1": zero}
    rids = [a.route(A_SPEC.namespace_id, a_ids, spec=spec_a).request_id for _ in range(5)]
    # The cluster sees A's five requests and their blocks queued, and what they cost...
    seen = terms(cluster, B_SPEC.namespace_id)
    assert sum(t["in_flight"] for t in seen.values()) == 5
    assert sum(t["queued_blocks"] for t in seen.values()) > 0
    assert all(t["cost"] > 0 for t in seen.values())
    # ...B sees none of it: the same nodes, no load.
    assert terms(b, B_SPEC.namespace_id, spec=spec_b) == quiet
    for rid in rids:
        a.release(rid)
