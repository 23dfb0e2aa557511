"""Writers of the same chain racing each other (issue: concurrent identical Puts leaked
pool slots). The store plans under its lock, copies outside it and commits under it again:
a block committed by another writer in between must not be committed twice."""

from __future__ import annotations

import threading

import numpy as np
from support.common import TEST_SECRET
from support.store import SPEC, check_invariants, get, lookup, prompt

from kvstore import checksum as cks
from kvstore.events import EventKind

NS = SPEC.namespace_id
ROOT = SPEC.root(0, TEST_SECRET)


class _RendezvousPool:
    """Fault injection: the first write of each of `n` threads waits until all `n` are
    copying, so their plans are both made before either commits (the race, every time)."""

    def __init__(self, pool, n: int) -> None:
        self._pool = pool
        self._barrier = threading.Barrier(n, timeout=10)
        self._seen: set[int] = set()

    def _meet(self) -> None:
        me = threading.get_ident()
        if me not in self._seen:
            self._seen.add(me)
            self._barrier.wait()

    def write(self, slot, src):
        self._meet()
        return self._pool.write(slot, src)

    def write_many(self, slots, srcs, threads=1):
        self._meet()
        return self._pool.write_many(slots, srcs, threads)

    def __getattr__(self, name):
        return getattr(self._pool, name)


def test_identical_puts_copying_at_once_store_each_block_once(make_store):
    store = make_store(n_slots=16)
    store.open_namespace(SPEC)
    store.pool = _RendezvousPool(store.pool, 2)
    ids, items = prompt(1, 6)
    results = []

    def writer():
        results.append(store.put(NS, 0, items, root=ROOT))

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    # Both writers planned all six blocks; one commit stored them, the other found them there.
    assert sorted(results) == [(0, 6), (6, 0)]
    assert store.counters["put_raced"] == 6
    assert store.counters["put_blocks"] == 6
    stored = [e for e in store.events.drain() if e.kind == EventKind.STORED]
    assert sum(len(e.block_ids) for e in stored) == 6
    assert store.pool.free_slots == 16 - 6
    check_invariants(store)
    assert get(store, ids)[1] == [it.data for it in items]


def test_in_place_reservations_of_the_same_run_commit_once(make_store):
    store = make_store(n_slots=16)
    store.open_namespace(SPEC)
    ids, items = prompt(2, 4)
    first = store.reserve(NS, 0, ids, ROOT, ROOT)
    second = store.reserve(NS, 0, ids, ROOT, ROOT)  # neither is visible yet: both reserve
    assert len(first) == len(second) == 4
    sums = [cks.checksum(it.data) for it in items]
    for res in (first, second):
        for view, it in zip(res.views, items):
            view[:] = np.frombuffer(it.data, dtype=np.uint8)
    assert store.commit(first, sums) == 4
    assert store.commit(second, sums) == 0
    assert store.pool.free_slots == 16 - 4
    assert lookup(store, ids) == (4, 4, 0)
    check_invariants(store)


def test_many_rounds_of_racing_writers_leave_no_slot_behind(make_store):
    """The reported workload, in miniature: three writers put the same prompt round after
    round, the store evicting earlier rounds to make room, and every slot is accounted for."""
    store = make_store(n_slots=40, nvme_bytes=0)
    store.open_namespace(SPEC)
    base_pool = store.pool
    for rnd in range(6):
        ids, items = prompt(100 + rnd, 10)
        store.pool = _RendezvousPool(base_pool, 3)
        results: list = []

        def writer(items=items, results=results):
            results.append(store.put(NS, 0, items, root=ROOT))

        threads = [threading.Thread(target=writer) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        store.pool = base_pool
        assert sorted(results) == [(0, 10), (0, 10), (10, 0)]
        check_invariants(store)
        assert lookup(store, ids)[0] == 10
    assert store.counters["put_raced"] == 6 * 2 * 10
    assert store.counters["put_blocks"] == 6 * 10
