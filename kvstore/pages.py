"""The pages behind bulk memory: huge pages asked for where the kernel allows them, and the
page size a mapping actually got.

A 2 MiB block on 4 KiB pages is 512 TLB entries and 512 page walks per copy, and the
hardware prefetchers stop at every 4 KiB boundary; on one 2 MiB page it is one. Whether a
mapping gets huge pages is the kernel's call (/sys/kernel/mm/transparent_hugepage:
`enabled` for anonymous memory, `shmem_enabled` for memfds), so the staging area and the
pool ask (MADV_HUGEPAGE before the first touch, MADV_COLLAPSE after it, Linux 6.1+), never
insist, and what they got is read back from /proc/<pid>/smaps (bench_agent reports it).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import re
import sys
import threading
import weakref
from dataclasses import dataclass

import numpy as np

# Linux values, for Pythons built against headers older than the constant.
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)
MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", 10)
MADV_DONTDUMP = getattr(mmap, "MADV_DONTDUMP", 16)

HUGE_PAGE = 2 << 20
_MAP_FIXED = 0x10  # Linux values
_PROT_NONE = 0
_RANGE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")
_HUGE_FIELDS = ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped")


def ask_huge_pages(mm: mmap.mmap, collapse: bool) -> None:
    """Ask for transparent huge pages on `mm` (best effort: a kernel that refuses, EINVAL
    where THP is off for this kind of memory, leaves it on small pages). `collapse`: its
    pages are already there (touched or populated), so also ask the kernel to move them
    onto huge pages now (MADV_COLLAPSE; on failure, ENOMEM or EAGAIN, they stay small),
    then read once per huge page (first_touch)."""
    for advice in (MADV_HUGEPAGE, MADV_COLLAPSE) if collapse else (MADV_HUGEPAGE,):
        try:
            mm.madvise(advice)
        except (OSError, ValueError):
            pass  # not allowed here: small pages, which bench_agent reports
    if collapse:
        first_touch(np.frombuffer(mm, dtype=np.uint8))  # a view, gone on return


def first_touch(arr: np.ndarray) -> None:
    """Read one byte of every 2 MiB of `arr`, right after its pages were collapsed. In
    some processes (7 of 22 here, never in the others) the first access to each huge
    page of a fresh mapping cost 12-38 us, though smaps showed the whole mapping
    PMD-mapped before it: 64 first writes into pool slots took up to 2.5 ms instead of
    ~50 us, and the same-host Put's control path ran 2-4x slower in those agents (a 2 MiB
    block pays it once per slot not yet written: a small share of its ~100 us copy).
    Reading once per huge page here moves that to start-up (0-23 ms for 3 GiB;
    docs/benchmarks.md, 2026-12-05 21:30). The same cost comes back, after this read,
    while other processes of the guest allocate and free memory fast, on virtual
    machines that report freed pages to their host at once: not something a touch here
    can keep away (docs/benchmarks.md, 2026-12-07 19:59)."""
    if arr.size:
        int(arr[::HUGE_PAGE].max())


@dataclass(frozen=True, slots=True)
class PageReport:
    """What backs one mapping (from /proc/<pid>/smaps)."""

    start: int  # address range [start, end)
    end: int
    name: str  # the mapping's path ("" when anonymous)
    rss_kib: int
    huge_kib: int  # resident bytes mapped by 2 MiB page-table entries (THP)
    kernel_page_kib: int  # the base page size (KernelPageSize)

    @property
    def page_kib(self) -> int:
        """The page size that maps most of the resident bytes: 2048 when most are on
        transparent huge pages, else the base page size."""
        if self.rss_kib and self.huge_kib * 2 > self.rss_kib:
            return 2048
        return self.kernel_page_kib

    @property
    def size_kib(self) -> int:
        return (self.end - self.start) >> 10

    @property
    def huge_share(self) -> float:
        return self.huge_kib / self.rss_kib if self.rss_kib else 0.0


def _kib(value: str) -> int:
    return int(value.split()[0])


def mappings(pid: int | str = "self") -> list[PageReport]:
    """Every mapping of process `pid`, from /proc/<pid>/smaps."""
    out: list[PageReport] = []
    cur: dict[str, str] = {}
    name, start, end = "", 0, 0

    def flush() -> None:
        if cur:
            out.append(
                PageReport(
                    start,
                    end,
                    name,
                    _kib(cur.get("Rss", "0 kB")),
                    sum(_kib(cur.get(f, "0 kB")) for f in _HUGE_FIELDS),
                    _kib(cur.get("KernelPageSize", "4 kB")),
                )
            )

    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = _RANGE.match(line)
            if m:
                flush()
                cur = {"Rss": "0 kB"}
                fields = line.split(maxsplit=5)
                name = fields[5].strip() if len(fields) > 5 else ""
                start, end = int(m.group(1), 16), int(m.group(2), 16)
            elif ":" in line:
                key, value = line.split(":", 1)
                if value.strip().endswith("kB"):
                    cur[key] = value.strip()
        flush()
    return out


def mapping_of(address: int, pid: int | str = "self") -> PageReport | None:
    """The mapping of process `pid` that holds `address`, or None."""
    return next((m for m in mappings(pid) if m.start <= address < m.end), None)


# ---------------------------------------------------------------- aligned shared mappings


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_LIBC = _libc()
_FAILED = ctypes.c_void_p(-1).value


def _map_aligned(fd: int, size: int, writable: bool = True) -> np.ndarray | None:
    """`fd`'s first `size` bytes, shared, at a 2 MiB-aligned address (so its huge pages,
    where the kernel makes them, are mapped as such: the kernel aligns a memfd mapping
    only where shmem_enabled allows huge pages, and MADV_COLLAPSE needs whole aligned
    2 MiB ranges); `writable`: read-write, populated and collapsed, else read-only and
    faulted in as it is read (a huge page already there maps whole). None where this
    cannot be tried (not Linux, no room for the reservation). The mapping goes when the
    array and its last view do."""
    libc = _LIBC
    if libc is None:
        return None
    span = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    base = libc.mmap(None, span + HUGE_PAGE, _PROT_NONE, flags, -1, 0)  # address space only
    if base in (None, _FAILED):
        return None
    start = (base + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    shared = mmap.MAP_SHARED | _MAP_FIXED | (getattr(mmap, "MAP_POPULATE", 0) if writable else 0)
    got = libc.mmap(start, span, prot, shared, fd, 0)
    if got != start:
        err = ctypes.get_errno()
        libc.munmap(base, span + HUGE_PAGE)
        raise OSError(err, os.strerror(err))
    if start > base:  # the reservation's unused head and tail
        libc.munmap(base, start - base)
    if base + span + HUGE_PAGE > start + span:
        libc.munmap(start + span, base + span + HUGE_PAGE - (start + span))
    if writable:  # best effort, as ask_huge_pages
        libc.madvise(start, span, MADV_HUGEPAGE)
        _collapse(libc, start, span)
    else:  # another process's memory, kept out of this one's core dumps and children
        for advice in (MADV_DONTDUMP, MADV_DONTFORK):
            libc.madvise(start, span, advice)
    raw = (ctypes.c_uint8 * size).from_address(start)
    weakref.finalize(raw, libc.munmap, start, span)
    # Through a memoryview: it holds `raw` (so the mapping) for as long as any view does.
    arr = np.frombuffer(memoryview(raw), dtype=np.uint8)
    if writable:
        first_touch(arr)
    arr.flags.writeable = writable
    return arr


COLLAPSE_SPLIT = 256 << 20  # at least this much per collapsing thread


def _collapse(libc: ctypes.CDLL, start: int, span: int) -> None:
    """MADV_COLLAPSE over [start, start + span), split over threads: the kernel copies
    each 2 MiB of small pages into a huge page one after another (2 GiB of a memfd took
    3.5-4.7 s on one core here), and ctypes releases the GIL for the call."""
    threads = max(1, min(os.cpu_count() or 1, 8, span // COLLAPSE_SPLIT))
    step = -(-span // threads // HUGE_PAGE) * HUGE_PAGE
    parts = [(start + off, min(step, span - off)) for off in range(0, span, step)]
    if len(parts) == 1:
        libc.madvise(start, span, MADV_COLLAPSE)
        return
    workers = [
        threading.Thread(target=libc.madvise, args=(a, n, MADV_COLLAPSE), daemon=True)
        for a, n in parts
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def map_shared(fd: int, size: int) -> np.ndarray:
    """The first `size` bytes of memory file `fd`, mapped shared and populated (page
    faults now, not mid-transfer), huge pages asked for; 2 MiB-aligned where that can be
    had. Raises OSError (ENOMEM ...) when it cannot be mapped."""
    arr = _map_aligned(fd, size)
    if arr is not None:
        return arr
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    ask_huge_pages(mm, collapse=True)
    return np.frombuffer(mm, dtype=np.uint8)  # the mapping goes with its last view


def map_read_only(fd: int, size: int) -> np.ndarray:
    """The first `size` bytes of memory file `fd` (opened read-only), mapped shared and
    read-only, 2 MiB-aligned where that can be had; pages are faulted in as they are read.
    Raises OSError when it cannot be mapped."""
    arr = _map_aligned(fd, size, writable=False)
    if arr is not None:
        return arr
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    for advice in (MADV_DONTDUMP, MADV_DONTFORK):
        try:
            mm.madvise(advice)
        except (OSError, ValueError):
            pass
    return np.frombuffer(mm, dtype=np.uint8)


def sealed_memfd(
    name: str, size: int, seals: int, mode: int | None = None
) -> tuple[int, np.ndarray]:
    """A memory file of `size` bytes, every page backed now (posix_fallocate: a clean
    ENOMEM/ENOSPC here rather than SIGBUS on a later fault), sealed with `seals`
    (fcntl.F_SEAL_*), with permission bits `mode` (who may open it again through
    /proc/PID/fd; a memfd's are 0777 else), mapped by map_shared: (fd, array). The caller
    owns the fd. OSError when it cannot be had (the fd is closed then)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        return fd, map_shared(fd, size)
    except BaseException:
        os.close(fd)
        raise
