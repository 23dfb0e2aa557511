"""Attacks of a caller holding one tenant's valid token (globex, "B"), or the router's
cluster token, on a real cluster that authenticates everyone: etcd, two agents and a
router, each in its own process (issue 18, items 2 and 4; the shared-memory and lane
attacks are in test_attack_lane.py). Every refusal is checked against what it must leave
unchanged: etcd (read directly), the agents' namespaces, blocks and counters, the router's
index. The timing side of probes is measured by loadtest/probe_timing.py, not here."""

from __future__ import annotations

import asyncio
import json

import grpc
from support.attack import (
    TOKENS,
    As,
    agent_view,
    etcd_items,
    ns_msg,
    put_chain,
    ref,
    refusal,
    tenants,
)
from support.cluster import agent_config
from support.common import TEST_SECRET, block_payload, make_namespace, prompt_tokens, wait_for

import torch

from kvstore.auth import NOT_YOURS
from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.coord.etcd import EtcdClient
from kvstore.hashing import hash_chain, pack_ids
from kvstore.v1 import agent_pb2, router_pb2, router_pb2_grpc

A_SPEC = make_namespace(tenant="acme", name="secret-chat")
UNOPENED = make_namespace(tenant="acme", name="never-opened")  # nowhere, not even in etcd
BS = A_SPEC.block_size
P = grpc.StatusCode.PERMISSION_DENIED
N_BLOCKS = 6


class World:
    """Agent 0 holds A's prompt (N_BLOCKS blocks); agent 1 is where pulls are asked for."""

    def __init__(self, etcd, spawn_agent, start_router) -> None:
        cfg = agent_config(etcd, tenants=tenants(), allow_unauthenticated=False)
        self.agents = [spawn_agent(**cfg), spawn_agent(**cfg)]
        self.router = start_router(
            token=TOKENS["_cluster"],
            config={"tenants": tenants(), "allow_unauthenticated": False},
        )
        self.etcd = etcd
        tokens = prompt_tokens(3, N_BLOCKS * BS)
        self.root = A_SPEC.root(0, TEST_SECRET)
        self.ids = hash_chain(self.root, tokens, BS)
        self.uncached = hash_chain(self.root, prompt_tokens(4, N_BLOCKS * BS), BS)
        self.blocks = [block_payload(i, A_SPEC.block_bytes) for i in self.ids]
        with KVClient(
            self.agents[0].address, token=TOKENS["acme"], tenant_secret=TEST_SECRET, use_shm=False
        ) as a:
            ns = a.open_namespace(A_SPEC)
            tensors = [
                torch.frombuffer(bytearray(b), dtype=torch.uint8)
                .view(torch_dtype(A_SPEC.kv_dtype))
                .view(block_shape(A_SPEC))
                for b in self.blocks
            ]
            assert a.put(ns, self.ids, tensors).stored == N_BLOCKS
        self.router_stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(self.router.address))
        wait_for(lambda: self.indexed() == N_BLOCKS, 30, what="the router to index A's blocks")
        # Agents publish what they hold in their etcd records on a heartbeat: let that
        # catch up with A's blocks, so a later change there is one a probe made.
        wait_for(
            lambda: sum(r["blocks"] for r in self.node_records()) == N_BLOCKS,
            30,
            what="the agents' etcd records to show A's blocks",
        )

    def indexed(self) -> int:
        resp = self.router_stub.ListNodes(
            router_pb2.ListNodesRequest(), metadata=As(self.router.address, "_cluster").md
        )
        return sum(n.indexed_blocks for n in resp.nodes)

    def node_records(self) -> list[dict]:
        items = etcd_items(self.etcd.endpoint)
        return [json.loads(v) for k, v in items.items() if k.startswith("nodes/")]

    def snapshot(self) -> tuple:
        return (
            etcd_items(self.etcd.endpoint),
            [agent_view(a.address) for a in self.agents],
            self.indexed(),
        )


