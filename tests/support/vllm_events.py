"""vLLM 0.32 KV event frames built by hand (vllm/distributed/kv_events.py wire format), for
feeding an engine's stream in pure tests."""

from __future__ import annotations

import hashlib

import msgpack


def vllm_hash(tokens: list[int], parent: bytes | None, salt: str | None = None) -> bytes:
    """A stand-in for vLLM's block hash: any injective function of the same inputs."""
    return hashlib.sha256(repr((parent, tokens, salt)).encode()).digest()


def stored(tokens: list[int], block_size: int, salt: str | None = None) -> dict:
    """BlockStored for every full block of `tokens`, as vLLM emits it for a fresh prompt
    (the request's cache_salt in the first block's extra keys only)."""
    hashes: list[bytes] = []
    parent = None
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = vllm_hash(block, parent, salt if i == 0 else None)
        hashes.append(parent)
    ev: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens[: len(hashes) * block_size],
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    if salt:
        ev["extra_keys"] = [[salt]] + [None] * (len(hashes) - 1)
    return ev


def batch(*events: dict, ts: float = 1.0) -> bytes:
    return msgpack.packb([ts, list(events), 0], use_bin_type=True)
