"""The fetching side of peer transfer: one Prefetch call (FetchJob), the UCX transfer,
and the sink that stores received batches. See node_agent/peer/serve.py for the protocol."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore import errors
from kvstore.hashing import pack_ids
from kvstore.store import NsState, PutItem
from kvstore.store_types import Reservation
from kvstore.v1 import agent_pb2, peer_pb2
from node_agent.peer.staging import (ACK, GRPC_CHUNK_BYTES, OFFLOAD_BYTES, PeerRef,
                                    PeerRefused, PeerTransportError, check_runs,
                                    contiguous, control_buffer, is_ip, namespace_to_proto,
                                    packed, post_control, present_prefix, recv_control, spans,
                                    split_host_port, within)

if TYPE_CHECKING:
    from node_agent.peer.serve import PeerService

log = logging.getLogger("kvstore.agent.peer")


@dataclass(frozen=True, slots=True)
class FetchRequestIds:
    ids: list[bytes]
    parent_id: bytes


@dataclass(slots=True, eq=False)
class Landing:
    """Where the payloads of one UCX batch land: pool slots reserved for its leading
    blocks (`res`, when PeerService.in_place), staging buffers for the others (all of
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


class BatchSink:
    """A's side of one transfer: stores received batches in chain order, with one store
    step in flight while the next batch arrives. Tracks how many of `ids` are stored and
    why it stopped early, and tells `on_stored` about each stored run. `root` is the
    chain root of the whole Prefetch: a block whose parent is neither held nor `root` is
    refused as an orphan."""

    def __init__(self, peer: "PeerService", st: NsState, generation: int, ids: list[bytes],
                 parent_id: bytes, root: bytes, on_stored) -> None:
        self.peer = peer
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
        self._task: asyncio.Task | None = None
        self._staging: list | None = None  # the staging set the store step reads

    def begin(self) -> FetchRequestIds:
        """Start a (re)request for the ids not stored yet."""
        self.base = self.expect = self.stored
        self.remote_done = False
        rest = self.ids[self.stored:]
        parent = self.ids[self.stored - 1] if self.stored else self.parent_id
        return FetchRequestIds(rest, parent)

    def check(self, chunk: peer_pb2.FetchChunk, max_count: int) -> int:
        """Validate a chunk header against what was asked; returns its absolute index."""
        first = self.base + chunk.first_index
        if first != self.expect or chunk.count > max_count or \
                first + chunk.count > len(self.ids) or len(chunk.checksums) != chunk.count:
            raise PeerTransportError(
                f"malformed chunk from peer: first_index {chunk.first_index}, count "
                f"{chunk.count}, {len(chunk.checksums)} checksums (expected index "
                f"{self.expect - self.base}, at most {max_count})")
        self.expect = first + chunk.count
        return first

    async def push(self, first: int, bufs, checksums: list[int],
                   staging: list | None = None) -> bool:
        """Queue a received batch for storing (a copying put); False when the transfer
        should stop. `staging`: a set that goes back to the pool once the put is done."""
        size = sum(memoryview(b).nbytes for b in bufs)
        return await self._queue(len(bufs), size >= OFFLOAD_BYTES, staging, self._store,
                                 first, bufs, checksums)

    async def land(self, ld: Landing) -> bool:
        """Queue a batch received into a Landing for storing: verified in place (packed:
        copied from staging into the slots and verified in one pass), then committed (put
        from staging on device pools)."""
        staging, ld.scratch = (ld.scratch, []) if ld.pack else (None, ld.scratch)
        if ld.res is None:
            return await self.push(ld.first, (staging or ld.scratch)[:ld.count],
                                   ld.checksums, staging)
        if not ld.pack:
            self.peer.count("peer_blocks_in_place", len(ld.res))
        digests = None  # taken as the messages landed; else the store step hashes
        if ld.digests is not None:
            parts = await asyncio.gather(*ld.digests)
            if all(p is not None for p in parts):
                digests = [d for part in parts for d in part]
        # Hashed already, committing is bookkeeping only: right here, without two thread
        # hand-offs (else the commit copies or hashes the batch: a worker thread).
        offload = (digests is None or bool(staging)) and \
            ld.count * self.st.spec.block_bytes >= OFFLOAD_BYTES
        return await self._queue(ld.count, offload, staging, self._commit, ld, staging,
                                 digests)

    async def _queue(self, n: int, offload: bool, staging: list | None, fn, *args) -> bool:
        """Store a batch (fn(*args)): in a worker thread when `offload` (it copies or
        hashes enough bytes to be worth the hand-off), else right here."""
        if not await self.drain():
            if staging:
                self.peer.staging.give(staging)
            return False
        self._staging = staging
        self.peer.count("peer_blocks_received", n)
        if offload:
            self._task = asyncio.create_task(asyncio.to_thread(fn, *args))
        else:
            self._task = asyncio.get_running_loop().create_future()
            self._task.set_result(fn(*args))
        return True

    def reserve_ahead(self, count: int) -> Reservation | None:
        """Slots for the next `count` blocks, reserved while the request is on its way so
        that the first header finds them ready (destination() takes them, trimmed to what
        the header announces; the caller aborts them when no header comes). None when the
        store does not take payloads in place or the pool lacks free slots (making room
        may write NVMe: not on the event loop), or when the reservation fails (the one
        made for the header then says why)."""
        store = self.peer.store
        if not count or not self.peer.in_place or store.pool.free_slots < count:
            return None
        try:
            return self._reserve(self.expect, count, None)
        except errors.KvError:
            return None

    def _reserve(self, first: int, count: int, after: Reservation | None) -> Reservation:
        parent = self.ids[first - 1] if first else self.parent_id
        return self.peer.store.reserve(self.st.ns_id, self.generation,
                                       self.ids[first:first + count], parent, self.root,
                                       after=after)

    def destination(self, first: int, count: int, checksums: list[int],
                    after: Reservation | None, batch: int, runs: list[int] | None,
                    ahead: Reservation | None = None) -> Landing:
        """Reserve pool slots for blocks first..first+count (a Landing with no slots when
        the store cannot take them in place; `reason` of a short reservation stops the
        transfer after this batch), or take `ahead` (reserve_ahead) for them. `runs`:
        blocks per payload message (large blocks). When the slots reserved for a run do
        not lie back to back, the batch lands in a staging set instead and the verifying
        pass copies it into the slots. Worker thread when it may have to evict."""
        store = self.peer.store
        size = self.st.spec.block_bytes
        res = None
        if ahead is not None:
            store.trim(ahead, count)
            res = ahead
        elif self.peer.in_place:
            res = self._reserve(first, count, after)
        if packed(size):  # a whole set (not `count` buffers): sets are reused across batches
            scratch = self.peer.staging.take(batch, size)
            return Landing(first, count, checksums, res, scratch,
                           [contiguous(scratch, count)], pack=True)
        left = count - (len(res) if res is not None else 0)
        scratch = self.peer.staging.take(left, size) if left else []
        msgs = spans((res.views if res is not None else []) + scratch, runs, size)
        if msgs is not None:
            return Landing(first, count, checksums, res, scratch, msgs)
        if scratch:
            self.peer.staging.give(scratch)
        scratch = self.peer.staging.take(batch, size)  # a set is contiguous
        self.peer.count("peer_blocks_staged", count)
        return Landing(first, count, checksums, res, scratch,
                       spans(scratch[:count], runs, size), pack=True)

    def _commit(self, ld: Landing, staging: list | None, digests: list[int] | None):
        """Worker-thread part of land(): verify (packed: copy from `staging` and verify;
        in place with `digests`: check those) and commit the reserved blocks."""
        reason = ""
        n_res = len(ld.res)
        try:
            self.peer.store.commit(ld.res, ld.checksums[:n_res],
                                   sources=staging[:n_res] if staging else None,
                                   digests=digests)
        except errors.DataLoss as exc:
            self.peer.count("peer_checksum_mismatch")
            reason = f"checksum mismatch: {exc}"
        except errors.KvError as exc:
            reason = f"not stored here: {exc}"
        if n_res < ld.count and not reason:
            reason = f"not stored here: {ld.res.reason}"
        n = present_prefix(self.peer.store, self.st.ns_id, self.generation, self.ids,
                           self.parent_id, ld.first)
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
                    self.peer.staging.give(staging)  # nothing reads it any more
            self.peer.published()
            self.stored = first + n
            if n:
                self.on_stored(first, n)
                self.peer.count("peer_blocks_stored", n)
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

    def _store(self, first: int, bufs, checksums: list[int]):
        """Worker-thread part: put, then see how far the chain got (put may skip blocks
        on a full pool or refuse them on a checksum mismatch)."""
        items = [PutItem(self.ids[first + i],
                         self.ids[first + i - 1] if first + i else self.parent_id,
                         bufs[i], checksums[i]) for i in range(len(bufs))]
        reason = ""
        try:
            # A block whose parent is neither held nor the chain root is an orphan.
            self.peer.store.put(self.st.ns_id, self.generation, items, root=self.root)
        except errors.DataLoss as exc:
            self.peer.count("peer_checksum_mismatch")
            reason = f"checksum mismatch: {exc}"
        except errors.KvError as exc:
            reason = f"not stored here: {exc}"
        n = present_prefix(self.peer.store, self.st.ns_id, self.generation, self.ids,
                           self.parent_id, first)
        return first, min(n, len(bufs)), len(bufs), reason


class FetchJob:
    """One Prefetch: claims the missing blocks, waits for runs a concurrent call already
    transfers, and transfers its own runs (UCX, then gRPC for whatever is left)."""

    def __init__(self, svc: "PeerService", st: NsState, generation: int, ids: list[bytes],
                 parent_id: bytes, peer: PeerRef, deadline: float, authorization: str) -> None:
        self.svc = svc
        self.st = st
        self.generation = generation
        self.ids = ids
        self.parent_id = parent_id
        self.peer = peer
        self.deadline = deadline
        self.authorization = authorization
        self.fetched = self.waited = 0
        self.used: list[str] = []
        self.stopped = ""
        self._mine: dict[int, asyncio.Future] = {}

    async def run(self) -> None:
        start = present_prefix(self.svc.store, self.st.ns_id, self.generation, self.ids,
                               self.parent_id)
        if start == len(self.ids):
            return
        runs = self.svc.claim(self.st, self.generation, self.ids, start)
        for s, e, mine, futs in runs:
            if mine:
                self._mine.update(zip(range(s, e), futs))
        try:
            for s, e, mine, futs in runs:
                ok = await (self._transfer(s, e) if mine else self._wait(s, e, futs))
                if not ok:
                    break
        finally:
            self.svc.release(self.st, self.generation, self.ids, self._mine)

    async def _wait(self, s: int, e: int, futs: list[asyncio.Future]) -> bool:
        left = self.deadline - time.monotonic()
        try:
            done = await asyncio.wait_for(
                asyncio.gather(*(asyncio.shield(f) for f in futs)), max(left, 0.001))
        except asyncio.TimeoutError:
            self.stopped = "deadline passed waiting for a concurrent fetch of these blocks"
            return False
        if not all(done):
            self.stopped = "a concurrent fetch of these blocks did not get them"
            return False
        self.waited += e - s
        self.svc.count("peer_dedup_blocks", e - s)
        return True

    def _request(self, ids: list[bytes], parent: bytes, batch: int,
                 authorization: str) -> peer_pb2.FetchRequest:
        return peer_pb2.FetchRequest(
            ns=agent_pb2.NamespaceRef(namespace_id=self.st.ns_id, generation=self.generation),
            spec=namespace_to_proto(self.st.spec), block_ids=pack_ids(ids), parent_id=parent,
            batch_blocks=batch, authorization=authorization)

    def _stored(self, offset: int):
        def on_stored(first: int, n: int) -> None:
            for i in range(offset + first, offset + first + n):
                fut = self._mine.get(i)
                if fut is not None and not fut.done():
                    fut.set_result(True)
        return on_stored

    async def _transfer(self, s: int, e: int) -> bool:
        pcfg = self.svc.pcfg
        parent = self.ids[s - 1] if s else self.parent_id
        sink = BatchSink(self.svc, self.st, self.generation, self.ids[s:e], parent,
                         self.parent_id, self._stored(s))
        # The store refuses chains shorter than min_prefix_blocks per put: the first
        # batch must be at least that long.
        size = self.st.spec.block_bytes
        batch = max(pcfg.batch_for(size), min(self.st.policy.min_prefix_blocks,
                                              pcfg.max_batch_blocks))
        if self.svc.ucx_ready and self.peer.ucx_address:
            await self._attempt("ucx", sink, batch)
        if (sink.stored < e - s and not sink.stop_reason and not sink.remote_done
                and self.peer.grpc_address and time.monotonic() < self.deadline):
            gbatch = max(1, min(batch, GRPC_CHUNK_BYTES // size,
                                (self.svc.cfg.max_message_bytes // 2) // size))
            await self._attempt("grpc", sink, gbatch)
        self.fetched += sink.stored
        if sink.stored == e - s:
            return True
        self.stopped = sink.stop_reason or self.stopped or (
            f"the peer holds only {s + sink.stored} of the blocks" if sink.remote_done
            else "transfer incomplete")
        return False

    async def _attempt(self, transport: str, sink: "BatchSink", batch: int) -> None:
        want = sink.begin()
        self.used.append(transport)
        self.svc.count(f"peer_fetch_{transport}")
        slots = self.svc.fetch_slots
        try:
            await within(slots.acquire(), self.deadline, self.deadline - time.monotonic(),
                         "a free transfer slot")
        except PeerTransportError as exc:
            self.stopped = f"{transport}: {exc}"
            return
        try:
            if transport == "ucx":
                req = self._request(want.ids, want.parent_id, batch, self.authorization)
                await ucx_fetch(self.svc, self.peer.ucx_address, req, sink, batch,
                                self.deadline)
            else:
                req = self._request(want.ids, want.parent_id, batch, "")
                await self.svc.grpc_fetcher().fetch(
                    self.peer.grpc_address, req, sink, batch, self.deadline,
                    self.svc.pcfg.io_timeout_s, self.authorization)
        except PeerRefused as exc:
            sink.stop_reason = str(exc)
        except PeerTransportError as exc:
            self.svc.count(f"peer_{transport}_failures")
            self.stopped = f"{transport}: {exc}"
            log.warning("%s fetch of %d blocks from %s failed after %d: %s", transport,
                        len(sink.ids), self.peer.ucx_address if transport == "ucx"
                        else self.peer.grpc_address, sink.stored, exc)
        finally:
            slots.release()


async def ucx_fetch(svc: "PeerService", address: str, req: peer_pb2.FetchRequest,
                    sink: BatchSink, batch: int, deadline: float) -> None:
    """Pull `req` over UCX into `sink`. Raises PeerTransportError on transport trouble
    (the caller may fall back), PeerRefused when the peer declines.

    Batch k+1's header is awaited, its slots reserved and its receives posted before batch
    k is verified and committed, so the wire never idles for a store step; at most
    staging_sets - 1 batches are posted at a time."""
    ep = svc.checkout(address)
    if ep is not None:
        try:
            return await _ucx_transfer(svc, ep, address, req, sink, batch, deadline, True)
        except _StaleConnection as exc:
            log.debug("kept UCX connection to %s was gone (%s); reconnecting", address, exc)
            svc.count("peer_ucx_reconnects")
    ep = await _ucx_connect(svc, address, deadline)
    await _ucx_transfer(svc, ep, address, req, sink, batch, deadline, False)


class _StaleConnection(Exception):
    """A kept connection failed before the peer answered: retry on a fresh one."""


async def _ucx_transfer(svc: "PeerService", ep, address: str, req: peer_pb2.FetchRequest,
                        sink: BatchSink, batch: int, deadline: float, reused: bool) -> None:
    io = svc.pcfg.io_timeout_s
    control = control_buffer()  # chunk headers, one after another
    posted: list[Landing] = []  # batches whose payloads are on their way, oldest first
    ahead: list[Reservation] = []  # the first batch's slots, reserved during the request
    clean = abandoned = False

    def reserve_first() -> None:
        res = sink.reserve_ahead(min(batch, len(sink.ids) - sink.expect))
        if res is not None:
            ahead.append(res)

    try:
        try:
            raw = await _ask(ep, req, control, deadline, io, reserve_first)
        except Exception as exc:
            if reused:  # nothing happened on this request yet: safe to retry elsewhere
                raise _StaleConnection(f"{type(exc).__name__}: {exc}") from exc
            raise
        while True:
            hdr = peer_pb2.FetchChunk.FromString(bytes(raw))
            if hdr.error:
                raise PeerRefused(f"peer {address} refused: {hdr.error_code} {hdr.error}")
            first = sink.check(hdr, batch)
            sink.remote_done = hdr.done
            if hdr.count:
                runs = None if packed(sink.st.spec.block_bytes) else \
                    check_runs(hdr.runs, hdr.count)
                # _post owns the slots reserved ahead from here; unused, `finally` frees them
                take = ahead.pop() if ahead else None
                if not await _post(svc, ep, sink, posted, first, hdr, batch, runs, take):
                    abandoned = True  # payloads of this batch come with no receive posted
                    break
            if len(posted) > svc.pcfg.staging_sets - 2 and not await _store_oldest(
                    posted, sink, deadline, io):
                break
            if sink.remote_done:
                break
            raw = await within(recv_control(ep, control), deadline, io,
                               "chunk header")
        while posted and await _store_oldest(posted, sink, deadline, io):
            pass
        if sink.remote_done and not posted and not abandoned:
            # The answer is complete: acknowledge it without waiting (the connection goes
            # back to the idle set once the acknowledgement is out).
            svc.spawn(_acknowledge(svc, ep, address))
            clean = True
            await sink.drain()
    except (PeerTransportError, PeerRefused, _StaleConnection):
        raise
    except Exception as exc:  # ucxx errors: reset by peer, truncation, closed endpoint
        raise PeerTransportError(f"UCX transfer from {address}: {type(exc).__name__}: "
                                 f"{exc}") from exc
    finally:
        for res in ahead:  # no header came to take them: nothing wrote into them
            svc.store.abort(res)
        if not clean:
            ep.abort()  # completes (cancels) the receives still posted into `posted`
        await _settle(svc, posted)
        await sink.drain_quietly()


async def _ask(ep, req: peer_pb2.FetchRequest, control, deadline: float, io: float,
               meanwhile=None):
    """Send the request and receive the first chunk header, the receive posted without
    waiting for the sends to complete (one completion wait less); a failed send ends
    the wait at once. `meanwhile()` runs once both are posted, while the peer works."""
    sending = post_control(ep, req.SerializeToString())
    answer = asyncio.ensure_future(recv_control(ep, control))
    try:
        if meanwhile is not None:
            await asyncio.sleep(0)  # the send and the receive reach UCX first
            meanwhile()
        await within(asyncio.wait({sending, answer}, return_when=asyncio.FIRST_EXCEPTION),
                     deadline, io, "first chunk header")
        if sending.done() and sending.exception() is not None:
            raise sending.exception()
        return answer.result()
    finally:
        for fut in (sending, answer):
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: no "never retrieved" warning


async def _acknowledge(svc: "PeerService", ep, address: str) -> None:
    """Acknowledge a complete answer, then keep the connection for the next request to
    this peer (it waits for that on it); a connection whose acknowledgement fails is
    dropped."""
    try:
        await within(ep.send(np.frombuffer(ACK, dtype=np.uint8)),
                     time.monotonic() + svc.pcfg.io_timeout_s, svc.pcfg.io_timeout_s,
                     "acknowledgement")
    except Exception as exc:
        log.debug("acknowledging to %s failed (%s); dropping the connection", address, exc)
        ep.abort()
        return
    svc.checkin(address, ep)


async def _post(svc: "PeerService", ep, sink: BatchSink, posted: list[Landing], first: int,
                hdr: peer_pb2.FetchChunk, batch: int, runs: list[int] | None,
                ahead: Reservation | None) -> bool:
    """Reserve the batch's destination (or take `ahead`, slots reserved for it before its
    header came) and post its receives, one per message of `runs` (large blocks); False
    (the sink knows why) when not one block of it can be stored here."""
    after = posted[-1].res if posted else None
    args = (first, hdr.count, list(hdr.checksums), after, batch, runs, ahead)
    try:
        if ahead is None and svc.store.pool.free_slots < hdr.count:
            # making room may write NVMe: off the event loop
            ld = await asyncio.to_thread(sink.destination, *args)
        else:
            ld = sink.destination(*args)
    except errors.KvError as exc:
        sink.stop_reason = sink.stop_reason or f"not stored here: {exc}"
        return False
    if ld.res is not None and not ld.res.plan:
        sink.stop_reason = sink.stop_reason or f"not stored here: {ld.res.reason}"
        _give_back(svc, ld)
        return False
    # return_exceptions: the future completes only once every receive has, so nothing
    # writes into the slots or buffers any more when it is done (see _settle).
    recvs = [asyncio.ensure_future(ep.recv(m)) for m in ld.msgs]
    ld.recvs = asyncio.ensure_future(asyncio.gather(*recvs, return_exceptions=True))
    if ld.res is not None and not ld.pack:  # in place: hash each message as it lands
        size = sink.st.spec.block_bytes
        ld.digests, i, slots = [], 0, ld.res.views
        for recv, msg in zip(recvs, ld.msgs):
            views = slots[i:i + msg.nbytes // size]
            if not views:
                break
            ld.digests.append(asyncio.ensure_future(
                _digest_landed(recv, views, svc.store.pool.digests)))
            i += len(views)
    posted.append(ld)
    return True


async def _digest_landed(recv: asyncio.Future, views: list, digests) -> list[int] | None:
    """XXH64 of each of `views` (pool slots) once `recv` (the message filling them)
    landed, in a worker thread: `digests` is the pool's (on the host, or in device memory
    for a device pool); None when the receive failed (the transfer fails on its own)."""
    try:
        await recv
    except Exception:
        return None
    return await asyncio.to_thread(digests, views)


async def _store_oldest(posted: list[Landing], sink: BatchSink, deadline: float,
                        io: float) -> bool:
    """Wait for the oldest posted batch to land, then hand it to the sink."""
    ld = posted[0]
    results = await within(asyncio.shield(ld.recvs), deadline, io, f"{ld.count} payloads")
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise PeerTransportError(f"receiving a payload: {type(failed).__name__}: {failed}")
    posted.pop(0)
    ok = await sink.land(ld)
    if ld.res is not None:  # its scratch only took payloads that are not stored
        _give_back(sink.peer, ld)  # (packed, land() took the set: the sink gives it back)
    return ok


async def _settle(svc: "PeerService", posted: list[Landing]) -> None:
    """After a failed transfer: free the slots of batches not stored, once their receives
    completed (the endpoint abort completes them). A receive UCX never completes keeps
    its slots reserved for good rather than let a late write land in a reused slot."""
    for ld in posted:
        if ld.recvs is not None and not ld.recvs.done():
            await asyncio.wait([ld.recvs], timeout=1.0)
        if ld.recvs is None or ld.recvs.done():
            if ld.res is not None:
                svc.store.abort(ld.res)
            _give_back(svc, ld)
        else:
            log.error("a UCX receive did not complete after abort: %d slots stay reserved "
                      "until it does", len(ld.res) if ld.res is not None else 0)
            if ld.res is not None:
                res = ld.res
                ld.recvs.add_done_callback(lambda _f, res=res: svc.store.abort(res))
    posted.clear()


def _give_back(svc: "PeerService", ld: Landing) -> None:
    if ld.scratch:
        svc.staging.give(ld.scratch)
        ld.scratch = []


async def _ucx_connect(svc: "PeerService", address: str, deadline: float):
    host, port = split_host_port(address)
    timeout = svc.pcfg.connect_timeout_s
    try:
        if not is_ip(host):
            infos = await asyncio.get_running_loop().getaddrinfo(host, port)
            host = infos[0][4][0]
        return await within(connect_endpoint(svc.ucx, host, port, timeout), deadline,
                            timeout, f"UCX connect to {address}")
    except PeerTransportError:
        raise
    except Exception as exc:
        raise PeerTransportError(f"UCX connect to {address}: {type(exc).__name__}: "
                                 f"{exc}") from exc


async def connect_endpoint(ucx, host: str, port: int, timeout: float):
    """ucxx.create_endpoint, minus a race: when the connection is refused before ucxx
    posts its handshake receive, that receive never completes and create_endpoint waits
    out its whole timeout (about half the time here). Same steps, but the endpoint's error
    state is polled meanwhile. Uses ucxx internals (0.52); the public call otherwise."""
    try:
        from ucxx._lib import libucxx as api
        from ucxx._lib_async.endpoint import Endpoint
        from ucxx._lib_async.exchange_peer_info import exchange_peer_info
        from ucxx._lib_async.utils import hash64bits
        ctx = ucx.core._get_ctx()
    except (ImportError, AttributeError):
        return await ucx.create_endpoint(host, port, endpoint_error_handling=True,
                                         connect_timeout=timeout)
    ctx.continuous_ucx_progress()
    raw = api.UCXEndpoint.create(ctx.worker, host, port, True)
    msg_tag = hash64bits("msg_tag", os.urandom(16), raw.handle)
    task = asyncio.ensure_future(exchange_peer_info(endpoint=raw, msg_tag=msg_tag,
                                                    listener=False, connect_timeout=timeout))
    try:
        while not (await asyncio.wait({task}, timeout=0.01))[0]:
            raw.raise_on_error()
        info = task.result()
    except BaseException:
        task.cancel()
        raw.close_blocking(period=10**9, max_attempts=1)
        raise
    return Endpoint(endpoint=raw, ctx=ctx, tags={"msg_send": info["msg_tag"],
                                                 "msg_recv": msg_tag})
