"""The flush guarantee against members whose etcd lease lapsed, and duplicate router ids,
with real etcd, real agent and router processes (the freeze is SIGSTOP / SIGCONT):

- an agent frozen past its lease drops out of the members a flush waits for; when it
  wakes up it must not answer a lookup or get from the old generation (the lease fence,
  kvstore/coord/fence.py), and it counts and logs the fenced requests (Stats and its
  Prometheus page);
- a flush that a member leaves without acknowledging says so on stderr;
- a router frozen past its lease must not route by a stale index when it wakes up, and
  counts those routes on its Prometheus page;
- a second router with the same router_id waits instead of taking routers/<id> over, so
  stopping it does not deregister the real one; a holder whose key vanished claims it
  again."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import pytest
from support.cluster import RouterProc
from support.common import free_port, make_namespace, wait_for
from support.control import AgentClient, agent_cfg, chain, kvctl, kvctl_json
from support.metrics import scrape, val
from support.tcp_count import CountingRelay

from kvstore.coord.admin_records import ROUTERS
from kvstore.coord.etcd import EtcdClient
from kvstore.coord.seen import seen_key
from kvstore.hashing import pack_ids
from kvstore.v1 import agent_pb2, router_pb2

SPEC = make_namespace()
STALE = grpc.StatusCode.FAILED_PRECONDITION


def _etcd_get(endpoint: str, key: str):
    async def main():
        async with EtcdClient(endpoint) as c:
            return await c.get(key)

    return asyncio.run(main())


def _etcd_delete(endpoint: str, key: str) -> None:
    async def main():
        async with EtcdClient(endpoint) as c:
            await c.delete(key)

    asyncio.run(main())


def _outcome(call) -> str:
    """'hit' / 'miss' / 'stale' (refused: FAILED_PRECONDITION) / 'error: CODE'."""
    try:
        n = call()
    except grpc.RpcError as exc:
        return "stale" if exc.code() == STALE else f"error: {exc.code().name}"
    return "hit" if n else "miss"


def _get_blocks(client: AgentClient, spec, ids, generation: int) -> int:
    ref = agent_pb2.NamespaceRef(namespace_id=spec.namespace_id, generation=generation)
    stream = client.stub.Get(agent_pb2.GetRequest(ns=ref, block_ids=pack_ids(ids)), timeout=30)
    return sum(r.count for r in stream)


def _calls_while_frozen(proc, calls) -> list[str]:
    """Start every call (they queue at the stopped process), resume it, collect outcomes."""
    out: list[str | None] = [None] * len(calls)

    def one(i, fn):
        out[i] = _outcome(fn)

    threads = [threading.Thread(target=one, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the requests reach the stopped process's socket
    os.kill(proc.pid, signal.SIGCONT)
    for t in threads:
        t.join(60)
    return [o or "no answer" for o in out]


def _frozen_until_gone(etcd, proc, key: str) -> None:
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: _etcd_get(etcd.endpoint, key) is None, 30, what=f"{key} to expire")
    except BaseException:
        os.kill(proc.pid, signal.SIGCONT)
        raise


# ------------------------------------------------------------------- agents
def test_agent_frozen_past_its_lease_serves_no_old_generation_after_a_flush(
    etcd, spawn_agent, relay
):
    """The freeze (SIGSTOP), the agent's link to etcd held too so that it wakes up before
    it can hear from etcd (etcd's answers would otherwise be waiting in its socket): only
    its own clock tells it a flush may have gone on without it. Its first call to etcd is
    still on its way (no failure yet: not out of reach), so it answers misses."""
    spawn_agent(**agent_cfg(etcd))
    port = free_port()
    frozen = spawn_agent(**agent_cfg(etcd, etcd_endpoints=relay.address, metrics_port=port))
    c = AgentClient(frozen.address)
    c.open(SPEC)
    ids = c.put_chain(SPEC, 5, 4, 0)
    assert c.lookup(SPEC, ids, 0).matched == 4

    relay.pause()
    _frozen_until_gone(etcd, frozen.proc, "nodes/agent-1")
    r = kvctl_json("flush", "acme/chat", etcd=etcd)
    assert r["ok"] and r["acknowledged"] == ["agent-0"], r
    # Exit 0: from now on no Lookup or Get anywhere returns a hit on the old generation.
    calls = [lambda: c.lookup(SPEC, ids, 0).matched for _ in range(4)]
    calls += [lambda: _get_blocks(c, SPEC, ids, 0) for _ in range(2)]
    outcomes = _calls_while_frozen(frozen.proc, calls)
    assert outcomes == ["miss"] * 6, outcomes
    assert c.lookup(SPEC, ids, 0).matched == 0
    stats = c.stub.Stats(agent_pb2.StatsRequest(), timeout=10)
    assert stats.counters["fenced_lookups"] >= 5, dict(stats.counters)
    assert stats.counters["fenced_gets"] >= 2, dict(stats.counters)
    page = scrape(port)  # the operator's view of the same counters
    assert (
        val(page, "kvstore_fenced_calls_total", call="lookup") == stats.counters["fenced_lookups"]
    )
    assert val(page, "kvstore_fenced_calls_total", call="get") == stats.counters["fenced_gets"]

    relay.resume()
    # Once re-registered it has re-read the generation: the old one is refused.
    wait_for(lambda: _outcome(lambda: c.lookup(SPEC, ids, 0).matched) == "stale", 30)
    assert c.open(SPEC).generation == 1
    fresh = c.put_chain(SPEC, 5, 4, 1)
    wait_for(lambda: c.lookup(SPEC, fresh, 1).matched == 4, 30, what="hits again")
    log = frozen.log
    assert log.count("etcd lease not confirmed") == 1, log[-3000:]
    assert "serving hits again" in log


def test_flush_says_which_member_left_without_acknowledging(etcd, spawn_agent):
    spawn_agent(**agent_cfg(etcd))
    frozen = spawn_agent(**agent_cfg(etcd, lease_ttl_s=5))
    c = AgentClient(frozen.address)
    c.open(SPEC)
    ids = c.put_chain(SPEC, 6, 3, 0)
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        r = kvctl("flush", "acme/chat", etcd=etcd)
    finally:
        outcomes = _calls_while_frozen(frozen.proc, [lambda: c.lookup(SPEC, ids, 0).matched])
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert (
        "agent-1 left (its lease expired or was revoked) without acknowledging: it fences "
        "itself and re-reads generations before serving again" in r.stderr
    ), r.stderr
    assert outcomes[0] in ("miss", "stale"), outcomes


def test_agent_keeps_serving_known_generations_while_etcd_is_out_of_reach(etcd, spawn_agent):
    """etcd down past the agent's lease (the design: "the data path keeps serving with the
    last known generations"; no flush can commit meanwhile): once its calls to etcd failed
    twice the agent serves hits again, says so once, and re-reads etcd when it is back."""
    a = spawn_agent(**agent_cfg(etcd))
    c = AgentClient(a.address)
    c.open(SPEC)
    ids = c.put_chain(SPEC, 7, 3, 0)
    assert c.lookup(SPEC, ids, 0).matched == 3
    etcd.stop()
    try:
        wait_for(lambda: "etcd out of reach" in a.log, 60, what="the agent to find etcd gone")
        assert c.lookup(SPEC, ids, 0).matched == 3
        assert _get_blocks(c, SPEC, ids, 0) == 3
    finally:
        etcd.start()

    def rejoined() -> bool:  # its lease kept (re-read after the lapse), or a new one
        after = a.log.split("etcd out of reach")[-1]
        return "confirmed again after a lapse" in after or "registered agent-0" in after

    wait_for(rejoined, 60, what="etcd re-read once it is back")
    assert c.lookup(SPEC, ids, 0).matched == 3
    assert a.log.count("etcd out of reach") == 1


# ------------------------------------------------------------------- routers
def _route(router, ids, generation: int) -> router_pb2.RouteResponse:
    return router.stub.Route(
        router_pb2.RouteRequest(
            namespace_id=SPEC.namespace_id,
            generation=generation,
            block_ids=pack_ids(ids),
            dry_run=True,
        ),
        timeout=30,
    )


def test_router_frozen_past_its_lease_routes_by_no_stale_index(etcd, spawn_agent, relay, tmp_path):
    """The router frozen and cut off from etcd, the agent that holds the blocks frozen
    too (so no event of its own tells the router): when the router wakes up its index
    still names the old generation's blocks; it must not route by them."""
    a = spawn_agent(**agent_cfg(etcd))
    port = free_port()
    router = RouterProc(tmp_path / "router", relay.address, "router-0").start(
        config={"metrics_port": port}
    )
    try:
        c = AgentClient(a.address)
        c.open(SPEC)
        ids = c.put_chain(SPEC, 8, 4, 0)
        wait_for(lambda: _route(router, ids, 0).matched_blocks == 4, 30, what="indexed")

        relay.pause()
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            _frozen_until_gone(etcd, router.proc, ROUTERS + "router-0")
            wait_for(lambda: _etcd_get(etcd.endpoint, "nodes/agent-0") is None, 30)
            r = kvctl_json("flush", "acme/chat", etcd=etcd)
            assert r["ok"] and r["acknowledged"] == [], r
            got = _calls_while_frozen(
                router.proc, [lambda: _route(router, ids, 0).matched_blocks for _ in range(4)]
            )
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
            os.kill(router.proc.pid, signal.SIGCONT)
            relay.resume()
        assert got == ["miss"] * 4, got
        # Each of the four was fenced: the router could not reach etcd (relay paused)
        # before it answered them.
        assert val(scrape(port), "kvstore_router_fenced_routes_total") == 4
    finally:
        router.stop()


# ---------------------------------------------------------- duplicate router id
def test_second_router_with_the_same_id_waits_and_leaves_the_first_registered(
    etcd, start_router, tmp_path
):
    first = start_router("router-0")
    kv = _etcd_get(etcd.endpoint, ROUTERS + "router-0")
    assert kv is not None and kv.lease
    seen = seen_key("router", "router-0")  # what kvctl status misses a router by
    wait_for(lambda: _etcd_get(etcd.endpoint, seen) is not None, 30, what="router-0 seen")
    dup = RouterProc(tmp_path / "dup", etcd.endpoint, "router-0")
    with pytest.raises(TimeoutError):
        dup.start(timeout=8)  # not ready: it waits for the id
    try:
        assert "held by another live process" in dup.log
        assert _etcd_get(etcd.endpoint, ROUTERS + "router-0").lease == kv.lease
    finally:
        dup.stop()  # SIGTERM: revokes its own lease only
    time.sleep(1.0)
    now = _etcd_get(etcd.endpoint, ROUTERS + "router-0")
    assert now is not None and now.lease == kv.lease, "the duplicate deregistered router-0"
    assert _etcd_get(etcd.endpoint, seen) is not None, "the duplicate deleted router-0's record"
    status = kvctl_json("status", etcd=etcd)
    assert "router-0" in str(status), status
    assert first.proc.poll() is None


def test_router_claims_its_key_again_when_it_vanishes(etcd, start_router):
    router = start_router("router-0")
    _etcd_delete(etcd.endpoint, ROUTERS + "router-0")
    wait_for(
        lambda: _etcd_get(etcd.endpoint, ROUTERS + "router-0") is not None,
        30,
        what="routers/router-0 claimed again",
    )
    assert "gone from etcd; claiming it again" in router.log


@pytest.fixture
def relay(etcd):
    r = CountingRelay(etcd.endpoint)
    yield r
    r.resume()
    r.close()


@pytest.fixture(autouse=True)
def _no_leftover_env(monkeypatch):
    monkeypatch.delenv("KVSTORE_ETCD", raising=False)


__all__ = ["chain"]
