"""BlockStore in-place transfers (kvstore/store_inplace.py): reserve -> fill the slot views
-> commit (verified in place) / abort, and borrowed verified read-only slot views."""

from __future__ import annotations

import numpy as np
import pytest
from support.common import TEST_SECRET
from support.store import NB, SPEC, check_invariants, events_of, get, lookup, policy, prompt, put

from kvstore import checksum as cks
from kvstore.errors import DataLoss, FailedPrecondition, ResourceExhausted
from kvstore.eviction import LRUPolicy, ValueAwarePolicy
from kvstore.events import EventKind

NS = SPEC.namespace_id
ROOT = SPEC.root(0, TEST_SECRET)


def fill(res, items) -> list[int]:
    """What a transport does: payloads land in the views; returns the sender's checksums."""
    for view, it in zip(res.views, items):
        view[:] = np.frombuffer(it.data, dtype=np.uint8)
    return [cks.checksum(it.data) for it in items]


def reserve(store, ids, parent=ROOT, after=None):
    return store.reserve(NS, 0, ids, parent, ROOT, after=after)


def test_reserve_fill_commit_is_a_put(make_store):
    store = make_store()
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    res = reserve(store, ids)
    assert len(res) == 4 and res.reason == ""
    assert lookup(store, ids) == (0, 0, 0)  # nothing visible before commit
    assert store.commit(res, fill(res, items)) == 4
    assert lookup(store, ids) == (4, 4, 0)
    assert get(store, ids)[1] == [it.data for it in items]
    assert [e.kind for e in events_of(store)] == [EventKind.STORED]
    check_invariants(store)


def test_pipelined_reservations_chain_through_an_uncommitted_one(make_store):
    store = make_store(policy_for=policy(min_prefix_blocks=3))
    store.open_namespace(SPEC)
    ids, items = prompt(2, 5)
    first = reserve(store, ids[:3])
    second = reserve(store, ids[3:], parent=ids[2], after=first)  # 2 blocks < min 3: ok
    assert (len(first), len(second)) == (3, 2)
    sums = fill(first, items[:3]) + fill(second, items[3:])
    assert store.commit(first, sums[:3]) == 3
    assert store.commit(second, sums[3:]) == 2
    assert get(store, ids)[1] == [it.data for it in items]
    check_invariants(store)


@pytest.mark.parametrize("eviction", [ValueAwarePolicy(), LRUPolicy()], ids=["value", "lru"])
def test_pipelined_reservations_never_evict_their_own_chain(make_store, eviction):
    """A transfer reserves run k+1 before run k commits, and run k+2 once k has: making
    room for k+2 must not evict k's last block, the parent k+1 is about to be attached
    under. The value policy ranks that block (shallow, never hit) below the leaf of an
    older, deeper chain, so without the hold the new chain evicted itself and its commit
    found no parent."""
    store = make_store(n_slots=8, nvme_bytes=0, eviction=eviction)
    store.open_namespace(SPEC)
    old_ids, old_items = prompt(30, 4)
    assert put(store, old_items).stored == 4  # a deeper chain fills half the pool
    ids, items = prompt(31, 6)
    res = [reserve(store, ids[:2])]
    res.append(reserve(store, ids[2:4], parent=ids[1], after=res[0]))
    sums = fill(res[0], items[:2]) + fill(res[1], items[2:4])
    assert store.commit(res[0], sums[:2]) == 2
    res.append(reserve(store, ids[4:], parent=ids[3], after=res[1]))  # evicts two blocks
    assert len(res[2]) == 2
    sums += fill(res[2], items[4:])
    assert store.commit(res[1], sums[2:4]) == 2
    assert store.commit(res[2], sums[4:]) == 2
    assert lookup(store, ids)[0] == 6
    assert get(store, ids)[1] == [it.data for it in items]
    assert lookup(store, old_ids)[0] == 2  # the older chain's tail made the room
    assert [m.readers for st in store.namespaces() for m in st.blocks.values()] == [0] * 8
    check_invariants(store)


