"""Event records: every change of what a node holds, as data with sequence numbers.

The store appends to an `EventQueue`; the agent drains it and ships batches to whatever
sinks are attached (the gRPC event stream, tests). Routers rebuild their index from these
records alone: a snapshot at sequence S, then every event with seq > S, contiguous.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol


class Tier(IntEnum):
    """Values match the protobuf enum kvstore.v1.Tier."""

    HBM = 1
    NVME = 2


class EventKind(IntEnum):
    """Values match kvstore.v1.Event.Kind."""

    STORED = 1
    REMOVED = 2
    NAMESPACE_CLEARED = 3
    TIER_CHANGED = 4


@dataclass(frozen=True, slots=True)
class BlockEvent:
    seq: int
    kind: EventKind
    namespace_id: bytes
    block_ids: tuple[bytes, ...] = ()
    parent_id: bytes = b""
    tier: Tier | None = None
    generation: int = 0


class EventSink(Protocol):
    def publish(self, events: list[BlockEvent]) -> None: ...


class EventQueue:
    """Append-only queue with contiguous sequence numbers. Not thread-safe on its own:
    the store appends under its lock."""

    def __init__(self, start_seq: int = 0) -> None:
        self._seq = start_seq
        self._pending: deque[BlockEvent] = deque()

    @property
    def last_seq(self) -> int:
        return self._seq

    def append(
        self,
        kind: EventKind,
        namespace_id: bytes,
        block_ids: tuple[bytes, ...] = (),
        parent_id: bytes = b"",
        tier: Tier | None = None,
        generation: int = 0,
    ) -> BlockEvent:
        self._seq += 1
        ev = BlockEvent(self._seq, kind, namespace_id, block_ids, parent_id, tier, generation)
        self._pending.append(ev)
        return ev

    def drain(self) -> list[BlockEvent]:
        out = list(self._pending)
        self._pending.clear()
        return out

    def __len__(self) -> int:
        return len(self._pending)
