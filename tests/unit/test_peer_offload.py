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


def test_a_cancelled_wait_hands_the_result_to_release_once_the_thread_ends():
    gate = threading.Event()
    released = []

    def reserve():
        gate.wait(10)
        return "slots"

    async def main():
        task = asyncio.ensure_future(in_thread_owned(reserve, released.append))
        await asyncio.sleep(0.05)  # the thread is in reserve(), held at the gate
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert released == []  # the thread has not returned yet
        gate.set()
        for _ in range(500):
            if released:
                break
            await asyncio.sleep(0.01)

    run(main())
    assert released == ["slots"]


def test_an_exception_reaches_the_caller_and_nothing_is_released():
    released = []

    def fail():
        raise ValueError("no slot")

    with pytest.raises(ValueError, match="no slot"):
        run(in_thread_owned(fail, released.append))
    assert released == []


def test_a_thread_that_fails_after_its_waiter_was_cancelled_releases_nothing():
    gate = threading.Event()
    released = []

    def fail():
        gate.wait(10)
        raise ValueError("no slot")

    async def main():
        task = asyncio.ensure_future(in_thread_owned(fail, released.append))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await asyncio.sleep(0.2)

    run(main())
    assert released == []
