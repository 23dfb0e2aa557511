"""The fetching side of the UCX transport: one request to a peer's listener, its batches
received into reserved pool slots (or staging) and handed to the BatchSink, and the
connections kept for the next request. The protocol: node_agent/peer/__init__.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore import errors
from kvstore.config import PeerConfig
from kvstore.store import BlockStore
from kvstore.store_types import Reservation
from kvstore.v1 import peer_pb2
from node_agent.peer.counters import Counters
from node_agent.peer.errors import PeerRefused, PeerTransportError, PeerUnreachable, within
from node_agent.peer.offload import in_thread_owned
from node_agent.peer.sink import BatchSink, Landing
from node_agent.peer.staging import StagingPool, contiguous, spans
from node_agent.peer.ucx.auth import UcxAuth, connect_handshake
from node_agent.peer.ucx.direct_fetch import DirectFetcher
from node_agent.peer.ucx.wire import (
    ACK,
    check_runs,
    connect_endpoint,
    control_buffer,
    is_ip,
    notifier_state,
    packed,
    post_control,
    recv_control,
    split_host_port,
)

log = logging.getLogger("kvstore.agent.peer")
MAX_IDLE_PER_PEER = 4  # kept connections per peer address


class UcxFetcher:
    """Pulls FetchRequests from peers' UCX listeners into BatchSinks. `in_place`: receive
    into reserved pool slots (UcxTransport.in_place), else through staging. `same_host`:
    this agent's direct.host_identity, offered to every peer (a peer of the same host
    then lets this agent read large blocks from its memory itself); "": no offer (the
    transport gives none unless the pool takes payloads in place in host memory)."""

    def __init__(
        self,
        ucx,
        store: BlockStore,
        staging: StagingPool,
        pcfg: PeerConfig,
        counters: Counters,
        in_place: bool,
        auth: UcxAuth | None = None,
        same_host: str = "",
    ) -> None:
        self._direct = DirectFetcher(store, pcfg, counters, same_host, self._spawn)
        self._auth = auth  # the certificate handshake on each new connection (auth.py)
        self._ucx = ucx  # the initialised ucxx module
        self._store = store
        self._staging = staging
        self._pcfg = pcfg
        self._counters = counters
        self._in_place = in_place
        # Connections to peers' listeners kept for the next fetch: address -> [(t, ep)].
        # (ucxx has no type stubs: an endpoint is Any)
        self._idle: dict[str, list[tuple[float, Any]]] = {}
        self._background: set[asyncio.Task] = set()  # acknowledgements finishing
        self._closed = False

    def close(self) -> None:
        """Drop the kept connections; later acknowledgements drop theirs."""
        self._closed = True
        self._direct.close()
        for eps in self._idle.values():
            for _, ep in eps:
                ep.abort()
        self._idle.clear()

    def _spawn(self, coro) -> asyncio.Future:
        """Run `coro` in the background (kept referenced until done); its task."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _checkout(self, address: str):
        """An idle connection to `address` young enough that the peer still keeps it."""
        eps = self._idle.get(address, [])
        while eps:
            since, ep = eps.pop()
            if time.monotonic() - since < self._pcfg.idle_endpoint_s / 2 and not ep.closed:
                return ep
            ep.abort()
        return None

    def _checkin(self, address: str, ep) -> None:
        eps = self._idle.setdefault(address, [])
        if len(eps) < MAX_IDLE_PER_PEER and not self._closed:
            eps.append((time.monotonic(), ep))
        else:
            ep.abort()

    async def fetch(
        self, address: str, req: peer_pb2.FetchRequest, sink: BatchSink, batch: int, deadline: float
    ) -> None:
        """Pull `req` over UCX into `sink`. Raises PeerTransportError on transport trouble
        (the caller may fall back), PeerRefused when the peer declines.

        Batch k+1's header is awaited, its slots reserved and its receives posted before batch
        k is verified and committed, so the wire never idles for a store step; at most
        staging_sets - 1 batches are posted at a time."""
        req.same_host = self._direct.offer(address)
        ep = self._checkout(address)
        if ep is not None:
            try:
                return await self._transfer(ep, address, req, sink, batch, deadline, True)
            except _StaleConnection as exc:
                log.debug("kept UCX connection to %s was gone (%s); reconnecting", address, exc)
                self._counters.add("peer_ucx_reconnects")
        ep = await self._connect(address, deadline)
        self._counters.add("peer_ucx_connects")
        if self._auth is not None:
            try:
                await connect_handshake(ep, self._auth, address, deadline, self._pcfg.io_timeout_s)
            except BaseException as exc:
                ep.abort()
                if isinstance(exc, PeerTransportError) or not isinstance(exc, Exception):
                    raise
                # The listener aborts a connection whose proof it refused: UCX errors.
                raise PeerUnreachable(
                    f"UCX handshake with {address}: {type(exc).__name__}: {exc}",
                    f"UCX handshake with {address} failed",
                ) from exc
        await self._transfer(ep, address, req, sink, batch, deadline, False)

    async def _transfer(
        self,
        ep,
        address: str,
        req: peer_pb2.FetchRequest,
        sink: BatchSink,
        batch: int,
        deadline: float,
        reused: bool,
    ) -> None:
        io = self._pcfg.io_timeout_s
        control = control_buffer()  # chunk headers, one after another
        posted: list[Landing] = []  # batches whose payloads are on their way, oldest first
        ahead: list[Reservation] = []  # the first batch's slots, reserved during the request
        # Packed: the next chunk's payload receive, posted right behind its header's
        # (_expect); at most one, taken by the header that comes, settled in `finally`
        early: list[_EarlyPayload] = []
        # Direct reads: each chunk's release message, sent as soon as its read is over and
        # the chunks before it were released (in chunk order, whatever the pace of storing:
        # a server with fewer staging sets waits for a release before its next header);
        # the last one goes before the acknowledgement
        releases: list[asyncio.Future] = []
        clean = abandoned = False

        def reserve_first() -> None:
            res = self._reserve_ahead(sink, min(batch, len(sink.ids) - sink.expect))
            if res is not None:
                ahead.append(res)

        def expect() -> asyncio.Future:
            return self._expect(ep, control, sink.block_bytes, batch, early)

        try:
            try:
                raw = await _ask(ep, req, expect, deadline, io, reserve_first)
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
                # this chunk's payload receive, if posted early: stays in `early` (settled
                # by `finally`) until a Landing takes it or it is taken empty
                payload = early[0] if early else None
                if hdr.direct_pid:
                    self._direct.check(hdr, req, sink.block_bytes)
                if hdr.count and hdr.direct_pid:
                    take = ahead.pop() if ahead else None
                    if not await self._direct.post(
                        ep, address, sink, posted, first, hdr, take, releases
                    ):
                        abandoned = True  # the peer waits for a release that never comes
                        break
                elif hdr.count:
                    runs = None if packed(sink.block_bytes) else check_runs(hdr.runs, hdr.count)
                    # _post owns the slots reserved ahead from here; unused, `finally` frees them
                    take = ahead.pop() if ahead else None
                    if not await self._post(
                        ep, sink, posted, first, hdr, batch, runs, take, payload
                    ):
                        abandoned = True  # payloads of this batch come with no receive posted
                        break
                    early.clear()
                elif payload is not None:
                    await self._skip(early.pop(), deadline, io)
                if len(posted) > self._pcfg.staging_sets - 2 and not await self._store_oldest(
                    posted, sink, deadline, io
                ):
                    break
                if sink.remote_done:
                    break
                raw = await within(expect(), deadline, io, "chunk header")
            while posted and await self._store_oldest(posted, sink, deadline, io):
                pass
            if sink.remote_done and not posted and not abandoned:
                # The answer is complete: acknowledge it without waiting (the connection goes
                # back to the idle set once the acknowledgement is out).
                self._spawn(self._acknowledge(ep, address, releases[-1] if releases else None))
                clean = True
                await sink.drain()
        except (PeerTransportError, PeerRefused, _StaleConnection):
            raise
        except Exception as exc:  # ucxx errors: reset by peer, truncation, closed endpoint
            raise PeerTransportError(
                f"UCX transfer from {address}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            for res in ahead:  # no header came to take them: nothing wrote into them
                self._store.abort(res)
            if not clean:
                ep.abort()  # completes (cancels) the receives still posted into `posted`
            await self._settle(posted)
            for payload in early:  # the abort completed (cancelled) it
                await self._settle_early(payload)
            await sink.drain_quietly()

    def _expect(
        self, ep, control, block_bytes: int, batch: int, early: list["_EarlyPayload"]
    ) -> asyncio.Future:
        """Post the receive of the next chunk header into `control`; its future. Packed,
        also the receive of that chunk's payload message right behind it, into a staging
        set of `batch` blocks, added to `early`: UCX matches messages of one tag in the
        order their receives were posted, so the payload lands as soon as it comes instead
        of waiting, unexpected, for the event loop to read the header and post a receive
        (a round of thread hand-offs: UCX progress thread, ucxx notifier, event loop)."""
        header = asyncio.ensure_future(recv_control(ep, control))
        if packed(block_bytes):
            scratch = self._staging.take(batch, block_bytes)
            recv = asyncio.ensure_future(ep.recv(contiguous(scratch, batch)))
            early.append(_EarlyPayload(recv, scratch))
        return header

    async def _skip(self, payload: "_EarlyPayload", deadline: float, io: float) -> None:
        """A packed chunk of no blocks still brings its (empty) payload message: take it
        (on failure the abort settles it, and its set is dropped)."""
        await within(asyncio.shield(payload.recv), deadline, io, "empty payload")
        self._staging.give(payload.scratch)

    async def _settle_early(self, payload: "_EarlyPayload") -> None:
        """After an abort: give the payload's staging set back once its receive completed
        (else drop it: UCX could still write into it)."""
        if not payload.recv.done():
            await asyncio.wait([payload.recv], timeout=1.0)
        if payload.recv.done():
            if not payload.recv.cancelled():
                payload.recv.exception()  # retrieved: no "never retrieved" warning
            self._staging.give(payload.scratch)

    async def _acknowledge(self, ep, address: str, after: asyncio.Future | None = None) -> None:
        """Acknowledge a complete answer (once `after`, the last release message, is out),
        then keep the connection for the next request to this peer (it waits for that on
        it); a connection whose acknowledgement fails is dropped."""
        if after is not None and not await after:
            log.debug("a release to %s failed; dropping the connection", address)
            ep.abort()
            return
        try:
            await within(
                ep.send(np.frombuffer(ACK, dtype=np.uint8)),
                time.monotonic() + self._pcfg.io_timeout_s,
                self._pcfg.io_timeout_s,
                "acknowledgement",
            )
        except Exception as exc:
            log.debug("acknowledging to %s failed (%s); dropping the connection", address, exc)
            ep.abort()
            return
        self._checkin(address, ep)

    async def _post(
        self,
        ep,
        sink: BatchSink,
        posted: list[Landing],
        first: int,
        hdr: peer_pb2.FetchChunk,
        batch: int,
        runs: list[int] | None,
        ahead: Reservation | None,
        payload: "_EarlyPayload | None" = None,
    ) -> bool:
        """Reserve the batch's destination (or take `ahead`, slots reserved for it before its
        header came) and post its receives, one per message of `runs` (large blocks), or
        take `payload`, the packed batch's receive posted with its header's; False (the
        sink knows why) when not one block of it can be stored here."""
        after = posted[-1].res if posted else None
        args = (first, hdr.count, list(hdr.checksums), after, batch, runs, ahead, payload)
        try:
            if ahead is None and self._store.pool.free_slots < hdr.count:
                # making room may write NVMe: off the event loop (and handed back if the
                # Prefetch is cancelled meanwhile)
                ld = await in_thread_owned(
                    self._destination, lambda ld: self._free(ld, payload), sink, *args
                )
            else:
                ld = self._destination(sink, *args)
        except errors.KvError as exc:
            sink.stop_reason = sink.stop_reason or f"not stored here: {exc}"
            return False
        if ld.res is not None and not ld.res.plan:
            sink.stop_reason = sink.stop_reason or f"not stored here: {ld.res.reason}"
            self._free(ld, payload)
            return False
        # return_exceptions: the future completes only once every receive has, so nothing
        # writes into the slots or buffers any more when it is done (see _settle).
        if payload is not None:
            recvs = [payload.recv]
        else:
            recvs = [asyncio.ensure_future(ep.recv(m)) for m in ld.msgs]
        ld.recvs = asyncio.ensure_future(asyncio.gather(*recvs, return_exceptions=True))
        if ld.res is not None and not ld.pack:  # in place: hash each message as it lands
            size = sink.block_bytes
            ld.digests, i, slots = [], 0, ld.res.views
            for recv, msg in zip(recvs, ld.msgs):
                views = slots[i : i + msg.nbytes // size]
                if not views:
                    break
                ld.digests.append(
                    asyncio.ensure_future(_digest_landed(recv, views, self._store.pool.digests))
                )
                i += len(views)
        posted.append(ld)
        return True

    async def _store_oldest(
        self, posted: list[Landing], sink: BatchSink, deadline: float, io: float
    ) -> bool:
        """Wait for the oldest posted batch to land, then hand it to the sink; False when
        the transfer stops (then its slots go back: the sink did not take them)."""
        ld = posted[0]
        if ld.recvs is None:  # _post sets it before posting the batch
            raise PeerTransportError("a batch was posted without its receives")
        results = await within(asyncio.shield(ld.recvs), deadline, io, f"{ld.count} payloads")
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise PeerTransportError(f"receiving a payload: {type(failed).__name__}: {failed}")
        posted.pop(0)
        try:
            ok = await sink.land(ld)
        except BaseException:  # not handed to a commit (land hands it over last): its
            if ld.res is not None:  # slots, and what the store holds for it, go back
                self._store.abort(ld.res)
            raise
        if not ok and ld.res is not None:  # an earlier batch stopped the transfer: not
            self._store.abort(ld.res)  # committed, and nothing writes into it any more
        if ld.res is not None:  # its scratch only took payloads that are not stored
            self._give_back(ld)  # (packed, land() took the set: the sink gives it back)
        return ok

    async def _settle(self, posted: list[Landing]) -> None:
        """After a failed transfer: free the slots of batches not stored, once their receives
        completed (the endpoint abort completes them). A receive UCX never completes keeps
        its slots reserved for good rather than let a late write land in a reused slot."""
        for ld in posted:
            if ld.recvs is not None and not ld.recvs.done():
                await asyncio.wait([ld.recvs], timeout=1.0)
            if ld.recvs is None or ld.recvs.done():
                if ld.res is not None:
                    self._store.abort(ld.res)
                self._give_back(ld)
            else:
                log.error(
                    "a UCX receive did not complete after abort: %d slots stay reserved "
                    "until it does",
                    len(ld.res) if ld.res is not None else 0,
                )
                if ld.res is not None:
                    ld.recvs.add_done_callback(self._abort_when_done(ld.res))
        posted.clear()

    def _free(self, ld: Landing, payload: "_EarlyPayload | None") -> None:
        """Free a destination nothing was posted into (no slot reserved, or the transfer
        was cancelled while it was made). The early payload's staging set is the caller's
        to settle: it is still being received into."""
        if ld.res is not None:
            self._store.abort(ld.res)
        if payload is not None:
            ld.scratch = []
        self._give_back(ld)

    def _abort_when_done(self, res: Reservation) -> Callable[[asyncio.Future], None]:
        def abort(_done: asyncio.Future) -> None:
            self._store.abort(res)

        return abort

    def _give_back(self, ld: Landing) -> None:
        if ld.scratch:
            self._staging.give(ld.scratch)
            ld.scratch = []

    async def _connect(self, address: str, deadline: float):
        host, port = split_host_port(address)
        timeout = self._pcfg.connect_timeout_s
        try:
            if not is_ip(host):
                infos = await asyncio.get_running_loop().getaddrinfo(host, port)
                host = str(infos[0][4][0])
            return await within(
                connect_endpoint(self._ucx, host, port, timeout),
                deadline,
                timeout,
                f"UCX connect to {address}",
            )
        except PeerTransportError as exc:
            # A peer gone or slow times out too; the notifier's state tells those apart
            # from this process's UCX no longer completing anything.
            raise PeerTransportError(f"{exc} (notifier {notifier_state(self._ucx)})") from exc
        except Exception as exc:
            raise PeerUnreachable(
                f"UCX connect to {address}: {type(exc).__name__}: {exc}",
                f"UCX connect to {address} failed",
            ) from exc

    def _reserve_ahead(self, sink: BatchSink, count: int) -> Reservation | None:
        """Slots for the next `count` blocks, reserved while the request is on its way so
        that the first header finds them ready (_destination() takes them, trimmed to what
        the header announces; the caller aborts them when no header comes). None when the
        store does not take payloads in place or the pool lacks free slots (making room
        may write NVMe: not on the event loop), or when the reservation fails (the one
        made for the header then says why)."""
        store = self._store
        if not count or not self._in_place or store.pool.free_slots < count:
            return None
        try:
            return sink.reserve(sink.expect, count, None)
        except errors.KvError:
            return None

    def _destination(
        self,
        sink: BatchSink,
        first: int,
        count: int,
        checksums: list[int],
        after: Reservation | None,
        batch: int,
        runs: list[int] | None,
        ahead: Reservation | None = None,
        payload: "_EarlyPayload | None" = None,
    ) -> Landing:
        """Reserve pool slots for blocks first..first+count (a Landing with no slots when
        the store cannot take them in place; `reason` of a short reservation stops the
        transfer after this batch), or take `ahead` (_reserve_ahead) for them. `runs`:
        blocks per payload message (large blocks). When the slots reserved for a run do
        not lie back to back, the batch lands in a staging set instead and the verifying
        pass copies it into the slots. Worker thread when it may have to evict."""
        store = self._store
        res = None
        if ahead is not None:
            store.trim(ahead, count)
            res = ahead
        elif self._in_place:
            res = sink.reserve(first, count, after)
        try:
            return self._land_into(sink, first, count, checksums, res, batch, runs, payload)
        except BaseException:
            if res is not None:  # nothing was posted into it
                store.abort(res)
            raise

    def _land_into(
        self,
        sink: BatchSink,
        first: int,
        count: int,
        checksums: list[int],
        res: Reservation | None,
        batch: int,
        runs: list[int] | None,
        payload: "_EarlyPayload | None",
    ) -> Landing:
        """_destination's Landing over the slots of `res` (or staging sets)."""
        size = sink.block_bytes
        if packed(size):  # a whole set (not `count` buffers): sets are reused across batches
            scratch = payload.scratch if payload is not None else self._staging.take(batch, size)
            return Landing(
                first, count, checksums, res, scratch, [contiguous(scratch, count)], pack=True
            )
        if runs is None:  # only packed batches travel without runs
            raise PeerTransportError("a chunk of large blocks came without its runs")
        left = count - (len(res) if res is not None else 0)
        scratch = self._staging.take(left, size) if left else []
        msgs = spans((res.views if res is not None else []) + scratch, runs, size)
        if msgs is not None:
            return Landing(first, count, checksums, res, scratch, msgs)
        if scratch:
            self._staging.give(scratch)
        scratch = self._staging.take(batch, size)  # a set is contiguous
        self._counters.add("peer_blocks_staged", count)
        staged = spans(scratch[:count], runs, size)
        if staged is None:  # StagingPool.take carves a set from one arena: never
            self._staging.give(scratch)
            raise PeerTransportError("a staging set does not lie back to back")
        return Landing(first, count, checksums, res, scratch, staged, pack=True)


@dataclass(slots=True, eq=False)
class _EarlyPayload:
    """The receive of a packed chunk's payload message, posted before its header came
    (UcxFetcher._expect), and the staging set of `batch` blocks it lands in."""

    recv: asyncio.Future
    scratch: list


class _StaleConnection(Exception):
    """A kept connection failed before the peer answered: retry on a fresh one."""


async def _ask(
    ep,
    req: peer_pb2.FetchRequest,
    expect: Callable[[], asyncio.Future],
    deadline: float,
    io: float,
    meanwhile=None,
):
    """Send the request and receive the first chunk header (`expect()` posts that
    receive), the receive posted without waiting for the sends to complete (one
    completion wait less); a failed send ends the wait at once. `meanwhile()` runs once
    both are posted, while the peer works."""
    sending = post_control(ep, req.SerializeToString())
    answer = expect()
    try:
        if meanwhile is not None:
            await asyncio.sleep(0)  # the send and the receive reach UCX first
            meanwhile()
        await within(
            asyncio.wait({sending, answer}, return_when=asyncio.FIRST_EXCEPTION),
            deadline,
            io,
            "first chunk header",
        )
        failed = sending.exception() if sending.done() else None
        if failed is not None:
            raise failed
        return answer.result()
    finally:
        for fut in (sending, answer):
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: no "never retrieved" warning


async def _digest_landed(recv: asyncio.Future, views: list, digests) -> list[int] | None:
    """XXH64 of each of `views` (pool slots) once `recv` (the message filling them)
    landed, in a worker thread: `digests` is the pool's (on the host, or in device memory
    for a device pool); None when the receive failed (the transfer fails on its own)."""
    try:
        await recv
    except Exception:
        return None
    return await asyncio.to_thread(digests, views)
