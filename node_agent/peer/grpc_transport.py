"""gRPC side of peer transfer: the Peer service (FetchBlocks, the fallback transport, and
Prefetch, the entry point) and the client that pulls over FetchBlocks. The protocol and
the UCX fast path are described in node_agent/peer/serve.py."""
from __future__ import annotations

import logging
import time
from contextlib import aclosing
from typing import TYPE_CHECKING

import grpc

from kvstore.telemetry import trace_metadata
from kvstore.v1 import peer_pb2, peer_pb2_grpc
from node_agent.interceptors import current_tenant
from node_agent.peer.staging import REFUSALS, PeerRefused, PeerTransportError, within

if TYPE_CHECKING:
    from node_agent.peer.serve import PeerService
    from node_agent.peer.ucx.fetch import BatchSink

log = logging.getLogger("kvstore.agent.peer")


class PeerServicer(peer_pb2_grpc.PeerServicer):
    """Thin: validation and the work live in PeerService."""

    def __init__(self, svc: "PeerService") -> None:
        self.svc = svc

    async def FetchBlocks(self, request, context):
        st, ids, parent, batch = await self.svc.source(request, current_tenant.get())
        size = st.spec.block_bytes
        # Keep every chunk well inside the message size limit.
        batch = max(1, min(batch, (self.svc.cfg.max_message_bytes // 2) // size))
        chunks = self._chunks(st, request.ns.generation, ids, parent, batch)
        async with self.svc.serve_slots, aclosing(chunks) as it:
            async for chunk in it:
                yield chunk

    async def _chunks(self, st, generation: int, ids: list[bytes], parent: bytes,
                      batch: int):
        size = st.spec.block_bytes
        lease = self.svc.staging.lease(2, batch, size)  # payloads are copied out at once
        # gRPC payloads go through host memory anyway: GPU slots are copied out in a
        # worker thread (read_batches), never lent to this event loop to copy from
        batches = self.svc.read_batches(st, generation, ids, parent, batch, lease,
                                        borrow=self.svc.in_place and
                                        not self.svc.store.pool.is_cuda)
        try:
            async with aclosing(batches) as it:
                async for rb in it:
                    try:
                        chunk = peer_pb2.FetchChunk(
                            first_index=rb.first, count=len(rb.served),
                            checksums=[s.checksum for s in rb.served],
                            data=[rb.bufs[i][:size].tobytes() for i in range(len(rb.served))],
                            done=rb.last)
                    finally:
                        self.svc.done_with(rb)
                    yield chunk
        finally:
            lease.release()

    async def Prefetch(self, request, context):
        md = dict(context.invocation_metadata() or ())
        return await self.svc.prefetch(request, current_tenant.get(),
                                       md.get("authorization", ""), context.time_remaining())


class GrpcFetcher:
    """Pulls blocks over Peer.FetchBlocks; one channel per peer address, kept open."""

    def __init__(self, max_message_bytes: int) -> None:
        self._opts = [("grpc.max_send_message_length", max_message_bytes),
                      ("grpc.max_receive_message_length", max_message_bytes)]
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> peer_pb2_grpc.PeerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address, options=self._opts)
        return peer_pb2_grpc.PeerStub(ch)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def fetch(self, address: str, req: peer_pb2.FetchRequest, sink: "BatchSink",
                    batch: int, deadline: float, io_timeout: float,
                    authorization: str) -> None:
        """Pull `req` into `sink`; PeerTransportError / PeerRefused as the UCX path."""
        md = (("authorization", authorization),) if authorization else None
        md = trace_metadata(md)  # the peer's FetchBlocks span joins this Prefetch's trace
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerTransportError("deadline passed before the gRPC fallback")
        call = self._stub(address).FetchBlocks(req, timeout=left, metadata=md)
        try:
            while not sink.remote_done:
                msg = await within(call.read(), deadline, io_timeout, "gRPC chunk")
                if msg is grpc.aio.EOF:
                    raise PeerTransportError(f"{address} ended the stream early")
                first = sink.check(msg, batch)
                if len(msg.data) != msg.count:
                    raise PeerTransportError(f"{address} sent {len(msg.data)} payloads for "
                                             f"a chunk of {msg.count}")
                sink.remote_done = msg.done
                if msg.count and not await sink.push(first, list(msg.data),
                                                     list(msg.checksums)):
                    break
            await sink.drain()
        except grpc.aio.AioRpcError as exc:
            cls = PeerRefused if exc.code().name in REFUSALS else PeerTransportError
            raise cls(f"{address}: {exc.code().name} {exc.details()}") from None
        finally:
            call.cancel()
            await sink.drain_quietly()
