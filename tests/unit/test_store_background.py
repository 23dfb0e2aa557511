"""BlockStore.put_begin / get_begin: a put or get whose copy runs in the background
(the native batch's own threads) while the agent's event loop waits on a descriptor
(node_agent/servicer.py). Whatever happens between the begin and the finish (a flush, a
corrupt payload, the caller going away) the store ends as a foreground put or get would
leave it: same blocks, same events, every slot and every hold given back."""

from __future__ import annotations

import select
import time

import pytest
from support.common import make_namespace
from support.store import (
    NB,
    NS,
    ROOT,
    SPEC,
    check_invariants,
    demote_all,
    get,
    lookup,
    needs_native,
    prompt,
    put,
)

from kvstore.errors import DataLoss, DeadlineExceeded, NotFound
from kvstore.events import Tier
from kvstore.store import PutItem


pytestmark = pytest.mark.usefixtures("small_background_batches")


def _wait(pending) -> None:
    fd = pending.fileno()
    assert fd is not None, "the copy did not start in the background"
    assert select.select([fd], [], [], 30)[0]


def _dsts(n: int) -> tuple[list[bytearray], object]:
    bufs = [bytearray(NB) for _ in range(n)]
    return bufs, (lambda i, nbytes: bufs[i])


@needs_native
def test_a_background_put_and_get_store_and_serve_what_the_foreground_does(make_store):
    store = make_store(copy_threads=2)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 5)
    pending = store.put_begin(NS, 0, items, ROOT)
    _wait(pending)
    assert pending.finish() == (5, 0)
    assert lookup(store, ids) == (5, 5, 0)
    bufs, dst_for = _dsts(5)
    got = store.get_begin(NS, 0, ids, ROOT, dst_for)
    assert not got.reads_beyond_pool
    _wait(got)
    served = got.finish()
    assert [s.block_id for s in served] == ids and all(s.tier == Tier.HBM for s in served)
    assert [bytes(b) for b in bufs] == [bytes(it.data) for it in items]
    assert store.counters["get_blocks"] == 5
    again = store.put_begin(NS, 0, items, ROOT)  # all present: nothing planned to copy
    assert again.finish() == (0, 5)
    check_invariants(store)


