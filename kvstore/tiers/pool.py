"""Device-memory pool: preallocated fixed-size slots on one torch device.

On a CUDA machine the pool lives in device memory (`cuda:N`); elsewhere it falls back to
host memory. Every slot moves through an explicit state machine and writes are two-phase:
reserve -> (copy) -> commit, or abort. Nothing is allocated on the hot path: the backing
tensor is allocated and touched once at start-up, and the free list is a plain stack.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import warnings
import weakref
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from kvstore import checksum as cks
from kvstore import device_hash, pages
from kvstore.errors import InvalidArgument, KvError


class SlotState(IntEnum):
    FREE = 0
    RESERVED = 1
    OCCUPIED = 2


_ALLOWED = {
    (SlotState.FREE, SlotState.RESERVED),
    (SlotState.RESERVED, SlotState.OCCUPIED),
    (SlotState.RESERVED, SlotState.FREE),
    (SlotState.OCCUPIED, SlotState.FREE),
}
_ALLOWED_INT = frozenset((int(a), int(b)) for a, b in _ALLOWED)
# The members as module constants: reading one through its class costs ~0.3 us on Python
# 3.11 (against ~0.05 us for a global), and every block a store moves reads several.
_FREE, _RESERVED, _OCCUPIED = SlotState.FREE, SlotState.RESERVED, SlotState.OCCUPIED


class SlotStateError(KvError):
    """A slot transition the state machine does not allow: a bug, never user input."""


def resolve_device(device: str) -> torch.device:
    """`auto` picks cuda:0 when CUDA is usable, else the CPU. InvalidArgument for a device
    this host does not have."""
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"device {device!r} requested but CUDA is not available")
    if dev.type == "cuda" and (dev.index or 0) >= (count := torch.cuda.device_count()):
        raise InvalidArgument(f"device {device!r}: this host has {count} CUDA device(s)")
    if dev.type not in ("cuda", "cpu"):
        raise InvalidArgument(f"device {device!r}: only cuda:N and cpu are supported")
    return dev


POOL_MEMFD = "kvstore-pool"  # the name /proc/PID/maps shows: /memfd:kvstore-pool (deleted)


@dataclass(frozen=True, slots=True)
class PoolShare:
    """Where another agent of this host finds a host pool's memory to read it directly
    (node_agent/peer/ucx/mapped.py): this process's file descriptor `fd`, a memfd sealed
    against resizing (no reader can be cut short by a shrink) and readable by its owner
    only, mapped at `base` for `size` bytes here."""

    fd: int
    base: int
    size: int


def shared_host_memory(nbytes: int) -> tuple[int, np.ndarray] | None:
    """A host pool's memory as a sealed memfd (pages.sealed_memfd): an agent of this host
    that may read this process's memory anyway can then map it read-only and copy blocks
    out itself, one fused copy+hash pass, instead of a kernel copy and a second pass to
    hash. Opening it through /proc/PID/fd takes the ptrace read check (who may: the
    caller decides, node_agent/peer/ucx/direct.pool_may_be_mapped) and, as its mode is
    0400, the owner's user (a process of that user cannot open it for writing). Huge
    pages as for anonymous memory: MADV_COLLAPSE puts a memfd on them even where
    shmem_enabled is `never`. None where no memfd can be had (not Linux, memory short):
    then anonymous memory (host_memory)."""
    if not hasattr(os, "memfd_create"):
        return None
    try:
        return pages.sealed_memfd(
            POOL_MEMFD,
            nbytes,
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
            mode=0o400,
        )
    except OSError:
        return None


def host_memory(nbytes: int) -> mmap.mmap:
    """Anonymous memory for a host-memory pool, with transparent huge pages asked for:
    a 2 MiB block then sits in one TLB entry instead of 512, which measured ~15-20% faster
    copies into and out of the pool here. Without THP it is plain anonymous memory. The
    caller touches every page, then calls pages.ask_huge_pages(mem, collapse=True)."""
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages.ask_huge_pages(mem, collapse=False)
    return mem


def _read_only_tensor(src) -> torch.Tensor:
    """`src` (any buffer, read-only ones too) as a uint8 tensor over the same memory, to
    copy FROM. torch warns that a read-only buffer could be written through the tensor;
    nothing writes through this one, so that warning (once per process, in every GPU
    agent's log) is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The given buffer is not writable", category=UserWarning
        )
        return torch.frombuffer(src, dtype=torch.uint8)


