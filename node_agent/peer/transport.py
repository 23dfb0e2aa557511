"""The interface every peer transport implements (UCX: node_agent/peer/ucx/transport.py,
gRPC: node_agent/peer/grpc_transport.py). The Prefetcher holds transports in order of
preference and tries the next one for whatever the previous one left; it never asks which
transport it holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvstore.v1 import peer_pb2
from node_agent.peer.sink import BatchSink


@dataclass(frozen=True, slots=True)
class PeerRef:
    """Where a peer can be reached; '' where it cannot (on that transport)."""

    grpc_address: str  # host:port of the peer's gRPC server
    ucx_address: str  # host:port of the peer's UCX listener


class Transport(Protocol):
    """The fetching side of one way to move blocks (the serving side is the transport's
    own: a UCX listener, a gRPC method)."""

    # Names the transport in PrefetchResponse.transport and in counters
    # (peer_fetch_<name>, peer_<name>_failures).
    name: str

    def address_of(self, peer: PeerRef) -> str:
        """The peer's address on this transport; '' when this transport cannot reach it
        (the peer has none, or the transport is down here)."""

    def chunk_blocks(self, block_bytes: int, batch: int) -> int:
        """Blocks per chunk to ask for, given the preferred `batch` (message limits)."""

    async def fetch(
        self,
        address: str,
        req: peer_pb2.FetchRequest,
        sink: BatchSink,
        batch: int,
        deadline: float,
        authorization: str,
    ) -> None:
        """Pull `req` (authorization not filled in) from `address` into `sink`,
        forwarding the caller's `authorization`. Raises PeerTransportError on transport
        trouble (the next transport may work), PeerRefused when the peer declines."""

    async def close(self) -> None:
        """Drop connections and listeners; the transport is not used again."""
