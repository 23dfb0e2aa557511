"""kvstore.heap and process.return_freed_memory: what a burst left free in glibc's heap
goes back to the kernel (before, a server's resident memory stayed at its peak). The
burst here is malloc'd and freed through ctypes: 64 KiB chunks, under glibc's mmap
threshold, so they come from the heap; every 16th is kept, so that what is freed lies
between chunks in use and glibc does not give it back by itself (it does so only from
the top of the heap)."""

from __future__ import annotations

import asyncio
import ctypes
import logging

import pytest

from kvstore import heap
from kvstore.process import return_freed_memory

pytestmark = pytest.mark.skipif(heap._LIBC is None, reason="needs glibc 2.33+")

CHUNK = 64 << 10
MIB = 1 << 20


class Burst:
    """`n` chunks of CHUNK bytes, written (so resident); free() frees 15 of every 16."""

    def __init__(self, n: int) -> None:
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.malloc.restype = ctypes.c_void_p
        self.libc.malloc.argtypes = [ctypes.c_size_t]
        self.libc.free.argtypes = [ctypes.c_void_p]
        self.chunks = []
        for _ in range(n):
            p = self.libc.malloc(CHUNK)
            ctypes.memset(p, 1, CHUNK)
            self.chunks.append(p)
        self.kept: list[int] = []

    def free(self) -> None:
        for i, p in enumerate(self.chunks):
            if i % 16 == 15:
                self.kept.append(p)
            else:
                self.libc.free(p)
        self.chunks = []

    def close(self) -> None:
        self.free()
        for p in self.kept:
            self.libc.free(p)
        self.kept = []


def test_trim_gives_back_what_a_burst_left_free():
    burst = Burst(1600)  # 100 MiB, 94 of them freed
    try:
        held = heap.free_held()
        burst.free()
        assert heap.free_held() - held >= 90 * MIB, (held, heap.free_held())
        before = heap.resident_bytes()
        returned = heap.trim()
        assert returned >= 80 * MIB, returned
        assert before - heap.resident_bytes() >= 80 * MIB
    finally:
        burst.close()


def test_the_loop_trims_after_a_burst_and_not_while_memory_is_in_use(caplog):
    """Memory grown and still in use is looked at, not trimmed; once freed, the next look
    gives it back (resident memory falls) and says so."""
    caplog.set_level(logging.INFO, logger="kvstore.process")

    async def main() -> None:
        task = asyncio.create_task(return_freed_memory(every_s=0.05, above=32 * MIB))
        await asyncio.sleep(0.3)  # what this process freed before: trimmed at the first look
        caplog.clear()
        burst = Burst(1600)
        try:
            await asyncio.sleep(0.5)  # ten looks with 100 MiB in use
            assert "freed memory back" not in caplog.text
            peak = heap.resident_bytes()
            burst.free()
            for _ in range(100):
                await asyncio.sleep(0.05)
                if peak - heap.resident_bytes() >= 80 * MIB:
                    break
            assert peak - heap.resident_bytes() >= 80 * MIB, (peak, heap.resident_bytes())
        finally:
            burst.close()
            task.cancel()
        assert "freed memory back to the system" in caplog.text

    asyncio.run(main())
