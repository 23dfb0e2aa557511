"""The local lane's limits that need no agent process: which frame headers are refused
before anything after them is read (kvstore/lane.py), which descriptors the agent maps
as shared memory (node_agent/shm.py), and the client's staging memory (a sealed memfd)."""

from __future__ import annotations

import asyncio
import fcntl
import os

import pytest

from kvstore import lane
from kvstore.client.staging import create_staging
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound
from node_agent.shm import FdOffer, ShmLimits, ShmRegistry, check_memory_fd


def test_header_limits():
    assert lane.header_problem(0, 0) is None
    assert lane.header_problem(lane.MAX_FRAME_BYTES, lane.MAX_META_BYTES) is None
    assert "limit" in lane.header_problem(lane.MAX_FRAME_BYTES + 1, 0)
    assert "longer than the body" in lane.header_problem(10, 11)
    # Metadata is what is read before the caller is authenticated: it is capped small.
    too_much = lane.header_problem(lane.MAX_FRAME_BYTES, lane.MAX_META_BYTES + 1)
    assert too_much is not None and str(lane.MAX_META_BYTES) in too_much
    assert lane.MAX_META_BYTES <= 64 << 10 and lane.MAX_FRAME_BYTES <= 8 << 20


def test_register_is_a_lane_method():
    assert lane.METHODS[lane.REGISTER] == "RegisterShm"


def _memfd(size: int, seal: bool, allocate: bool = True) -> int:
    fd = os.memfd_create("unit", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if allocate:
        os.posix_fallocate(fd, 0, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def test_only_sealed_anonymous_memory_is_mapped(tmp_path):
    good = _memfd(1 << 16, seal=True)
    unsealed = _memfd(1 << 16, seal=False)
    named = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT)
    os.ftruncate(named, 1 << 16)
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        check_memory_fd(good, 1 << 16)
        for fd, match in (
            (unsealed, "F_SEAL_SHRINK"),
            (named, "F_SEAL_SHRINK"),
            (directory, "directory"),
            (good, "smaller"),  # asks for more than it holds
        ):
            size = 1 << 17 if fd == good else 1 << 16
            with pytest.raises(InvalidArgument, match=match):
                check_memory_fd(fd, size)
        with pytest.raises(InvalidArgument, match="size"):
            check_memory_fd(good, 0)
        reg = ShmRegistry()
        region = asyncio.run(reg.register_fd(FdOffer(good, 1, 0), 1 << 16, "acme"))
        assert region.owner == "pid 1 uid 0" and len(reg) == 1
        reg.drop(region.region_id)
        assert len(reg) == 0
    finally:
        for fd in (good, unsealed, named, directory):
            os.close(fd)


def test_sparse_memory_and_oversize_regions_are_refused():
    """A memfd whose pages are not all allocated would be allocated by the agent's
    populated mapping, at the agent's cost: refused, before anything is mapped."""
    sparse = _memfd(1 << 20, seal=True, allocate=False)
    half = _memfd(1 << 20, seal=True, allocate=False)
    os.posix_fallocate(half, 0, 1 << 19)
    good = _memfd(1 << 20, seal=True)
    try:
        for fd in (sparse, half):
            with pytest.raises(InvalidArgument, match="every page allocated"):
                check_memory_fd(fd, 1 << 20)
            with pytest.raises(InvalidArgument, match="every page allocated"):
                check_memory_fd(fd, 1 << 18)  # the whole file must be, not just the region
        # A policy of the agent's, not a bad request: FAILED_PRECONDITION, which clients
        # (old ones too) take for "no shared memory here" and go on over gRPC.
        with pytest.raises(FailedPrecondition, match="local_lane_max_region_bytes"):
            check_memory_fd(good, 1 << 20, max_bytes=1 << 19)
    finally:
        for fd in (sparse, half, good):
            os.close(fd)


def test_a_tenants_registered_bytes_are_capped_and_given_back():
    fd = _memfd(1 << 20, seal=True)
    reg = ShmRegistry(ShmLimits(max_region_bytes=1 << 20, max_bytes_per_tenant=2 << 20))
    offer = FdOffer(fd, 1, 0)

    def register(tenant: str):
        return asyncio.run(reg.register_fd(offer, 1 << 20, tenant))

    try:
        first, _ = register("acme"), register("acme")
        with pytest.raises(FailedPrecondition, match="local_lane_max_tenant_region_bytes"):
            register("acme")
        register("globex")  # its own room
        with pytest.raises(NotFound, match="unknown shared-memory region"):
            reg.get(first.region_id, "globex")  # the same answer as an id nobody holds
        reg.drop(first.region_id)
        register("acme")
        assert len(reg) == 3
    finally:
        reg.close()
        os.close(fd)


def test_client_staging_is_a_sealed_memfd_with_no_name():
    staging = create_staging(1 << 20, 1 << 16)
    assert staging is not None and staging.size == 1 << 20
    try:
        st = os.fstat(staging.fd)
        assert st.st_nlink == 0  # nothing under /dev/shm or anywhere else names it
        assert fcntl.fcntl(staging.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        with pytest.raises(PermissionError):  # nobody can shrink it under a mapping
            os.ftruncate(staging.fd, 4096)
        check_memory_fd(staging.fd, staging.size)
    finally:
        staging.close()