def test_refused_prefetch_and_fetch_register_nothing_in_etcd(etcd, spawn_agent, start_router):
    """Item 2: B's Prefetch (and FetchBlocks) for a spec of A's that no node has opened is
    refused before the namespace is opened, so no record appears under namespaces/acme/."""
    w = World(etcd, spawn_agent, start_router)
    before = w.snapshot()
    assert not any(k.endswith(UNOPENED.namespace_id.hex()) for k in before[0])
    b = As(w.agents[1].address, "globex")
    ids = hash_chain(UNOPENED.root(0, TEST_SECRET), prompt_tokens(3, 2 * BS), BS)
    got = {
        refusal(b.prefetch, UNOPENED, ids, UNOPENED.root(0, TEST_SECRET), w.agents[0].address),
        refusal(b.fetch, UNOPENED, ids, UNOPENED.root(0, TEST_SECRET)),
    }
    after = w.snapshot()
    assert after[0] == before[0]  # etcd first: no namespaces/acme/<id> record appeared
    assert after == before  # both agents and the router's index untouched too
    assert got == {(P, NOT_YOURS)}


def test_cluster_identity_follows_events_but_reads_no_payloads(etcd, spawn_agent, start_router):
    """Item 4: the router's token streams events and reads stats, but FetchBlocks, Prefetch,
    Get and Lookup of a tenant's namespace are refused; the agent identity (peers) may pull."""
    w = World(etcd, spawn_agent, start_router)
    cluster = As(w.agents[0].address, "_cluster")
    first = next(
        iter(cluster.agent.Subscribe(agent_pb2.SubscribeRequest(), metadata=cluster.md, timeout=10))
    )
    assert first.snapshot
    assert cluster.call(cluster.agent.Stats, agent_pb2.StatsRequest(tenant="acme")).tenants
    before = w.snapshot()
    denied = {
        refusal(cluster.fetch, A_SPEC, w.ids, w.root)[0],
        refusal(cluster.fetch, A_SPEC, w.ids, w.root, with_spec=False)[0],
        refusal(As(w.agents[1].address, "_cluster").prefetch, A_SPEC, w.ids, w.root, "x:1")[0],
        refusal(
            cluster.call,
            cluster.agent.Get,
            agent_pb2.GetRequest(ns=ref(A_SPEC), block_ids=pack_ids(w.ids), parent_id=w.root),
        )[0],
        refusal(
            cluster.call,
            cluster.agent.Lookup,
            agent_pb2.LookupRequest(ns=ref(A_SPEC), block_ids=pack_ids(w.ids)),
        )[0],
    }
    assert denied == {P}
    assert w.snapshot() == before
    # A peer agent proves it is one with the agent credential, and may move the blocks.
    chunks = As(w.agents[0].address, "_agent").fetch(A_SPEC, w.ids, w.root)
    assert [bytes(d) for c in chunks for d in c.data] == w.blocks


def test_probes_of_another_tenant_get_one_answer(etcd, spawn_agent, start_router):
    """Item 2 and the probe half of the timing item: B asks every RPC about A's namespace
    with A's cached ids, with ids nothing caches, at a generation A's namespace is not at,
    and about a namespace of A's that exists nowhere: one answer, PERMISSION_DENIED with one
    message, for each RPC; and none of it changed anything anywhere."""
    w = World(etcd, spawn_agent, start_router)
    before = w.snapshot()
    b0, b1 = As(w.agents[0].address, "globex"), As(w.agents[1].address, "globex")
    probes = [
        (A_SPEC, w.ids, 0),  # A's namespace, prefix cached on agent 0
        (A_SPEC, w.uncached, 0),  # A's namespace, prefix cached nowhere
        (A_SPEC, w.ids, 7),  # a generation A's namespace is not at
        (UNOPENED, w.ids, 0),  # a namespace of A's that exists nowhere
    ]
    for name, rpc in _rpcs(b0, b1, w).items():
        answers = {refusal(rpc, spec, ids, gen) for spec, ids, gen in probes}
        assert answers == {(P, NOT_YOURS)}, name
    # Nor do B's OpenNamespace, Stats or Subscribe for A, nor B's Route of A's prefix.
    assert (
        refusal(
            b0.call, b0.agent.OpenNamespace, agent_pb2.OpenNamespaceRequest(spec=ns_msg(UNOPENED))
        )[0]
        == P
    )
    assert refusal(b0.call, b0.agent.Stats, agent_pb2.StatsRequest(tenant="acme"))[0] == P
    assert refusal(b0.call, b0.agent.Subscribe, agent_pb2.SubscribeRequest())[0] == P
    route = router_pb2_grpc.RouterStub(grpc.insecure_channel(w.router.address))
    for spec, ids, gen in probes:
        req = router_pb2.RouteRequest(
            namespace_id=spec.namespace_id, block_ids=pack_ids(ids), generation=gen
        )
        assert refusal(route.Route, req, metadata=b0.md, timeout=10) == (P, NOT_YOURS)
    assert w.snapshot() == before