@needs_native
def test_a_flush_while_the_copy_runs_stores_nothing_and_frees_every_slot(make_store):
    store = make_store(n_slots=4, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    pending = store.put_begin(NS, 0, items, ROOT)
    store.set_generation(NS, 1)  # flushed while the payloads were still landing
    _wait(pending)
    assert pending.finish() == (0, 0)
    assert store.block_count() == 0 and store.pool.free_slots == 4
    check_invariants(store)


@needs_native
def test_a_flush_while_a_background_get_copies_serves_nothing(make_store):
    store = make_store(n_slots=4, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    put(store, items)
    _, dst_for = _dsts(3)
    pending = store.get_begin(NS, 0, ids, ROOT, dst_for)
    store.set_generation(NS, 1)
    _wait(pending)
    assert pending.finish() == []
    assert store.pool.free_slots == 4  # the flushed blocks' slots, freed by the last reader
    check_invariants(store)


@needs_native
def test_a_corrupt_payload_keeps_the_blocks_before_it_and_leaks_no_slot(make_store):
    store = make_store(n_slots=8, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    bad = PutItem(items[1].block_id, items[1].parent_id, items[1].data, checksum=12345)
    pending = store.put_begin(NS, 0, [items[0], bad, items[2]], ROOT)
    _wait(pending)
    with pytest.raises(DataLoss, match="checksum"):
        pending.finish()
    assert lookup(store, ids) == (1, 1, 0)
    assert store.pool.free_slots == 7
    check_invariants(store)


@needs_native
def test_finishing_twice_is_refused_and_abandoning_ends_cleanly(make_store):
    store = make_store(n_slots=8, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    pending = store.put_begin(NS, 0, items, ROOT)
    pending.abandon()  # the caller went away: nothing stored, every slot back
    pending.abandon()
    with pytest.raises(RuntimeError, match="finished already"):
        pending.finish()
    assert lookup(store, ids) == (0, 0, 0) and store.pool.free_slots == 8
    assert store.put(NS, 0, items, ROOT).stored == 4  # the same blocks, put again
    _, dst_for = _dsts(4)
    got = store.get_begin(NS, 0, ids, ROOT, dst_for)
    got.abandon()  # nothing served, every hold let go of
    got.abandon()
    with pytest.raises(RuntimeError, match="finished already"):
        got.finish()
    assert store.counters["get_blocks"] == 0
    assert all(m.readers == 0 for st in store.namespaces() for m in st.blocks.values())
    check_invariants(store)


@needs_native
@pytest.mark.parametrize("background", [True, False], ids=["background", "foreground"])
def test_a_put_whose_copy_ended_past_the_deadline_stores_nothing(make_store, background):
    """The caller was told its call failed at its deadline and may have written its
    buffers again while the copy read them: nothing of it is stored, every slot back."""
    store = make_store(n_slots=8, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    deadline = time.monotonic_ns() + 50_000_000  # 50 ms: time enough to plan
    pending = store.put_begin(NS, 0, items, ROOT, background, deadline)
    if background:
        _wait(pending)
    time.sleep(max(0, deadline - time.monotonic_ns()) / 1e9 + 0.001)  # the copy ends late
    with pytest.raises(DeadlineExceeded, match="nothing stored"):
        pending.finish()
    assert lookup(store, ids) == (0, 0, 0) and store.pool.free_slots == 8
    assert store.counters["put_past_deadline"] == 1
    in_time = store.put_begin(NS, 0, items, ROOT, background, time.monotonic_ns() + 60 * 10**9)
    if background:
        _wait(in_time)
    assert in_time.finish() == (4, 0)
    check_invariants(store)


@needs_native
def test_a_get_past_its_deadline_copies_nothing_and_keeps_its_blocks(make_store, monkeypatch):
    store = make_store(n_slots=8, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    bufs, dst_for = _dsts(4)
    # Past before the copy starts: refused at once, nothing written.
    with pytest.raises(DeadlineExceeded, match="nothing written"):
        store.get_begin(NS, 0, ids, ROOT, dst_for, deadline_ns=time.monotonic_ns())
    with pytest.raises(DeadlineExceeded, match="nothing written"):
        store.get(NS, 0, ids, ROOT, dst_for, deadline_ns=time.monotonic_ns())
    assert all(b == bytearray(NB) for b in bufs)
    # Past by the time the copy threads begin (they find it so: the fault injected here
    # is a deadline long gone, as a thread started late would see it): none served, and
    # the blocks copied or not are not taken for corrupt.
    real = store._copier.read_start
    monkeypatch.setattr(store._copier, "read_start", lambda *a: real(*a[:-1], deadline_ns=1))
    pending = store.get_begin(NS, 0, ids, ROOT, dst_for, deadline_ns=time.monotonic_ns() + 10**9)
    _wait(pending)
    with pytest.raises(DeadlineExceeded, match="none served"):
        pending.finish()
    assert all(b == bytearray(NB) for b in bufs)
    assert store.counters["get_past_deadline"] == 3
    assert lookup(store, ids) == (4, 4, 0)
    assert all(m.readers == 0 for st in store.namespaces() for m in st.blocks.values())
    served, data = get(store, ids)
    assert data == [it.data for it in items]
    check_invariants(store)


def test_a_get_that_reaches_nvme_says_so_and_promotes_on_finish(make_store):
    store = make_store(n_slots=4)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    put(store, items)
    demote_all(store)
    _, dst_for = _dsts(3)
    pending = store.get_begin(NS, 0, ids, ROOT, dst_for)
    assert pending.reads_beyond_pool  # finish() reads RocksDB: the agent runs it on a thread
    served = pending.finish()
    assert [s.tier for s in served] == [Tier.NVME] * 3
    check_invariants(store)


def test_without_background_the_copy_runs_in_finish(make_store):
    store = make_store()
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    pending = store.put_begin(NS, 0, items, ROOT, background=False)
    assert pending.fileno() is None
    assert pending.finish() == (3, 0)
    served, data = get(store, ids)
    assert data == [it.data for it in items]


def _fits(store, items, ns=NS) -> bool:
    """put_begin_if_fits planned them (and the put is then given up, nothing stored)."""
    pending = store.put_begin_if_fits(ns, 0, items, ROOT)
    if pending is not None:
        pending.abandon()
    return pending is not None


def test_put_begin_if_fits_counts_free_slots_quota_and_writes_in_flight(make_store):
    store = make_store(n_slots=4, nvme_bytes=0)
    store.open_namespace(SPEC)
    _, four = prompt(1, 4)
    _, five = prompt(2, 5)
    assert _fits(store, four)
    assert not _fits(store, five)
    assert store.pool.free_slots == 4  # nothing planned either way, nothing kept
    with pytest.raises(NotFound):
        store.put_begin_if_fits(b"\0" * 16, 0, four[:1], ROOT)  # no such namespace
    pending = store.put_begin(NS, 0, four[:2], ROOT, background=False)  # 2 slots in flight
    _, two, three = prompt(3, 2)[1], prompt(4, 2)[1], prompt(5, 3)[1]
    assert _fits(store, two) and not _fits(store, three)
    pending.finish()
    store.set_tenant_limits(SPEC.tenant, 3 * NB, None)
    assert _fits(store, two[:1])
    assert not _fits(store, two)  # free slots, but over the quota
    got = store.put_begin_if_fits(NS, 0, two[:1], ROOT)  # what fits is planned and put
    assert got is not None and got.finish().stored == 1


def test_a_parent_held_on_nvme_only_does_not_fit(make_store):
    """Planning a child of a block held on NVMe only reads that block back into the pool
    first (and may evict to make room for it): not work for the agent's event loop."""
    store = make_store(n_slots=4)
    store.open_namespace(SPEC)
    other = make_namespace(name="filler")
    store.open_namespace(other)
    ids, items = prompt(1, 3)
    put(store, items[:2])
    put(store, prompt(2, 4, spec=other)[1], spec=other)  # pushes the chain to NVMe
    store.set_generation(other.namespace_id, 1)  # flushed: its 4 slots free again
    assert store.pool.free_slots == 4
    st = next(s for s in store.namespaces() if s.ns_id == NS)
    assert st.blocks[ids[1]].slot < 0 and st.blocks[ids[1]].on_nvme
    assert not _fits(store, items[2:])  # its parent is on NVMe only
    assert _fits(store, prompt(3, 3)[1])  # a chain of its own does