def test_a_hold_for_the_next_run_ends_with_it(make_store):
    """The last block held for a run reserved after it is let go when that run ends, by
    commit, abort or a trim to nothing, and never held for a run that ended first."""
    store = make_store(n_slots=8, nvme_bytes=0)
    store.open_namespace(SPEC)
    for seed, end in enumerate(("commit", "abort", "trim", "ended first")):
        ids, items = prompt(32 + seed, 4)
        first = reserve(store, ids[:2])
        second = reserve(store, ids[2:], parent=ids[1], after=first)
        if end == "ended first":  # nothing to hold for it
            store.abort(second)
        assert store.commit(first, fill(first, items[:2])) == 2
        blocks = store.namespaces()[0].blocks
        assert [blocks[b].readers for b in ids[:2]] == [0, 0 if end == "ended first" else 1]
        if end == "commit":
            assert store.commit(second, fill(second, items[2:])) == 2
        elif end == "abort":
            store.abort(second)
        elif end == "trim":
            store.trim(second, 0)
            assert blocks[ids[1]].readers == 0  # kept to none, it has ended
            store.abort(second)  # changes nothing now
        present = [b for b in ids if b in blocks]
        assert len(present) == (4 if end == "commit" else 2)
        assert [blocks[b].readers for b in present] == [0] * len(present)
        check_invariants(store)


def test_a_child_reservation_is_not_stored_when_its_parent_never_was(make_store):
    store = make_store()
    store.open_namespace(SPEC)
    ids, items = prompt(3, 4)
    first = reserve(store, ids[:2])
    second = reserve(store, ids[2:], parent=ids[1], after=first)
    fill(second, items[2:])
    store.abort(first)
    assert store.commit(second, [cks.checksum(it.data) for it in items[2:]]) == 0
    assert lookup(store, ids) == (0, 0, 0)
    assert store.pool.free_slots == store.pool.n_slots
    check_invariants(store)


def test_mismatch_stores_the_verified_prefix_and_frees_the_rest(make_store):
    store = make_store()
    store.open_namespace(SPEC)
    ids, items = prompt(4, 4)
    res = reserve(store, ids)
    sums = fill(res, items)
    res.views[2][7] ^= 0xFF  # corrupted on the wire
    with pytest.raises(DataLoss):
        store.commit(res, sums)
    assert lookup(store, ids) == (2, 2, 0)
    assert store.pool.free_slots == store.pool.n_slots - 2
    check_invariants(store)


def test_commit_with_digests_hashed_as_the_payloads_landed(make_store):
    """A transport that hashed the slots itself passes the digests: they are checked
    against the sender's checksums exactly as the store's own pass would be, and blocks
    past the digests given are not stored."""
    store = make_store()
    store.open_namespace(SPEC)
    ids, items = prompt(9, 5)
    res = reserve(store, ids)
    sums = fill(res, items)
    res.views[3][0] ^= 0xFF  # corrupted on the wire: its digest no longer matches
    digests = [cks.checksum(v) for v in res.views]
    with pytest.raises(DataLoss):
        store.commit(res, sums, digests=digests)
    assert lookup(store, ids) == (3, 3, 0)
    assert store.pool.free_slots == store.pool.n_slots - 3
    ids2, items2 = prompt(10, 4)
    res = reserve(store, ids2)
    sums = fill(res, items2)
    assert store.commit(res, sums, digests=[cks.checksum(v) for v in res.views][:2]) == 2
    assert get(store, ids2)[1] == [it.data for it in items2[:2]]
    assert store.pool.free_slots == store.pool.n_slots - 5
    check_invariants(store)


def test_abort_frees_every_slot_and_orphans_are_refused(make_store):
    store = make_store(n_slots=4)
    store.open_namespace(SPEC)
    ids, _ = prompt(5, 3)
    res = reserve(store, ids)
    store.abort(res)
    store.abort(res)  # idempotent
    assert store.pool.free_slots == 4
    orphan = reserve(store, ids[1:], parent=ids[0])
    assert len(orphan) == 0 and "orphan" in orphan.reason
    check_invariants(store)


def test_trim_keeps_the_leading_slots_and_frees_the_rest(make_store):
    """A transport reserves ahead for the blocks it asked for; the sender announces fewer."""
    store = make_store(n_slots=6)
    store.open_namespace(SPEC)
    ids, items = prompt(11, 5)
    res = reserve(store, ids)
    assert store.pool.free_slots == 1
    store.trim(res, 3)
    assert len(res) == 3 and store.pool.free_slots == 3
    store.trim(res, 4)  # never grows
    assert len(res) == 3
    assert store.commit(res, fill(res, items[:3])) == 3
    assert get(store, ids[:3])[1] == [it.data for it in items[:3]]
    assert store.pool.free_slots == 3
    check_invariants(store)


