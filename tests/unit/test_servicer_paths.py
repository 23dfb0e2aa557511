"""Which thread does what in the agent's big same-host Puts and Gets
(node_agent/servicer.py _store_put / _store_get): the plan on the event loop unless it may
touch NVMe (put_begin_if_fits decides, under the plan's lock), the copy in the
background, the finish on the loop unless it reads NVMe; and each way stores and serves
what store.put / store.get would. A real BlockStore (with and without a RocksDB tier), the
servicer's own methods, thresholds lowered so that the test namespace's small blocks take
the big-batch path."""

from __future__ import annotations

import asyncio
import threading

import pytest
from support.common import make_namespace
from support.store import NB, NS, ROOT, SPEC, check_invariants, lookup, needs_native, prompt, put

from kvstore import store as store_mod
from kvstore import store_copy
from kvstore.events import Tier
from node_agent import servicer
from node_agent.events import EventHub
from node_agent.shm import ShmRegistry


pytestmark = [needs_native, pytest.mark.usefixtures("small_background_batches")]


@pytest.fixture(autouse=True)
def big_batches_by_the_servicer_too(monkeypatch):
    monkeypatch.setattr(servicer, "_OFFLOAD_BYTES", 1)


class Seen:
    """Where put_begin(_if_fits) / get_begin and the finishes ran (the loop's thread or
    another), and whether the copy ran in the background (None: nothing was begun)."""

    def __init__(self, monkeypatch, store) -> None:
        self.calls: list[tuple[str, bool, bool | None]] = []
        for name in ("put_begin", "put_begin_if_fits", "get_begin"):
            real = getattr(store, name)
            monkeypatch.setattr(store, name, self._wrap(name, real))
        for cls in (store_mod.PendingPut, store_mod.PendingGet):
            monkeypatch.setattr(cls, "finish", self._wrap(f"{cls.__name__}.finish", cls.finish))

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            background = None if out is None or "finish" in name else out.fileno() is not None
            self.calls.append(
                (name, threading.current_thread() is threading.main_thread(), background)
            )
            return out

        return call

    def on_loop(self, name: str) -> bool:
        (hit,) = [c for c in self.calls if c[0] == name]
        return hit[1]

    def in_background(self, name: str) -> bool:
        (hit,) = [c for c in self.calls if c[0] == name]
        return bool(hit[2])


def _servicer(store) -> servicer.AgentServicer:
    return servicer.AgentServicer(store, EventHub(store, "n1"), ShmRegistry(), "n1", 64)


def _put(svc, items):
    st = svc.store.namespace(NS, 0)
    return asyncio.run(svc._store_put(st, 0, items, ROOT))


def _get(svc, ids, bufs):
    st = svc.store.namespace(NS, 0)
    return asyncio.run(svc._store_get(st, 0, ids, ROOT, lambda i, n: bufs[i]))


def test_without_an_nvme_tier_even_a_plan_that_evicts_runs_on_the_loop(make_store, monkeypatch):
    store = make_store(n_slots=4, nvme_bytes=0)
    store.open_namespace(SPEC)
    put(store, prompt(1, 4)[1])  # the pool is full: the next put evicts (drops)
    seen = Seen(monkeypatch, store)
    ids, items = prompt(2, 3)
    assert _put(_servicer(store), items) == (3, 0, "")
    assert seen.on_loop("put_begin") and seen.in_background("put_begin")
    assert seen.on_loop("PendingPut.finish")
    assert lookup(store, ids) == (3, 3, 0)
    check_invariants(store)


def test_with_an_nvme_tier_a_plan_with_room_runs_on_the_loop(make_store, monkeypatch):
    store = make_store(n_slots=8)
    store.open_namespace(SPEC)
    seen = Seen(monkeypatch, store)
    ids, items = prompt(1, 3)
    assert _put(_servicer(store), items) == (3, 0, "")
    assert seen.on_loop("put_begin_if_fits") and seen.in_background("put_begin_if_fits")
    assert "put_begin" not in [c[0] for c in seen.calls]
    assert lookup(store, ids) == (3, 3, 0)


