"""Same-host fast path: shared-memory staging regions the client created and holds.

A client on the same host creates its staging memory as a memfd sealed against shrinking,
hands the file descriptor to the agent over the local lane (SCM_RIGHTS, node_agent/
local_lane.py), and then Get/Put move block payloads through it: the agent copies straight
between its pool slots and the region (one copy, checksummed on the way), and gRPC or the
lane carries only control. The agent maps the descriptor it received, never a file named
by the caller, so nobody can point it at memory they do not hold; a region is bound to the
tenant that registered it and lives as long as the lane connection it came over.

A GPU engine's staging area is device memory instead (`DeviceRegion`): the descriptor is a
CUDA virtual-memory allocation's (kvstore/cuda_vmm.py), accepted only when the agent's
pool lives on that same GPU and verifies payloads there, so a Get copies pool slots into
it device to device (kvstore/tiers/pool.py, read_many) with no host memory between.
"""

from __future__ import annotations

import contextvars
import fcntl
import os
import secrets
import stat
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.errors import (
    UNKNOWN_REGION,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
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


def staging_deadline(deadline_ns: int, sent_ns: int, what: str) -> int | None:
    """The agent's CLOCK_MONOTONIC time (ns) by which a same-host call's copy to or from
    the caller's staging must end, from the deadline and sent time the caller gave on its
    own clock (PutRequest.staging_deadline_ns / ShmTarget.deadline_ns); None when it gave
    none. The earlier of the deadline as given and the time the caller had left counted
    from now: on the clock the two share that is the deadline itself (now is past the
    sent time), and a caller whose clock runs ahead of the agent's (a time namespace of
    its own) gets no more than it had left. One whose clock runs behind gets a deadline
    that has passed: refused, never a window the caller did not give."""
    if not deadline_ns and not sent_ns:
        return None
    if not deadline_ns or not sent_ns or sent_ns > deadline_ns:
        raise InvalidArgument(
            f"{what}: a deadline needs both times, in ns of CLOCK_MONOTONIC, the deadline "
            f"not before the sent time (got deadline {deadline_ns}, sent {sent_ns})"
        )
    return min(deadline_ns, time.monotonic_ns() + (deadline_ns - sent_ns))


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

    def spans(self, first: int, stride: int, nbytes: int, count: int) -> list[np.ndarray]:
        """`count` spans of `nbytes`, the i-th at first + i * stride (stride >= nbytes),
        every one checked before any is made."""
        if count:
            self.span(first, nbytes)
            self.span(first + (count - 1) * stride, nbytes)
        a = self.array
        return [a[o : o + nbytes] for o in range(first, first + count * stride, stride)]

    def release(self) -> None:
        # The mapping goes with the array's last view: now, unless a copy still holds one.
        self.array = np.empty(0, dtype=np.uint8)


@dataclass(slots=True, eq=False)
class DeviceRegion:
    """A client's staging area in GPU memory, mapped here: spans are uint8 tensors on the
    pool's GPU (a torch tensor over the mapping holds it until its last view is gone)."""

    region_id: int
    owner: str
    tenant: str | None
    tensor: torch.Tensor  # 1-D uint8, on the pool's device
    memory: object = None  # kvstore.cuda_vmm.DeviceMemory: unmapped with its last view

    def span(self, offset: int, nbytes: int) -> torch.Tensor:
        if offset < 0 or offset + nbytes > self.tensor.numel():
            raise InvalidArgument(
                f"device staging range [{offset}, {offset + nbytes}) is outside "
                f"region {self.region_id} of {self.tensor.numel()} bytes"
            )
        return self.tensor[offset : offset + nbytes]

    def release(self) -> None:
        # As for host regions: the mapping goes once no copy still holds a view of it.
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.memory = None


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


def device_staging_refusal(pool_device: torch.device, in_place_why: str, uuid: bytes) -> str:
    """Why GPU staging memory on the GPU `uuid` cannot be taken by a pool on
    `pool_device` ('' when it can): the copy must stay on one GPU and be verified there."""
    if pool_device.type != "cuda":
        return (
            f"this agent's pool is in host memory ({pool_device}); device staging needs the "
            "pool on the same GPU: use host staging"
        )
    if in_place_why:
        return f"this agent's GPU pool cannot verify payloads in place ({in_place_why})"
    from kvstore import cuda_vmm

    why = cuda_vmm.why_unavailable()
    if why:
        return why
    ours = cuda_vmm.device_uuid(pool_device.index or 0)
    if ours != uuid:
        return (
            f"the staging memory is on GPU {uuid.hex()}, this agent's pool on GPU "
            f"{ours.hex()}: use host staging"
        )
    return ""


class ShmRegistry:
    def __init__(self) -> None:
        self._regions: dict[int, Region | DeviceRegion] = {}

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

    def register_device_fd(
        self,
        offer: FdOffer,
        size: int,
        uuid: bytes,
        tenant: str | None,
        pool_device: torch.device,
        in_place_why: str,
    ) -> DeviceRegion:
        """Map the GPU memory behind `offer.fd` (a CUDA VMM allocation's descriptor) for
        a pool on `pool_device`; FAILED_PRECONDITION when the pool cannot take it there."""
        if not 0 < size <= MAX_REGION_BYTES:
            raise InvalidArgument(f"device staging size must be in (0, {MAX_REGION_BYTES}]")
        if len(uuid) != 16:
            raise InvalidArgument(f"device_uuid must be 16 bytes, got {len(uuid)}")
        why = device_staging_refusal(pool_device, in_place_why, uuid)
        if why:
            raise FailedPrecondition(why)
        from kvstore import cuda_vmm

        mem = cuda_vmm.DeviceMemory.import_fd(offer.fd, size, pool_device.index or 0)
        owner = f"pid {offer.pid} uid {offer.uid}"
        region = DeviceRegion(self._new_id(), owner, tenant, mem.tensor(), mem)
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

    def get(self, region_id: int, tenant: str | None) -> Region | DeviceRegion:
        """Another tenant's region is an unknown region: one answer for both, so no
        tenant learns which ids are live."""
        region = self._regions.get(region_id)
        if region is None or region.tenant != tenant:
            raise NotFound(f"{UNKNOWN_REGION} {region_id}")
        return region

    def unregister(self, region_id: int, tenant: str | None) -> None:
        self.get(region_id, tenant)
        self.drop(region_id)

    def drop(self, region_id: int) -> None:
        """Forget a region whatever its tenant (its lane connection closed)."""
        region = self._regions.pop(region_id, None)
        if region is not None:
            region.release()

    def __len__(self) -> int:
        return len(self._regions)

    def close(self) -> None:
        for rid in list(self._regions):
            self.drop(rid)
