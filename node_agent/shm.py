"""Same-host fast path: client-created POSIX shared-memory staging regions.

A client on the same host creates /dev/shm/<name>, registers it, and then Get/Put move
block payloads through it: the agent copies straight between its pool slots and the
region (one copy, checksummed on the way), and gRPC carries only control. Each region is
mapped only for the tenant that registered it, so tenants never see each other's bytes.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass

import numpy as np

from kvstore.errors import (
    UNKNOWN_REGION,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
MAX_REGION_BYTES = 1 << 40


@dataclass(slots=True, eq=False)
class Region:
    region_id: int
    name: str
    tenant: str | None
    mm: mmap.mmap
    array: np.ndarray

    def span(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or offset + nbytes > self.array.size:
            raise InvalidArgument(
                f"shared-memory range [{offset}, {offset + nbytes}) is outside "
                f"region {self.region_id} of {self.array.size} bytes"
            )
        return self.array[offset : offset + nbytes]


class ShmRegistry:
    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}

    def register(self, name: str, size: int, tenant: str | None) -> Region:
        if not _NAME.match(name or ""):
            raise InvalidArgument("shared-memory name must be 1-200 chars of [A-Za-z0-9_.-]")
        if not 0 < size <= MAX_REGION_BYTES:
            raise InvalidArgument(f"shared-memory size must be in (0, {MAX_REGION_BYTES}]")
        # Names under /dev/shm are visible to every process on the host: a tenant must not
        # map another tenant's staging region through the agent and read or write it.
        if any(r.name == name and r.tenant != tenant for r in self._regions.values()):
            raise PermissionDenied(f"shared memory {name!r} is registered by another tenant")
        if name in (".", ".."):
            raise InvalidArgument("shared-memory name must name a file, not '.' or '..'")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise FailedPrecondition(
                f"shared memory {name!r} not found: client is not on this host (use the gRPC path)"
            ) from None
        except OSError as exc:  # a directory, a socket, a link, not ours to open
            raise FailedPrecondition(
                f"shared memory {name!r} cannot be opened: {exc.strerror}"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FailedPrecondition(f"shared memory {name!r} is not a regular file")
            if st.st_size < size:
                raise InvalidArgument(f"shared memory {name!r} is smaller than {size} bytes")
            # Populate the mapping now: page faults at registration, not mid-transfer.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError as exc:
            raise ResourceExhausted(
                f"shared memory {name!r} cannot be mapped: {exc.strerror}"
            ) from None
        finally:
            os.close(fd)
        region = Region(self._new_id(), name, tenant, mm, np.frombuffer(mm, dtype=np.uint8))
        self._regions[region.region_id] = region
        return region

    def _new_id(self) -> int:
        """Random, never 0 (no region): a client of this agent's previous process at the
        same address still names its old id, and with ids counted from 1 that id would
        be another client's region here, its Gets landing there. A random id is unknown
        (NOT_FOUND), so the client re-registers (kvstore/client)."""
        while True:
            rid = secrets.randbits(62) + 1
            if rid not in self._regions:
                return rid

    def get(self, region_id: int, tenant: str | None) -> Region:
        region = self._regions.get(region_id)
        if region is None:
            raise NotFound(f"{UNKNOWN_REGION} {region_id}")
        if region.tenant != tenant:
            raise PermissionDenied(f"shared-memory region {region_id} belongs to another tenant")
        return region

    def unregister(self, region_id: int, tenant: str | None) -> None:
        region = self.get(region_id, tenant)
        del self._regions[region_id]
        region.array = np.empty(0, dtype=np.uint8)
        try:
            region.mm.close()
        except BufferError:
            pass  # a copy still holds a view; the mapping goes when it is collected

    def close(self) -> None:
        for rid in list(self._regions):
            self.unregister(rid, self._regions[rid].tenant)
