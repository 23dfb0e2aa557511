"""Control plane against real etcd, real agent processes and a real router process: atomic
flush racing lookups and routes, a node down during a flush, the kill switch across
restarts, quotas isolating tenants, and an etcd outage (data path keeps serving, admin
commands fail clearly)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import pytest
from support.cluster import spawn_many
from support.common import PY, ROOT, Lines, make_namespace, wait_for
from support.control import (
    AgentClient,
    agent_cfg,
    chain,
    kvctl,
    kvctl_json,
    lagging_watches,
    status_of,
    with_fake_member,
)

from kvstore.coord.admin import ControlPlane
from kvstore.coord.admin_records import ROUTERS
from kvstore.coord.etcd import EtcdClient, NodeRecord
from kvstore import errors
from kvstore.hashing import pack_ids
from kvstore.v1 import agent_pb2, agent_pb2_grpc, router_pb2, router_pb2_grpc
from node_agent.control import AgentControl
from node_agent.registration import Registration
from router.control import RouterControl

SPEC = make_namespace()
# Same name, another weights revision: `flush acme/chat` takes both in one transaction.
SPEC_R2 = make_namespace(model_revision="r2")
OTHER = make_namespace(name="code")
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def _stale(client: AgentClient, spec, ids, generation) -> bool:
    return status_of(client.lookup, spec, ids, generation) == FAILED_PRECONDITION


# ------------------------------------------------------------- flush under load
PER_PHASE = 1000  # lookups and routes each, before the flush starts and after it returns
_STORM_LIMIT_S = 90.0  # safety bound only


class Storm:
    """Old-generation lookups (every agent, 16 in flight) and routes (the router, 4 in
    flight), all over gRPC, until PER_PHASE of each were sent after the flush returned.
    Records (sent_at, kind, outcome), outcome one of hit / miss / stale (refused:
    fenced). Bounded in count, and in time as a safety net."""

    def __init__(self, addresses, ids, router_address: str) -> None:
        self.ids = ids
        self.addresses = addresses
        self.router_address = router_address
        self.samples: list[tuple[float, str, str]] = []
        self.done_at: float | None = None
        self.counts = {"lookup": [0, 0], "route": [0, 0]}  # [before, after]

    def _record(self, sent: float, kind: str, outcome: str) -> None:
        self.samples.append((sent, kind, outcome))
        self.counts[kind][self.done_at is not None and sent > self.done_at] += 1

    def _more(self, kind: str, deadline: float) -> bool:
        return self.counts[kind][1] < PER_PHASE and asyncio.get_running_loop().time() < deadline

    def ready(self) -> bool:
        return all(c[0] >= PER_PHASE for c in self.counts.values())

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _STORM_LIMIT_S
        channels = [grpc.aio.insecure_channel(a) for a in self.addresses]
        ref = agent_pb2.NamespaceRef(namespace_id=SPEC.namespace_id, generation=0)
        req = agent_pb2.LookupRequest(ns=ref, block_ids=pack_ids(self.ids))
        router = grpc.aio.insecure_channel(self.router_address)
        route_stub = router_pb2_grpc.RouterStub(router)
        route_req = router_pb2.RouteRequest(
            namespace_id=SPEC.namespace_id, generation=0, block_ids=pack_ids(self.ids), dry_run=True
        )

        async def lookups(stub):
            while self._more("lookup", deadline):
                sent = loop.time()
                try:
                    resp = await stub.Lookup(req, timeout=10)
                    self._record(sent, "lookup", "hit" if resp.matched else "miss")
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == FAILED_PRECONDITION, exc
                    self._record(sent, "lookup", "stale")

        async def routes():
            while self._more("route", deadline):
                sent = loop.time()
                try:
                    resp = await route_stub.Route(route_req, timeout=10)
                    self._record(sent, "route", "hit" if resp.matched_blocks else "miss")
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == FAILED_PRECONDITION, exc
                    self._record(sent, "route", "stale")

        stubs = [agent_pb2_grpc.NodeAgentStub(c) for c in channels]
        try:
            await asyncio.gather(
                *[lookups(s) for s in stubs for _ in range(8)], *[routes() for _ in range(4)]
            )
        finally:
            for c in channels + [router]:
                await c.close()


async def _flush_under_load(etcd, addresses, router_address, ids):
    storm = Storm(addresses, ids, router_address)
    task = asyncio.create_task(storm.run())
    for _ in range(600):
        if storm.ready() or task.done():
            break
        await asyncio.sleep(0.05)
    proc = await asyncio.create_subprocess_exec(
        PY,
        "-m",
        "kvstore.cli",
        "flush",
        "acme/chat",
        "--etcd",
        etcd.endpoint,
        "-o",
        "json",
        cwd=ROOT,
        env={**os.environ, "KVSTORE_OPERATOR": "test-operator"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    storm.done_at = asyncio.get_running_loop().time()
    await asyncio.wait_for(task, _STORM_LIMIT_S + 10)
    assert proc.returncode == 0, stderr.decode()
    return json.loads(stdout), storm


def test_flush_racing_lookups_and_routes_leaves_no_old_hits(etcd, spawn_agent, start_router):
    agents = spawn_many(spawn_agent, 2, **agent_cfg(etcd))
    clients = [AgentClient(a.address) for a in agents]
    ids = []
    for c in clients:
        assert c.open(SPEC).generation == 0
        assert c.open(SPEC_R2).generation == 0
        ids = c.put_chain(SPEC, 1, 8, 0)
        c.put_chain(SPEC_R2, 2, 4, 0)
        c.open(OTHER)
        other_ids = c.put_chain(OTHER, 3, 4, 0)
    router = start_router("r1")
    router.wait_nodes({"agent-0": 16, "agent-1": 16})
    assert router.route(SPEC.namespace_id, pack_ids(ids), dry_run=True).matched_blocks == 8
    report, storm = asyncio.run(
        _flush_under_load(etcd, [a.address for a in agents], router.address, ids)
    )

    assert report["ok"] and report["missing"] == []
    assert set(report["acknowledged"]) == {"agent-0", "agent-1", "router:r1"}
    assert {(n["name"], n["new_generation"]) for n in report["namespaces"]} == {("chat", 1)}, (
        "both revisions of acme/chat, nothing else"
    )
    assert len(report["namespaces"]) == 2
    assert report["blocks_scheduled_for_deletion"] == 2 * (8 + 4)
    assert storm.ready() and all(c[1] >= PER_PHASE for c in storm.counts.values()), storm.counts
    before = [s for s in storm.samples if s[0] <= storm.done_at]
    after = [s for s in storm.samples if s[0] > storm.done_at]
    assert {k for _, k, outcome in before if outcome == "hit"} == {"lookup", "route"}
    assert not [s for s in after if s[2] == "hit"], "an old-generation hit after the flush"
    # and not by luck: every old-generation request after it was refused (fenced)
    assert {outcome for _, _, outcome in after} == {"stale"}
    for c in clients:
        assert _stale(c, SPEC, ids, 0)
        assert status_of(c.get_count, SPEC, ids, 0) == FAILED_PRECONDITION
        assert c.open(SPEC).generation == 1
        assert c.lookup(SPEC, chain(SPEC, 1, 8, 1)[0], 1).matched == 0
        assert c.lookup(OTHER, other_ids, 0).matched == 4, "other namespaces keep their blocks"
        counters = c.stats().counters
        assert counters["blocks_dropped_flush"] == 12
        assert c.stats().tiers[0].blocks == 4  # only `code` left in the pool
        new_ids = c.put_chain(SPEC, 1, 8, 1)  # caching resumes at the new generation
        assert c.lookup(SPEC, new_ids, 1).matched == 8
        c.close()
    audit = kvctl_json("audit", etcd=etcd)
    assert [(a["action"], a["target"], a["ok"], a["who"]) for a in audit] == [
        ("flush", "acme/chat", True, "test-operator")
    ]


# ------------------------------------------------------ node down during a flush
def test_node_down_during_flush_catches_up_before_serving(etcd, spawn_agent):
    a, b = spawn_many(spawn_agent, 2, **agent_cfg(etcd))
    ca, cb = AgentClient(a.address), AgentClient(b.address)
    for c in (ca, cb):
        c.open(SPEC)
        ids = c.put_chain(SPEC, 5, 6, 0)
    cb.close()
    b.stop()  # clean stop: its blocks go to NVMe, its lease is revoked
    # A crashed node: its lease lives until its TTL runs out, and the flush waits it out.
    r = with_fake_member(
        etcd.endpoint,
        "crashed",
        lambda: kvctl("flush", "acme/chat", "--timeout", "20", etcd=etcd),
        ttl=2,
        keep=False,
    )
    assert r.returncode == 0, r.stderr
    assert "waiting for crashed" in r.stderr, r.stderr  # progress while it was live
    assert f"nodes acknowledged:  1/1 ({a.config['node_id']})" in r.stdout, r.stdout
    assert "blocks scheduled for deletion: 6" in r.stdout
    assert _stale(ca, SPEC, ids, 0)

    b.restart()  # recovers the gen-0 blocks from RocksDB, then catches up before serving
    cb = AgentClient(b.address)
    counters = cb.stats().counters
    assert counters["recovered_blocks"] == 6 and counters["blocks_dropped_flush"] == 6
    assert _stale(cb, SPEC, ids, 0), "the restarted node served the old generation"
    assert cb.open(SPEC).generation == 1
    assert cb.lookup(SPEC, ids, 1).matched == 0
    assert sum(t.blocks for t in cb.stats().tiers) == 0, "old blocks deleted from every tier"
    assert "caught up with etcd" in b.log
    # it is a member again: the next flush counts it from the start
    r = kvctl_json("flush", "acme/chat", etcd=etcd)
    assert sorted(r["acknowledged"]) == ["agent-0", "agent-1"]
    assert r["namespaces"][0]["new_generation"] == 2


def test_flush_not_acknowledged_in_time_exits_5(etcd, spawn_agent):
    a = spawn_agent(**agent_cfg(etcd))
    AgentClient(a.address).open(SPEC)
    r = with_fake_member(
        etcd.endpoint, "ghost", lambda: kvctl("flush", "acme/chat", "--timeout", "1.5", etcd=etcd)
    )
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert "ghost did not acknowledge" in r.stderr
    assert "generation committed at etcd revision" in r.stderr
    audit = kvctl_json("audit", etcd=etcd)[-1]
    assert (audit["action"], audit["ok"]) == ("flush", False)
    assert audit["params"]["missing"] == ["ghost"]
    r = kvctl("flush", "acme/nope", "--unregistered", etcd=etcd)
    assert r.returncode == 1 and "no namespace named acme/nope" in r.stderr
    # what it did write is said, not left to "no change was made"
    assert "no namespace record in etcd: the name only" in r.stderr
    assert "The flush by name stays recorded (flushes/acme/nope, etcd revision" in r.stderr
    audit = kvctl_json("audit", etcd=etcd)[-1]
    assert (audit["action"], audit["target"], audit["ok"]) == ("flush", "acme/nope", False)


def test_flush_of_a_name_not_registered_is_refused_and_writes_nothing(etcd, spawn_agent):
    """A typo (case, a trailing space, a glob, an unknown name) named no record, yet its
    flush marker was committed for good before the flush exited 1. Now it is refused
    before anything is written, with the name it may have meant."""
    a = spawn_agent(**agent_cfg(etcd))
    AgentClient(a.address).open(SPEC)
    for target, hint in (
        ("ACME/chat", "Did you mean acme/chat?"),
        ("acme/Chat", "Did you mean acme/chat?"),
        ("acme/chat ", "Did you mean acme/chat?"),
        ("acme/*", ""),
        ("acme/nosuch", ""),
    ):
        r = kvctl("flush", target, etcd=etcd)
        assert r.returncode == 1, (target, r.stdout, r.stderr)
        assert "is registered in etcd" in r.stderr and hint in r.stderr, r.stderr
        assert "Nothing was flushed or written" in r.stderr and "--unregistered" in r.stderr
        assert "committed" not in r.stderr
    assert kvctl_json("audit", etcd=etcd) == []

    async def markers():
        async with EtcdClient(etcd.endpoint) as client:
            return [kv.key for kv in (await client.list("flushes/"))[1]]

    assert asyncio.run(markers()) == []
    assert kvctl("flush", "acme/chat", etcd=etcd).returncode == 0  # the real name works


def test_flush_committed_then_etcd_lost_exits_5_not_3(etcd, spawn_agent):
    """etcd going away after the commit (a member still to acknowledge) is not "nothing
    was changed": exit 5, the message says the flush is committed and its
    acknowledgements unconfirmed, and so does the audit record."""
    import subprocess

    a = spawn_agent(**agent_cfg(etcd))
    AgentClient(a.address).open(SPEC)

    def flush_then_lose_etcd():
        env = {k: v for k, v in os.environ.items() if k != "KVSTORE_ETCD"}
        argv = ["flush", "acme/chat", "--timeout", "60", "--etcd-timeout", "1"]
        p = subprocess.Popen(
            [PY, "-m", "kvstore.cli", *argv, "--etcd", etcd.endpoint],
            cwd=ROOT,
            env={**env, "KVSTORE_OPERATOR": "ops@test"},
            stderr=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        out, err = Lines(p.stdout), Lines(p.stderr)
        try:
            err.wait_line("committed at etcd revision")
            etcd.stop()
            try:
                p.wait(60)
            finally:
                etcd.start()
        finally:
            if p.poll() is None:  # a failed wait: not left running to its --timeout
                p.kill()
                p.wait(30)
        return p.returncode, out.rest(), err.rest()

    rc, out, err = with_fake_member(etcd.endpoint, "ghost", flush_then_lose_etcd)
    assert rc == 5, (out, err)
    assert "COMMITTED at etcd revision" in err and "unconfirmed" in err
    assert "no change was made" not in err
    audit = kvctl_json("audit", etcd=etcd)[-1]
    assert (audit["action"], audit["ok"]) == ("flush", False), audit
    assert "acknowledgements unconfirmed" in audit["result"], audit


# ------------------------------------------------- joining right after a flush
# A flush stops waiting for members its membership check did not see. A member that
# registers just after that check gets the new generation from its watch a moment later;
# these tests stall its watches (fault injection) so that moment never comes, and check
# that it still never serves the old generation once registered (ControlFollower.catch_up).
def test_agent_registering_after_a_flush_never_serves_the_old_generation(etcd, make_store):
    store = make_store()
    ids, items = chain(SPEC, 11, 4, 0)

    async def main():
        control = AgentControl(store, etcd.endpoint, "agent-j")
        release = lagging_watches(control.etcd)
        reg = Registration(
            etcd.endpoint,
            lambda: NodeRecord("agent-j", "127.0.0.1:9"),
            2,
            on_registered=control.catch_up,
        )
        try:
            await control.start(timeout_s=15)  # first listing: generation 0
            await control.open_namespace(SPEC)  # creates the namespace record in etcd
            store.put(SPEC.namespace_id, 0, items)
            assert store.lookup(SPEC.namespace_id, 0, ids).matched == 4
            # The agent is delayed between that listing and its registration; the flush
            # commits meanwhile, and its membership check does not see the agent.
            async with EtcdClient(etcd.endpoint) as admin:
                report = await ControlPlane(admin, who="test").flush("acme", "chat", 5.0)
            assert report.ok and report.progress.members == (), report
            await reg.start()
            await asyncio.wait_for(reg.registered.wait(), 15)
            with pytest.raises(errors.StaleGeneration):  # FAILED_PRECONDITION over gRPC
                store.lookup(SPEC.namespace_id, 0, ids)
            assert store.lookup(SPEC.namespace_id, 1, ids).matched == 0, "old blocks kept"
            assert control.generation(SPEC.namespace_id) == 1
            release.set()  # the watch catches up late: nothing moves backwards
            async with EtcdClient(etcd.endpoint) as admin:  # and it is a member now
                report = await ControlPlane(admin, who="test").flush("acme", "chat", 10.0)
            assert report.ok and report.progress.acked == ("agent-j",), report
            with pytest.raises(errors.StaleGeneration):
                store.lookup(SPEC.namespace_id, 1, ids)
        finally:
            await reg.stop()
            await control.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_router_announcing_after_a_flush_never_routes_the_old_generation(etcd):
    async def main():
        async with EtcdClient(etcd.endpoint) as admin, EtcdClient(etcd.endpoint) as client:
            await admin.put_namespace("acme", SPEC.namespace_id, SPEC.to_dict())
            plane = ControlPlane(admin, who="test")
            release = lagging_watches(client)
            real_claim, reports = client.claim, []

            async def claim(key: str, value: bytes, lease: int) -> bool:
                # The flush and the kill switch commit right before the router announces
                # itself (claims routers/<id>): their membership checks do not see it.
                if key.startswith(ROUTERS) and not reports:
                    reports.append(await plane.flush("acme", "chat", 5.0))
                    reports.append(await plane.set_killswitch(True, "test", 5.0))
                return await real_claim(key, value, lease)

            client.claim = claim
            control = RouterControl(client, "rj", lease_ttl_s=2)
            await control.start(timeout_s=15)  # the router serves from here on
            announced_before_serving = await admin.get(ROUTERS + "rj") is not None
            try:
                for _ in range(200):
                    if await admin.get(ROUTERS + "rj") is not None:
                        break
                    await asyncio.sleep(0.05)
                assert [r.ok and r.progress.members == () for r in reports] == [True, True]
                with pytest.raises(errors.StaleGeneration):
                    control.check(SPEC.namespace_id, 0)
                assert control.generation(SPEC.namespace_id) == 1
                assert control.is_killed(), "routing by cache under the kill switch"
                assert announced_before_serving
                release.set()
                report = await plane.set_killswitch(False, "", 10.0)
                assert report.ok and report.progress.acked == ("router:rj",), report
                assert not control.is_killed()
            finally:
                await control.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


# ----------------------------------------------------------------- kill switch
def test_killswitch_on_off_survives_restarts(etcd, spawn_agent, start_router):
    a = spawn_agent(**agent_cfg(etcd))
    c = AgentClient(a.address)
    c.open(SPEC)
    ids = c.put_chain(SPEC, 7, 5, 0)
    assert c.lookup(SPEC, ids, 0).matched == 5
    router = start_router("r1")
    router.wait_nodes({"agent-0": 5})

    def routed(block_ids) -> int:
        return router.route(SPEC.namespace_id, pack_ids(block_ids), dry_run=True).matched_blocks

    assert routed(ids) == 5

    r = kvctl("killswitch", "on", "--reason", "pollution suspected", etcd=etcd)
    assert r.returncode == 0, r.stderr
    assert "nodes acknowledged: 2/2" in r.stdout, r.stdout  # agent-0 and router:r1
    assert c.lookup(SPEC, ids, 0).matched == 0
    assert c.get_count(SPEC, ids, 0) == 0
    assert status_of(c.put_chain, SPEC, 8, 2, 0) == FAILED_PRECONDITION
    assert routed(ids) == 0, "the router still routes by cache"

    c.close()
    a.restart()
    router.stop()
    router.start()
    c = AgentClient(a.address)
    c.open(SPEC)
    assert c.lookup(SPEC, ids, 0).matched == 0, "kill switch lost across an agent restart"
    assert status_of(c.put_chain, SPEC, 8, 2, 0) == FAILED_PRECONDITION
    router.wait_nodes({"agent-0"})
    assert routed(ids) == 0, "kill switch lost across a router restart"
    st = kvctl_json("killswitch", "status", etcd=etcd)
    assert st["enabled"] and st["info"]["reason"] == "pollution suspected"

    r = kvctl_json("killswitch", "off", etcd=etcd)
    assert r["ok"] and r["acknowledged"] == ["agent-0", "router:r1"]
    new = c.put_chain(SPEC, 8, 2, 0)
    assert c.lookup(SPEC, new, 0).matched == 2
    wait_for(lambda: routed(new) == 2, 10, what="routing by cache again")
    assert [x["target"] for x in kvctl_json("audit", etcd=etcd)] == ["on", "off"]


# ---------------------------------------------------------------------- quotas
def test_quotas_isolate_tenants(etcd, spawn_agent):
    a = spawn_agent(**agent_cfg(etcd, pool_bytes="256KiB", slot_bytes="4KiB", nvme_bytes="1MiB"))
    c = AgentClient(a.address)
    noisy, quiet = make_namespace(tenant="noisy"), make_namespace(tenant="quiet")
    for spec in (noisy, quiet):
        c.open(spec)
    quiet_ids = [c.put_chain(quiet, 100 + i, 4, 0) for i in range(5)]
    blk = SPEC.block_bytes
    r = kvctl("quota", "set", "noisy", "--hbm", f"{8 * blk}B", "--nvme", f"{12 * blk}B", etcd=etcd)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: c.tenant("noisy").hbm_limit_bytes == 8 * blk, 10, what="quota applied")
    for i in range(12):  # 48 blocks through an 8-block quota
        c.put_chain(noisy, 200 + i, 4, 0)
    t = c.tenant("noisy")
    assert t.hbm_bytes <= 8 * blk and t.nvme_bytes <= 12 * blk
    assert c.stats().counters["evict_hbm_quota"] > 0
    for ids in quiet_ids:
        assert c.lookup(quiet, ids, 0).hbm == 4, "another tenant's quota evicted quiet's blocks"
    assert c.tenant("quiet").lookup_hit_blocks == c.tenant("quiet").lookup_blocks

    # lowered live below what it holds: evicted down at once, its own blocks only
    assert kvctl("quota", "set", "noisy", "--hbm", f"{2 * blk}B", etcd=etcd).returncode == 0
    wait_for(lambda: c.tenant("noisy").hbm_bytes <= 2 * blk, 10, what="noisy shrunk")
    assert c.tenant("noisy").nvme_limit_bytes == 12 * blk, "--nvme kept its value"
    # admission that cannot fit: RESOURCE_EXHAUSTED, and only for that tenant
    assert kvctl("quota", "set", "noisy", "--hbm", "1KiB", etcd=etcd).returncode == 0
    wait_for(lambda: c.tenant("noisy").hbm_limit_bytes == 1024, 10, what="quota applied")
    assert status_of(c.put_chain, noisy, 300, 2, 0) == grpc.StatusCode.RESOURCE_EXHAUSTED
    c.put_chain(quiet, 400, 2, 0)
    for ids in quiet_ids:
        assert c.lookup(quiet, ids, 0).hbm == 4

    assert kvctl("quota", "clear", "noisy", etcd=etcd).returncode == 0
    wait_for(lambda: c.tenant("noisy").hbm_limit_bytes == 0, 10, what="quota removed")
    c.put_chain(noisy, 300, 2, 0)


# --------------------------------------------------------------------- etcd down
def test_etcd_down_data_path_serves_last_known_generations(etcd, spawn_agent):
    a = spawn_agent(**agent_cfg(etcd))
    c = AgentClient(a.address)
    c.open(SPEC)
    c.put_chain(SPEC, 9, 3, 0)
    assert kvctl("flush", "acme/chat", etcd=etcd).returncode == 0
    ids = c.put_chain(SPEC, 9, 3, 1)

    etcd.stop()
    try:
        assert c.lookup(SPEC, ids, 1).matched == 3, "data path stopped with etcd"
        assert _stale(c, SPEC, ids, 0), "forgot the last known generation"
        more = c.put_chain(SPEC, 10, 2, 1)
        assert c.lookup(SPEC, more, 1).matched == 2
        assert c.open(SPEC).generation == 1
        for args, what in (
            (("flush", "acme/chat"), "flush"),
            (("killswitch", "on", "--reason", "test"), "killswitch"),
            (("quota", "set", "acme", "--hbm", "1GiB"), "quota set"),
            (("status",), "status"),
            (("audit",), "audit"),
        ):
            t0 = time.monotonic()
            r = kvctl(*args, "--etcd-timeout", "2", etcd=etcd)
            assert r.returncode == 3, (args, r.stdout, r.stderr)
            assert f"kvctl {what}: etcd unreachable at {etcd.endpoint}" in r.stderr
            assert "is etcd running?" in r.stderr
            assert time.monotonic() - t0 < 20
        # Past its lease (kvstore/coord/fence.py) with etcd out of reach: still its hits.
        wait_for(lambda: "etcd out of reach" in a.log, 60, what="the agent to find etcd gone")
        assert c.lookup(SPEC, ids, 1).matched == 3
        assert _stale(c, SPEC, ids, 0)
    finally:
        etcd.start()
    # watches resume: the next flush reaches the agent and is acknowledged
    r = kvctl_json("flush", "acme/chat", etcd=etcd)
    assert r["ok"] and r["acknowledged"] == ["agent-0"]
    assert _stale(c, SPEC, ids, 1)
    assert [x["ok"] for x in kvctl_json("audit", etcd=etcd)] == [True, True]


def test_agent_stops_cleanly_after_etcd_restarted(etcd, spawn_agent):
    """Each watch that etcd's restart broke left grpc's request task waiting for good on
    the watch's request iterator: the agent's clean stop then logged "Task was destroyed
    but it is pending!" and "cannot reuse already awaited coroutine" tracebacks."""
    a = spawn_agent(**agent_cfg(etcd))
    etcd.stop()
    wait_for(lambda: a.log.count("broke") >= 4, 30, what="the agent's 4 watches to break")
    etcd.start()
    # Back with its lease kept, or (its lease lapsed while etcd was down: a slow host)
    # registered again under a new one.
    registered = f"registered {a.config['node_id']} at "
    wait_for(
        lambda: "etcd reachable again" in a.log or a.log.count(registered) >= 2,
        60,
        what="the agent to reach etcd again",
    )
    c = AgentClient(a.address)
    c.open(SPEC)
    assert kvctl("flush", "acme/chat", etcd=etcd).returncode == 0  # the watches work again
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(60) == 0
    a.proc = None
    log = a.log
    assert f"agent {a.config['node_id']} stopped" in log
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]


@pytest.fixture(autouse=True)
def _no_leftover_env(monkeypatch):
    monkeypatch.delenv("KVSTORE_ETCD", raising=False)
