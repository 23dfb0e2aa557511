"""KV layout conversions between a model's cache tensors and block payloads."""

from __future__ import annotations

import torch

from kvstore.namespace import Namespace

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}


def torch_dtype(kv_dtype: str) -> torch.dtype:
    try:
        return _DTYPES[kv_dtype]
    except KeyError:
        raise ValueError(
            f"kv_dtype {kv_dtype!r} has no torch dtype; use one of {sorted(_DTYPES)}"
        ) from None


def block_shape(ns: Namespace) -> tuple[int, ...]:
    return (ns.num_layers, 2, ns.block_size, ns.num_kv_heads, ns.head_dim)


def block_tensor(ns: Namespace, buf) -> torch.Tensor:
    """View a payload buffer as a block tensor (no copy)."""
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=ns.block_bytes)
    return flat.view(torch_dtype(ns.kv_dtype)).view(block_shape(ns))


def check_block(ns: Namespace, t: torch.Tensor, i: int = 0) -> None:
    """A block tensor must be in the namespace's KV dtype and hold exactly one block (any
    layout of that many elements): never cast or pad silently."""
    if t.dtype != torch_dtype(ns.kv_dtype):
        raise ValueError(f"block {i} has dtype {t.dtype}; namespace {ns.key} stores {ns.kv_dtype}")
    if t.numel() * t.element_size() != ns.block_bytes:
        raise ValueError(
            f"block {i} has shape {tuple(t.shape)}; namespace blocks are {block_shape(ns)}"
        )


def tensor_bytes(t: torch.Tensor, nbytes: int) -> bytes:
    raw = t.detach().contiguous().cpu().view(torch.uint8).reshape(-1)
    if raw.numel() != nbytes:
        raise ValueError(f"block tensor has {raw.numel()} bytes, namespace blocks have {nbytes}")
    return raw.numpy().tobytes()


def kv_to_blocks(kv: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """(layers, 2, tokens, heads, head_dim) -> full blocks of `block_size` tokens."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be (layers, 2, tokens, heads, head_dim), got {tuple(kv.shape)}")
    n = kv.shape[2] // block_size
    return [kv[:, :, i * block_size : (i + 1) * block_size].contiguous() for i in range(n)]


def blocks_to_kv(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Full blocks -> (layers, 2, tokens, heads, head_dim)."""
    return torch.cat(blocks, dim=2)
