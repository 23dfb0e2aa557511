"""The serving side of peer transfer, whatever the transport: a FetchRequest validated
into a ServeRequest, and the verified batches that answer it, borrowed from pool slots or
copied into staging, each read while the previous one is on the wire. The protocol:
node_agent/peer/__init__.py."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from kvstore import errors
from kvstore.auth import AGENT_TENANT
from kvstore.config import PeerConfig
from kvstore.store import BlockStore, NsState, ServedBlock
from kvstore.store_types import Borrowed
from kvstore.v1 import peer_pb2
from node_agent.peer.counters import Counters
from node_agent.peer.requests import PeerRequests
from node_agent.peer.staging import OFFLOAD_BYTES, StagingLease, StagingPool, contiguous


@dataclass(frozen=True, slots=True)
class ServeRequest:
    """A validated FetchRequest: what to read, and how many blocks per batch; `share`:
    whose share of the transfer slots it takes (TransferSlots): the calling tenant's, or,
    for the agent identity (and unauthenticated development callers), the namespace
    owner's."""

    st: NsState
    generation: int
    ids: list[bytes]
    parent_id: bytes
    batch: int
    share: str = ""


class TransferSlots:
    """Concurrent transfers served, all transports together (each holds staging sets
    and CPU), `total` of them, of which one share takes at most `total - 1` (all of
    them when total is 1). A share is the calling tenant's, or, for the agent identity,
    the namespace owner's (ServeRequest.share). What it guarantees: one tenant whose
    transfers stall (a receiver that posts no receives and sends no release, held until
    the io timeouts end them) cannot take every slot, so another tenant is still
    served. Two tenants stalling together can take them all, and readers of a public
    namespace through agents share its owner's slots."""

    def __init__(self, total: int) -> None:
        self._all = asyncio.Semaphore(total)
        self.per_share = max(1, total - 1)
        self._shares: dict[str, asyncio.Semaphore] = {}
        self._users: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def hold(self, share: str):
        """One transfer of `share` (its own slot first, then one of all: a share that
        waits for itself holds nothing of the others')."""
        sem = self._shares.get(share)
        if sem is None:
            sem = self._shares[share] = asyncio.Semaphore(self.per_share)
        self._users[share] = self._users.get(share, 0) + 1
        try:
            async with sem, self._all:
                yield
        finally:
            self._users[share] -= 1
            if not self._users[share]:  # forget idle shares: tenants come and go
                del self._users[share], self._shares[share]


@dataclass(slots=True, eq=False)
class ReadBatch:
    """One batch B serves: `bufs[i]` holds the payload of `served[i]` (borrowed slot views
    first, then staging copies of blocks read from NVMe), or, packed, `bufs[0]` holds every
    payload back to back in staging. BlockSource.done_with(batch)
    once nothing reads `bufs` any more."""

    first: int
    served: list[ServedBlock]
    bufs: list
    borrowed: Borrowed | None
    last: bool = False


