"""The worker's loads: each step's Gets are sent as soon as the step reaches the worker,
and their blocks written into the paged cache in start_load_kv.

vLLM hands the worker a step's connector metadata first in `handle_preemptions`, before
it prepares the step's inputs (about 1.3 ms for one request on vLLM CPU), and calls
`start_load_kv` after that. The Gets only fill this link's own staging area, so they are
sent then (over the agent's local lane; AgentLink.begin) and the agent copies and
verifies the blocks (another process) while vLLM prepares; start_load_kv reads the
answers. The copy into the cache waits for start_load_kv: preparing the inputs zeroes
newly allocated blocks (vLLM orders loads after that), and those are the blocks loaded
into.

Without that early start (another runner, no lane, more than the staging area holds at
once) the Gets are made in start_load_kv. A Get that failed loads nothing; the caller
reports the blocks not loaded and vLLM recomputes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvstore.integrations.vllm_agent import AgentLink, Begun, StagedGet
from kvstore.integrations.vllm_layout import PagedLayout

__all__ = ["Load", "Loader"]


class Load(Protocol):
    """What a load names (the connector's LoadSpec)."""

    kv_ids: list[bytes]  # kvstore ids of the blocks, in order
    parent: bytes | None  # id of the block before kv_ids[0]; None: the chain root
    salt: str | None
    block_ids: list[int]  # the vLLM blocks they go into
    count_id: str  # the request as the agent counts it


class Loader:
    def __init__(self, link: AgentLink, layout: PagedLayout) -> None:
        self._link = link
        self._layout = layout
        self._begun: tuple[object, Begun] | None = None  # (the step's metadata, its Gets)

    def begin(self, step: object, loads: Sequence[Load]) -> None:
        """Send the Gets of `step`'s loads now (as many as the staging area holds)."""
        self._begun = (step, self._link.begin(_gets(loads))) if loads else None

    def load(self, step: object, loads: Sequence[Load]) -> list[int]:
        """Write every load's blocks into its vLLM blocks; per load, how many leading
        blocks were loaded (fewer than its block_ids: the rest must be recomputed)."""
        begun, self._begun = self._begun, None
        staged = self._link.stage(_gets(loads), begun[1] if begun and begun[0] is step else None)
        counts = []
        for x, blocks in zip(loads, staged):
            if len(blocks):
                self._layout.scatter(x.block_ids[: len(blocks)], blocks)
            counts.append(len(blocks))
        # What was not staged goes through the staging area from its start: every staged
        # load is in the cache by now.
        for x in loads[len(staged) :]:

            def sink(first: int, blocks: torch.Tensor, x=x) -> None:
                self._layout.scatter(x.block_ids[first : first + len(blocks)], blocks)

            counts.append(self._link.load(x.kv_ids, x.parent, x.salt, sink, x.count_id))
        return counts


def _gets(loads: Sequence[Load]) -> list[StagedGet]:
    return [StagedGet(x.kv_ids, x.parent, x.salt, x.count_id) for x in loads]
