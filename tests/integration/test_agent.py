"""Node agent over real gRPC, as a real process (spawn_agent): data path on both transports,
spill/promotion, restart recovery, on-disk corruption, precise status codes for bad input,
tenant auth, health checking and the event stream."""

from __future__ import annotations

import hashlib
import json
import os

import grpc
import pytest
import torch
from support.common import (
    TEST_SECRET,
    block_payload,
    flip_rocks_byte,
    make_namespace,
    open_rocks_raw,
    prompt_tokens,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.lane_raw import lane_region

from kvstore import checksum as cks
from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.hashing import pack_ids
from kvstore.v1 import agent_pb2, agent_pb2_grpc, common_pb2

SPEC = make_namespace()
BS = SPEC.block_size
NB = SPEC.block_bytes
SMALL_POOL = dict(pool_bytes=f"{8 * 64}KiB")  # 8 slots of 64 KiB


def blocks_for(seed: int, n: int, spec=SPEC) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(block_shape(spec), generator=g).to(torch_dtype(spec.kv_dtype)) for _ in range(n)
    ]


def store_prompt(client, ns, seed: int, n_blocks: int):
    """Put an n-block prompt; returns (ids, block tensors)."""
    ids = client.block_ids(ns, prompt_tokens(seed, n_blocks * BS))
    blocks = blocks_for(seed, n_blocks, ns.spec)
    r = client.put(ns, ids, blocks)
    assert r.stored + r.already_present == n_blocks
    return ids, blocks


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def stats_counters(client) -> dict:
    return dict(client.stats().counters)


def expect_status(code: grpc.StatusCode, fn, *args, match: str | None = None, **kw):
    with pytest.raises(grpc.RpcError) as ei:
        r = fn(*args, **kw)
        if hasattr(r, "__next__"):  # server streams fail on the first read
            list(r)
    assert ei.value.code() == code, ei.value.details()
    if match:
        assert match in ei.value.details(), ei.value.details()
    return ei.value


# ------------------------------------------------------------------------- data path
def test_round_trip_over_shared_memory_and_grpc(spawn_agent):
    agent = spawn_agent()
    with (
        KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as shm_c,
        KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as grpc_c,
    ):
        assert shm_c.uses_shm and not grpc_c.uses_shm
        ns_s = shm_c.open_namespace(SPEC)
        ns_g = grpc_c.open_namespace(SPEC)
        assert ns_s.namespace_id == ns_g.namespace_id == SPEC.namespace_id
        assert ns_s.block_bytes == NB and ns_s.root == ns_g.root
        # 20 blocks: more than one gRPC message each way.
        ids_a, blocks_a = store_prompt(shm_c, ns_s, 1, 20)
        ids_b, blocks_b = store_prompt(grpc_c, ns_g, 2, 20)
        for c, ns in ((shm_c, ns_s), (grpc_c, ns_g)):
            assert c.lookup(ns, ids_a).matched == 20
            assert same(c.get(ns, ids_a), blocks_a)
            assert same(c.get(ns, ids_b), blocks_b)
            # From the middle of the chain, with the explicit parent.
            assert same(c.get(ns, ids_a[5:], parent=ids_a[4]), blocks_a[5:])
            assert c.get(ns, ids_a[5:], parent=ids_b[4]) == []  # wrong chain
        views = shm_c.get_views(ns_s, ids_a[:3])
        assert same(views, blocks_a[:3])
        r = grpc_c.put(ns_g, ids_a, blocks_a)
        assert (r.stored, r.already_present) == (0, 20)
        st = grpc_c.stats()
        assert st.tiers[0].blocks == 40 and st.node_id == agent.config["node_id"]


def test_spill_promotion_and_restart_recovery(spawn_agent):
    agent = spawn_agent(**SMALL_POOL)
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        ids_a, blocks_a = store_prompt(c, ns, 1, 6)
        ids_b, blocks_b = store_prompt(c, ns, 2, 6)
        la = c.lookup(ns, ids_a)
        assert (la.matched, la.hbm, la.nvme) == (6, 2, 4)  # four of A spilled
        assert same(c.get(ns, ids_a), blocks_a)
        la, lb = c.lookup(ns, ids_a), c.lookup(ns, ids_b)
        assert (la.hbm, la.nvme) == (6, 0)  # promoted on get
        assert (lb.hbm, lb.nvme) == (2, 4)  # B made room
        counters = stats_counters(c)
        assert counters["promotions"] == 4 and counters["demotions"] >= 8
    agent.restart()  # a clean stop writes the pool's chain heads next to their tails
    with KVClient(agent.address, tenant_secret=TEST_SECRET) as c:
        ns = c.open_namespace(SPEC)
        counters = stats_counters(c)
        assert counters["recovered_blocks"] == 12 and counters["recovery_dropped"] == 0
        for ids, blocks in ((ids_a, blocks_a), (ids_b, blocks_b)):
            r = c.lookup(ns, ids)
            assert (r.matched, r.hbm, r.nvme) == (6, 0, 6)
            assert same(c.get(ns, ids), blocks)  # over shared memory this time


