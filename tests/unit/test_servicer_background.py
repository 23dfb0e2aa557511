"""The agent's waits on background copies (node_agent/servicer.py): a Put or Get whose
caller goes away (a cancelled call: the client's deadline, a dropped connection) while its
copy runs, or while its plan runs on a worker thread, still ends in the store: the copy
waited for, nothing stored (a Put: the client may already reuse its staging slots) or
nothing served (a Get), no slot left reserved and no block left held. A real BlockStore
over a host pool."""

from __future__ import annotations

import asyncio
import threading

import pytest
from support.store import NB, NS, ROOT, SPEC, check_invariants, lookup, needs_native, prompt, put

from kvstore.errors import Unavailable
from kvstore.tiers.pool import SlotState
from node_agent import servicer
from node_agent.events import EventHub
from node_agent.shm import ShmRegistry


pytestmark = [needs_native, pytest.mark.usefixtures("small_background_batches")]


def _reserved(store) -> int:
    return sum(store.pool.state(s) == SlotState.RESERVED for s in range(store.pool.n_slots))


async def _cancel_soon(task: asyncio.Task) -> None:
    await asyncio.sleep(0)  # the task runs up to its first wait
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _slots_given_back(store, slots: int = 16) -> None:
    for _ in range(500):
        if _reserved(store) == 0 and store.pool.free_slots == slots:
            return
        await asyncio.sleep(0.01)


def _nothing_kept(store, ids, slots: int = 16) -> None:
    """An abandoned put: none of its blocks stored, every slot free again."""
    assert lookup(store, ids) == (0, 0, 0)
    assert _reserved(store) == 0 and store.pool.free_slots == slots
    check_invariants(store)


def test_a_put_cancelled_while_its_copy_runs_stores_nothing_and_frees_its_slots(make_store):
    store = make_store(n_slots=16, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 8)

    async def main() -> None:
        pending = store.put_begin(NS, 0, items, ROOT)
        assert pending.fileno() is not None
        await _cancel_soon(asyncio.ensure_future(servicer._copied(pending)))
        await _slots_given_back(store)  # on a worker thread, once the copy is over

    asyncio.run(main())
    _nothing_kept(store, ids)


def test_a_get_cancelled_while_its_copy_runs_serves_nothing_and_holds_nothing(make_store):
    store = make_store(n_slots=16, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 8)
    put(store, items)
    bufs = [bytearray(NB) for _ in ids]

    async def main() -> None:
        pending = store.get_begin(NS, 0, ids, ROOT, lambda i, n: bufs[i])
        assert pending.fileno() is not None
        await _cancel_soon(asyncio.ensure_future(servicer._copied(pending)))

    asyncio.run(main())
    assert store.counters["get_blocks"] == 0
    assert all(m.readers == 0 for st in store.namespaces() for m in st.blocks.values())
    check_invariants(store)


def test_a_put_cancelled_while_its_plan_runs_on_a_thread_is_still_ended(make_store):
    store = make_store(n_slots=16, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 8)
    planning, go_on, begun = threading.Event(), threading.Event(), threading.Event()

    def begin():
        planning.set()
        go_on.wait(10)  # the caller is cancelled while the plan is still running
        pending = store.put_begin(NS, 0, items, ROOT)
        begun.set()
        return pending

    svc = servicer.AgentServicer(store, EventHub(store, "n1"), ShmRegistry(), "n1", 64)

    async def main() -> None:
        task = asyncio.ensure_future(svc._begun_in_thread(begin))
        await asyncio.to_thread(planning.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert svc.in_flight == 1  # the plan's thread still runs: it still loads the node
        go_on.set()
        assert await asyncio.to_thread(begun.wait, 10)
        await _slots_given_back(store)  # the put begun after the cancel is abandoned
        for _ in range(1000):  # its done callback runs on the loop
            if not svc.in_flight:
                break
            await asyncio.sleep(0.01)
        assert svc.in_flight == 0

    asyncio.run(main())
    _nothing_kept(store, ids)


def test_a_put_a_thread_finishes_after_its_call_was_cancelled_stores_nothing(make_store):
    """A put whose copy runs on a worker thread (a batch too small for the background,
    or no copy thread to be had) cannot be stopped by the cancel: it is told (`gone`)
    and stores nothing once its copy is over. The caller hears of the failure when the
    call ends, and may write its staging again from then on."""
    store = make_store(n_slots=16, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 8)
    copying, go_on = threading.Event(), threading.Event()
    ended: list[BaseException | None] = []

    def put_on_thread(gone: threading.Event) -> None:
        copying.set()
        go_on.wait(10)  # the call is cancelled while this thread still works on the put
        try:
            store.put(NS, 0, items, ROOT, None, gone)
            ended.append(None)
        except Exception as exc:  # noqa: BLE001 - what the put ended with, checked below
            ended.append(exc)

    async def main() -> None:
        gone = threading.Event()

        async def call() -> None:
            with servicer._setting_when_cancelled(gone):
                await asyncio.to_thread(put_on_thread, gone)

        task = asyncio.ensure_future(call())
        await asyncio.to_thread(copying.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gone.is_set()
        go_on.set()

    asyncio.run(main())  # waits for the worker thread at its end
    assert len(ended) == 1 and isinstance(ended[0], Unavailable)
    assert "gave up" in str(ended[0])
    _nothing_kept(store, ids)