def is_tensor(dst) -> bool:
    """Whether a read's destination is a tensor (device staging) rather than a host buffer."""
    return isinstance(dst, torch.Tensor)


def fill_tensor(dst: torch.Tensor, src) -> None:
    """Copy host bytes `src` (e.g. a block read from NVMe) into tensor `dst`."""
    n = memoryview(src).nbytes
    dst[:n].copy_(_read_only_tensor(src))


class DevicePool:
    """Every write into a slot is a blocking copy (done when write() returns): transports
    send straight from borrowed slot views, and the tensor interface they read carries no
    stream to wait on. `tensor_views`: a host pool that hands out slot views as torch
    tensors hashed by the device kernel, as a CUDA pool does; tests only (under Triton's
    interpreter), to run the device code paths where no GPU is."""

    def __init__(
        self,
        n_slots: int,
        slot_bytes: int,
        device: str = "auto",
        tensor_views: bool = False,
        shareable: bool = False,
    ) -> None:
        if n_slots <= 0 or slot_bytes <= 0:
            raise InvalidArgument("pool needs n_slots > 0 and slot_bytes > 0")
        self.device = resolve_device(device)
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.share: PoolShare | None = None  # host memory other agents may map
        shared = None
        if shareable and self.device.type == "cpu":
            shared = shared_host_memory(n_slots * slot_bytes)
        if shared is not None:  # backed, zero and collapsed onto huge pages already
            fd, arr = shared
            weakref.finalize(self, os.close, fd)  # the memory goes with fd and mapping
            self.share = PoolShare(fd, arr.ctypes.data, arr.nbytes)
            self.tensor = torch.from_numpy(arr).view(n_slots, slot_bytes)
        elif self.device.type == "cpu":
            mem = host_memory(n_slots * slot_bytes)
            self.tensor = torch.frombuffer(mem, dtype=torch.uint8).view(n_slots, slot_bytes)
            self.tensor.zero_()  # touch every page now, not on the first put
            pages.ask_huge_pages(mem, collapse=True)  # pages the fault did not put on them
        else:
            self.tensor = torch.empty((n_slots, slot_bytes), dtype=torch.uint8, device=self.device)
            self.tensor.zero_()
        self._host = self.tensor.numpy() if self.device.type == "cpu" else None
        self.tensor_views = self.is_cuda or tensor_views
        # Payloads written in place by a transport are verified where they lie: on the host
        # by XXH64, in device memory by the device kernel (kvstore.device_hash), when it
        # can be had; else a device pool takes payloads only through copying writes.
        self.why_not_in_place = self._check_device_hash() if self.tensor_views else ""
        self._state = bytearray(n_slots)
        self._free = list(range(n_slots - 1, -1, -1))

    def _check_device_hash(self) -> str:
        """Why slot views in device memory cannot be verified in place ('' when they can).
        On a GPU the kernel is compiled here (a second or two), not inside the first
        transfer nor from several worker threads at once; a GPU where it does not build
        (no C compiler for triton's launcher, say) keeps copying writes."""
        if self.slot_bytes % 8:
            return f"{self.slot_bytes}-byte slots are not 8-byte aligned"
        if not device_hash.available(self.device):
            on_cpu = "" if self.is_cuda else " (on the CPU: only under TRITON_INTERPRET=1)"
            return device_hash.why_not() or f"no device hash on {self.device}{on_cpu}"
        if self.is_cuda:
            try:
                device_hash.slot_digests(self.tensor, [0], self.slot_bytes)
            except Exception as exc:  # noqa: BLE001 - any failure means "not in place"
                return f"the device hash kernel failed: {exc}"
        return ""

    @property
    def in_place(self) -> bool:
        """Whether transports may land payloads in slot views (slot_view) and have them
        verified where they lie (digests)."""
        return not self.why_not_in_place

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def capacity_bytes(self) -> int:
        return self.n_slots * self.slot_bytes

    def state(self, slot: int) -> SlotState:
        return SlotState(self._state[slot])

    def _move(self, slot: int, new: SlotState, expect: SlotState | None = None) -> None:
        old = self._state[slot]  # an int: an enum built per move costs more than the move
        if (old, new) not in _ALLOWED_INT or (expect is not None and old != expect):
            raise SlotStateError(
                f"slot {slot}: illegal transition {SlotState(old).name} -> {new.name}"
            )
        self._state[slot] = new

    def reserve(self) -> int | None:
        """A free slot in RESERVED state, or None when the pool is full."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._move(slot, _RESERVED)
        return slot

    def commit(self, slot: int) -> None:
        self._move(slot, _OCCUPIED)

    def abort(self, slot: int) -> None:
        """Give back a RESERVED slot whose write did not complete."""
        self._move(slot, _FREE, expect=_RESERVED)
        self._free.append(slot)

    def release(self, slot: int) -> None:
        """Free an OCCUPIED slot. Aborting a committed block or releasing a half-written
        one would be a bookkeeping bug, so each path accepts only its own state."""
        self._move(slot, _FREE, expect=_OCCUPIED)
        self._free.append(slot)

    def _check_len(self, n: int) -> None:
        if n > self.slot_bytes:
            raise InvalidArgument(f"block of {n} bytes does not fit a {self.slot_bytes}-byte slot")

    def write(self, slot: int, src) -> int:
        """Copy `src` (any buffer) into a RESERVED slot; returns the payload's XXH64."""
        if self._state[slot] != _RESERVED:
            raise SlotStateError(f"slot {slot} written while {self.state(slot).name}")
        n = memoryview(src).nbytes
        self._check_len(n)
        if self._host is not None:
            return cks.copy_with_checksum(self._host[slot, :n], src)
        digest = cks.checksum(src)
        self.tensor[slot, :n].copy_(_read_only_tensor(src))
        return digest

    def read_into(self, slot: int, nbytes: int, dst) -> int:
        """Copy an OCCUPIED slot's first `nbytes` into `dst`; returns their XXH64."""
        if is_tensor(dst):
            return self.read_tensors([slot], [nbytes], [dst])[0]
        if self._state[slot] != _OCCUPIED:
            raise SlotStateError(f"slot {slot} read while {self.state(slot).name}")
        self._check_len(nbytes)
        if self._host is not None:
            return cks.copy_with_checksum(dst, self._host[slot, :nbytes])
        out = torch.frombuffer(dst, dtype=torch.uint8, count=nbytes)
        out.copy_(self.tensor[slot, :nbytes])
        return cks.checksum(memoryview(dst)[:nbytes])

    @property
    def host(self) -> bool:
        """A host-memory pool: its batch copies run natively, over threads."""
        return self._host is not None

    def write_many(self, slots: list[int], srcs: list, threads: int = 1) -> list[int]:
        """write(slots[i], srcs[i]) for every i; returns the payloads' XXH64. A host pool
        copies the batch in one native call on `threads` threads, every slot checked
        before the first copy; a device pool writes one slot after another."""
        if self._host is None:
            return [self.write(s, src) for s, src in zip(slots, srcs)]
        return cks.copy_with_checksum_many(self._write_views(slots, srcs), srcs, threads)

    def write_start(self, slots: list[int], srcs: list, threads: int = 1):
        """write_many of a host pool, started in the background (kvstore.checksum.
        copy_with_checksum_start: a job whose fileno() is readable when it is done and
        whose result() is the digests); None where it cannot run so (no native
        extension, or a device pool). Every slot is checked before the first copy."""
        if self._host is None:
            return None
        return cks.copy_with_checksum_start(self._write_views(slots, srcs), srcs, threads)

    def _write_views(self, slots: list[int], srcs: list) -> list:
        """The host slots `srcs` go to, each checked RESERVED and big enough."""
        assert self._host is not None
        dsts = []
        for slot, src in zip(slots, srcs):
            if self._state[slot] != _RESERVED:
                raise SlotStateError(f"slot {slot} written while {self.state(slot).name}")
            n = memoryview(src).nbytes
            self._check_len(n)
            dsts.append(self._host[slot, :n])
        return dsts

    def read_many(
        self, slots: list[int], sizes: list[int], dsts: list, threads: int = 1
    ) -> list[int]:
        """read_into(slots[i], sizes[i], dsts[i]) for every i, batched like write_many."""
        if self._host is None:
            return [self.read_into(s, n, d) for s, n, d in zip(slots, sizes, dsts)]
        return cks.copy_with_checksum_many(dsts, self._read_views(slots, sizes), threads)

    def read_start(
        self,
        slots: list[int],
        sizes: list[int],
        dsts: list,
        threads: int = 1,
        deadline_ns: int | None = None,
    ):
        """read_many of a host pool started in the background, like write_start; a block
        not begun by `deadline_ns` is not copied (its digest None)."""
        if self._host is None:
            return None
        return cks.copy_with_checksum_start(
            dsts, self._read_views(slots, sizes), threads, deadline_ns
        )

    def _read_views(self, slots: list[int], sizes: list[int]) -> list:
        """The host slots' first `sizes` bytes, each slot checked OCCUPIED."""
        assert self._host is not None
        srcs = []
        for slot, n in zip(slots, sizes):
            if self._state[slot] != _OCCUPIED:
                raise SlotStateError(f"slot {slot} read while {self.state(slot).name}")
            self._check_len(n)
            srcs.append(self._host[slot, :n])
        return srcs

    def read_tensors(self, slots: list[int], sizes: list[int], dsts: list) -> list[int]:
        """read_into for uint8 tensor destinations on the pool's device (a GPU client's
        device staging, node_agent/shm.py): every slot hashed where it lies by the device
        kernel (one launch per run of one size), then copied device to device; returns the
        XXH64s once the copies are done (the client reads the moment the Get answers)."""
        if not self.tensor_views:
            raise InvalidArgument("tensor destinations need a pool that hashes tensor views")
        views = []
        for slot, n, dst in zip(slots, sizes, dsts):
            if self._state[slot] != _OCCUPIED:
                raise SlotStateError(f"slot {slot} read while {self.state(slot).name}")
            self._check_len(n)
            if dst.device != self.device or dst.numel() < n:
                raise InvalidArgument(f"a {n}-byte block needs room on {self.device}")
            views.append(self.tensor[slot, :n])
        digests = self.digests(views)
        for view, dst in zip(views, dsts):
            dst[: view.numel()].copy_(view, non_blocking=True)
        if self.is_cuda and views:
            torch.cuda.synchronize(self.device)
        return digests

    def read_bytes(self, slot: int, nbytes: int) -> tuple[bytes, int]:
        """A slot's payload as a new bytes object (one copy) and its XXH64."""
        if self._host is not None:
            if self._state[slot] != _OCCUPIED:
                raise SlotStateError(f"slot {slot} read while {self.state(slot).name}")
            self._check_len(nbytes)
            data = self._host[slot, :nbytes].tobytes()
            return data, cks.checksum(data)
        buf = bytearray(nbytes)
        digest = self.read_into(slot, nbytes, buf)
        return bytes(buf), digest

    def slot_view(self, slot: int, nbytes: int, writable: bool):
        """A slot's first `nbytes`, for transports that move payloads themselves: writable
        while RESERVED (a two-phase write landing in place), read-only while OCCUPIED (a
        borrowed read). A host array on a host pool; on a device pool a 1-D uint8 tensor
        in device memory (UCX registers it; torch cannot mark it read-only). Only where
        `in_place`."""
        if not self.in_place:
            raise InvalidArgument(
                f"this pool cannot verify payloads in place ({self.why_not_in_place})"
            )
        want = _RESERVED if writable else _OCCUPIED
        if self._state[slot] != want:
            raise SlotStateError(f"slot {slot} viewed while {self.state(slot).name}")
        self._check_len(nbytes)
        if self.tensor_views or self._host is None:  # device memory: no host array
            return self.tensor[slot, :nbytes]
        view = self._host[slot, :nbytes]
        if not writable:
            view = view.view()
            view.flags.writeable = False
        return view

    def digests(self, views: list) -> list[int]:
        """XXH64 of each of `views` (slot_view results): on the host, or by the device
        kernel over the slots they lie in, without copying them out (one launch per run of
        views of one length)."""
        if not self.tensor_views:
            return [cks.checksum(v) for v in views]
        base = self.tensor.data_ptr()
        out: list[int] = []
        for n, group in itertools.groupby(views, key=lambda v: v.numel()):
            slots = [(v.data_ptr() - base) // self.slot_bytes for v in group]
            out += device_hash.slot_digests(self.tensor, slots, n)
        return out

    def raw_view(self, slot: int):
        """Host view of a slot (CPU pools only): for fault injection and debugging tools."""
        if self._host is None:
            raise InvalidArgument("raw_view needs a host-memory pool")
        return self._host[slot]
