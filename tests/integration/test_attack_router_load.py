"""Phantom load through Route (a tenant's non-dry-run Route with made-up block ids, held
in flight), against a real router, etcd and agents that authenticate everyone. The ids of
a Route are the caller's word: before the caps, one Route of 65,536 random ids queued
65,536 blocks of prefill on a node, and with Release to keep only the route that landed
where it wanted, tenant acme pushed tenant globex's requests off the node that caches
globex's prefix (router/routing.py RouterCore.route, RouterConfig.max_route_work_blocks and
max_queued_blocks_per_tenant)."""

from __future__ import annotations

import os

import grpc
import torch
from support.attack import TOKENS, auth, ns_msg, tenants
from support.cluster import agent_config
from support.common import TEST_SECRET, block_payload, make_namespace, prompt_tokens, wait_for

from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.hashing import hash_chain, pack_ids
from kvstore.v1 import router_pb2, router_pb2_grpc

VICTIM = make_namespace(tenant="globex", name="chat")
ATTACKER = make_namespace(tenant="acme", name="noise")
NB = 16  # the victim's cached prefix, in blocks
BIG = 1 << 16  # blocks per attacking Route: the most a Route may name


def _cluster(etcd, spawn_agent, start_router, **router_config):
    cfg = agent_config(etcd, tenants=tenants(), allow_unauthenticated=False)
    agents = [spawn_agent(**cfg), spawn_agent(**cfg)]
    router = start_router(
        token=TOKENS["_cluster"],
        config={"tenants": tenants(), "allow_unauthenticated": False, **router_config},
    )
    return agents, router_pb2_grpc.RouterStub(grpc.insecure_channel(router.address))


def _phantom(stub, n: int = 1) -> list[router_pb2.RouteResponse]:
    """acme's attack: Routes of BIG random ids in its own namespace, held in flight."""
    big = os.urandom(16 * BIG)
    req = router_pb2.RouteRequest(
        namespace_id=ATTACKER.namespace_id, block_ids=big, spec=ns_msg(ATTACKER)
    )
    return [stub.Route(req, metadata=auth("acme"), timeout=30) for _ in range(n)]


def _queued(stub, spec) -> dict[str, float]:
    """Each node's queued prefill as the cluster identity sees it."""
    req = router_pb2.RouteRequest(namespace_id=spec.namespace_id, dry_run=True)
    resp = stub.Route(req, metadata=auth("_cluster"), timeout=10)
    return {c.node_id: c.queued_blocks for c in resp.candidates}


def test_a_tenants_made_up_route_ids_queue_at_most_the_caps(etcd, spawn_agent, start_router):
    """Defaults: a Route counts at most max_route_work_blocks (8192) of prefill, and one
    tenant's Routes at most max_queued_blocks_per_tenant (16384) on a node, however many
    ids they name; each is still routed and counted as a request in flight."""
    _, stub = _cluster(etcd, spawn_agent, start_router)
    wait_for(lambda: len(_queued(stub, ATTACKER)) == 2, 30, what="both agents in the router")
    routes = _phantom(stub, 5)
    assert all(r.node_id for r in routes)
    queued = _queued(stub, ATTACKER)
    on = {n: sum(r.node_id == n for r in routes) for n in queued}
    for node, q in queued.items():
        assert q == min(8192 * on[node], 16384), (queued, on)
    assert sum(queued.values()) < BIG  # before: 5 x 65,536


def test_made_up_ids_weigh_on_another_tenants_route_no_more_than_the_cap(
    etcd, spawn_agent, start_router
):
    """The tester's attack: acme holds one 65,536-block Route on the node caching
    globex's prefix (releasing the ones that landed elsewhere). What it adds to that
    node's cost in globex's decision is its request (weight_load, 4) and at most
    max_route_work_blocks (8192) of queued work; before, 65,536 + 4. (Whether globex still
    goes there depends on what else it would pay: here a pull from that node is cheap,
    so even the request alone can move it, as real load would.)

    The router prices no pool utilization here: the target's node record, rewritten
    within a heartbeat of globex's put, would otherwise move its cost between `before`
    and after, and keep every attacking route off it once it has landed."""
    agents, stub = _cluster(etcd, spawn_agent, start_router, weight_utilization=0)
    bs = VICTIM.block_size
    ids = hash_chain(VICTIM.root(0, TEST_SECRET), prompt_tokens(3, NB * bs), bs)
    with KVClient(
        agents[0].address, token=TOKENS["globex"], tenant_secret=TEST_SECRET, use_shm=False
    ) as c:
        ns = c.open_namespace(VICTIM)
        shape, dtype = block_shape(VICTIM), torch_dtype(VICTIM.kv_dtype)
        t = [
            torch.frombuffer(bytearray(block_payload(i, VICTIM.block_bytes)), dtype=torch.uint8)
            .view(dtype)
            .view(shape)
            for i in ids
        ]
        assert c.put(ns, ids, t).stored == NB
    victim = router_pb2.RouteRequest(
        namespace_id=VICTIM.namespace_id, block_ids=pack_ids(ids), spec=ns_msg(VICTIM),
        dry_run=True,
    )  # fmt: skip

    def route(who: str = "globex"):
        return stub.Route(victim, metadata=auth(who), timeout=10)

    wait_for(lambda: route().matched_blocks == NB, 30, what="the router indexed globex")
    target = route().node_id

    def cost() -> float:  # the target's cost in globex's decision, as operators see it
        return {c.node_id: c.cost for c in route("_cluster").candidates}[target]

    before = cost()
    held = []
    for _ in range(8):  # until one lands on globex's node; the others are released
        (r,) = _phantom(stub)
        if r.node_id == target:
            held.append(r)
            break
        stub.Release(
            router_pb2.ReleaseRequest(request_id=r.request_id), metadata=auth("acme"), timeout=10
        )
    assert held, "no attacking route landed on globex's node"
    assert _queued(stub, ATTACKER)[target] == 8192
    assert abs(cost() - before - (4 + 8192)) < 1e-6
    # Released, it weighs nothing any more.
    stub.Release(
        router_pb2.ReleaseRequest(request_id=held[0].request_id), metadata=auth("acme"), timeout=10
    )
    assert (route().node_id, route().matched_blocks) == (target, NB)
