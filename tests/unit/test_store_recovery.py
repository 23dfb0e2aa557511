"""BlockStore restart recovery and corruption: records flipped on disk (through
rocksdict, with the store closed) or in the tier, and bytes flipped in pool slots (through
DevicePool.raw_view). A corrupt block is never served; it and its descendants are dropped."""

from __future__ import annotations

from support.common import flip_rocks_byte
from support.store import SPEC, check_invariants, demote_all, events_of, get, lookup, prompt, put

from kvstore.events import EventKind
from kvstore.tiers.rocks import RocksTier


# ------------------------------------------------------------- restart recovery
def test_restart_recovery(make_store, tmp_path):
    path = tmp_path / "db"
    store = make_store(n_slots=4, path=path)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    demote_all(store)
    assert lookup(store, ids) == (4, 0, 4)
    store.rocks.close()

    again = make_store(n_slots=4, path=path)
    rec = again.recover()
    assert rec == {"recovered": 4, "dropped": 0}
    assert again.counters["recovered_blocks"] == 4
    assert lookup(again, ids) == (4, 0, 4)
    served, data = get(again, ids)
    assert data == [it.data for it in items]
    check_invariants(again)


def test_a_swapped_nvme_tier_is_the_one_recovered_and_spilled_to(make_store, tmp_path):
    """What the agent does with an NVMe tier it cannot read (node_agent/server.py): close
    it, quarantine it, give the store a fresh one and recover that. From then on the store
    reads and writes the fresh tier only, never the closed one."""
    store = make_store(n_slots=4, path=tmp_path / "unreadable")
    store.rocks.close()
    store.rocks = fresh = RocksTier(str(tmp_path / "fresh"), 1 << 20)
    assert store.recover() == {"recovered": 0, "dropped": 0}
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    put(store, prompt(2, 2)[1])  # spills the tail ids[2:]
    assert lookup(store, ids) == (4, 2, 2)
    assert sum(1 for _ in fresh.scan()) == 4  # the tail ids[2:], its heads ids[:2] (copies)
    served, data = get(store, ids)
    assert data == [it.data for it in items]
    check_invariants(store)


def test_persist_pool_before_restart_keeps_whole_chains(make_store, tmp_path):
    """Spilled tails survive a restart only together with their heads: the heads got an
    NVMe copy when their tails spilled, and a clean stop writes the rest of the pool."""
    path = tmp_path / "db"
    store = make_store(n_slots=4, path=path)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    put(store, prompt(2, 2)[1])  # spills the tail ids[2:], the head stays in the pool
    assert lookup(store, ids) == (4, 2, 2)
    assert store.counters["nvme_prefix_copies"] == 3  # ids[:3], copied when ids[3] spilled
    assert store.persist_pool(deadline_s=10) == 2  # the second prompt
    assert store.persist_pool() == 0  # everything is on NVMe now
    check_invariants(store)
    store.rocks.close()
    again = make_store(n_slots=4, path=path)
    assert again.recover() == {"recovered": 6, "dropped": 0}
    served, data = get(again, ids)
    assert data == [it.data for it in items]


def test_a_spilled_tail_survives_a_restart_without_persist_pool(make_store, tmp_path):
    """What a kill -9 leaves: no clean stop wrote the pool. The tail's heads were copied to
    NVMe when the tail spilled, so recovery keeps the whole chain."""
    path = tmp_path / "db"
    store = make_store(n_slots=4, path=path)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    put(store, prompt(2, 2)[1])  # spills the tail ids[2:]; the head stays in the pool
    assert lookup(store, ids) == (4, 2, 2)
    check_invariants(store)
    store.rocks.close()  # no persist_pool: only what was spilled is on NVMe
    again = make_store(n_slots=4, path=path)
    assert again.recover() == {"recovered": 4, "dropped": 0}
    assert lookup(again, ids) == (4, 0, 4)
    assert get(again, ids)[1] == [it.data for it in items]
    check_invariants(again)


