"""glibc's allocator: what a process keeps of the memory it frees.

`keep_message_buffers` (agents) keeps freed gRPC message buffers for the next calls;
`free_held` and `trim` (routers) give what a burst left free back to the kernel.

glibc's malloc keeps what a process frees in its heaps for reuse, and gives pages back on
its own only from the top of the main heap. After a burst, a server's resident memory
stays at the peak though Python freed everything: 3,000 TLS connections opened and
closed on the gateway left the router at ~270 MiB more than before them, for good.
malloc_trim(0) hands the free pages inside every arena back (MADV_DONTNEED); the next
burst faults them in again. `free_held` reads what the allocator holds free (mallinfo2,
all arenas), `trim` gives it back. On a C library without both calls (musl), neither
does anything.
"""

from __future__ import annotations

import ctypes
import os

_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",  # bytes in free chunks: what the allocator holds and nothing uses
    "keepcost",
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)  # the process's own C library
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc, or one older than 2.33 (no mallinfo2)
        return None
    return libc


_LIBC = _glibc()


def free_held() -> int:
    """Bytes the allocator holds in free chunks, all arenas (0 where it cannot say)."""
    return int(_LIBC.mallinfo2().fordblks) if _LIBC is not None else 0


def resident_bytes() -> int:
    """This process's resident memory (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trim() -> int:
    """Give the free pages of every arena back; the resident bytes that went (0 where
    this C library has no malloc_trim)."""
    if _LIBC is None:
        return 0
    before = resident_bytes()
    _LIBC.malloc_trim(0)
    return max(before - resident_bytes(), 0)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_message_buffers(largest: int) -> bool:
    """Serve allocations up to `largest` bytes (a gRPC message and its copies) from the
    heap, and keep up to twice that much freed memory for the next ones.

    With glibc's defaults the agent handed each Get's multi-MiB buffers back to the kernel
    (unmapped or trimmed) and faulted them in again for the next: about 760 page faults
    per MiB served over gRPC, half the Get throughput (tests/integration/
    test_grpc_message_memory.py, bench_agent's grpc_get_gbps). Fixed thresholds end that
    (glibc caps the mmap threshold at 32 MiB). False where the C library has no mallopt
    (musl) or refuses; nothing else changes.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    size = min(max(largest, 1 << 20), 32 << 20)
    return bool(mallopt(_M_MMAP_THRESHOLD, size)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * size))
