"""The fetching side of peer transfer, whatever the transport: BatchSink stores the
batches a transport receives, in chain order, verified before any block is visible. The
protocol: node_agent/peer/__init__.py."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from kvstore import errors
from kvstore.store import BlockStore, NsState, PutItem
from kvstore.store_types import Reservation
from kvstore.v1 import peer_pb2
from node_agent.peer.counters import Counters
from node_agent.peer.errors import PeerTransportError
from node_agent.peer.staging import OFFLOAD_BYTES, StagingPool

log = logging.getLogger("kvstore.agent.peer")


@dataclass(frozen=True, slots=True)
class FetchRequestIds:
    ids: list[bytes]
    parent_id: bytes


@dataclass(slots=True, eq=False)
class Landing:
    """Where the payloads of one UCX batch land: pool slots reserved for its leading
    blocks (`res`, when UcxTransport.in_place), staging buffers for the others (all of
    them otherwise, or blocks left without a slot, which are then not stored), received as
    `msgs`. Packed (small
    blocks, or large ones whose slots do not lie back to back as the sender's runs need),
    the whole batch lands in one staging set, `scratch`, and the store step copies it into
    the slots. `recvs` completes once UCX no longer writes into any of them, whatever the
    outcome."""

    first: int
    count: int
    checksums: list[int]
    res: Reservation | None
    scratch: list
    msgs: list  # one receive buffer per payload message, in order
    pack: bool = False
    recvs: asyncio.Future | None = None
    # In place: per message, a future of the XXH64s of its blocks that have a slot, taken
    # as soon as it landed (None: that message failed)
    digests: list[asyncio.Future] | None = None
    # Read by the fetcher from the peer's memory (direct reads, no UCX receive): the
    # peer keeps the blocks lent until it is told the batch is done with
    direct: bool = False


class BatchSink:
    """A's side of one transfer: stores received batches in chain order, with one store
    step in flight while the next batch arrives. Tracks how many of `ids` are stored and
    why it stopped early, and tells `on_stored` about each stored run. `root` is the
    chain root of the whole Prefetch: a block whose parent is neither held nor `root` is
    refused as an orphan."""

    def __init__(
        self,
        store: BlockStore,
        staging: StagingPool,
        counters: Counters,
        published,
        st: NsState,
        generation: int,
        ids: list[bytes],
        parent_id: bytes,
        root: bytes,
        on_stored,
    ) -> None:
        self._store = store
        self._staging_pool = staging
        self._counters = counters
        self._published = published  # ships the store's pending events (event loop)
        self.st = st
        self.generation = generation
        self.ids = ids
        self.parent_id = parent_id
        self.root = root
        self.on_stored = on_stored
        self.stored = 0  # leading ids stored (or found present)
        self.expect = 0  # index the next chunk must start at
        self.base = 0  # index of the current request's first id within `ids`
        self.remote_done = False
        self.stop_reason = ""
        self._task: asyncio.Future | None = None  # a Task, or a Future already done
        self._staging: list | None = None  # the staging set the store step reads

    def begin(self) -> FetchRequestIds:
        """Start a (re)request for the ids not stored yet."""
        self.base = self.expect = self.stored
        self.remote_done = False
        rest = self.ids[self.stored :]
        parent = self.ids[self.stored - 1] if self.stored else self.parent_id
        return FetchRequestIds(rest, parent)

    def check(self, chunk: peer_pb2.FetchChunk, max_count: int) -> int:
        """Validate a chunk header against what was asked; returns its absolute index."""
        first = self.base + chunk.first_index
        if (
            first != self.expect
            or chunk.count > max_count
            or first + chunk.count > len(self.ids)
            or len(chunk.checksums) != chunk.count
        ):
            raise PeerTransportError(
                f"malformed chunk from peer: first_index {chunk.first_index}, count "
                f"{chunk.count}, {len(chunk.checksums)} checksums (expected index "
                f"{self.expect - self.base}, at most {max_count})"
            )
        self.expect = first + chunk.count
        return first

    async def push(
        self, first: int, bufs, checksums: list[int], staging: list | None = None
    ) -> bool:
        """Queue a received batch for storing (a copying put); False when the transfer
        should stop. `staging`: a set that goes back to the pool once the put is done."""
        size = sum(memoryview(b).nbytes for b in bufs)
        return await self._queue(
            len(bufs), size >= OFFLOAD_BYTES, staging, self._put, first, bufs, checksums
        )

    async def land(self, ld: Landing) -> bool:
        """Queue a batch received into a Landing for storing: verified in place (packed:
        copied from staging into the slots and verified in one pass), then committed (put
        from staging on device pools)."""
        staging, ld.scratch = (ld.scratch, []) if ld.pack else (None, ld.scratch)
        if ld.res is None:
            return await self.push(
                ld.first, (staging or ld.scratch)[: ld.count], ld.checksums, staging
            )
        if not ld.pack:
            self._counters.add("peer_blocks_in_place", len(ld.res))
        digests = None  # taken as the messages landed; else the store step hashes
        if ld.digests is not None:
            parts = await asyncio.gather(*ld.digests)
            if all(p is not None for p in parts):
                digests = [d for part in parts for d in part]
        # Hashed already, committing is bookkeeping only: right here, without two thread
        # hand-offs (else the commit copies or hashes the batch: a worker thread).
        offload = (
            digests is None or bool(staging)
        ) and ld.count * self.st.spec.block_bytes >= OFFLOAD_BYTES
        return await self._queue(
            ld.count, offload, staging, self._commit, ld, ld.res, staging, digests
        )

    async def _queue(self, n: int, offload: bool, staging: list | None, fn, *args) -> bool:
        """Store a batch (fn(*args)): in a worker thread when `offload` (it copies or
        hashes enough bytes to be worth the hand-off), else right here."""
        if not await self.drain():
            if staging:
                self._staging_pool.give(staging)
            return False
        self._staging = staging
        self._counters.add("peer_blocks_received", n)
        if offload:
            self._task = asyncio.create_task(asyncio.to_thread(fn, *args))
        else:
            self._task = asyncio.get_running_loop().create_future()
            self._task.set_result(fn(*args))
        return True

    def reserve(self, first: int, count: int, after: Reservation | None) -> Reservation:
        """Pool slots for blocks first..first+count of the chain (after `after`'s), to
        receive into and then commit (land). KvError when none can be had."""
        parent = self.ids[first - 1] if first else self.parent_id
        return self._store.reserve(
            self.st.ns_id,
            self.generation,
            self.ids[first : first + count],
            parent,
            self.root,
            after=after,
        )

    def _commit(
        self, ld: Landing, res: Reservation, staging: list | None, digests: list[int] | None
    ):
        """Worker-thread part of land(): verify (packed: copy from `staging` and verify;
        in place with `digests`: check those) and commit the reserved blocks (`res`,
        ld.res)."""
        reason = ""
        n_res = len(res)
        try:
            self._store.commit(
                res,
                ld.checksums[:n_res],
                sources=staging[:n_res] if staging else None,
                digests=digests,
            )
        except errors.DataLoss as exc:
            self._counters.add("peer_checksum_mismatch")
            reason = f"checksum mismatch: {exc}"
        except errors.KvError as exc:
            reason = f"not stored here: {exc}"
        if n_res < ld.count and not reason:
            reason = f"not stored here: {res.reason}"
        n = present_prefix(
            self._store, self.st.ns_id, self.generation, self.ids, self.parent_id, ld.first
        )
        return ld.first, min(n, ld.count), ld.count, reason

    async def drain(self) -> bool:
        """Wait for the batch being stored; False when it did not store completely."""
        if self._task is not None:
            task, self._task = self._task, None
            staging, self._staging = self._staging, None
            try:
                first, n, wanted, reason = await task
            finally:
                if staging and task.done() and not task.cancelled():
                    self._staging_pool.give(staging)  # nothing reads it any more
            self._published()
            self.stored = first + n
            if n:
                self.on_stored(first, n)
                self._counters.add("peer_blocks_stored", n)
            if n < wanted and not self.stop_reason:
                self.stop_reason = reason or f"block {first + n} was not stored"
        return not self.stop_reason

    async def drain_quietly(self) -> None:
        """drain() for cleanup paths: the store copy must finish before its staging set
        can go, whatever else went wrong."""
        try:
            await self.drain()
        except Exception as exc:  # reported, the transfer already failed
            log.warning("storing a received batch failed: %s: %s", type(exc).__name__, exc)

    def _put(self, first: int, bufs, checksums: list[int]):
        """Worker-thread part: put, then see how far the chain got (put may skip blocks
        on a full pool or refuse them on a checksum mismatch)."""
        items = [
            PutItem(
                self.ids[first + i],
                self.ids[first + i - 1] if first + i else self.parent_id,
                bufs[i],
                checksums[i],
            )
            for i in range(len(bufs))
        ]
        reason = ""
        try:
            # A block whose parent is neither held nor the chain root is an orphan.
            self._store.put(self.st.ns_id, self.generation, items, root=self.root)
        except errors.DataLoss as exc:
            self._counters.add("peer_checksum_mismatch")
            reason = f"checksum mismatch: {exc}"
        except errors.KvError as exc:
            reason = f"not stored here: {exc}"
        n = present_prefix(
            self._store, self.st.ns_id, self.generation, self.ids, self.parent_id, first
        )
        return first, min(n, len(bufs)), len(bufs), reason

    @property
    def block_bytes(self) -> int:
        return self.st.spec.block_bytes


def present_prefix(
    store: BlockStore,
    ns_id: bytes,
    generation: int,
    ids: list[bytes],
    parent_id: bytes,
    start: int = 0,
) -> int:
    """How many of ids[start:] continue a chain held here. Unlike store.lookup this counts
    no lookup in the hit-rate statistics: it is bookkeeping, not a request."""
    with store.lock:
        try:
            st = store.namespace(ns_id, generation)
        except errors.KvError:
            return 0
        prev = ids[start - 1] if start else parent_id
        n = 0
        for bid in ids[start:]:
            m = st.blocks.get(bid)
            if m is None or (prev and m.parent_id != prev):
                break
            n += 1
            prev = bid
        return n
