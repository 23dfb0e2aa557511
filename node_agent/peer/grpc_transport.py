"""The gRPC transport of peer transfer: the Peer service (FetchBlocks, the fallback
transport, and Prefetch, the entry point) and GrpcTransport, which pulls over FetchBlocks.
The protocol and the UCX fast path are described in node_agent/peer/__init__.py."""

from __future__ import annotations

import logging
import time
from contextlib import aclosing
from dataclasses import replace

import grpc

from kvstore.config import TLSConfig
from kvstore.telemetry import trace_metadata
from kvstore.tls import aio_channel
from kvstore.v1 import peer_pb2, peer_pb2_grpc
from node_agent.interceptors import current_tenant
from node_agent.peer.errors import PeerUnreachable, PeerRefused, PeerTransportError, within
from node_agent.peer.prefetch import Prefetcher
from node_agent.peer.serve import BlockSource, ServeRequest
from node_agent.peer.sink import BatchSink
from node_agent.peer.transport import PeerRef

log = logging.getLogger("kvstore.agent.peer")

GRPC_CHUNK_BYTES = 16 << 20  # payload per gRPC chunk: larger messages only add copy time
# gRPC status names that mean "the peer will not serve this", not "the transport broke".
REFUSALS = (
    "NOT_FOUND",
    "FAILED_PRECONDITION",
    "PERMISSION_DENIED",
    "INVALID_ARGUMENT",
    "UNAUTHENTICATED",
)


class PeerServicer(peer_pb2_grpc.PeerServicer):
    """Thin: validation and the work live in BlockSource (FetchBlocks) and Prefetcher.
    `borrow`: whether FetchBlocks may read payloads straight from pool slots (host
    pools that verify in place; gRPC payloads go through host memory anyway, so GPU
    slots are copied out in a worker thread, never lent to this event loop)."""

    def __init__(
        self, source: BlockSource, prefetcher: Prefetcher, max_message_bytes: int, borrow: bool
    ) -> None:
        self.source = source
        self.prefetcher = prefetcher
        self.max_message_bytes = max_message_bytes
        self.borrow = borrow

    async def FetchBlocks(self, request, context):
        src = await self.source.request(request, current_tenant.get())
        size = src.st.spec.block_bytes
        # Keep every chunk well inside the message size limit.
        batch = max(1, min(src.batch, (self.max_message_bytes // 2) // size))
        chunks = self._chunks(replace(src, batch=batch))
        async with self.source.slots.hold(src.share), aclosing(chunks) as it:
            async for chunk in it:
                yield chunk

    async def _chunks(self, src: ServeRequest):
        size = src.st.spec.block_bytes
        lease = self.source.lease(2, src.batch, size)  # payloads are copied out at once
        batches = self.source.read_batches(src, lease, borrow=self.borrow)
        try:
            async with aclosing(batches) as it:
                async for rb in it:
                    try:
                        chunk = peer_pb2.FetchChunk(
                            first_index=rb.first,
                            count=len(rb.served),
                            checksums=[s.checksum for s in rb.served],
                            data=[rb.bufs[i][:size].tobytes() for i in range(len(rb.served))],
                            done=rb.last,
                        )
                    finally:
                        self.source.done_with(rb)
                    yield chunk
        finally:
            lease.release()

    async def Prefetch(self, request, context):
        md = dict(context.invocation_metadata() or ())
        return await self.prefetcher.prefetch(
            request, current_tenant.get(), md.get("authorization", ""), context.time_remaining()
        )


class GrpcTransport:
    """Transport "grpc": pulls blocks over Peer.FetchBlocks, payloads inline in the
    chunks; one channel per peer address, opened on first use and kept."""

    name = "grpc"

    def __init__(
        self, max_message_bytes: int, io_timeout_s: float, tls: TLSConfig | None = None
    ) -> None:
        self._tls = tls  # mTLS to the peer's gRPC port (kvstore/tls.py)
        self._max_message_bytes = max_message_bytes
        self._io_timeout = io_timeout_s
        self._opts = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._channels: dict[str, grpc.aio.Channel] = {}

    def address_of(self, peer: PeerRef) -> str:
        return peer.grpc_address

    def chunk_blocks(self, block_bytes: int, batch: int) -> int:
        """At most GRPC_CHUNK_BYTES per chunk, well inside the message size limit."""
        return max(
            1,
            min(
                batch,
                GRPC_CHUNK_BYTES // block_bytes,
                (self._max_message_bytes // 2) // block_bytes,
            ),
        )

    def _stub(self, address: str) -> peer_pb2_grpc.PeerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = aio_channel(address, self._tls, self._opts)
        return peer_pb2_grpc.PeerStub(ch)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def fetch(
        self,
        address: str,
        req: peer_pb2.FetchRequest,
        sink: BatchSink,
        batch: int,
        deadline: float,
        authorization: str,
    ) -> None:
        """Pull `req` into `sink`, the caller's token in the call's metadata (the peer's
        gRPC edge checks it); PeerTransportError / PeerRefused as the Transport says."""
        md = (("authorization", authorization),) if authorization else None
        md = trace_metadata(md)  # the peer's FetchBlocks span joins this Prefetch's trace
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerTransportError("deadline passed before the gRPC fallback")
        call = self._stub(address).FetchBlocks(req, timeout=left, metadata=md)
        try:
            while not sink.remote_done:
                msg = await within(call.read(), deadline, self._io_timeout, "gRPC chunk")
                if msg is grpc.aio.EOF:
                    raise PeerTransportError(f"{address} ended the stream early")
                first = sink.check(msg, batch)
                if len(msg.data) != msg.count:
                    raise PeerTransportError(
                        f"{address} sent {len(msg.data)} payloads for a chunk of {msg.count}"
                    )
                sink.remote_done = msg.done
                if msg.count and not await sink.push(first, list(msg.data), list(msg.checksums)):
                    break
            await sink.drain()
        except grpc.aio.AioRpcError as exc:
            said = f"{address}: {exc.code().name} {exc.details()}"
            if exc.code().name in REFUSALS:  # a kvstore peer's own answer
                raise PeerRefused(said) from None
            raise PeerUnreachable(said, f"{address}: {exc.code().name}") from None
        finally:
            call.cancel()
            await sink.drain_quietly()