def _rpcs(b0: As, b1: As, w: World) -> dict:
    """Every agent and peer RPC that names a namespace, as B's probe (spec, ids, gen)."""

    def unary(method, build):
        return lambda spec, ids, gen: b0.call(method, build(ref(spec, gen), ids))

    def put(spec, ids, gen):
        first = agent_pb2.PutRequest(ns=ref(spec, gen), root=w.root)
        first.blocks.add(block_id=ids[0], parent_id=w.root, data=b"\0" * spec.block_bytes)
        return b0.call(b0.agent.Put, iter([first]))

    def lookup(r, ids):
        return agent_pb2.LookupRequest(ns=r, block_ids=pack_ids(ids))

    def get(r, ids):
        return agent_pb2.GetRequest(ns=r, block_ids=pack_ids(ids), parent_id=w.root)

    def pin(r, ids):
        return agent_pb2.PinRequest(ns=r, block_ids=pack_ids(ids))

    return {
        "Lookup": unary(b0.agent.Lookup, lookup),
        "Get": unary(b0.agent.Get, get),
        "Pin": unary(b0.agent.Pin, pin),
        "Unpin": unary(b0.agent.Unpin, pin),
        "Put": put,
        "FetchBlocks": lambda spec, ids, gen: b0.fetch(spec, ids, w.root, gen, with_spec=False),
        "FetchBlocks+spec": lambda spec, ids, gen: b0.fetch(spec, ids, w.root, gen),
        "Prefetch": lambda spec, ids, gen: b1.prefetch(spec, ids, w.root, w.agents[0].address, gen),
    }


