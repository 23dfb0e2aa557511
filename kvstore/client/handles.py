"""The client's own records of a namespace and of a call's outcome that are not plain
results (kvstore/client/results.py): a namespace's handle, a Get sent and not yet read,
a prompt's cached prefix, a request's usage."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.client.local_lane import LaneChannel, Sent
from kvstore.namespace import Namespace
from kvstore.v1 import agent_pb2


@dataclass(frozen=True, slots=True)
class NamespaceHandle:
    spec: Namespace
    namespace_id: bytes
    generation: int
    root: bytes
    block_bytes: int
    min_prefix_blocks: int

    @property
    def ref(self) -> agent_pb2.NamespaceRef:
        return agent_pb2.NamespaceRef(namespace_id=self.namespace_id, generation=self.generation)


@dataclass(frozen=True, slots=True)
class Usage:
    """Per request, the way providers report it; cache_write counts newly stored tokens."""

    prompt_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    uncached_tokens: int


@dataclass(frozen=True, slots=True)
class Blocks:
    """The verified leading run of a Get, and the tier each block was served from."""

    blocks: list[torch.Tensor]
    tiers: list[int]  # kvstore.events.Tier values, one per block


@dataclass(frozen=True, slots=True, eq=False)
class PendingGet:
    """A Get `KVClient.begin_get_staged` sent; `finish_get_staged` reads its answer."""

    ns: NamespaceHandle
    ids: list[bytes]
    parent: bytes | None
    timeout: float | None
    request_id: str
    first_slot: int
    lane: LaneChannel | None  # where it was sent; None: nothing sent, finish makes the call
    sent: Sent | None


@dataclass(frozen=True, slots=True)
class PrefixHit:
    block_ids: list[bytes]  # ids of every full block of the prompt
    blocks: list[torch.Tensor]  # the cached leading blocks, in order
    block_size: int

    @property
    def cached_blocks(self) -> int:
        return len(self.blocks)

    @property
    def cached_tokens(self) -> int:
        return len(self.blocks) * self.block_size
