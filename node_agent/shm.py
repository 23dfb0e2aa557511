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

import asyncio
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
)
from kvstore.pages import map_shared

SHM_DIR = "/dev/shm"
DEFAULT_MAX_REGION_BYTES = 64 << 30  # AgentConfig.local_lane_max_region_bytes


@dataclass(frozen=True, slots=True)
class ShmLimits:
    """How much memory clients may lend the agent (kvstore.config.AgentConfig fields).
    A refusal by either is FAILED_PRECONDITION: what clients, old ones included, take for
    "no shared memory here" and carry on over gRPC."""

    max_region_bytes: int = DEFAULT_MAX_REGION_BYTES  # local_lane_max_region_bytes
    max_bytes_per_tenant: int = 0  # local_lane_max_tenant_region_bytes; 0: no cap


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


def check_region_size(size: int, max_bytes: int, what: str = "shared-memory") -> None:
    if size <= 0:
        raise InvalidArgument(f"{what} size must be > 0, got {size}")
    if size > max_bytes:  # a policy of this agent's, not a bad request: no lane for it
        raise FailedPrecondition(
            f"{what} of {size} bytes is larger than this agent takes ({max_bytes}, "
            "local_lane_max_region_bytes): payloads go over gRPC"
        )


def check_memory_fd(fd: int, size: int, max_bytes: int = DEFAULT_MAX_REGION_BYTES) -> None:
    """Refuse a descriptor that is not anonymous memory sealed against shrinking, with
    every page allocated: a file with a name is memory someone else may hold too, memory
    that can shrink under the agent's mapping would fault it (SIGBUS) mid-copy, and the
    pages of a sparse file would be allocated by the agent's populated mapping, charged
    to the agent (a 2 GiB sparse memfd cost its sender nothing and the agent 2 GiB)."""
    check_region_size(size, max_bytes)
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
    # The whole file, not [0, size): which of its pages are allocated is not asked (that
    # would move the sender's file offset), and a client's staging is all of its file.
    if st.st_blocks * 512 < st.st_size:
        raise InvalidArgument(
            f"shared memory must have every page allocated (posix_fallocate before "
            f"registering): {st.st_blocks * 512} of its {st.st_size} bytes are"
        )


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


def _map_own_fd(fd: int, size: int) -> np.ndarray:
    """map_shared of `fd`, which this call closes (a worker thread's own duplicate)."""
    try:  # populated: page faults at registration, not mid-transfer; 2 MiB-aligned,
        # so the kernel can put it on huge pages (kvstore/pages.py)
        return map_shared(fd, size)
    except OSError as exc:
        raise FailedPrecondition(f"shared memory cannot be mapped: {exc.strerror}") from None
    finally:
        os.close(fd)


class ShmRegistry:
    def __init__(self, limits: ShmLimits = ShmLimits()) -> None:
        self._regions: dict[int, Region | DeviceRegion] = {}
        self.limits = limits
        self._held: dict[str | None, int] = {}  # bytes registered or being mapped, per tenant
        self._charged: dict[int, int] = {}  # region id -> the bytes its tenant was charged

    def _charge(self, tenant: str | None, size: int) -> None:
        held = self._held.get(tenant, 0)
        cap = self.limits.max_bytes_per_tenant
        if cap and held + size > cap:
            raise FailedPrecondition(
                f"this tenant holds {held} bytes of shared-memory regions on this agent; "
                f"{size} more would pass its {cap} (local_lane_max_tenant_region_bytes): "
                "payloads go over gRPC"
            )
        self._held[tenant] = held + size

    def _refund(self, tenant: str | None, size: int) -> None:
        left = self._held.get(tenant, 0) - size
        if left > 0:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)

    async def register_fd(self, offer: FdOffer, size: int, tenant: str | None) -> Region:
        """Map the memory behind `offer.fd` (the caller keeps and closes the descriptor).
        The mapping is populated and its pages collapsed onto huge pages: seconds for
        gigabytes, so it runs on a worker thread, over a duplicate descriptor the thread
        closes (the caller's may be closed and its number reused meanwhile, if the call
        is cancelled). Cancelled, the region is never registered and its bytes come back
        to the tenant once the thread is done."""
        check_memory_fd(offer.fd, size, self.limits.max_region_bytes)
        self._charge(tenant, size)
        try:
            mapping = asyncio.ensure_future(asyncio.to_thread(_map_own_fd, os.dup(offer.fd), size))
        except BaseException:
            self._refund(tenant, size)
            raise
        try:
            array = await asyncio.shield(mapping)
        except asyncio.CancelledError:
            mapping.add_done_callback(lambda fut: self._mapped_for_nobody(fut, tenant, size))
            raise
        except BaseException:
            self._refund(tenant, size)
            raise
        region = Region(self._new_id(), f"pid {offer.pid} uid {offer.uid}", tenant, array)
        self._add(region, size)
        return region

    def _mapped_for_nobody(self, fut: asyncio.Future, tenant: str | None, size: int) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved: its caller is gone; a mapping goes with the result
        self._refund(tenant, size)

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
        check_region_size(size, self.limits.max_region_bytes, "device staging")
        if len(uuid) != 16:
            raise InvalidArgument(f"device_uuid must be 16 bytes, got {len(uuid)}")
        why = device_staging_refusal(pool_device, in_place_why, uuid)
        if why:
            raise FailedPrecondition(why)
        from kvstore import cuda_vmm

        self._charge(tenant, size)
        try:
            mem = cuda_vmm.DeviceMemory.import_fd(offer.fd, size, pool_device.index or 0)
            owner = f"pid {offer.pid} uid {offer.uid}"
            region = DeviceRegion(self._new_id(), owner, tenant, mem.tensor(), mem)
        except BaseException:
            self._refund(tenant, size)
            raise
        self._add(region, size)
        return region

    def _add(self, region: Region | DeviceRegion, charged: int) -> None:
        self._regions[region.region_id] = region
        self._charged[region.region_id] = charged

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
            self._refund(region.tenant, self._charged.pop(region_id))
            region.release()

    def __len__(self) -> int:
        return len(self._regions)

    def close(self) -> None:
        for rid in list(self._regions):
            self.drop(rid)