def test_public_names_of_a_tenant_cannot_be_squatted_to_fill_its_namespace_cap(
    etcd, spawn_agent, start_router
):
    """B opening A's public namespaces that A never opened would create them, counted
    against A's cap (3 here): B could lock A out of its own namespaces, and read A's count
    in the refusal. Only A creates its namespaces; B opens those A opened."""
    cfg = agent_config(
        etcd, tenants=tenants(), allow_unauthenticated=False, max_namespaces_per_tenant=3
    )
    agents = [spawn_agent(**cfg), spawn_agent(**cfg)]
    squats = [make_namespace(tenant="acme", name=f"squat{i}", public=True) for i in range(4)]
    b = As(agents[0].address, "globex")

    def acme_records() -> dict:  # A's namespace records and its namespace count
        items = etcd_items(etcd.endpoint)
        return {k: v for k, v in items.items() if k.startswith(("namespaces/", "ns-counts/"))}

    before = acme_records()
    for spec in squats:  # by OpenNamespace, and by FetchBlocks with the spec on the other
        code, details = refusal(b.call, b.agent.OpenNamespace, _open(spec))
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        assert details == (
            f"public namespace '{spec.name}' of tenant 'acme' is not open yet: only 'acme' "
            "creates it; open it after it has"
        )
        ids = hash_chain(spec.root(0, None), prompt_tokens(3, BS), BS)
        other = As(agents[1].address, "globex")
        code, _ = refusal(other.fetch, spec, ids, spec.root(0, None))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert acme_records() == before  # nothing registered, nothing counted
    # A still has its whole cap: three namespaces of its own...
    with KVClient(agents[0].address, token=TOKENS["acme"], use_shm=False) as a:
        for spec in squats[:3]:
            a.open_namespace(spec)
        a_raw = As(agents[0].address, "acme")
        code, details = refusal(a_raw.call, a_raw.agent.OpenNamespace, _open(squats[3]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    # ...and B opens the ones A opened, on either agent, at once: the other agent reads
    # etcd itself when its watch has not shown it the record yet.
    for address in (agents[0].address, agents[1].address):
        with KVClient(address, token=TOKENS["globex"], use_shm=False) as bc:
            assert bc.open_namespace(squats[0]).namespace_id == squats[0].namespace_id


def _open(spec) -> agent_pb2.OpenNamespaceRequest:
    return agent_pb2.OpenNamespaceRequest(spec=ns_msg(spec))


# ------------------------------------------------------------ capacity between tenants
G_CHAT = make_namespace(tenant="globex", name="chat")
SLOT = 64 << 10  # spawn_agent's slot_bytes


def _globex_chain(g: As) -> list[bytes]:
    """globex's 8-block prompt, stored: what the attacks below must leave in place."""
    g.call(g.agent.OpenNamespace, _open(G_CHAT))
    root = G_CHAT.root(0, TEST_SECRET)
    ids = hash_chain(root, prompt_tokens(1, 8 * G_CHAT.block_size), G_CHAT.block_size)
    assert put_chain(g, G_CHAT, ids, root).stored == 8
    return ids


def test_tiny_blocks_cannot_take_more_of_the_pool_than_the_quota(etcd, spawn_agent):
    """Quotas counted payload bytes, but every block takes a whole pool slot: acme, with a
    4-slot (256 KiB) HBM quota, opened a namespace of 4-byte blocks and filled all 64
    slots while 'using' a few hundred bytes, evicting globex's blocks. Each block in the
    pool is charged its slot now: acme holds 4 slots, globex keeps its 8 blocks."""
    asyncio.run(_set_quota(etcd, "acme", hbm=4 * SLOT))
    agent = spawn_agent(
        **agent_config(
            etcd, tenants=tenants(), allow_unauthenticated=False, pool_bytes="4MiB", nvme_bytes=0
        )
    )
    g, a, op = (As(agent.address, who) for who in ("globex", "acme", "_cluster"))

    def tenant_stats(name: str):
        resp = op.call(op.agent.Stats, agent_pb2.StatsRequest())
        return next((t for t in resp.tenants if t.tenant == name), None), resp.tiers[0]

    wait_for(
        lambda: (tenant_stats("acme")[0] or agent_pb2.TenantStats()).hbm_limit_bytes == 4 * SLOT,
        30,
        what="the agent to apply acme's quota",
    )
    gids = _globex_chain(g)
    tiny = make_namespace(
        tenant="acme", name="tiny", num_layers=1, num_kv_heads=1, head_dim=1, block_size=1
    )
    assert tiny.block_bytes == 4
    a.call(a.agent.OpenNamespace, _open(tiny))
    for seed in range(4):  # 128 blocks of 4 bytes: 512 bytes of payload
        root = tiny.root(0, TEST_SECRET)
        ids = hash_chain(root, prompt_tokens(100 + seed, 32), 1)
        put_chain(a, tiny, ids, root)
    acme, pool = tenant_stats("acme")
    globex, _ = tenant_stats("globex")
    assert acme is not None and globex is not None
    assert (acme.hbm_bytes, acme.hbm_limit_bytes) == (4 * SLOT, 4 * SLOT)
    assert globex.hbm_bytes == 8 * SLOT  # 4 KiB blocks, a 64 KiB slot each
    assert (pool.slots_total, pool.slots_free) == (64, 64 - 8 - 4)
    assert pool.used_bytes == acme.hbm_bytes + globex.hbm_bytes  # what the tenants are charged
    lk = g.call(g.agent.Lookup, agent_pb2.LookupRequest(ns=ref(G_CHAT), block_ids=pack_ids(gids)))
    assert (lk.matched, lk.hbm) == (8, 8)


def test_one_tenants_pins_across_its_namespaces_leave_room_for_others(etcd, spawn_agent):
    """The pin budget was per namespace: acme pinned 4 slots in each of 8 namespaces of
    its own, every slot of a 32-slot pool, and globex's Put was refused ("every slot is
    pinned"). One tenant pins at most tenant_pin_fraction (default half) of the pool, all
    its namespaces together; the refusal names that limit."""
    agent = spawn_agent(
        **agent_config(
            etcd,
            tenants=tenants(),
            allow_unauthenticated=False,
            pool_bytes="2MiB",
            nvme_bytes=0,
            default_policy={"pin_budget_bytes": 4 * SLOT},
        )
    )
    g, a = As(agent.address, "globex"), As(agent.address, "acme")
    pinned, refused = 0, []
    for k in range(8):
        spec = make_namespace(tenant="acme", name=f"pin-{k}")
        a.call(a.agent.OpenNamespace, _open(spec))
        root = spec.root(0, TEST_SECRET)
        ids = hash_chain(root, prompt_tokens(200 + k, 4 * spec.block_size), spec.block_size)
        assert put_chain(a, spec, ids, root).stored == 4
        pin = agent_pb2.PinRequest(ns=ref(spec), block_ids=pack_ids(ids))
        try:
            pinned += a.call(a.agent.Pin, pin).blocks
        except grpc.RpcError as exc:
            refused.append((exc.code(), exc.details()))
    assert pinned == 16  # half of the 32 slots
    assert len(refused) == 4
    code, details = refused[0]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"tenant acme's pin limit on this node of {16 * SLOT} bytes" in details, details
    gids = _globex_chain(g)  # room for globex: acme's unpinned blocks make way
    lk = g.call(g.agent.Lookup, agent_pb2.LookupRequest(ns=ref(G_CHAT), block_ids=pack_ids(gids)))
    assert lk.matched == 8


async def _set_quota(etcd, tenant: str, hbm: int) -> None:
    async with EtcdClient(etcd.endpoint) as c:
        await c.put_tenant(tenant, {"hbm_limit_bytes": hbm})


def test_reading_a_public_namespace_counts_in_the_readers_rates_not_the_owners(spawn_agent):
    """B's Lookups of junk ids in A's public namespace turned A's hit rate from 100 % to
    4 % (A's Stats and metrics) and pushed A's request ids out of A's ledger, while B's
    own Stats showed nothing. A request counts for the tenant that makes it."""
    agent = spawn_agent(tenants=tenants(), allow_unauthenticated=False)
    spec = make_namespace(tenant="acme", name="docs", public=True)
    tokens = prompt_tokens(21, 4 * BS)

    def usage(who: str):
        with KVClient(agent.address, token=TOKENS[who], use_shm=False) as c:
            return next(t for t in c.stats().tenants if t.tenant == who)

    with KVClient(agent.address, token=TOKENS["acme"], tenant_secret="s", use_shm=False) as a:
        ns = a.open_namespace(spec)
        ids = a.block_ids(ns, tokens)
        blocks = [block_payload(i, spec.block_bytes) for i in ids]
        tensors = [
            torch.frombuffer(bytearray(b), dtype=torch.uint8)
            .view(torch_dtype(spec.kv_dtype))
            .view(block_shape(spec))
            for b in blocks
        ]
        assert a.put(ns, ids, tensors).stored == 4
        assert a.lookup(ns, ids, request_id="a-1").matched == 4
    owner = usage("acme")
    assert (owner.lookups, owner.lookup_hits) == (1, 1)
    with KVClient(agent.address, token=TOKENS["globex"], tenant_secret="s", use_shm=False) as b:
        nb = b.open_namespace(spec)  # public: B may read
        assert b.lookup(nb, ids, request_id="b-1").matched == 4
        junk = hash_chain(nb.root, prompt_tokens(22, 64 * BS), BS)
        for i in range(20):
            assert b.lookup(nb, junk, request_id=f"b-junk-{i}").matched == 0
    assert usage("acme") == owner  # A's rates as A left them
    reader = usage("globex")
    assert (reader.lookups, reader.lookup_hits, reader.lookup_hit_blocks) == (21, 1, 4)