class BlockSource:
    """Reads the blocks peers ask for. Serving transports (UcxServer, PeerServicer) send
    what it yields, and bound their concurrent transfers with `slots`."""

    def __init__(
        self,
        store: BlockStore,
        requests: PeerRequests,
        staging: StagingPool,
        pcfg: PeerConfig,
        counters: Counters,
    ) -> None:
        self._store = store
        self._requests = requests
        self._staging = staging
        self._pcfg = pcfg
        self._counters = counters
        # Concurrent transfers served, all transports together: each holds staging sets.
        self.slots = TransferSlots(pcfg.max_transfers)

    async def request(self, req: peer_pb2.FetchRequest, tenant: str | None) -> ServeRequest:
        """Validate a FetchRequest of `tenant` (KvError: the refusal to send back)."""
        spec = req.spec if req.HasField("spec") else None
        st = await self._requests.namespace(req.ns, spec, tenant, write=False)
        ids = self._requests.ids(req.block_ids)
        parent = self._requests.parent(req.parent_id)
        batch = min(
            req.batch_blocks or self._pcfg.batch_for(st.spec.block_bytes),
            self._pcfg.max_batch_blocks,
        )
        share = st.tenant if tenant in (None, AGENT_TENANT) else tenant
        return ServeRequest(st, req.ns.generation, ids, parent, batch, share)

    def lease(self, n_sets: int, batch: int, block_bytes: int) -> StagingLease:
        """Staging sets for one transfer's batches (read_batches' `lease`)."""
        return self._staging.lease(n_sets, batch, block_bytes)

    async def read_batches(
        self, req: ServeRequest, lease: StagingLease, pack: bool = False, borrow: bool = True
    ):
        """Yield a verified ReadBatch per batch, batch k's staging copies in lease[k]
        (`pack`: all of its payloads, contiguous, and no borrow outlives the read; not
        `borrow`: every block copied into staging, none lent from the pool). Batch
        k+1 is read from the store while the caller sends batch k: a caller that keeps
        sends in flight after asking for the next batch must have finished those of batch
        k+1-len(lease.sets) by then. The caller hands each batch to done_with()."""
        st, generation, ids, batch = req.st, req.generation, req.ids, req.batch
        pending = None
        try:
            if not ids:
                yield ReadBatch(0, [], [], None, True)
                return
            pending = self._read(
                st, generation, ids, 0, req.parent_id, lease[0], batch, pack, borrow
            )
            for k, start in enumerate(range(0, len(ids), batch)):
                if pending is None:  # read ahead after every batch but the last: not here
                    return
                rb = await pending
                pending = None
                n = min(batch, len(ids) - start)
                rb.first, rb.last = start, len(rb.served) < n or start + n >= len(ids)
                if not rb.last:
                    pending = self._read(
                        st,
                        generation,
                        ids,
                        start + n,
                        ids[start + n - 1],
                        lease[k + 1],
                        batch,
                        pack,
                        borrow,
                    )
                self._counters.add("peer_blocks_served", len(rb.served))
                yield rb
                if rb.last:
                    return
        finally:
            if pending is not None:  # a worker thread may still read into its set
                pending.add_done_callback(self._drop_read)
                lease.clean = False

    def _drop_read(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.done_with(fut.result())

    def done_with(self, rb: ReadBatch) -> None:
        """End the borrow of a served batch (its blocks may be evicted again). Called when
        its sends completed or failed: a slot reused under a send still in flight can only
        reach a receiver that verifies every payload against the checksums we sent."""
        if rb.borrowed is not None:
            self._store.release(rb.borrowed)
            rb.borrowed = None

    def _read(
        self, st, generation, ids, start, parent, bufs, batch, pack, borrow
    ) -> asyncio.Future:
        """Read one batch. Borrowing is bookkeeping only (no bytes move: the receiver
        verifies), so it runs right here; copies (packed batches, blocks on NVMe) run in a
        worker thread when big enough."""
        chunk = ids[start : start + batch]
        fut = asyncio.get_running_loop().create_future()
        try:
            if pack:
                rb = None
            elif borrow:
                rb = self._borrow(st, generation, chunk, parent)
            else:  # nothing borrowed: every block is copied into staging
                rb = ReadBatch(0, [], [], None)
            if rb is None or len(rb.served) < len(chunk):
                args = (st, generation, chunk, parent, bufs, rb)
                if len(chunk) * st.spec.block_bytes >= OFFLOAD_BYTES:
                    return asyncio.ensure_future(asyncio.to_thread(self._copy_rest, *args))
                rb = self._copy_rest(*args)
            fut.set_result(rb)
        except errors.KvError as exc:  # flushed meanwhile: surfaces at the await
            fut.set_exception(exc)
        return fut

    def _borrow(self, st, generation, chunk, parent) -> ReadBatch:
        """The leading pool-resident blocks, borrowed. Sent straight from the slots, they
        are verified by the receiver against the checksums in the header (end to end), so
        a pass here is skipped."""
        b = self._store.borrow(st.ns_id, generation, chunk, parent, verify=False)
        self._counters.add("peer_blocks_borrowed", len(b.served))
        return ReadBatch(0, list(b.served), list(b.views), b)

    def _copy_rest(self, st, generation, chunk, parent, bufs, rb: ReadBatch | None) -> ReadBatch:
        """Copy into staging what `rb` did not borrow (get verifies, and promotes blocks
        read from NVMe). Packed (`rb` None), every block is copied by get (one verified
        copy each) and nothing stays borrowed."""
        if rb is None:
            served = self._store.get(st.ns_id, generation, chunk, parent, lambda i, n: bufs[i][:n])
            return ReadBatch(0, served, [contiguous(bufs, len(served))] if served else [], None)
        k = len(rb.served)
        try:
            got = self._store.get(
                st.ns_id,
                generation,
                chunk[k:],
                chunk[k - 1] if k else parent,
                lambda i, n: bufs[i][:n],
            )
        except BaseException:
            self.done_with(rb)
            raise
        rb.served += got
        rb.bufs += bufs[: len(got)]
        return rb
