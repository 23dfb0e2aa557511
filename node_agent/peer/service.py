"""The composition root of peer transfer: builds one agent's serving side, fetching side
and transports from its store and config, and owns their lifecycle. Nothing else in
node_agent/peer/ knows how the pieces are wired."""

from __future__ import annotations

import logging

from kvstore.config import AgentConfig, read_token_file
from kvstore.coord.etcd import NodeRecord
from kvstore.store import BlockStore
from node_agent.peer.counters import Counters
from node_agent.peer.credential import PeerCredential
from node_agent.peer.grpc_transport import GrpcTransport, PeerServicer
from node_agent.peer.prefetch import Prefetcher
from kvstore.pullcost import PullCost
from node_agent.peer.requests import PeerRequests
from node_agent.peer.serve import BlockSource
from node_agent.peer.staging import StagingPool
from node_agent.peer.transport import Transport
from node_agent.peer.ucx.transport import UcxTransport
from node_agent.tokens import TokenTable

log = logging.getLogger("kvstore.agent.peer")


class PeerTransfer:
    """Peer transfer of one agent. `servicer` goes on the agent's gRPC server;
    `peer_address` is what the agent publishes for UCX ('' when UCX is off or down)."""

    def __init__(self, store: BlockStore, cfg: AgentConfig, publish=lambda: None) -> None:
        pcfg = cfg.peer
        counters = Counters(store)
        staging = StagingPool()
        self._requests = PeerRequests(store, cfg.max_blocks_per_request)
        source = BlockSource(store, self._requests, staging, pcfg, counters)
        self._ucx = (
            UcxTransport(
                store,
                source,
                staging,
                TokenTable.from_config(cfg),
                pcfg,
                counters,
                cfg.peer_port,
                cfg.tls,
                bind_host=cfg.listen.rsplit(":", 1)[0],
            )
            if cfg.ucx_enabled
            else None
        )
        grpc = GrpcTransport(cfg.max_message_bytes, pcfg.io_timeout_s, cfg.tls)
        # Order of preference: UCX, then gRPC for whatever UCX could not move.
        self._transports: list[Transport] = [t for t in (self._ucx, grpc) if t is not None]
        self._credential = PeerCredential(read_token_file("agent_token_file", cfg.agent_token_file))
        self._etcd_endpoints = cfg.etcd_endpoints
        self._tls = cfg.tls
        self._prefetcher = prefetcher = Prefetcher(
            store,
            self._requests,
            staging,
            pcfg,
            counters,
            self._transports,
            publish,
            self._credential,
        )
        # FetchBlocks lends pool slots to the event loop's copy only where the pool
        # verifies in place in host memory.
        borrow = pcfg.in_place and store.supports_in_place and not store.pool.is_cuda
        self.servicer = PeerServicer(source, prefetcher, cfg.max_message_bytes, borrow)

    def sign(self, record: NodeRecord) -> NodeRecord:
        """This agent's etcd record, signed so that peers holding the same agent token
        trust its addresses with the agent credential (credential.py)."""
        return self._credential.sign(record)

    def pull_cost(self) -> PullCost | None:
        """The fitted cost of this agent's pulls so far (kvstore/pullcost.py)."""
        return self._prefetcher.pull_cost.estimate()

    @property
    def peer_address(self) -> str:
        return self._ucx.address if self._ucx is not None else ""

    async def start(self, host: str, control=None) -> None:
        """Bring UCX up (listening on `host`); open unseen namespaces through `control`
        (etcd generations) when given; follow the registered agents that pulls may show
        the agent credential to."""
        self._requests.use_control(control)
        self._credential.start(self._etcd_endpoints, self._tls)
        if self._ucx is None:
            log.info("UCX disabled by configuration: peers use the gRPC fallback")
            return
        await self._ucx.start(host)

    async def stop(self) -> None:
        await self._credential.stop()
        for transport in self._transports:
            await transport.close()
