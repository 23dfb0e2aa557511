"""The client's staging area when memory cannot back all of it: posix_fallocate refuses
(ENOSPC/ENOMEM) before any page is touched, and the client takes the largest power-of-two
fraction that fits, or none (payloads over gRPC), saying so once. The refusal is injected
(a fault), the memfd and its sealing are real."""

from __future__ import annotations

import errno
import logging
import os
import resource

import pytest

from kvstore import pages
from kvstore.client import staging as staging_mod


@pytest.fixture
def memory_holds(monkeypatch):
    """Make posix_fallocate refuse anything above `limit` bytes, as a full memory cgroup
    or tmpfs would."""

    def install(limit: int) -> None:
        real = os.posix_fallocate

        def fallocate(fd: int, offset: int, length: int) -> None:
            if offset + length > limit:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, offset, length)

        monkeypatch.setattr(staging_mod.os, "posix_fallocate", fallocate)

    return install


def test_short_memory_gives_the_largest_area_that_fits(memory_holds, caplog):
    memory_holds(40 << 20)
    with caplog.at_level(logging.WARNING, logger="kvstore.client"):
        st = staging_mod.create_staging(256 << 20, 16 << 20)
    assert st is not None
    try:
        assert st.size == 32 << 20
    finally:
        st.close()
    assert [r.getMessage() for r in caplog.records] == [
        "memory holds less than the 256 MiB staging area asked for: using 32 MiB"
    ]


def test_no_room_for_the_floor_means_no_area_and_one_warning(memory_holds, caplog):
    memory_holds(8 << 20)
    with caplog.at_level(logging.WARNING, logger="kvstore.client"):
        assert staging_mod.create_staging(256 << 20, 16 << 20) is None
    assert len(caplog.records) == 1 and "payloads go over gRPC" in caplog.records[0].getMessage()


def test_other_errors_are_not_taken_for_short_memory(monkeypatch):
    def broken(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(staging_mod.os, "posix_fallocate", broken)
    with pytest.raises(OSError) as exc:
        staging_mod.create_staging(1 << 20, 1 << 16)
    assert exc.value.errno == errno.EBADF


def test_first_write_into_the_area_takes_no_page_faults():
    """The area is populated when it is made: writing all of it afterwards (what the
    first put does) faults no page in (4,096 faults for these 16 MiB on 4 KiB pages
    otherwise, each on the first transfer's clock)."""
    st = staging_mod.create_staging(16 << 20, 1 << 20)
    assert st is not None
    try:
        area = st.array
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        area[:] = 0x5A
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del area
    finally:
        st.close()
    assert faults < 256  # other threads of the test process may fault a few pages


def test_the_area_reports_its_pages():
    st = staging_mod.create_staging(8 << 20, 1 << 20)
    assert st is not None
    try:
        area = st.array
        report = pages.mapping_of(area.ctypes.data)
        del area
    finally:
        st.close()
    assert report is not None and report.name.startswith("/memfd:kvstore-staging")
    assert report.rss_kib == 8 << 10  # every page backed and mapped
    assert report.page_kib == (2048 if report.huge_kib * 2 > report.rss_kib else 4)
