"""kvstore/coord/etcd.py and node_agent/registration.py against a real etcd (the `etcd` fixture):
compare-and-create registration, leases, list-then-watch, compaction, etcd restarts,
error translation at the edge."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvstore.coord.etcd import EtcdClient, NodeRecord, channel_target, parse_endpoints
from kvstore import errors
from node_agent.registration import Registration

NS_ID = bytes(range(16))


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(pred, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def rec(node_id: str = "n1", **kw) -> NodeRecord:
    return NodeRecord(node_id, kw.pop("address", "127.0.0.1:1"), **kw)


# ---------------------------------------------------------------------------- basics
def test_parse_endpoints_and_record_validation():
    assert parse_endpoints("http://localhost:2379, 10.0.0.1:2380/") == [
        "127.0.0.1:2379",
        "10.0.0.1:2380",
    ]
    for bad in ("", "nohost", "host:port", "127.0.0.1:99999", "127.0.0.1:0"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)
    # a bare IPv6 address read as host "2001:db8:" and port 5, then waited for etcd
    # forever; a scheme gRPC takes or a space were dialled as host names
    for bad, said in (
        ("2001:db8::5", "an IPv6 address goes in brackets"),
        ("grpc://x:1", "is not a host name"),
        ("a b:2379", "is not a host name"),
        ("[zz]:2379", "is not an IPv6 address"),
    ):
        with pytest.raises(ValueError, match=said):
            parse_endpoints(bad)
    assert parse_endpoints("[2001:db8::5]:2379") == ["[2001:db8::5]:2379"]
    # only a host that is localhost is rewritten, never a name containing it
    assert parse_endpoints("mylocalhost.example:2379") == ["mylocalhost.example:2379"]
    with pytest.raises(ValueError):
        NodeRecord("a/b", "x:1")
    with pytest.raises(ValueError):
        NodeRecord("a", "x:1", utilization=1.5)
    r = rec(device="cpu", utilization=0.25, blocks=7)
    assert NodeRecord.from_json(r.to_json()) == r
    # Fields a newer agent adds are ignored, not fatal.
    assert (
        NodeRecord.from_json(
            json.dumps({"node_id": "a", "address": "x:1", "future": 1}).encode()
        ).node_id
        == "a"
    )


def test_one_channel_over_addresses_or_one_name(caplog):
    assert channel_target(["10.0.0.1:2379", "10.0.0.2:2379"]) == "ipv4:10.0.0.1:2379,10.0.0.2:2379"
    assert channel_target(["[::1]:2379", "[fd00::2]:2379"]) == "ipv6:[::1]:2379,[fd00::2]:2379"
    # A name: gRPC resolves it (and again when connections fail) to every address it has.
    assert channel_target(["etcd-headless.kv.svc:2379"]) == "dns:///etcd-headless.kv.svc:2379"
    assert not caplog.records
    # Several names cannot share one channel: the first one, and a warning that says so.
    with caplog.at_level("WARNING", logger="kvstore.etcd"):
        assert channel_target(["etcd-a:2379", "etcd-b:2379"]) == "dns:///etcd-a:2379"
        assert channel_target(["10.0.0.1:2379", "[::1]:2379"]) == "10.0.0.1:2379"
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "etcd endpoints etcd-a",
        "etcd endpoints 10.0.0.1",
    ]
    assert "one name that resolves to every member" in caplog.records[0].getMessage()


def test_endpoints_by_name_reach_etcd(etcd):
    """Names, not only IP addresses (the Helm chart names etcd by its Services): the
    client once made them an ipv4: target, which gRPC refuses ("the target uri is not
    valid"), and waited for etcd forever. LOCALHOST: a name /etc/hosts resolves that
    parse_endpoints leaves as it is (it rewrites only `localhost`)."""
    port = etcd.endpoint.rsplit(":", 1)[1]

    async def main():
        async with EtcdClient(f"LOCALHOST:{port}", timeout=10) as c:
            await c.put("by-name", b"1")
            assert (await c.get("by-name")).value == b"1"

    run(main())


def test_compare_and_create_registration(etcd):
    async def main():
        async with EtcdClient(etcd.endpoint) as c:
            l1, l2 = await c.grant(30), await c.grant(30)
            assert await c.register_node(rec(), l1)
            assert await c.register_node(rec(address="127.0.0.1:2"), l1)  # same lease
            assert not await c.register_node(rec(address="127.0.0.1:3"), l2)  # taken
            assert (await c.list_nodes())[0].address == "127.0.0.1:2"
            assert not await c.update_node(rec(address="127.0.0.1:4"), l2)
            await c.revoke(l1)
            assert await c.list_nodes() == []
            assert await c.register_node(rec(address="127.0.0.1:3"), l2)
            await c.revoke(l1)  # revoking a gone lease is not an error
            assert await c.keepalive(l1) == 0
            assert await c.keepalive(l2) > 0
            with pytest.raises(errors.NotFound):
                await c.put("x", b"1", lease=l1)

    run(main())


def test_lease_expiry_removes_the_record(etcd):
    async def main():
        async with EtcdClient(etcd.endpoint) as c:
            lease = await c.grant(2)
            assert await c.register_node(rec(), lease)
            await until(lambda: _gone(c), 15, "the record to expire with its lease")

    run(main())


async def _gone(c: EtcdClient) -> bool:
    return await c.get("nodes/n1") is None


def test_namespace_generation_bumps_are_atomic(etcd):
    async def main():
        async with EtcdClient(etcd.endpoint) as c:
            assert await c.put_namespace("acme", NS_ID, {"name": "chat"}) == 0
            assert await c.put_namespace("acme", NS_ID, {"name": "other"}) == 0  # kept
            gens = await asyncio.gather(*(c.bump_generation("acme", NS_ID) for _ in range(6)))
            assert sorted(gens) == [1, 2, 3, 4, 5, 6]
            rec_ = await c.get_namespace("acme", NS_ID)
            assert rec_["generation"] == 6 and rec_["spec"] == {"name": "chat"}
            with pytest.raises(errors.NotFound):
                await c.bump_generation("acme", bytes(16))
            await c.put_tenant("acme", {"hbm_limit_bytes": 1 << 20})
            assert await c.get_tenant("acme") == {"hbm_limit_bytes": 1 << 20}
            with pytest.raises(errors.InvalidArgument):
                await c.put_tenant("a/b", {})
            assert not await c.get_killswitch()
            await c.set_killswitch(True, "pollution suspected")
            assert await c.get_killswitch()
            await c.set_killswitch(False)
            assert not await c.get_killswitch()

    run(main())


# ----------------------------------------------------------------------- list + watch
class Mirror:
    """What a follower rebuilds from reset/apply: key -> value."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.resets = 0

    def reset(self, items) -> None:
        self.resets += 1
        self.data = {kv.key: kv.value for kv in items}

    def apply(self, events) -> None:
        for ev in events:
            if ev.deleted:
                self.data.pop(ev.key, None)
            else:
                self.data[ev.key] = ev.value


def test_follow_lists_then_watches_and_relists_after_compaction(etcd):
    async def main():
        async with EtcdClient(etcd.endpoint) as c:
            await c.put("nodes/a", b"1")
            m = Mirror()
            task = asyncio.create_task(c.follow("nodes/", m.reset, m.apply))
            await until(lambda: m.resets == 1, what="the initial listing")
            assert m.data == {"nodes/a": b"1"}
            await c.put("nodes/b", b"2")
            await c.put("other/x", b"ignored")
            await c.delete("nodes/a")
            await until(lambda: m.data == {"nodes/b": b"2"}, what="watch events")
            task.cancel()
            # History compacted past where a watch would resume: it must relist.
            rev, _ = await c.list("nodes/")
            for i in range(5):
                await c.put("nodes/c", str(i).encode())
            rev2, _ = await c.list("nodes/")
            await c._kv.compact(rev2)  # noqa: SLF001 - compaction is the injected fault
            got = []
            with pytest.raises(Exception) as ei:
                async for batch in c.watch("nodes/", rev + 1):
                    got.append(batch)
            assert type(ei.value).__name__ == "Compacted" and not got
            m2 = Mirror()
            task = asyncio.create_task(c.follow("nodes/", m2.reset, m2.apply))
            await until(lambda: m2.data == {"nodes/b": b"2", "nodes/c": b"4"}, what="relist")
            task.cancel()

    run(main())


def test_watch_resumes_after_etcd_restart(etcd):
    async def main():
        async with EtcdClient(etcd.endpoint) as c:
            m = Mirror()
            task = asyncio.create_task(
                c.follow("nodes/", m.reset, m.apply, retry_s=0.1, max_retry_s=0.5)
            )
            await c.put("nodes/a", b"1")
            await until(lambda: m.data == {"nodes/a": b"1"}, what="first event")
            await asyncio.to_thread(etcd.stop)
            with pytest.raises(errors.Unavailable) as ei:
                await c.put("nodes/b", b"2")
            assert etcd.endpoint in str(ei.value)
            await asyncio.to_thread(etcd.start)
            await c.put("nodes/b", b"2")
            await c.delete("nodes/a")
            await until(lambda: m.data == {"nodes/b": b"2"}, 20, "events after the restart")
            assert m.resets == 1  # resumed from the revision, not relisted
            task.cancel()

    run(main())


def test_unreachable_etcd_is_unavailable_with_a_clear_message():
    async def main():
        async with EtcdClient("127.0.0.1:1", timeout=2.0) as c:
            with pytest.raises(errors.Unavailable, match=r"etcd unreachable at 127\.0\.0\.1:1"):
                await c.list("nodes/")
            with pytest.raises(errors.Unavailable):
                await c.grant(5)

    run(main())


# ----------------------------------------------------------------------- registration
def test_registration_lifecycle(etcd):
    state = {"util": 0.0}

    def record() -> NodeRecord:
        return rec("agent-x", utilization=state["util"])

    async def main():
        async with EtcdClient(etcd.endpoint) as c:
            reg = Registration(etcd.endpoint, record, ttl_s=2)
            await reg.start()
            await asyncio.wait_for(reg.registered.wait(), 15)
            first_lease = reg.lease
            assert (await c.get("nodes/agent-x")).lease == first_lease
            state["util"] = 0.5  # reported on the next heartbeat
            await until(lambda: _util(c, 0.5), what="utilization update")
            # The lease vanishes behind the agent's back (as after a long outage):
            # it registers again under a new one.
            await c.revoke(first_lease)
            await until(lambda: _registered_with_new_lease(c, first_lease), 15, "re-registration")
            # etcd restarts: the agent keeps serving its record with the same lease.
            lease = (await c.get("nodes/agent-x")).lease
            await asyncio.to_thread(etcd.stop)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(etcd.start)
            await asyncio.sleep(2.5)  # more than one TTL of heartbeats
            kv = await until(lambda: c.get("nodes/agent-x"), 15, "record after restart")
            assert kv.lease == lease
            # A second agent with the same id waits instead of stealing the record.
            other = Registration(etcd.endpoint, lambda: rec("agent-x", address="x:9"), 2)
            await other.start()
            await asyncio.sleep(1.5)
            assert not other.registered.is_set()
            await reg.stop()  # revokes: the waiting agent takes over
            await asyncio.wait_for(other.registered.wait(), 15)
            assert NodeRecord.from_json((await c.get("nodes/agent-x")).value).address == "x:9"
            await other.stop()
            assert await c.get("nodes/agent-x") is None

    run(main(), 90)


async def _util(c: EtcdClient, u: float) -> bool:
    kv = await c.get("nodes/agent-x")
    return kv is not None and NodeRecord.from_json(kv.value).utilization == u


async def _registered_with_new_lease(c: EtcdClient, old: int) -> bool:
    kv = await c.get("nodes/agent-x")
    return kv is not None and kv.lease not in (0, old)
