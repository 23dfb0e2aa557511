"""Memory a process freed, given back to the kernel.

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
import ctypes.util
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
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
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
