"""The serving side of the UCX transport: one connection of a fetching agent, its
FetchRequests answered one after another from the BlockSource. The protocol:
node_agent/peer/__init__.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from contextlib import aclosing

import numpy as np

from kvstore import errors
from kvstore.auth import AGENT_TENANT
from kvstore.config import PeerConfig
from kvstore.tiers.pool import PoolShare
from kvstore.v1 import peer_pb2
from node_agent.peer.counters import Counters
from node_agent.peer.errors import PeerTransportError, within
from node_agent.peer.serve import BlockSource, ReadBatch, ServeRequest
from node_agent.peer.staging import runs_of, spans
from node_agent.peer.ucx import direct
from node_agent.peer.ucx.auth import UcxAuth, accept_handshake
from node_agent.peer.ucx.wire import (
    ACK,
    MESSAGE_BYTES,
    control_buffer,
    packed,
    post_control,
    recv_control,
    tapered,
)
from node_agent.tokens import TokenTable

log = logging.getLogger("kvstore.agent.peer")
_EMPTY = np.empty(0, dtype=np.uint8)  # the payload message of a packed chunk of no blocks
# After a refusal: how long the connection stays for the fetcher to close its end (it
# does once it has read the refusal; a stranger that does not is cut off then)
REFUSED_CLOSE_S = 1.0


class UcxServer:
    """Answers the connections a UCX listener accepts (handle). The UCX path bypasses
    the gRPC edge, so the token the fetching agent forwards is checked here (`tokens`).
    `borrow`: payloads are sent straight from pool slots (UcxTransport.in_place).
    `same_host`: this agent's direct.host_identity; a fetcher that offers the same one
    reads large blocks from this process's memory itself (direct reads); "": never."""

    def __init__(
        self,
        source: BlockSource,
        tokens: TokenTable,
        pcfg: PeerConfig,
        counters: Counters,
        borrow: bool,
        auth: UcxAuth | None = None,
        address: Callable[[], str] = lambda: "",
        same_host: str = "",
        share: PoolShare | None = None,
    ) -> None:
        """`auth`: every connection must pass the certificate handshake first
        (node_agent/peer/ucx/auth.py), made for the listener's `address()`. `share`: the
        pool's memfd, named to direct readers of blocks that lie in it (mapped.py)."""
        self._share = share
        self._auth = auth
        self._same_host = same_host
        self._address = address
        self._source = source
        self._tokens = tokens
        # Agents have a credential of their own: direct reads for it only (the table is
        # built once per process)
        self._direct_for_agents_only = tokens.knows(AGENT_TENANT)
        self._pcfg = pcfg
        self._counters = counters
        self._borrow = borrow
        self._serving: set = set()  # endpoints being served, aborted at close

    def close(self) -> None:
        for ep in list(self._serving):
            ep.abort()
        self._serving.clear()

    async def handle(self, ep) -> None:
        """One UCX connection: FetchRequests one after another, each answered with its
        chunks and closed by the fetcher's acknowledgement. The fetcher keeps the
        connection for its next request (a connect costs tens of ms); it ends when the
        fetcher goes, or after idle_endpoint_s without a request."""
        self._serving.add(ep)
        served = 0
        control = control_buffer()
        far = time.monotonic() + 1e9
        io = self._pcfg.io_timeout_s
        try:
            if self._auth is not None:
                try:
                    await accept_handshake(ep, self._auth, self._address(), control, io)
                except PeerTransportError:
                    self._counters.add("peer_ucx_auth_refused")
                    raise
            while True:
                try:
                    raw = await within(
                        recv_control(ep, control),
                        far,
                        self._pcfg.idle_endpoint_s if served else io,
                        "request",
                    )
                except Exception as exc:
                    if served:  # the fetcher closed its end between requests: normal
                        log.debug("UCX peer connection ends after %d requests", served)
                        return
                    raise PeerTransportError(f"no request: {exc}") from exc
                if not await self._serve_request(ep, peer_pb2.FetchRequest.FromString(raw)):
                    # Refused: the fetcher closes its end once it has read why (at once),
                    # and a caller without a valid token keeps no connection here: a
                    # moment for the refusal to arrive, holding nothing of the request
                    raw = b""
                    with contextlib.suppress(Exception):
                        await within(
                            ep.recv(np.empty(len(ACK), np.uint8)), far, REFUSED_CLOSE_S, "close"
                        )
                    return
                ack = np.empty(len(ACK), dtype=np.uint8)
                await within(ep.recv(ack), far, io, "acknowledgement")
                served += 1
        except Exception as exc:  # the fetching side turns this into a miss or a fallback
            log.warning(
                "UCX peer transfer (serving side) ended early: %s: %s", type(exc).__name__, exc
            )
        finally:
            self._serving.discard(ep)
            ep.abort()

    async def _serve_request(self, ep, req: peer_pb2.FetchRequest) -> bool:
        """Answer one request; False when it was refused (the connection ends)."""
        far = time.monotonic() + 1e9
        try:
            tenant = self._tokens.tenant(req.authorization)
            src = await self._source.request(req, tenant)
        except errors.KvError as exc:
            err = peer_pb2.FetchChunk(done=True, error=str(exc), error_code=exc.code)
            await within(
                post_control(ep, err.SerializeToString()), far, self._pcfg.io_timeout_s, "refusal"
            )
            return False
        same_host = bool(self._same_host) and req.same_host == self._same_host
        if same_host and not self._may_read_directly(tenant):
            same_host = False
            self._counters.add("peer_direct_withheld")
        async with self._source.slots.hold(src.share):
            await self._send_batches(ep, src, same_host)
        return True

    def _may_read_directly(self, tenant: str | None) -> bool:
        """Direct reads name this process, its pool's descriptor and where each block
        lies in memory: where agents have a credential of their own, only a caller
        presenting it learns them (a same-host tenant's token pull gets the payloads as
        UCX messages, counted in peer_direct_withheld), or one without a token where
        allow_unauthenticated lets such a caller read everything anyway; elsewhere (no
        agent identity configured) every caller, as before."""
        return tenant in (None, AGENT_TENANT) or not self._direct_for_agents_only

    async def _send_batches(self, ep, src: ServeRequest, same_host: bool = False) -> None:
        """Header then payloads per batch, all posted at once (one completion wait per
        batch), announcing the next batch before the payloads of this one have landed; at
        most staging_sets - 2 batches stay in flight when read_batches reads ahead, which
        keeps its buffer reuse safe. `same_host`: the fetcher reads large blocks itself
        (direct reads): a batch is done with once its release message came."""
        far = time.monotonic() + 1e9
        io = self._pcfg.io_timeout_s
        size = src.st.spec.block_bytes
        pack = packed(size)
        lease = self._source.lease(self._pcfg.staging_sets, src.batch, size)
        inflight: list[tuple[asyncio.Future, ReadBatch]] = []
        try:
            batches = self._source.read_batches(src, lease, pack, borrow=self._borrow)
            async with aclosing(batches) as it:
                async for rb in it:
                    sends = self._announce(ep, rb, size, pack, same_host)
                    inflight.append((asyncio.gather(*sends), rb))
                    while len(inflight) > self._pcfg.staging_sets - 2:
                        await self._sent(inflight, far, io)
                while inflight:
                    await self._sent(inflight, far, io)
        finally:
            if inflight:
                lease.clean = False
                for fut, rb in inflight:
                    fut.cancel()
                    fut.add_done_callback(_retrieved)  # a send failed: said above already
                    self._source.done_with(rb)
            lease.release()

    def _announce(
        self, ep, rb: ReadBatch, size: int, pack: bool, same_host: bool = False
    ) -> list[asyncio.Future]:
        """Post the header of `rb` and its payloads (packed: the batch as one message;
        else one per run of blocks back to back in memory); the sends' futures. Direct
        reads (`same_host`, large blocks in host memory): the header names where each
        block lies in this process, and the fetcher's release message for the batch
        stands for the payloads."""
        hdr = peer_pb2.FetchChunk(
            first_index=rb.first,
            count=len(rb.served),
            checksums=[s.checksum for s in rb.served],
            done=rb.last,
        )
        where = direct.addresses(rb.bufs[: len(rb.served)]) if same_host and not pack else None
        if where:
            hdr.direct_pid = os.getpid()
            hdr.addresses.extend(where)
            share = self._share
            if share is not None and all(
                share.base <= a and a + size <= share.base + share.size for a in where
            ):  # all in the pool (blocks read from NVMe lie in staging buffers)
                hdr.direct_fd, hdr.direct_base, hdr.direct_bytes = (
                    share.fd,
                    share.base,
                    share.size,
                )
            self._counters.add("peer_direct_chunks")
            return [post_control(ep, hdr.SerializeToString()), asyncio.ensure_future(_released(ep))]
        payloads = []
        if pack:  # the fetcher posts this receive before the header came: always one
            payloads = [rb.bufs[0][: len(rb.served) * size] if rb.served else _EMPTY]
        elif rb.served:
            views = rb.bufs[: len(rb.served)]
            runs = runs_of(views, size, max(1, MESSAGE_BYTES // size))
            # the last chunk's last messages smaller: less left to verify at the end
            hdr.runs.extend(tapered(runs, size) if rb.last else runs)
            spanned = spans(views, list(hdr.runs), size)
            if spanned is None:  # runs_of just cut the runs where the views lie back to back
                raise PeerTransportError("served views do not lie back to back")
            payloads = spanned
        self._counters.add("peer_payload_messages", len(payloads))
        return [post_control(ep, hdr.SerializeToString())] + [
            asyncio.ensure_future(ep.send(p)) for p in payloads
        ]

    async def _sent(self, inflight: list, far: float, io: float) -> None:
        fut, rb = inflight[0]
        await within(asyncio.shield(fut), far, io, "header and payload sends")
        inflight.pop(0)
        self._source.done_with(rb)


def _retrieved(fut: asyncio.Future) -> None:
    """Mark a future's outcome as seen (asyncio logs an exception nobody retrieved, with
    its traceback, at ERROR)."""
    if not fut.cancelled():
        fut.exception()


async def _released(ep) -> None:
    """Receive the fetcher's release message of a batch it read directly."""
    buf = np.empty(len(direct.RELEASE), dtype=np.uint8)
    await ep.recv(buf)
    if buf.tobytes() != direct.RELEASE:
        raise PeerTransportError("peer sent something else than a release message")
