"""kvstore.pages: which mapping holds an address and what pages back it, read from the
kernel's /proc/self/smaps for real mappings; asking for huge pages never fails a caller."""

from __future__ import annotations

import gc
import mmap
import os

import numpy as np

from kvstore import pages


def test_an_anonymous_mapping_is_found_with_its_resident_bytes():
    mem = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(mem, dtype=np.uint8)
    arr[: 4 << 20] = 1  # half of it touched
    report = pages.mapping_of(arr.ctypes.data + 12345)
    assert report is not None and report.name == ""
    assert report.start <= arr.ctypes.data < report.end and report.size_kib >= 8 << 10
    assert 4 << 10 <= report.rss_kib <= report.size_kib
    assert report.kernel_page_kib >= 4
    assert pages.mapping_of(0) is None  # nothing is mapped at address 0


def test_page_size_is_the_one_behind_most_resident_bytes():
    def rep(rss: int, huge: int) -> pages.PageReport:
        return pages.PageReport(0, 4 << 20, "", rss, huge, 4)

    assert rep(4096, 4096).page_kib == 2048 and rep(4096, 4096).huge_share == 1.0
    assert rep(4096, 2048).page_kib == 4  # half: not most
    assert rep(4096, 2050).page_kib == 2048
    assert rep(0, 0).page_kib == 4 and rep(0, 0).huge_share == 0.0


def test_asking_for_huge_pages_never_raises():
    """Where the kernel refuses (THP off for this memory, an unaligned range), the memory
    stays on small pages and the caller goes on; the bytes are unchanged either way."""
    mem = mmap.mmap(-1, 6 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages.ask_huge_pages(mem, collapse=False)
    arr = np.frombuffer(mem, dtype=np.uint8)
    arr[:] = np.arange(arr.size, dtype=np.uint64).astype(np.uint8)
    pages.ask_huge_pages(mem, collapse=True)
    assert np.array_equal(arr, np.arange(arr.size, dtype=np.uint64).astype(np.uint8))
    report = pages.mapping_of(arr.ctypes.data)
    assert report is not None and report.huge_kib <= report.rss_kib


def test_map_shared_is_aligned_shared_and_lives_as_long_as_its_views():
    """Two mappings of one memfd see each other's writes; each starts on a 2 MiB boundary
    (where huge pages can be mapped as such); a mapping goes with its last view."""
    fd = os.memfd_create("kvstore-staging-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 6 << 20)
        a = pages.map_shared(fd, 6 << 20)
        b = pages.map_shared(fd, 6 << 20)
        assert a.ctypes.data % pages.HUGE_PAGE == 0 == b.ctypes.data % pages.HUGE_PAGE
        a[:] = 0x3C
        assert (b == 0x3C).all()
        report = pages.mapping_of(b.ctypes.data)
        assert report is not None and report.rss_kib == 6 << 10  # populated
        view, where = b[4096:8192], b.ctypes.data
        del b
        gc.collect()
        assert (view == 0x3C).all() and pages.mapping_of(where) is not None
        del view
        gc.collect()
        assert pages.mapping_of(where) is None
    finally:
        os.close(fd)


def test_first_touch_only_reads():
    """The start-up pass over a fresh mapping (one byte read per 2 MiB) writes nothing: it
    runs on read-only memory, on sizes that are not a whole number of huge pages and on
    nothing at all, and a memfd's bytes are those it held before it was mapped."""
    data = np.arange(5 << 20, dtype=np.uint64).astype(np.uint8)
    frozen = data.copy()
    frozen.flags.writeable = False
    pages.first_touch(frozen)
    pages.first_touch(frozen[:0])
    pages.first_touch(frozen[: pages.HUGE_PAGE + 1])
    assert np.array_equal(frozen, data)
    fd = os.memfd_create("kvstore-touch-test", os.MFD_CLOEXEC)
    try:
        os.write(fd, data.tobytes())
        mapped = pages.map_shared(fd, data.size)  # populated, collapsed, touched
        assert np.array_equal(mapped, data)
    finally:
        os.close(fd)
