"""Work a transfer hands to a worker thread whose result it must not lose."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def in_thread_owned(fn: Callable[..., T], release: Callable[[T], None], *args) -> T:
    """fn(*args) in a worker thread, as asyncio.to_thread. If the awaiting task is
    cancelled meanwhile (the caller of a Prefetch went away), the thread still runs to its
    end, threads cannot be interrupted, and what it returns goes to `release`, on the
    event loop, instead of being dropped: slots reserved there would otherwise stay
    reserved for good. Nothing is released when fn raises."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_hand_to(release))
        raise


def _hand_to(release: Callable[[T], None]) -> Callable[[asyncio.Future], None]:
    def done(fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            release(fut.result())

    return done
