"""Peer-to-peer block transfer between node agents: UCX (ucxx) first, gRPC as fallback.

Agent A is asked (Peer.Prefetch) to pull the blocks of a prompt it lacks from agent B:

- UCX: A connects to B's listener (`AgentServer.peer_address`, host:port) and sends a
  FetchRequest. B answers per batch with a FetchChunk header (first index, count, XXH64 of
  each payload) followed by the payloads: for large blocks one tag message per run of
  blocks that lie back to back in B's pool (the header's `runs`; slots filled one after
  another usually do), ONE message holding the whole batch back to back for small ones
  (peer_common.packed: per-message costs would dominate, and copying a few hundred KiB
  costs tens of µs). Each message costs a round of thread hand-offs on both sides (UCX
  progress thread, ucxx notifier, event loop), which on a small host cost more than the
  copy of a 2 MiB block.
  Nobody closes before A's acknowledgement of the end of the answer (closing first could
  drop the other side's last messages); after it A keeps the connection for its next
  request to B. UCX keeps same-tag messages between two endpoints in order, so headers
  and payloads pair up by position. On one host UCX moves the payloads with one CMA read
  from B's memory into A's (node_agent/peer/staging.init_ucx), elsewhere over TCP.
- gRPC: Peer.FetchBlocks (node_agent/peer/grpc_transport.py) streams the same chunks with the
  payloads inline. A uses it when UCX is off or failed to import, when the peer has no UCX
  address, and when a UCX transfer fails midway (it resumes after the blocks stored).

Large blocks, no copies on either side over UCX (host-memory pools; GPU pools too when
the device hash and a UCX built with CUDA are there, PeerService.in_place): B sends from
borrowed read-only views of its pool slots (BlockStore.borrow: the blocks cannot be
evicted nor their slots reused until the sends are done; not re-verified, since A checks
every payload end to end), copying into staging buffers only blocks that sit on NVMe. A
receives into pool slots it reserved (BlockStore.reserve), one run per message when the
slots it reserved for that run lie back to back too (else the batch lands in a staging
buffer and is copied into the slots in the verifying pass, as for small blocks), hashes
each message's payloads as soon as it lands, and only makes blocks whose hash matches
B's checksum visible (BlockStore.commit); a mismatching block is not stored, and it and
the rest of the chain are a miss. Small blocks: B copies the borrowed blocks into a
staging buffer (and ends the borrow at once), A receives the batch into a staging buffer
and fills the reserved slots with one fused copy + checksum pass before committing.
Batches are sized in bytes (PeerConfig.batch_bytes), so small blocks also travel in few
batches. Both sides pipeline: B borrows batch k+1 while batch k is on the wire; A
reserves the first batch's slots while its request travels to B, and the slots and
receives of batch k+1 before it commits batch k (a batch hashed as it landed is committed
on the event loop: bookkeeping only, cheaper than two thread hand-offs).

Every await on the network has a timeout, and a Prefetch has an overall deadline, so a
dead or frozen peer turns the missing blocks into a miss in bounded time. Concurrent
Prefetches of the same blocks are de-duplicated: the first claims a block, later ones wait
for its outcome instead of transferring it again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass

import numpy as np

from kvstore import errors
from kvstore.config import AgentConfig
from kvstore.hashing import split_ids
from kvstore.store import BlockStore, NsState, ServedBlock
from kvstore.store_types import Borrowed
from kvstore.v1 import peer_pb2
from node_agent.peer.staging import (ACK, MESSAGE_BYTES, OFFLOAD_BYTES, PeerConfig, PeerRef,
                                    PeerTransportError, StagingLease, StagingPool, TokenTable,
                                    check_peer_access, contiguous, control_buffer, init_ucx,
                                    packed, post_control, present_prefix, recv_control, runs_of,
                                    spans, ucx_cuda_support, within)
from node_agent.peer.ucx.fetch import FetchJob
from node_agent.servicer import namespace_from_proto

log = logging.getLogger("kvstore.agent.peer")


@dataclass(slots=True, eq=False)
class ReadBatch:
    """One batch B serves: `bufs[i]` holds the payload of `served[i]` (borrowed slot views
    first, then staging copies of blocks read from NVMe), or, packed, `bufs[0]` holds every
    payload back to back in staging. PeerService.done_with(batch)
    once nothing reads `bufs` any more."""

    first: int
    served: list[ServedBlock]
    bufs: list
    borrowed: Borrowed | None
    last: bool = False


class PeerService:
    """Both ends of peer transfer for one agent: the UCX listener that serves this
    node's blocks, and Prefetch, which pulls blocks from another agent into this store."""

    def __init__(self, store: BlockStore, cfg: AgentConfig, publish=lambda: None,
                 pcfg: PeerConfig | None = None) -> None:
        self.store = store
        self.cfg = cfg
        self.pcfg = pcfg or PeerConfig.from_env()
        self.published = publish  # ship the store's pending events (event-loop thread)
        self.tokens = TokenTable(cfg)
        self.staging = StagingPool()
        self.control = None  # node_agent/control.AgentControl when etcd is configured
        self.peer_address = ""  # host:port of our UCX listener; '' when UCX is off
        self.ucx = None  # the ucxx module once initialised
        # Payloads move straight between pool slots (borrowed and reserved views), else
        # through host staging copies: a GPU pool needs the device hash (DevicePool.in_place)
        # and, once UCX is up, a UCX built with CUDA (start()).
        self.in_place = self._in_place(ucx_cuda=False)
        self._listener = None
        self._serving: set = set()  # UCX endpoints being served, aborted at stop
        self._inflight: dict[tuple[bytes, int, bytes], asyncio.Future] = {}
        self._grpc = None  # node_agent.peer.grpc_transport.GrpcFetcher, created on first use
        # Bounds on concurrent transfers: each holds staging_sets chunk buffers.
        self.fetch_slots = asyncio.Semaphore(self.pcfg.max_transfers)
        self.serve_slots = asyncio.Semaphore(self.pcfg.max_transfers)
        # Connections to peers' listeners kept for the next fetch: address -> [(t, ep)].
        self._idle: dict[str, list[tuple[float, object]]] = {}
        self._background: set[asyncio.Task] = set()  # acknowledgements finishing

    @property
    def ucx_ready(self) -> bool:
        return self.ucx is not None

    def spawn(self, coro) -> None:
        """Run `coro` in the background (nobody waits for it; kept referenced)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def count(self, name: str, n: int = 1) -> None:
        with self.store.lock:  # worker threads update the same Counter
            self.store.counters[name] += n

    # ------------------------------------------------------------- lifecycle
    async def start(self, host: str, control=None) -> None:
        self.control = control
        if not self.cfg.ucx_enabled:
            log.info("UCX disabled by configuration: peers use the gRPC fallback")
            return
        try:
            self.ucx = init_ucx(self.pcfg.shared_memory)
            self._listener = self.ucx.create_listener(self._serve_ucx, port=self.cfg.peer_port,
                                                       endpoint_error_handling=True)
        except Exception as exc:  # import failure, no transport, port taken
            log.error("UCX unavailable (%s: %s): peers use the gRPC fallback",
                      type(exc).__name__, exc)
            self.ucx = self._listener = None
            return
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        self.peer_address = f"{host}:{self._listener.port}"
        log.info("UCX peer listener on %s (ucx %s)", self.peer_address,
                 self.ucx.__ucx_version__)
        if self.store.pool.is_cuda:
            self.in_place = self._in_place(ucx_cuda_support(self.ucx))
            why = self.store.pool.why_not_in_place or (
                "UCX has no CUDA support" if self.pcfg.in_place else "KVSTORE_PEER_IN_PLACE=0")
            log.info("GPU pool: peer payloads %s", "move straight from and into GPU memory "
                     "(UCX registers it; verified there by the device hash)"
                     if self.in_place else f"are staged in host memory ({why})")

    def _in_place(self, ucx_cuda: bool) -> bool:
        """Whether payloads move straight between pool slots: configured so, and the pool
        verifies in place; a GPU pool also needs a UCX that moves CUDA memory."""
        return self.pcfg.in_place and self.store.supports_in_place and \
            (ucx_cuda or not self.store.pool.is_cuda)

    async def stop(self) -> None:
        for ep in list(self._serving):
            ep.abort()
        self._serving.clear()
        for eps in self._idle.values():
            for _, ep in eps:
                ep.abort()
        self._idle.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._grpc is not None:
            await self._grpc.close()
        if self.ucx is not None:
            # The notifier thread would keep the process from exiting.
            self.ucx.stop_notifier_thread()
            self.ucx = None
        self.peer_address = ""

    # ------------------------------------------------------------ namespaces
    async def namespace(self, ref, spec_msg, tenant: str | None, write: bool) -> NsState:
        """The namespace a request names, opened from its spec if this node never saw it;
        generation fencing applies (store.namespace)."""
        if len(ref.namespace_id) != 16:
            raise errors.InvalidArgument("namespace_id must be 16 bytes")
        try:
            st = self.store.namespace(ref.namespace_id, ref.generation)
        except errors.NotFound:
            if spec_msg is None:
                raise
            spec = namespace_from_proto(spec_msg)
            if spec.namespace_id != ref.namespace_id:
                raise errors.InvalidArgument("spec does not match namespace_id") from None
            if self.control is not None:
                await self.control.open_namespace(spec)
            else:
                self.store.open_namespace(spec)
            st = self.store.namespace(ref.namespace_id, ref.generation)
        check_peer_access(tenant, st, write)
        return st

    def _ids(self, packed: bytes) -> list[bytes]:
        if len(packed) % 16:
            raise errors.InvalidArgument(f"block_ids is {len(packed)} bytes, not a multiple "
                                         "of 16")
        if len(packed) // 16 > self.cfg.max_blocks_per_request:
            raise errors.InvalidArgument(f"request names {len(packed) // 16} blocks; the "
                                         f"limit is {self.cfg.max_blocks_per_request}")
        return split_ids(packed)

    # ---------------------------------------------------------- serving side
    async def source(self, req: peer_pb2.FetchRequest, tenant: str | None):
        """Validate a FetchRequest: (namespace, ids, parent, batch)."""
        spec = req.spec if req.HasField("spec") else None
        st = await self.namespace(req.ns, spec, tenant, write=False)
        ids = self._ids(req.block_ids)
        if req.parent_id and len(req.parent_id) != 16:
            raise errors.InvalidArgument("parent_id must be empty or 16 bytes")
        batch = min(req.batch_blocks or self.pcfg.batch_for(st.spec.block_bytes),
                    self.pcfg.max_batch_blocks)
        return st, ids, req.parent_id, batch

    async def read_batches(self, st: NsState, generation: int, ids: list[bytes],
                           parent_id: bytes, batch: int, lease: StagingLease,
                           pack: bool = False, borrow: bool = True):
        """Yield a verified ReadBatch per batch, batch k's staging copies in lease[k]
        (`pack`: all of its payloads, contiguous, and no borrow outlives the read; not
        `borrow`: every block copied into staging, none lent from the pool). Batch
        k+1 is read from the store while the caller sends batch k: a caller that keeps
        sends in flight after asking for the next batch must have finished those of batch
        k+1-len(lease.sets) by then. The caller hands each batch to done_with()."""
        pending = None
        try:
            if not ids:
                yield ReadBatch(0, [], [], None, True)
                return
            pending = self._read(st, generation, ids, 0, parent_id, lease[0], batch, pack,
                                 borrow)
            for k, start in enumerate(range(0, len(ids), batch)):
                rb = await pending
                pending = None
                n = min(batch, len(ids) - start)
                rb.first, rb.last = start, len(rb.served) < n or start + n >= len(ids)
                if not rb.last:
                    pending = self._read(st, generation, ids, start + n, ids[start + n - 1],
                                         lease[k + 1], batch, pack, borrow)
                self.count("peer_blocks_served", len(rb.served))
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
            self.store.release(rb.borrowed)
            rb.borrowed = None

    def _read(self, st, generation, ids, start, parent, bufs, batch, pack, borrow
              ) -> asyncio.Future:
        """Read one batch. Borrowing is bookkeeping only (no bytes move: the receiver
        verifies), so it runs right here; copies (packed batches, blocks on NVMe) run in a
        worker thread when big enough."""
        chunk = ids[start:start + batch]
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
        b = self.store.borrow(st.ns_id, generation, chunk, parent, verify=False)
        self.count("peer_blocks_borrowed", len(b.served))
        return ReadBatch(0, list(b.served), list(b.views), b)

    def _copy_rest(self, st, generation, chunk, parent, bufs, rb: ReadBatch | None
                   ) -> ReadBatch:
        """Copy into staging what `rb` did not borrow (get verifies, and promotes blocks
        read from NVMe). Packed (`rb` None), every block is copied by get (one verified
        copy each) and nothing stays borrowed."""
        if rb is None:
            served = self.store.get(st.ns_id, generation, chunk, parent,
                                    lambda i, n: bufs[i][:n])
            return ReadBatch(0, served, [contiguous(bufs, len(served))] if served else [],
                             None)
        k = len(rb.served)
        try:
            got = self.store.get(st.ns_id, generation, chunk[k:], chunk[k - 1] if k else parent,
                                 lambda i, n: bufs[i][:n])
        except BaseException:
            self.done_with(rb)
            raise
        rb.served += got
        rb.bufs += bufs[:len(got)]
        return rb

    async def _serve_ucx(self, ep) -> None:
        """One UCX connection: FetchRequests one after another, each answered with its
        chunks and closed by the fetcher's acknowledgement. The fetcher keeps the
        connection for its next request (a connect costs tens of ms); it ends when the
        fetcher goes, or after idle_endpoint_s without a request."""
        self._serving.add(ep)
        served = 0
        control = control_buffer()
        far = time.monotonic() + 1e9
        io = self.pcfg.io_timeout_s
        try:
            while True:
                try:
                    raw = await within(recv_control(ep, control), far,
                                       self.pcfg.idle_endpoint_s if served else io, "request")
                except Exception as exc:
                    if served:  # the fetcher closed its end between requests: normal
                        log.debug("UCX peer connection ends after %d requests", served)
                        return
                    raise PeerTransportError(f"no request: {exc}") from exc
                await self._serve_request(ep, peer_pb2.FetchRequest.FromString(bytes(raw)))
                ack = np.empty(len(ACK), dtype=np.uint8)
                await within(ep.recv(ack), far, io, "acknowledgement")
                served += 1
        except Exception as exc:  # the fetching side turns this into a miss or a fallback
            log.warning("UCX peer transfer (serving side) ended early: %s: %s",
                        type(exc).__name__, exc)
        finally:
            self._serving.discard(ep)
            ep.abort()

    async def _serve_request(self, ep, req: peer_pb2.FetchRequest) -> None:
        far = time.monotonic() + 1e9
        try:
            tenant = self.tokens.tenant(req.authorization)
            st, ids, parent, batch = await self.source(req, tenant)
        except errors.KvError as exc:
            err = peer_pb2.FetchChunk(done=True, error=str(exc), error_code=exc.code)
            await within(post_control(ep, err.SerializeToString()), far,
                         self.pcfg.io_timeout_s, "refusal")
            return
        async with self.serve_slots:
            await self._send_batches(ep, st, req.ns.generation, ids, parent, batch)

    async def _send_batches(self, ep, st, generation, ids, parent, batch) -> None:
        """Header then payloads per batch, all posted at once (one completion wait per
        batch), announcing the next batch before the payloads of this one have landed; at
        most staging_sets - 2 batches stay in flight when read_batches reads ahead, which
        keeps its buffer reuse safe."""
        far = time.monotonic() + 1e9
        io = self.pcfg.io_timeout_s
        size = st.spec.block_bytes
        pack = packed(size)
        lease = self.staging.lease(self.pcfg.staging_sets, batch, size)
        inflight: list[tuple[asyncio.Future, ReadBatch]] = []
        try:
            batches = self.read_batches(st, generation, ids, parent, batch, lease, pack,
                                        borrow=self.in_place)
            async with aclosing(batches) as it:
                async for rb in it:
                    sends = self._announce(ep, rb, size, pack)
                    inflight.append((asyncio.gather(*sends), rb))
                    while len(inflight) > self.pcfg.staging_sets - 2:
                        await self._sent(inflight, far, io)
                while inflight:
                    await self._sent(inflight, far, io)
        finally:
            if inflight:
                lease.clean = False
                for fut, rb in inflight:
                    fut.cancel()
                    self.done_with(rb)
            lease.release()

    def _announce(self, ep, rb: ReadBatch, size: int, pack: bool) -> list[asyncio.Future]:
        """Post the header of `rb` and its payloads (packed: the batch as one message;
        else one per run of blocks back to back in memory); the sends' futures."""
        hdr = peer_pb2.FetchChunk(first_index=rb.first, count=len(rb.served),
                                  checksums=[s.checksum for s in rb.served], done=rb.last)
        payloads = []
        if rb.served and pack:
            payloads = [rb.bufs[0][:len(rb.served) * size]]
        elif rb.served:
            views = rb.bufs[:len(rb.served)]
            hdr.runs.extend(runs_of(views, size, max(1, MESSAGE_BYTES // size)))
            payloads = spans(views, hdr.runs, size)
        self.count("peer_payload_messages", len(payloads))
        return [post_control(ep, hdr.SerializeToString())] + \
            [asyncio.ensure_future(ep.send(p)) for p in payloads]

    async def _sent(self, inflight: list, far: float, io: float) -> None:
        fut, rb = inflight[0]
        await within(asyncio.shield(fut), far, io, "header and payload sends")
        inflight.pop(0)
        self.done_with(rb)

    # --------------------------------------------------------- fetching side
    async def prefetch(self, req: peer_pb2.PrefetchRequest, tenant: str | None,
                       authorization: str, time_left: float | None
                       ) -> peer_pb2.PrefetchResponse:
        """Make the leading blocks of `req.block_ids` present here, pulling the missing
        ones from the peer. Never raises for transfer trouble: that is a shorter result."""
        spec = req.spec if req.HasField("spec") else None
        st = await self.namespace(req.ns, spec, tenant, write=True)
        gen = req.ns.generation
        ids = self._ids(req.block_ids)
        if req.parent_id and len(req.parent_id) != 16:
            raise errors.InvalidArgument("parent_id must be empty or 16 bytes")
        if ids and not (req.peer_address or req.peer_ucx_address):
            raise errors.InvalidArgument("Prefetch needs peer_address or peer_ucx_address")
        budget = req.timeout_ms / 1000 if req.timeout_ms else self.pcfg.prefetch_timeout_s
        if time_left is not None:
            budget = min(budget, time_left)
        deadline = time.monotonic() + budget
        peer = PeerRef(req.peer_address, req.peer_ucx_address)
        job = FetchJob(self, st, gen, ids, req.parent_id, peer, deadline, authorization)
        await job.run()
        present = present_prefix(self.store, st.ns_id, gen, ids, req.parent_id)
        stopped = "" if present == len(ids) else (job.stopped or "blocks left after fetch")
        if stopped:
            log.info("prefetch of %d blocks from %s stopped at %d: %s", len(ids),
                     peer.ucx_address or peer.grpc_address, present, stopped)
        return peer_pb2.PrefetchResponse(present=present, fetched=job.fetched,
                                         waited=job.waited, transport="+".join(job.used),
                                         stopped=stopped)

    def claim(self, st: NsState, gen: int, ids: list[bytes], start: int):
        """Split ids[start:] into runs this call transfers (mine=True, with fresh futures)
        and runs another call is already transferring (mine=False, its futures). Claims
        happen without an await, so a later call only ever waits on earlier ones: no
        cycle, no deadlock."""
        runs: list[list] = []  # [start, end, mine, futures]
        loop = asyncio.get_running_loop()
        for i in range(start, len(ids)):
            key = (st.ns_id, gen, ids[i])
            fut = self._inflight.get(key)
            mine = fut is None
            if mine:
                fut = self._inflight[key] = loop.create_future()
            if runs and runs[-1][2] == mine:
                runs[-1][1] = i + 1
                runs[-1][3].append(fut)
            else:
                runs.append([i, i + 1, mine, [fut]])
        return runs

    def release(self, st: NsState, gen: int, ids: list[bytes], futs: dict[int, asyncio.Future]
                ) -> None:
        """Resolve this call's claims (unstored ones as failed) and forget them."""
        for i, fut in futs.items():
            if not fut.done():
                fut.set_result(False)
            key = (st.ns_id, gen, ids[i])
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    def checkout(self, address: str):
        """An idle connection to `address` young enough that the peer still keeps it."""
        eps = self._idle.get(address, [])
        while eps:
            since, ep = eps.pop()
            if time.monotonic() - since < self.pcfg.idle_endpoint_s / 2 and not ep.closed:
                return ep
            ep.abort()
        return None

    def checkin(self, address: str, ep) -> None:
        eps = self._idle.setdefault(address, [])
        if len(eps) < 4 and self.ucx is not None:
            eps.append((time.monotonic(), ep))
        else:
            ep.abort()

    def grpc_fetcher(self):
        if self._grpc is None:
            from node_agent.peer.grpc_transport import GrpcFetcher
            self._grpc = GrpcFetcher(self.cfg.max_message_bytes)
        return self._grpc