def test_restart_drops_records_whose_heads_are_gone(make_store, tmp_path):
    path = tmp_path / "db"
    store = make_store(n_slots=4, path=path)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    put(store, prompt(2, 2)[1])
    store.rocks.delete_batch([SPEC.namespace_id + i for i in ids[:2]])  # heads lost
    store.rocks.close()
    again = make_store(n_slots=4, path=path)
    assert again.recover() == {"recovered": 0, "dropped": 2}
    assert lookup(again, ids)[0] == 0
    check_invariants(again)


def test_corrupt_nvme_record_is_dropped_on_get(make_store):
    store = make_store(n_slots=4)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    demote_all(store)
    key = SPEC.namespace_id + ids[2]
    raw = bytearray(store.rocks.get(key))
    raw[-100] ^= 0x01  # one bit of the payload
    store.rocks.put_batch([(key, bytes(raw))])
    events_of(store)
    assert lookup(store, ids)[0] == 4  # the index cannot know yet
    served, data = get(store, ids)
    assert [s.block_id for s in served] == ids[:2]
    assert data == [it.data for it in items[:2]]
    assert lookup(store, ids)[0] == 2
    assert store.counters["corrupt_dropped"] == 1
    assert store.counters["removed_corrupt"] == 2  # the corrupt block and its child
    removed = [b for e in events_of(store, EventKind.REMOVED) for b in e.block_ids]
    assert sorted(removed) == sorted(ids[2:])
    assert store.rocks.get(key) is None
    check_invariants(store)


def test_corrupt_pool_slot_is_dropped_on_get(make_store):
    store = make_store(n_slots=8)
    st = store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    store.pool.raw_view(st.blocks[ids[1]].slot)[17] ^= 0x80
    served, data = get(store, ids)
    assert [s.block_id for s in served] == ids[:1]
    assert data == [items[0].data]
    assert lookup(store, ids) == (1, 1, 0)
    assert store.counters["corrupt_dropped"] == 1
    check_invariants(store)


def test_corrupt_pool_slot_is_not_spilled(make_store):
    store = make_store(n_slots=2)
    st = store.open_namespace(SPEC)
    ids, items = prompt(1, 2)
    put(store, items)
    store.pool.raw_view(st.blocks[ids[1]].slot)[0] ^= 0xFF
    put(store, prompt(2, 1)[1])  # evicts the corrupt leaf
    assert store.rocks.get(SPEC.namespace_id + ids[1]) is None
    assert lookup(store, ids)[0] == 1
    assert store.counters["corrupt_dropped"] == 1
    check_invariants(store)


def test_corrupt_block_found_on_demotion_drops_its_subtree(make_store):
    store = make_store(n_slots=2)
    st = store.open_namespace(SPEC)
    ids, items = prompt(1, 2)
    put(store, items)
    store.pool.raw_view(st.blocks[ids[0]].slot)[9] ^= 0x10
    store.events.drain()
    # ids[1] spills; its head ids[0] is copied to NVMe first: found corrupt, not spilled,
    # and it goes with its subtree
    put(store, prompt(2, 1)[1])
    assert lookup(store, ids)[0] == 0
    assert store.rocks.get(SPEC.namespace_id + ids[0]) is None
    assert store.rocks.get(SPEC.namespace_id + ids[1]) is None
    removed = [b for e in events_of(store, EventKind.REMOVED) for b in e.block_ids]
    assert sorted(removed) == sorted(ids)
    assert store.counters["corrupt_dropped"] == 1
    check_invariants(store)


def test_corrupt_records_are_dropped_during_recover(make_store, tmp_path):
    path = tmp_path / "db"
    store = make_store(n_slots=4, path=path)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    demote_all(store)
    store.rocks.close()
    flip_rocks_byte(path, SPEC.namespace_id + ids[1], offset=40)  # inside the header

    again = make_store(n_slots=4, path=path)
    rec = again.recover()
    assert rec == {"recovered": 1, "dropped": 3}  # the corrupt record and its 2 descendants
    assert again.counters["recovered_blocks"] == 1
    assert again.counters["recovery_dropped"] == 3
    assert lookup(again, ids) == (1, 0, 1)
    served, data = get(again, ids)
    assert data == [items[0].data]
    assert sum(1 for _ in again.rocks.scan()) == 1
    check_invariants(again)