def test_corrupt_record_on_disk_is_never_served(spawn_agent):
    agent = spawn_agent(**SMALL_POOL)
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        ids, blocks = store_prompt(c, ns, 1, 6)
        store_prompt(c, ns, 2, 8)  # spills all of the first prompt
        assert c.lookup(ns, ids).nvme == 6
    agent.stop()
    flip_rocks_byte(agent.config["data_dir"], SPEC.namespace_id + ids[3], offset=-7)
    agent.start()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        assert c.lookup(ns, ids).matched == 3
        got = c.get(ns, ids)
        assert same(got, blocks[:3])
        counters = stats_counters(c)
        assert counters["recovery_dropped"] == 3  # the corrupt block and its 2 descendants
        assert counters["recovered_blocks"] == 3 + 8  # and the whole second prompt


def _set_generation_on_disk(data_dir, ns_id: bytes, generation: int) -> None:
    db = open_rocks_raw(data_dir)
    try:
        meta = db.get_column_family("meta")
        rec = json.loads(meta[b"ns:" + ns_id])
        rec["generation"] = generation
        meta[b"ns:" + ns_id] = json.dumps(rec).encode()
        db.flush()
        del meta
    finally:
        db.close()


def test_stale_generation_is_failed_precondition(spawn_agent):
    agent = spawn_agent(**SMALL_POOL)
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        ids, _ = store_prompt(c, ns, 1, 4)
        store_prompt(c, ns, 2, 8)
        ahead = agent_pb2.NamespaceRef(namespace_id=ns.namespace_id, generation=1)
        expect_status(
            grpc.StatusCode.FAILED_PRECONDITION,
            c.stub.Lookup,
            agent_pb2.LookupRequest(ns=ahead, block_ids=pack_ids(ids)),
            match="ahead",
        )
    agent.stop()
    _set_generation_on_disk(agent.config["data_dir"], SPEC.namespace_id, 1)  # a flush
    agent.start()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        old = agent_pb2.NamespaceRef(namespace_id=SPEC.namespace_id, generation=0)
        expect_status(
            grpc.StatusCode.FAILED_PRECONDITION,
            c.stub.Lookup,
            agent_pb2.LookupRequest(ns=old, block_ids=pack_ids(ids)),
            match="stale",
        )
        expect_status(
            grpc.StatusCode.FAILED_PRECONDITION,
            c.stub.Get,
            agent_pb2.GetRequest(ns=old, block_ids=pack_ids(ids)),
            match="stale",
        )
        ns = c.open_namespace(SPEC)
        assert ns.generation == 1
        assert c.lookup(ns, ids).matched == 0
        assert c.stats().counters["recovery_dropped"] >= 4  # old-generation records


# ------------------------------------------------------------------------- bad input
class Probe:
    """A namespace with stored blocks, to check after every bad request that the agent
    still serves them unchanged."""

    def __init__(self, client: KVClient) -> None:
        self.client = client
        self.ns = client.open_namespace(SPEC)
        self.ids, self.blocks = store_prompt(client, self.ns, 99, 3)

    def intact(self) -> None:
        assert self.client.lookup(self.ns, self.ids).matched == 3
        assert same(self.client.get(self.ns, self.ids), self.blocks)


def _put_req(ns, ids, datas, parent, **kw):
    blocks = []
    for bid, d in zip(ids, datas):
        blocks.append(agent_pb2.BlockPut(block_id=bid, parent_id=parent, data=d, **kw))
        parent = bid
    return agent_pb2.PutRequest(ns=ns.ref, blocks=blocks, root=ns.root)


