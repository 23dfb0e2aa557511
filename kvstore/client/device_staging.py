"""A GPU client's staging area in device memory, lent to its agent (kvstore/cuda_vmm.py).

When the agent's pool is in the memory of the GPU the client computes on, a Get into
this area is copied pool -> staging on that GPU (verified there by the device hash), and
the client copies staging -> its own tensors (vLLM's paged KV cache) on the same GPU: no
host memory on the way. The area is a CUDA virtual-memory allocation whose descriptor goes
to the agent over the local lane (SCM_RIGHTS), as the host staging memfd does: the agent
maps memory its caller holds, never a name.

The agent refuses it (FAILED_PRECONDITION, with the reason) when its pool is in host
memory, on another GPU, or cannot verify there; the client then keeps host staging.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from kvstore.errors import FailedPrecondition, InvalidArgument

__all__ = ["DeviceStaging", "allocate_device_staging"]


@dataclass(slots=True, eq=False)
class DeviceStaging:
    memory: object  # kvstore.cuda_vmm.DeviceMemory
    tensor: torch.Tensor  # 1-D uint8 over the whole area, on `device`
    device: torch.device
    uuid: bytes  # the GPU's 16-byte UUID, as the agent checks it
    region_id: int = 0
    views: dict[tuple, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.tensor.numel()

    def export_fd(self) -> int:
        """A descriptor for the agent (the caller closes it once it is sent)."""
        return self.memory.export_fd()  # type: ignore[attr-defined]

    def close(self) -> None:
        # Unmapped once the last tensor over it is gone (torch's tensors hold the memory),
        # so a view the caller still holds stays valid.
        self.views.clear()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.memory = None


def allocate_device_staging(device: torch.device | str, nbytes: int) -> DeviceStaging:
    """`nbytes` (rounded up to the GPU's granularity) of shareable memory on `device`.
    FAILED_PRECONDITION where there is no CUDA device or driver to make it with."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise InvalidArgument(f"device staging lives on a CUDA device, not {dev}")
    if nbytes <= 0:
        raise InvalidArgument("device staging needs a positive size")
    from kvstore import cuda_vmm

    why = cuda_vmm.why_unavailable()
    if why:
        raise FailedPrecondition(why)
    ordinal = dev.index if dev.index is not None else torch.cuda.current_device()
    mem = cuda_vmm.DeviceMemory.allocate(ordinal, nbytes)
    return DeviceStaging(
        mem, mem.tensor(), torch.device("cuda", ordinal), cuda_vmm.device_uuid(ordinal)
    )


def close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
