"""Transport "ucx": this agent's UCX listener (serving its blocks, UcxServer) and the
fetcher that pulls from other agents' listeners (UcxFetcher), brought up together at
start. The protocol: node_agent/peer/__init__.py."""

from __future__ import annotations

import logging
import os

from kvstore.config import PeerConfig, TLSConfig
from kvstore.store import BlockStore
from kvstore.v1 import peer_pb2
from node_agent.peer.counters import Counters
from node_agent.peer.errors import PeerTransportError
from node_agent.peer.serve import BlockSource
from node_agent.peer.sink import BatchSink
from node_agent.peer.staging import StagingPool
from node_agent.peer.transport import PeerRef
from node_agent.peer.ucx.auth import UcxAuth
from node_agent.peer.ucx import direct
from node_agent.peer.ucx.bind import InterfaceGuard, net_devices
from node_agent.peer.ucx.fetch import UcxFetcher
from node_agent.peer.ucx.serve import UcxServer
from node_agent.peer.ucx.wire import init_ucx, ucx_cuda_support
from node_agent.tokens import TokenTable

log = logging.getLogger("kvstore.agent.peer")


class UcxTransport:
    """Down until start() brings UCX up (and down again when that fails: peers then
    reach this agent, and it reaches them, over the next transport)."""

    name = "ucx"

    def __init__(
        self,
        store: BlockStore,
        source: BlockSource,
        staging: StagingPool,
        tokens: TokenTable,
        pcfg: PeerConfig,
        counters: Counters,
        port: int,
        tls: TLSConfig | None = None,
        bind_host: str = "",
    ) -> None:
        """`bind_host`: the agent's configured listen host; connections that arrive on
        another interface are refused (ucxx binds every one: node_agent/peer/ucx/bind.py)."""
        self._bind_host = bind_host
        # With mTLS configured, UCX connections are authenticated with the same files.
        self._auth = UcxAuth(tls) if tls is not None and tls.enabled else None
        self._store = store
        self._source = source
        self._staging = staging
        self._tokens = tokens
        self._pcfg = pcfg
        self._counters = counters
        self._port = port  # listener port; 0 picks a free one
        self.address = ""  # host:port of our listener; '' while down
        # Payloads move straight between pool slots (borrowed and reserved views), else
        # through host staging copies: a GPU pool needs the device hash (DevicePool.in_place)
        # and a UCX built with CUDA.
        self.in_place = False
        self._ucx = None  # the ucxx module once initialised
        self._listener = None
        self._server: UcxServer | None = None
        self._fetcher: UcxFetcher | None = None

    async def start(self, host: str) -> None:
        """Initialise ucxx (inside the running loop) and listen; on failure stay down."""
        ucx = None
        try:
            devices = net_devices(self._pcfg.ucx_net_devices, self._bind_host)
            ucx = init_ucx(self._pcfg.shared_memory, devices)
            self.in_place = self._decide_in_place(ucx_cuda_support(ucx))
            same_host = self._same_host()
            server = UcxServer(
                self._source,
                self._tokens,
                self._pcfg,
                self._counters,
                borrow=self.in_place,
                auth=self._auth,
                address=lambda: self.address,
                same_host=same_host,
                share=self._store.pool.share,
            )
            guard = InterfaceGuard(
                self._bind_host, lambda: self._counters.add("peer_ucx_wrong_interface")
            )
            listener = ucx.create_listener(
                guard.wrap(server.handle), port=self._port, endpoint_error_handling=True
            )
        except Exception as exc:  # import failure, no transport, port taken
            taken = ""  # ucxx says "Device is busy" for a port another socket holds
            if self._port and "Busy" in type(exc).__name__:
                taken = f"; is peer_port {self._port} in use by another process?"
            log.error(
                "UCX unavailable (%s: %s%s): peers use the gRPC fallback",
                type(exc).__name__,
                exc,
                taken,
            )
            if ucx is not None:  # its notifier thread would keep the process from exiting
                try:
                    ucx.stop_notifier_thread()
                except Exception:  # noqa: BLE001 - down either way; the log says why
                    log.exception("stopping ucxx's notifier thread failed")
            return
        self._ucx, self._server, self._listener = ucx, server, listener
        # direct reads land only in reserved slots of host memory: a GPU pool, or one that
        # takes payloads through staging, fetches by UCX messages
        self._fetcher = UcxFetcher(
            ucx,
            self._store,
            self._staging,
            self._pcfg,
            self._counters,
            self.in_place,
            self._auth,
            same_host=same_host if self.in_place and not self._store.pool.is_cuda else "",
        )
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        self.address = f"{host}:{listener.port}"
        log.info(
            "UCX peer listener on %s (ucx %s); UCX transports on %s",
            self.address,
            ucx.__ucx_version__,
            os.environ.get("UCX_NET_DEVICES") or "every network device",
        )
        if self._store.pool.is_cuda:
            why = self._store.pool.why_not_in_place or (
                "UCX has no CUDA support" if self._pcfg.in_place else "peer.in_place is off"
            )
            log.info(
                "GPU pool: peer payloads %s",
                "move straight from and into GPU memory "
                "(UCX registers it; verified there by the device hash)"
                if self.in_place
                else f"are staged in host memory ({why})",
            )

    def _same_host(self) -> str:
        """This agent's host identity for direct reads with agents of the same host, or ""
        when they are off (peer.same_host_reads, or peer.shared_memory: payloads kept on
        TCP), or cannot be had here."""
        if not (self._pcfg.same_host_reads and self._pcfg.shared_memory):
            return ""
        return direct.host_identity()

    def _decide_in_place(self, ucx_cuda: bool) -> bool:
        """Whether payloads move straight between pool slots: configured so, and the pool
        verifies in place; a GPU pool also needs a UCX that moves CUDA memory."""
        return (
            self._pcfg.in_place
            and self._store.supports_in_place
            and (ucx_cuda or not self._store.pool.is_cuda)
        )

    def address_of(self, peer: PeerRef) -> str:
        return peer.ucx_address if self._fetcher is not None else ""

    def chunk_blocks(self, block_bytes: int, batch: int) -> int:
        return batch

    async def fetch(
        self,
        address: str,
        req: peer_pb2.FetchRequest,
        sink: BatchSink,
        batch: int,
        deadline: float,
        authorization: str,
    ) -> None:
        """The caller's token travels in the request: the peer's UcxServer checks it."""
        if self._fetcher is None:  # address_of gave no address: not called
            raise PeerTransportError("UCX is not up on this agent")
        req.authorization = authorization
        await self._fetcher.fetch(address, req, sink, batch, deadline)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._fetcher is not None:
            self._fetcher.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._ucx is not None:
            # The notifier thread would keep the process from exiting.
            self._ucx.stop_notifier_thread()
            self._ucx = None
        self._fetcher = self._server = None
        self.address = ""
