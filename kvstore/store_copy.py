"""Bulk copies of a batch, split across threads (the native copy releases the GIL): one
core's copy-and-checksum is below what the memory bus can do."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

A = TypeVar("A")
R = TypeVar("R")

# Below this many bytes a batch is copied on the caller's thread: hand-offs cost more.
PARALLEL_MIN_BYTES = 8 << 20


class BatchCopier:
    def __init__(self, threads: int = 1) -> None:
        self._threads = threads
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="kv-copy") if threads > 1 else None
        )

    def map(self, fn: Callable[[A], R], args: Iterable[A], nbytes: int) -> list[R]:
        """fn over args, on the copy threads when the batch is big enough to pay."""
        items = list(args)
        if self._pool is None or len(items) < 2 or nbytes < PARALLEL_MIN_BYTES:
            return [fn(a) for a in items]
        # One task per thread over a contiguous share: a task per block costs more in
        # hand-offs (~20 us each, far more on a busy host) than it gains in balance.
        step = -(-len(items) // self._threads)
        shares = self._pool.map(
            lambda part: [fn(a) for a in part],
            [items[i : i + step] for i in range(0, len(items), step)],
        )
        return [r for part in shares for r in part]
