"""A task cancelled in the very loop step in which what it awaits completes stays
cancelled. On Python 3.11 asyncio.wait_for loses such a cancel (it returns the result
instead), and the task lives on: the router's EngineFeed.stop() once waited forever on a
subscriber whose replay answer came in as it was cancelled. The timed awaits now use
asyncio.timeout(), and ruff's TID251 (pyproject.toml) keeps wait_for out of the product
code. Fakes here only decide when an answer completes."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.coord.engines import EngineRecord
from node_agent.peer.errors import within
from router.engine_feed import EngineSubscriber


async def _cancel_as_it_completes(task: asyncio.Task, answer: asyncio.Future, value) -> None:
    """Complete `answer` and cancel `task` in one loop step, then let the task run on
    (answering whatever it waits for next) and see whether it ends cancelled."""
    answer.set_result(value)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(task), 5)  # the test's own bound


def test_a_peer_wait_cancelled_as_its_answer_comes_stays_cancelled():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        answers: list[asyncio.Future] = []

        async def transfer_loop() -> None:  # as the peer transports await each chunk
            while True:
                fut = loop.create_future()
                answers.append(fut)
                await within(fut, time.monotonic() + 10, 10, "a chunk")

        task = asyncio.create_task(transfer_loop())
        await asyncio.sleep(0)
        await _cancel_as_it_completes(task, answers[0], b"chunk")
        assert len(answers) == 1  # it did not go on to wait for a second chunk

    asyncio.run(main())


class _FakeDealer:
    """A replay DEALER whose answers the test hands in."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: list[asyncio.Future] = []

    async def send_multipart(self, frames) -> None:
        return None

    def recv_multipart(self) -> asyncio.Future:
        fut = self.loop.create_future()
        self.pending.append(fut)
        return fut

    def close(self, linger: int = 0) -> None:
        pass


def test_an_engine_subscriber_cancelled_as_a_replay_answer_comes_stays_cancelled():
    async def main() -> None:
        sub = EngineSubscriber.__new__(EngineSubscriber)  # no socket loop: _replay alone
        sub.rec = EngineRecord(
            "e0", "http://127.0.0.1:1", ("m",), "n0", {}, 4, "", "tcp://127.0.0.1:1"
        )
        dealer = _FakeDealer(asyncio.get_running_loop())
        sub._dealer = dealer

        async def catch_up_loop() -> None:  # as _follow asks every idle second
            while True:
                await sub._replay(0)

        task = asyncio.create_task(catch_up_loop())
        await asyncio.sleep(0)
        batch = [b"", b"", (0).to_bytes(8, "big"), b"batch"]
        await _cancel_as_it_completes(task, dealer.pending[0], batch)
        assert len(dealer.pending) == 1  # no further answer was waited for

    asyncio.run(main())
