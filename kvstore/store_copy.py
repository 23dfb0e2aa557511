"""Bulk copies of a batch, split across threads: one core's copy-and-checksum (bound by
XXH64's multiplies) is below what the memory bus can do. A host pool's batch is one
native call that starts its own threads (no GIL, no Python per block); a device pool's
copies (torch, which releases the GIL) go over a Python thread pool."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvstore import checksum as cks
from kvstore.tiers.pool import DevicePool, is_tensor

A = TypeVar("A")
R = TypeVar("R")

# Below this many bytes a batch is copied on the caller's thread: hand-offs cost more.
PARALLEL_MIN_BYTES = 8 << 20


class BatchCopier:
    def __init__(self, threads: int = 1) -> None:
        self._threads = threads
        # Used by device pools only; its threads start on first use.
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="kv-copy") if threads > 1 else None
        )

    def threads_for(self, nbytes: int) -> int:
        """Threads a batch of `nbytes` is split over."""
        return self._threads if nbytes >= PARALLEL_MIN_BYTES else 1

    def write(self, pool: DevicePool, slots: list[int], srcs: list[Any]) -> list[int]:
        """pool.write of every (slot, src); the payloads' XXH64."""
        nbytes = sum(memoryview(s).nbytes for s in srcs)
        if pool.host:
            return pool.write_many(slots, srcs, self.threads_for(nbytes))
        return self.map(lambda a: pool.write(*a), list(zip(slots, srcs)), nbytes)

    def copy_into(self, dsts: list[Any], srcs: list[Any]) -> list[int]:
        """Fused copy + XXH64 of host buffers into host buffers (`dsts`, views the
        caller made of slots it holds); the digests of what was copied."""
        nbytes = sum(memoryview(s).nbytes for s in srcs)
        return cks.copy_with_checksum_many(dsts, srcs, self.threads_for(nbytes))

    def read(
        self, pool: DevicePool, slots: list[int], sizes: list[int], dsts: list[Any]
    ) -> list[int]:
        """pool.read_into of every (slot, size, dst); the payloads' XXH64."""
        if dsts and is_tensor(dsts[0]):  # device staging: one batch on the device
            return pool.read_tensors(slots, sizes, dsts)
        if pool.host:
            return pool.read_many(slots, sizes, dsts, self.threads_for(sum(sizes)))
        return self.map(lambda a: pool.read_into(*a), list(zip(slots, sizes, dsts)), sum(sizes))

    def write_start(self, pool: DevicePool, slots: list[int], srcs: list[Any]) -> Any | None:
        """`write`, started in the background (a job: fileno() readable when it is done,
        result() the digests), or None where a batch is copied in the foreground only: a
        device pool, no native extension, or a batch small enough that starting threads
        costs more than it saves (PARALLEL_MIN_BYTES)."""
        if not pool.host or sum(memoryview(s).nbytes for s in srcs) < PARALLEL_MIN_BYTES:
            return None
        return pool.write_start(slots, srcs, self._threads)

    def read_start(
        self,
        pool: DevicePool,
        slots: list[int],
        sizes: list[int],
        dsts: list[Any],
        deadline_ns: int | None = None,
    ) -> Any | None:
        """`read` started in the background, like write_start (host destinations only);
        a block not begun by `deadline_ns` (CLOCK_MONOTONIC) is not copied, its digest
        None."""
        if not pool.host or sum(sizes) < PARALLEL_MIN_BYTES or (dsts and is_tensor(dsts[0])):
            return None
        return pool.read_start(slots, sizes, dsts, self._threads, deadline_ns)

    def checksums(self, views: list[Any]) -> list[int]:
        """XXH64 of host buffers."""
        return cks.checksum_many(views, self.threads_for(sum(memoryview(v).nbytes for v in views)))

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
