"""XXH64 of pool slots where they live: in GPU memory, by a Triton kernel.

A device pool that takes payloads in place (peer transfer over UCX into registered device
memory) must verify them without copying them back to the host first, which would cost
the PCIe traffic the in-place receive saves. `slot_digests` hashes the first `nbytes` of
some slots of a 2-D uint8 pool tensor and returns the same numbers as
`kvstore.checksum.checksum` (XXH64, seed 0) does over those bytes on the host: every block
keeps ONE checksum, whichever tier or transport it went through.

XXH64 is a sequential chain per 8-byte lane (four lanes per 32-byte stripe), so one block
cannot be split across threads; the parallelism is across blocks: one program per slot,
each walking its slot with UNROLL stripes of independent loads per step (they are issued
together, then chained), so load latency is paid once per step instead of once per stripe.

The kernel runs wherever Triton runs: compiled on CUDA, and under Triton's interpreter on
CPU tensors (TRITON_INTERPRET=1, set before triton is imported), which is how the tests
check it against the host XXH64 on machines without a GPU. `available()` says whether a
device hash can be had for a tensor's device; callers fall back to host copies when not.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from kvstore.errors import InvalidArgument

UNROLL = 16  # stripes per step of the main loop (32 bytes each): 512 B of loads in flight
MASK = (1 << 64) - 1

_kernel = None
_why_not = ""
_local = threading.local()  # a CUDA stream per thread (see slot_digests)


def _build():
    """Define the kernel on first use (importing triton costs ~1 s and is not needed by
    host-memory pools)."""
    global _kernel, _why_not
    if _kernel is not None or _why_not:
        return _kernel
    try:
        from kvstore import _xxh64_kernel
    except ImportError as exc:  # CUDA torch brings triton; a CPU install has it for tests
        _why_not = f"triton is not installed ({exc})"
        return None
    _kernel = _xxh64_kernel.xxh64_slots
    return _kernel


def available(device: torch.device) -> bool:
    """Whether slot_digests runs for tensors on `device`: CUDA with triton, or the CPU
    under Triton's interpreter (tests)."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _build() is not None


def why_not() -> str:
    """Why available() is False ('' when it is not, or not asked yet)."""
    return _why_not


def slot_digests(pool: torch.Tensor, slots: list[int], nbytes: int) -> list[int]:
    """XXH64 (seed 0) of the first `nbytes` of each slot (row) of `pool`, a contiguous
    (n_slots, slot_bytes) uint8 tensor whose slot_bytes is a multiple of 8; the numbers
    kvstore.checksum.checksum gives for the same bytes. Blocks until they are computed."""
    if pool.dtype != torch.uint8 or pool.dim() != 2 or not pool.is_contiguous():
        raise InvalidArgument("slot_digests needs a contiguous 2-D uint8 pool tensor")
    slot_bytes = pool.shape[1]
    if slot_bytes % 8 or pool.data_ptr() % 8:
        raise InvalidArgument("slot_digests needs 8-byte aligned slots")
    if not 0 <= nbytes <= slot_bytes:
        raise InvalidArgument(f"{nbytes} bytes do not fit a {slot_bytes}-byte slot")
    if not slots:
        return []
    if min(slots) < 0 or max(slots) >= pool.shape[0]:
        raise InvalidArgument("slot index out of range")
    kernel = _build()
    if kernel is None:
        raise InvalidArgument(f"no device hash: {_why_not}")
    flat = pool.view(-1)
    idx = torch.tensor(slots, dtype=torch.int64, device=pool.device)
    out = torch.empty(len(slots), dtype=torch.int64, device=pool.device)
    with _on(pool.device):
        kernel[(len(slots),)](
            flat.view(torch.int64),
            flat.view(torch.int32),
            flat,
            idx,
            out,
            slot_bytes // 8,
            nbytes,
            UNROLL=UNROLL,
            num_warps=1,
        )
        digests = out.cpu().tolist()  # waits for this thread's stream only
    return [v & MASK for v in digests]


@contextlib.contextmanager
def _on(device: torch.device):
    """Launch on `device` (triton launches on the current device), on a stream of this
    thread's own: one block's chain is slow (well under 1 GB/s), so throughput comes from
    many blocks at once, and the messages hashed by different worker threads as they land
    must run side by side, not queue on the default stream (nor wait for each other's
    results). Every write into pool slots is a blocking copy that finished before, and a
    transport's receive completed before its slots are hashed, so no ordering is lost."""
    if device.type != "cuda":
        yield
        return
    streams = _local.__dict__.setdefault("streams", {})
    stream = streams.get(device.index)
    if stream is None:
        stream = streams[device.index] = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield
