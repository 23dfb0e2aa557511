"""Fan-out of the store's event queue to gRPC subscribers (routers).

A subscriber gets a snapshot of everything the node holds, tagged with the sequence
number it reflects, then every later event in order. Both are taken under the store lock,
so nothing falls between them; events already covered by the snapshot are skipped.
A subscriber that falls too far behind is cut off and resyncs from a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

from kvstore.events import BlockEvent
from kvstore.hashing import pack_ids
from kvstore.store import BlockStore
from kvstore.v1 import agent_pb2, common_pb2
from kvstore.wire import kind_to_proto, tier_to_proto

log = logging.getLogger("kvstore.agent")
SNAPSHOT_IDS_PER_EVENT = 4096
MAX_BACKLOG = 10_000


def event_to_proto(ev: BlockEvent) -> agent_pb2.Event:
    return agent_pb2.Event(
        seq=ev.seq,
        kind=kind_to_proto(ev.kind),
        namespace_id=ev.namespace_id,
        block_ids=pack_ids(ev.block_ids),
        parent_id=ev.parent_id,
        tier=tier_to_proto(ev.tier) if ev.tier is not None else common_pb2.TIER_UNSPECIFIED,
        generation=ev.generation,
    )


class EventHub:
    def __init__(self, store: BlockStore, node_id: str) -> None:
        self.store = store
        self.node_id = node_id
        self.epoch = uuid.uuid4().hex
        self._subs: set[asyncio.Queue] = set()

    def publish_pending(self) -> None:
        """Ship whatever the store appended since the last call (event-loop thread only)."""
        with self.store.lock:
            events = self.store.events.drain()
        if not events or not self._subs:
            return
        for q in list(self._subs):
            if q.qsize() > MAX_BACKLOG:
                self._subs.discard(q)
                q.put_nowait(None)  # cut off: the subscriber resyncs
            else:
                q.put_nowait(events)

    async def subscribe(self, who: str) -> AsyncIterator[agent_pb2.EventBatch]:
        q: asyncio.Queue = asyncio.Queue()
        self.publish_pending()
        with self.store.lock:
            seq, snap = self.store.snapshot()
            self._subs.add(q)
        log.info("subscriber %s joined at seq %d", who, seq)
        try:
            for batch in self._snapshot_batches(seq, snap):
                yield batch
            while True:
                events = await q.get()
                if events is None:
                    log.warning("subscriber %s fell behind; closing its stream", who)
                    return
                live = [event_to_proto(e) for e in events if e.seq > seq]
                if live:
                    yield agent_pb2.EventBatch(node_id=self.node_id, epoch=self.epoch, events=live)
        finally:
            self._subs.discard(q)

    def _snapshot_batches(self, seq, snap):
        events = []
        for ns_id, blocks in snap:
            for tier in (1, 2):
                ids = [b for b, t in blocks if int(t) == tier]
                for i in range(0, len(ids), SNAPSHOT_IDS_PER_EVENT):
                    events.append(
                        agent_pb2.Event(
                            seq=seq,
                            kind=agent_pb2.Event.STORED,
                            namespace_id=ns_id,
                            block_ids=pack_ids(ids[i : i + SNAPSHOT_IDS_PER_EVENT]),
                            tier=tier,
                        )
                    )
        for i in range(0, max(len(events), 1), 64):
            yield agent_pb2.EventBatch(
                node_id=self.node_id,
                epoch=self.epoch,
                snapshot=True,
                snapshot_done=i + 64 >= len(events),
                events=events[i : i + 64],
            )