def test_full_pool_truncates_then_refuses(make_store):
    store = make_store(n_slots=3)
    store.open_namespace(SPEC)
    ids, items = prompt(6, 5)
    res = reserve(store, ids)
    assert len(res) == 3 and "full" in res.reason
    with pytest.raises(ResourceExhausted):
        reserve(store, prompt(7, 2)[0])
    assert store.commit(res, fill(res, items)) == 3
    check_invariants(store)


def test_flush_between_reserve_and_commit_stores_nothing(make_store):
    store = make_store()
    store.open_namespace(SPEC)
    ids, items = prompt(8, 2)
    res = reserve(store, ids)
    sums = fill(res, items)
    store.set_generation(NS, 1)
    assert store.commit(res, sums) == 0
    assert store.pool.free_slots == store.pool.n_slots
    store.killed = True
    with pytest.raises(FailedPrecondition):
        store.reserve(NS, 1, ids, ROOT, ROOT)


def test_borrow_gives_verified_read_only_views_that_pin_the_slots(make_store):
    store = make_store(n_slots=4, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(9, 4)
    put(store, items)
    b = store.borrow(NS, 0, ids, ROOT)
    assert [s.block_id for s in b.served] == ids
    assert [bytes(v) for v in b.views] == [it.data for it in items]
    assert not b.views[0].flags.writeable
    # The pool is full and every block is borrowed: nothing can be evicted for a new put.
    with pytest.raises(ResourceExhausted):
        put(store, prompt(10, 1)[1])
    store.release(b)
    store.release(b)  # idempotent
    assert put(store, prompt(10, 1)[1]) == (1, 0)
    check_invariants(store)


def test_flush_during_a_borrow_parks_the_slots_until_release(make_store):
    store = make_store(n_slots=4, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(11, 2)
    put(store, items)
    b = store.borrow(NS, 0, ids, ROOT)
    store.set_generation(NS, 1)
    assert store.pool.free_slots == 2  # parked, not reused under the transport
    assert [bytes(v) for v in b.views] == [it.data for it in items]
    store.release(b)
    assert store.pool.free_slots == 4


def test_borrow_drops_a_corrupt_block_and_serves_the_prefix(make_store):
    store = make_store(n_slots=8, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(12, 4)
    put(store, items)
    slot = store.namespace(NS, 0).blocks[ids[2]].slot
    store.pool.raw_view(slot)[3] ^= 0xFF
    b = store.borrow(NS, 0, ids, ROOT)
    assert len(b) == 2
    store.release(b)
    assert lookup(store, ids) == (2, 2, 0)
    assert store.counters["corrupt_dropped"] == 1
    check_invariants(store)


def test_borrow_stops_at_blocks_only_on_nvme(make_store):
    store = make_store(n_slots=2, nvme_bytes=8 * NB, policy_for=policy(persist=True))
    store.open_namespace(SPEC)
    ids, items = prompt(13, 2)
    put(store, items)
    put(store, prompt(14, 2)[1])  # demotes the first chain to NVMe
    b = store.borrow(NS, 0, ids, ROOT)
    assert len(b) == 0
    store.release(b)
    served, data = get(store, ids)
    assert data == [it.data for it in items]
    check_invariants(store)


def test_unverified_borrow_leaves_checking_to_the_receiver(make_store):
    store = make_store(n_slots=8, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(15, 3)
    put(store, items)
    slot = store.namespace(NS, 0).blocks[ids[1]].slot
    store.pool.raw_view(slot)[0] ^= 0xFF
    b = store.borrow(NS, 0, ids, ROOT, verify=False)
    assert len(b) == 3 and bytes(b.views[1]) != items[1].data  # sent as it is ...
    assert [s.checksum for s in b.served] == [cks.checksum(it.data) for it in items]
    store.release(b)  # ... with the checksum of what was stored: the receiver refuses it
    assert store.counters.get("corrupt_dropped", 0) == 0
    b = store.borrow(NS, 0, ids, ROOT)  # a verifying read finds it
    assert len(b) == 1 and store.counters["corrupt_dropped"] == 1
    store.release(b)
    check_invariants(store)
