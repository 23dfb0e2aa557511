"""Same-host fast path: shared-memory staging regions the client created and holds.

A client on the same host creates its staging memory as a memfd sealed against shrinking,
hands the file descriptor to the agent over the local lane (SCM_RIGHTS, node_agent/
local_lane.py), and then Get/Put move block payloads through it: the agent copies straight
between its pool slots and the region (one copy, checksummed on the way), and gRPC or the
lane carries only control. The agent maps the descriptor it received, never a file named
by the caller, so nobody can point it at memory they do not hold; a region is bound to the
tenant that registered it and lives as long as the lane connection it came over.
"""

from __future__ import annotations

import contextvars
import fcntl
import os
import secrets
import stat
from dataclasses import dataclass

import numpy as np

from kvstore.errors import (
    UNKNOWN_REGION,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvstore.pages import map_shared

SHM_DIR = "/dev/shm"
MAX_REGION_BYTES = 1 << 40


@dataclass(frozen=True, slots=True)
class FdOffer:
    """A descriptor that arrived with a RegisterShm frame, and who sent it (SO_PEERCRED)."""

    fd: int
    pid: int
    uid: int


# Set by the local lane around a RegisterShm call that carried a descriptor; None on gRPC.
shm_offer: contextvars.ContextVar[FdOffer | None] = contextvars.ContextVar(
    "shm_offer", default=None
)


@dataclass(slots=True, eq=False)
class Region:
    region_id: int
    owner: str  # "pid P uid U" of the process that handed the memory over
    tenant: str | None
    array: np.ndarray  # over the mapping (kvstore.pages.map_shared)

    def span(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or offset + nbytes > self.array.size:
            raise InvalidArgument(
                f"shared-memory range [{offset}, {offset + nbytes}) is outside "
                f"region {self.region_id} of {self.array.size} bytes"
            )
        return self.array[offset : offset + nbytes]


def check_memory_fd(fd: int, size: int) -> None:
    """Refuse a descriptor that is not anonymous memory sealed against shrinking: a file
    with a name is memory someone else may hold too, and memory that can shrink under the
    agent's mapping would fault it (SIGBUS) mid-copy."""
    if not 0 < size <= MAX_REGION_BYTES:
        raise InvalidArgument(f"shared-memory size must be in (0, {MAX_REGION_BYTES}]")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument("shared memory must be a memory file (memfd), not a directory")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not shared memory at all (a disk file): no seals to have
    if st.st_nlink or not seals & fcntl.F_SEAL_SHRINK:
        raise InvalidArgument(
            "shared memory must be a memfd sealed with F_SEAL_SHRINK (memfd_create with "
            "MFD_ALLOW_SEALING, then F_ADD_SEALS); a named file is refused"
        )
    if st.st_size < size:
        raise InvalidArgument(f"shared memory of {st.st_size} bytes is smaller than {size}")


class ShmRegistry:
    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}

    def register_fd(self, offer: FdOffer, size: int, tenant: str | None) -> Region:
        """Map the memory behind `offer.fd` (the caller keeps and closes the descriptor)."""
        check_memory_fd(offer.fd, size)
        try:  # populated: page faults at registration, not mid-transfer; 2 MiB-aligned,
            # so the kernel can put it on huge pages (kvstore/pages.py)
            array = map_shared(offer.fd, size)
        except OSError as exc:
            raise ResourceExhausted(f"shared memory cannot be mapped: {exc.strerror}") from None
        owner = f"pid {offer.pid} uid {offer.uid}"
        region = Region(self._new_id(), owner, tenant, array)
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
        self.get(region_id, tenant)
        self.drop(region_id)

    def drop(self, region_id: int) -> None:
        """Forget a region whatever its tenant (its lane connection closed)."""
        region = self._regions.pop(region_id, None)
        if region is None:
            return
        # The mapping goes with the array's last view: now, unless a copy still holds one.
        region.array = np.empty(0, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._regions)

    def close(self) -> None:
        for rid in list(self._regions):
            self.drop(rid)