def test_bad_requests_get_precise_status_codes(spawn_agent):
    agent = spawn_agent(max_message_bytes="1MiB", max_blocks_per_request=64)
    with (
        KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as c,
        lane_region(c.stub) as (_, region),
    ):
        assert c.uses_shm
        probe = Probe(c)
        ns, stub, IA = probe.ns, c.stub, grpc.StatusCode.INVALID_ARGUMENT
        ids = c.block_ids(ns, prompt_tokens(5, 4 * BS))
        good = [bytes(NB)] * 4
        checks = [
            # wrong block size
            (
                IA,
                stub.Put,
                iter([_put_req(ns, ids[:1], [b"x" * (NB - 2)], ns.root)]),
                f"{NB - 2} bytes",
            ),
            # block ids not a multiple of 16
            (
                IA,
                stub.Lookup,
                agent_pb2.LookupRequest(ns=ns.ref, block_ids=b"x" * 17),
                "multiple of 16",
            ),
            (IA, stub.Get, agent_pb2.GetRequest(ns=ns.ref, block_ids=b"x" * 33), "multiple of 16"),
            (IA, stub.Pin, agent_pb2.PinRequest(ns=ns.ref, block_ids=b"x" * 5), "multiple of 16"),
            # unknown namespace, malformed namespace id
            (
                grpc.StatusCode.NOT_FOUND,
                stub.Lookup,
                agent_pb2.LookupRequest(
                    ns=agent_pb2.NamespaceRef(namespace_id=b"\x01" * 16), block_ids=ids[0]
                ),
                "unknown namespace",
            ),
            (
                IA,
                stub.Lookup,
                agent_pb2.LookupRequest(ns=agent_pb2.NamespaceRef(namespace_id=b"\x01" * 3)),
                "16 bytes",
            ),
            # too many blocks
            (
                IA,
                stub.Lookup,
                agent_pb2.LookupRequest(ns=ns.ref, block_ids=b"\0" * 16 * 65),
                "limit is 64",
            ),
            (
                IA,
                stub.Get,
                agent_pb2.GetRequest(ns=ns.ref, block_ids=b"\0" * 16 * 65),
                "limit is 64",
            ),
            # a bad parent id, an empty Put, a Put without its namespace
            (
                IA,
                stub.Get,
                agent_pb2.GetRequest(ns=ns.ref, block_ids=ids[0], parent_id=b"xy"),
                "parent_id",
            ),
            (IA, stub.Put, iter([]), "empty Put"),
            (IA, stub.Put, iter([agent_pb2.PutRequest()]), "must carry ns"),
            # checksum mismatch on put
            (
                grpc.StatusCode.DATA_LOSS,
                stub.Put,
                iter(
                    [
                        _put_req(
                            ns,
                            ids[:1],
                            good[:1],
                            ns.root,
                            checksum=cks.checksum(b"other"),
                            has_checksum=True,
                        )
                    ]
                ),
                "checksum",
            ),
            # shared-memory targets: unknown region, range outside it, offsets count
            (
                grpc.StatusCode.NOT_FOUND,
                stub.Get,
                agent_pb2.GetRequest(
                    ns=ns.ref,
                    block_ids=probe.ids[0],
                    parent_id=ns.root,
                    shm=agent_pb2.ShmTarget(region_id=999, offsets=[0]),
                ),
                "region 999",
            ),
            (
                IA,
                stub.Get,
                agent_pb2.GetRequest(
                    ns=ns.ref,
                    block_ids=probe.ids[0],
                    parent_id=ns.root,
                    shm=agent_pb2.ShmTarget(region_id=region, offsets=[(1 << 20) - 10]),
                ),
                "outside region",
            ),
            (
                IA,
                stub.Get,
                agent_pb2.GetRequest(
                    ns=ns.ref,
                    block_ids=pack_ids(probe.ids),
                    parent_id=ns.root,
                    shm=agent_pb2.ShmTarget(region_id=region, offsets=[0]),
                ),
                "offsets",
            ),
            (
                IA,
                stub.Put,
                iter(
                    [
                        agent_pb2.PutRequest(
                            ns=ns.ref,
                            shm_region_id=region,
                            root=ns.root,
                            blocks=[
                                agent_pb2.BlockPut(
                                    block_id=ids[0], parent_id=ns.root, shm_offset=1 << 40
                                )
                            ],
                        )
                    ]
                ),
                "outside region",
            ),
            (
                grpc.StatusCode.NOT_FOUND,
                stub.Put,
                iter(
                    [
                        agent_pb2.PutRequest(
                            ns=ns.ref,
                            shm_region_id=12345,
                            blocks=[agent_pb2.BlockPut(block_id=ids[0], parent_id=ns.root)],
                        )
                    ]
                ),
                "region 12345",
            ),
            # the packed chain form of a shared-memory Put: every field checked first
            *[
                (IA, stub.Put, iter([agent_pb2.PutRequest(ns=ns.ref, root=ns.root, **kw)]), why)
                for kw, why in (
                    (dict(chain_ids=ids[0], chain_parent_id=ns.root), "shm_region_id set"),
                    (
                        dict(
                            shm_region_id=region,
                            chain_ids=ids[0],
                            chain_parent_id=ns.root,
                            chain_stride=NB,
                            blocks=[agent_pb2.BlockPut(block_id=ids[0], parent_id=ns.root)],
                        ),
                        "one or the other",
                    ),
                    (
                        dict(shm_region_id=region, chain_ids=b"x" * 20, chain_stride=NB),
                        "multiple of 16",
                    ),
                    (
                        dict(shm_region_id=region, chain_ids=ids[0], chain_stride=NB),
                        "chain_parent_id must be 16 bytes",
                    ),
                    (
                        dict(
                            shm_region_id=region,
                            chain_ids=pack_ids(ids[:2]),
                            chain_parent_id=ns.root,
                            chain_stride=NB - 1,
                        ),
                        f"below the namespace's {NB}-byte blocks",
                    ),
                    (
                        dict(
                            shm_region_id=region,
                            chain_ids=pack_ids(ids[:2]),
                            chain_parent_id=ns.root,
                            chain_stride=1 << 20,  # the second block past the 1 MiB region
                        ),
                        "outside region",
                    ),
                    (
                        dict(
                            shm_region_id=region,
                            chain_ids=ids[0],
                            chain_parent_id=ns.root,
                            chain_first_offset=2**64 - 1,  # far past any region
                            chain_stride=NB,
                        ),
                        "outside region",
                    ),
                    (
                        dict(shm_region_id=region, chain_parent_id=ns.root, chain_stride=NB),
                        "describe chain_ids, which is empty",
                    ),
                    (
                        dict(
                            shm_region_id=region,
                            chain_ids=b"\0" * 16 * 65,
                            chain_parent_id=ns.root,
                            chain_stride=NB,
                        ),
                        "more than 64 blocks",
                    ),
                )
            ],
            # memory by name (over gRPC): never; only a descriptor over the local lane
            (
                grpc.StatusCode.PERMISSION_DENIED,
                stub.RegisterShm,
                agent_pb2.RegisterShmRequest(name="../etc/passwd", size=4096),
                "file descriptor",
            ),
            # blocks bigger than this node's slots
            (
                IA,
                stub.OpenNamespace,
                agent_pb2.OpenNamespaceRequest(
                    spec=common_pb2.Namespace(**make_namespace(head_dim=4096).to_dict())
                ),
                "slots",
            ),
            (IA, stub.OpenNamespace, agent_pb2.OpenNamespaceRequest(), "needs a spec"),
        ]
        for code, fn, req, match in checks:
            expect_status(code, fn, req, match=match)
            probe.intact()
        # An incomplete namespace spec names every missing field.
        spec = SPEC.to_dict()
        spec.update(model_revision="", tokenizer_id="", rope_theta=0.0)
        err = expect_status(
            IA,
            stub.OpenNamespace,
            agent_pb2.OpenNamespaceRequest(spec=common_pb2.Namespace(**spec)),
        )
        for name in ("model_revision", "tokenizer_id", "rope_theta"):
            assert name in err.details()
        expect_status(
            IA,
            stub.OpenNamespace,
            agent_pb2.OpenNamespaceRequest(
                spec=common_pb2.Namespace(**{**SPEC.to_dict(), "kv_dtype": "fp4"})
            ),
            match="kv_dtype",
        )
        # A message over max_message_bytes is refused by gRPC itself.
        big = [bytes(NB)] * 300  # ~1.2 MiB of payload in one message
        expect_status(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            stub.Put,
            iter([_put_req(ns, c.block_ids(ns, prompt_tokens(6, 300 * BS)), big, ns.root)]),
        )
        probe.intact()
        # A checksum mismatch keeps nothing of the bad block, and no slot leaks.
        assert c.lookup(ns, ids).matched == 0
        st = c.stats()
        assert st.tiers[0].slots_total - st.tiers[0].slots_free == 3
        # Still serving, and a later good put works.
        health = health_pb2_grpc.HealthStub(c.channel)
        assert (
            health.Check(health_pb2.HealthCheckRequest()).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        assert c.put(ns, ids, blocks_for(5, 4)).stored == 4


# ------------------------------------------------------------------------------ auth
TOKENS = {"acme": "acme-token", "beta": "beta-token", "_cluster": "router-token"}
A_MD = (("authorization", "Bearer " + TOKENS["acme"]),)
B_MD = (("authorization", "Bearer " + TOKENS["beta"]),)


def _tenants():
    return {
        t: {"token_sha256": hashlib.sha256(tok.encode()).hexdigest()} for t, tok in TOKENS.items()
    }


def test_tenant_auth_and_isolation(spawn_agent):
    agent = spawn_agent(allow_unauthenticated=False, tenants=_tenants())
    private = make_namespace(tenant="acme", name="chat")
    public = make_namespace(tenant="acme", name="docs", public=True)
    with (
        KVClient(
            agent.address, token=TOKENS["acme"], tenant_secret="acme-secret", use_shm=False
        ) as a,
        KVClient(
            agent.address, token=TOKENS["beta"], tenant_secret="beta-secret", use_shm=False
        ) as b,
        KVClient(agent.address, use_shm=False) as anon,
        lane_region(a.stub, metadata=A_MD) as (a_lane, a_region_id),
    ):
        ns_priv = a.open_namespace(private)
        ns_pub = a.open_namespace(public)
        ids_priv, blocks_priv = store_prompt(a, ns_priv, 1, 3)
        ids_pub, blocks_pub = store_prompt(a, ns_pub, 2, 3)
        U, P = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
        expect_status(U, anon.open_namespace, private, match="authorization")
        expect_status(U, anon.lookup, ns_priv, ids_priv)
        with KVClient(agent.address, token="wrong", use_shm=False) as bad:
            expect_status(U, bad.lookup, ns_priv, ids_priv, match="unknown token")
        # Tenant B can neither open nor read nor write A's private namespace.
        expect_status(P, b.open_namespace, private, match="'beta'")
        expect_status(P, b.lookup, ns_priv, ids_priv)
        expect_status(P, b.get, ns_priv, ids_priv)
        expect_status(P, b.put, ns_priv, ids_priv, blocks_priv)
        expect_status(P, b.stats, "acme")
        # A's shared-memory region is A's alone: to B it is an unknown region.
        expect_status(
            grpc.StatusCode.NOT_FOUND,
            b.stub.Get,
            agent_pb2.GetRequest(
                ns=ns_pub.ref,
                block_ids=ids_pub[0],
                parent_id=ns_pub.root,
                shm=agent_pb2.ShmTarget(region_id=a_region_id, offsets=[0]),
            ),
            metadata=B_MD,
        )
        # Nor can B map memory by a name (anyone on the host can list /dev/shm).
        expect_status(
            P,
            b.stub.RegisterShm,
            agent_pb2.RegisterShmRequest(name=os.path.basename(a_lane), size=1 << 20),
            metadata=B_MD,
            match="file descriptor",
        )
        # A public namespace is readable by B, not writable.
        ns_pub_b = b.open_namespace(public)
        assert ns_pub_b.root == ns_pub.root  # unkeyed: B computes the same ids
        assert b.block_ids(ns_pub_b, prompt_tokens(2, 3 * BS)) == ids_pub
        assert b.lookup(ns_pub_b, ids_pub).matched == 3
        assert same(b.get(ns_pub_b, ids_pub), blocks_pub)
        more = b.block_ids(ns_pub_b, prompt_tokens(3, 2 * BS))
        expect_status(P, b.put, ns_pub_b, more, blocks_for(3, 2), match="may not write")
        expect_status(P, b.pin, ns_pub_b, ids_pub)
        # The event stream is for cluster components.
        expect_status(P, b.stub.Subscribe, agent_pb2.SubscribeRequest(), metadata=B_MD)
        router_md = (("authorization", "Bearer " + TOKENS["_cluster"]),)
        first = next(
            iter(
                a.stub.Subscribe(
                    agent_pb2.SubscribeRequest(subscriber="r"), metadata=router_md, timeout=10
                )
            )
        )
        assert first.snapshot
        # Nothing B tried changed A's blocks; B's stats show nothing of A's.
        assert same(a.get(ns_priv, ids_priv), blocks_priv)
        b_stats = b.stats()
        assert all(t.tenant == "beta" for t in b_stats.tenants) and not b_stats.counters
        a_stats = a.stats()
        assert [t.tenant for t in a_stats.tenants] == ["acme"]
        assert a_stats.tenants[0].hbm_bytes > 0  # its own usage, as before
        # The node's occupancy is every tenant's: a tenant sees capacities, not usage.
        node = a.stub.Stats(agent_pb2.StatsRequest(), metadata=router_md)
        assert node.utilization > 0 and node.tiers[0].blocks == 6 and node.tiers[0].used_bytes
        for st in (a_stats, b_stats):
            assert (st.in_flight, st.utilization) == (0, 0)
            t = st.tiers[0]
            assert (t.used_bytes, t.blocks, t.slots_free) == (0, 0, 0), t
            assert (t.capacity_bytes, t.slots_total) == (
                node.tiers[0].capacity_bytes,
                node.tiers[0].slots_total,
            )
        # Health checking needs no token.
        health = health_pb2_grpc.HealthStub(anon.channel)
        assert (
            health.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.NodeAgent")).status
            == health_pb2.HealthCheckResponse.SERVING
        )


# ----------------------------------------------------------------- health, events
def test_health_and_event_stream(spawn_agent):
    agent = spawn_agent(**SMALL_POOL)
    channel = grpc.insecure_channel(agent.address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvstore.v1.NodeAgent"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
            ns = c.open_namespace(SPEC)
            ids_a, _ = store_prompt(c, ns, 1, 3)
            stream = agent_pb2_grpc.NodeAgentStub(channel).Subscribe(
                agent_pb2.SubscribeRequest(subscriber="test"), timeout=20
            )
            snap = []
            for batch in stream:
                assert batch.snapshot
                snap.extend(batch.events)
                if batch.snapshot_done:
                    break
            seq0 = snap[0].seq
            held = {bid for e in snap for bid in _split(e.block_ids)}
            assert held == set(ids_a)
            ids_b, _ = store_prompt(c, ns, 2, 8)  # 8 more: demotes 3 blocks
            live = []
            for batch in stream:
                assert not batch.snapshot
                live.extend(batch.events)
                if sum(
                    len(_split(e.block_ids)) for e in live if e.kind == agent_pb2.Event.STORED
                ) >= 8 and any(e.kind == agent_pb2.Event.TIER_CHANGED for e in live):
                    break
            stream.cancel()
        assert [e.seq for e in live] == list(range(seq0 + 1, seq0 + 1 + len(live)))
        stored = [b for e in live if e.kind == agent_pb2.Event.STORED for b in _split(e.block_ids)]
        assert stored == ids_b
        first_stored = next(e for e in live if e.kind == agent_pb2.Event.STORED)
        assert first_stored.parent_id == ns.root
        demoted = {
            b for e in live if e.kind == agent_pb2.Event.TIER_CHANGED for b in _split(e.block_ids)
        }
        assert demoted and demoted <= set(ids_a)
    finally:
        channel.close()


def _split(packed: bytes) -> list[bytes]:
    return [packed[i : i + 16] for i in range(0, len(packed), 16)]


def test_agent_rejects_bad_configuration(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"pool_bytes": "lots"}))
    r = subprocess.run(
        [sys.executable, "-m", "node_agent", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        ),
    )
    assert r.returncode == 2
    assert "pool_bytes" in r.stderr


def test_orphan_blocks_are_refused(spawn_agent):
    """A block whose parent the node does not hold (and that is not the chain root) is
    refused: the node never holds a block without its whole prefix."""
    agent = spawn_agent()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(make_namespace())
        tokens = list(range(64))
        ids = c.block_ids(ns, tokens)
        blocks = [block_payload(b, ns.block_bytes) for b in ids]
        r = c.stub.Put(iter([_put_req(ns, ids[2:], blocks[2:], ids[1])]))
        assert r.stored == 0
        assert r.not_stored.startswith(f"block 0: its parent {ids[1].hex()[:12]} is not held")
        assert c.lookup(ns, ids).matched == 0
        assert dict(c.stats().counters)["put_orphan"] == 2
        r = c.stub.Put(iter([_put_req(ns, ids, blocks, ns.root)]))
        assert r.stored == 4 and r.not_stored == ""
        assert c.lookup(ns, ids).matched == 4
