"""node_agent/peer/offload.py: a worker thread's result is handed on, not dropped, when the
task that awaited it is cancelled."""

from __future__ import annotations

import asyncio
import threading

import pytest

from node_agent.peer.offload import in_thread_owned


def run(coro):
    return asyncio.run(coro)


def test_the_result_comes_back_and_nothing_is_released():
    released = []
    assert run(in_thread_owned(lambda a, b: a + b, released.append, 2, 3)) == 5
    assert released == []


def cancelled_while_running(outcome) -> list:
    """Await in_thread_owned(fn, release) where fn waits at a gate and then returns or
    raises `outcome`; cancel the waiter while fn is held, then open the gate. What
    release got (nothing may reach it before the thread returns)."""
    gate, returned = threading.Event(), threading.Event()
    released: list = []

    def fn():
        try:
            gate.wait(10)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        finally:
            returned.set()

    async def main():
        task = asyncio.ensure_future(in_thread_owned(fn, released.append))
        await asyncio.sleep(0.05)  # the thread is in fn, held at the gate
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert released == []  # the thread has not returned yet
        gate.set()
        await asyncio.to_thread(returned.wait, 10)
        for _ in range(100):  # the hand-off: a few turns of the loop after fn returned
            await asyncio.sleep(0.01)
            if released:
                break

    run(main())
    return released


def test_a_cancelled_wait_hands_the_result_to_release_once_the_thread_ends():
    assert cancelled_while_running("slots") == ["slots"]


def test_an_exception_reaches_the_caller_and_nothing_is_released():
    released = []

    def fail():
        raise ValueError("no slot")

    with pytest.raises(ValueError, match="no slot"):
        run(in_thread_owned(fail, released.append))
    assert released == []


def test_a_thread_that_fails_after_its_waiter_was_cancelled_releases_nothing():
    assert cancelled_while_running(ValueError("no slot")) == []