@pytest.mark.parametrize("why", ["pool-full", "parent-on-nvme"])
def test_with_an_nvme_tier_a_plan_that_may_touch_it_runs_on_a_thread(make_store, monkeypatch, why):
    store = make_store(n_slots=4)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    if why == "pool-full":
        put(store, prompt(9, 4)[1])  # room only by demoting to NVMe
        todo = items
    else:
        other = make_namespace(name="filler")
        store.open_namespace(other)
        put(store, items[:2])
        put(store, prompt(2, 4, spec=other)[1], spec=other)  # the chain goes to NVMe
        store.set_generation(other.namespace_id, 1)  # room again; the parent stays there
        todo = items[2:]
    seen = Seen(monkeypatch, store)
    assert _put(_servicer(store), todo) == (len(todo), 0, "")
    assert seen.calls[0] == ("put_begin_if_fits", True, None)  # asked on the loop: no
    assert not seen.on_loop("put_begin") and seen.in_background("put_begin")
    assert seen.on_loop("PendingPut.finish")  # the commit touches no NVMe
    assert lookup(store, ids)[0] == 3
    check_invariants(store)


def test_a_get_from_the_pool_copies_in_the_background_and_finishes_on_the_loop(
    make_store, monkeypatch
):
    store = make_store(n_slots=8)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    seen = Seen(monkeypatch, store)
    bufs = [bytearray(NB) for _ in ids]
    served = _get(_servicer(store), ids, bufs)
    assert [s.block_id for s in served] == ids and all(s.tier == Tier.HBM for s in served)
    assert [bytes(b) for b in bufs] == [bytes(it.data) for it in items]
    assert seen.on_loop("get_begin") and seen.in_background("get_begin")
    assert seen.on_loop("PendingGet.finish")


def test_a_get_that_reaches_nvme_finishes_on_a_thread(make_store, monkeypatch):
    store = make_store(n_slots=4)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    put(store, items)
    put(store, prompt(9, 4)[1])  # the chain goes to NVMe
    seen = Seen(monkeypatch, store)
    bufs = [bytearray(NB) for _ in ids]
    served = _get(_servicer(store), ids, bufs)
    assert [s.tier for s in served] == [Tier.NVME] * 3
    assert [bytes(b) for b in bufs] == [bytes(it.data) for it in items]
    assert seen.on_loop("get_begin")
    assert not seen.on_loop("PendingGet.finish")
    check_invariants(store)


def test_a_batch_below_the_background_size_begins_and_finishes_at_once(make_store, monkeypatch):
    monkeypatch.setattr(store_copy, "PARALLEL_MIN_BYTES", 10 * NB)
    store = make_store(n_slots=8)
    store.open_namespace(SPEC)
    seen = Seen(monkeypatch, store)
    ids, items = prompt(1, 3)
    assert _put(_servicer(store), items) == (3, 0, "")
    assert [c[0] for c in seen.calls] == ["put_begin", "PendingPut.finish"]
    assert not seen.in_background("put_begin")  # as store.put does: begin, then finish


@pytest.mark.parametrize("path", ["whole-on-a-thread", "finish-on-a-thread"])
def test_a_cancelled_get_stays_in_flight_until_its_worker_thread_ends(
    make_store, monkeypatch, path
):
    """The router balances by `in_flight`: a Get cancelled while a worker thread copies
    for it still loads the node until that thread ends."""
    store = make_store(n_slots=4)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    put(store, items)
    if path == "whole-on-a-thread":  # below the background size: store.get via _run
        monkeypatch.setattr(store_copy, "PARALLEL_MIN_BYTES", 10 * NB)
        owner, name = store, "get"
    else:  # the chain on NVMe: PendingGet.finish on a thread
        put(store, prompt(9, 4)[1])
        owner, name = store_mod.PendingGet, "finish"
    entered, release = threading.Event(), threading.Event()
    real = getattr(owner, name)

    def held(*args, **kwargs):  # a slow copy, injected
        entered.set()
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, held)
    svc = _servicer(store)
    bufs = [bytearray(NB) for _ in ids]

    async def cancelled_mid_copy() -> tuple[int, int, int]:
        st = store.namespace(NS, 0)
        call = asyncio.ensure_future(svc._store_get(st, 0, ids, ROOT, lambda i, n: bufs[i]))
        while not entered.is_set():
            await asyncio.sleep(0.005)
        during = svc.in_flight
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        after_cancel = svc.in_flight
        release.set()
        for _ in range(6000):  # the thread ends; its callback runs on the loop
            if not svc.in_flight:
                break
            await asyncio.sleep(0.01)
        return during, after_cancel, svc.in_flight

    assert asyncio.run(cancelled_mid_copy()) == (1, 1, 0)
    check_invariants(store)
