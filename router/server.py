"""Router process: grpc.aio server for kvstore.v1.Router plus grpc health, fed by etcd and
the agents' event streams. The servicer only converts protobuf <-> RouterCore calls, after
router/access.py said the caller may make them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.coord.etcd import DEFAULT_PREFIX, EtcdClient
from kvstore.grpc_edge import connection_options, keepalive_options, status_for
from kvstore import errors
from kvstore.process import (
    StartupError,
    bind_port,
    check_ready_file,
    run_until_signalled,
    write_ready_file,
)
from kvstore.config import RouterConfig, read_token_file
from kvstore.coord.engines import EngineRecordReader, engine_record_key
from kvstore.v1 import router_pb2, router_pb2_grpc
from kvstore.wire import check_id, check_request_id
from router.access import AuthEdge, NamespaceOwners, RouterAccess, current_caller
from router.engine_feed import EngineFeed
from router.follower import ClusterFollower
from router.gateway.config import GatewayConfig
from router.metrics import RouterTelemetry
from router.routing import RouterCore
from router.scoring import Weights

if TYPE_CHECKING:  # imported only when with_control (it follows etcd)
    from router.gateway.server import GatewayServer
    from router.control import RouterControl

log = logging.getLogger("kvstore.router")

MAX_ROUTE_BLOCKS = 1 << 16  # 1M tokens at 16 per block; bigger requests are malformed


def decision_to_proto(d, core: RouterCore) -> router_pb2.RouteResponse:
    cands = []
    for s in d.scores:
        st = core.nodes.get(s.node_id)
        cands.append(
            router_pb2.Candidate(
                node_id=s.node_id,
                address=st.record.address if st else "",
                local_blocks=s.local_blocks,
                peer_blocks=s.peer_blocks,
                peer_node_id=s.peer_node_id,
                recompute_blocks=s.recompute_blocks,
                in_flight=s.in_flight,
                utilization=s.utilization,
                cost=s.cost,
                recompute_cost=s.recompute_cost,
                peer_cost=s.peer_cost,
                space_cost=s.space_cost,
                load_cost=s.load_cost,
                utilization_cost=s.utilization_cost,
                queued_blocks=s.queued,
            )
        )
    c = cands[0]
    p = d.pricing
    peer = core.nodes.get(c.peer_node_id) if c.peer_node_id else None
    return router_pb2.RouteResponse(
        node_id=c.node_id,
        address=c.address,
        matched_blocks=c.local_blocks,
        candidates=cands,
        request_id=d.request_id,
        peer_hint=c.peer_node_id,
        peer_address=peer.record.address if peer else "",
        peer_transfer_address=peer.record.peer_address if peer else "",
        recompute_ms=p.recompute_s * 1e3 if p else 0.0,
        pull_fixed_ms=p.peer_fixed_s * 1e3 if p else 0.0,
        pull_ms_per_block=p.peer_price * p.recompute_s * 1e3 if p else 0.0,
    )


# What a tenant's Route answer leaves out: every node's load is the sum of all tenants'
# requests, so these terms would show a tenant the others' traffic from one dry run to
# the next (and `cost` sums them). The cluster identity sees them; so do the router's
# metrics and traces (RouterServicer.observe).
LOAD_TERMS = (
    "in_flight",
    "utilization",
    "queued_blocks",
    "cost",
    "recompute_cost",
    "peer_cost",
    "space_cost",
    "load_cost",
    "utilization_cost",
)


def withhold_load(resp: router_pb2.RouteResponse) -> None:
    """Clear the candidates' load and cost terms (LOAD_TERMS) and put the fallbacks in
    node order (the router ranks them by cost, load included): a tenant keeps the chosen
    node first, the others, and what each holds of its prompt. Which node is chosen still
    depends on load, as with any balancer: that much a tenant learns by being routed."""
    if not resp.candidates:
        return
    rest = sorted(resp.candidates[1:], key=lambda c: c.node_id)
    del resp.candidates[1:]
    resp.candidates.extend(rest)
    for c in resp.candidates:
        for name in LOAD_TERMS:
            c.ClearField(name)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore, access: RouterAccess) -> None:
        self.core = core
        self.access = access
        # Sees every Route's whole answer (RouterTelemetry.observe_route), before
        # withhold_load; None: nothing observes them.
        self.observe: Callable[[router_pb2.RouteRequest, router_pb2.RouteResponse], None] | None
        self.observe = None
        # Generation fence (router/control.py): raises StaleGeneration for a flushed one.
        self.fence = lambda namespace_id, generation: None

    async def Route(self, request, context):
        try:
            if len(request.block_ids) > MAX_ROUTE_BLOCKS * 16:
                raise errors.InvalidArgument(f"block_ids names more than {MAX_ROUTE_BLOCKS} blocks")
            check_id(request.namespace_id, "namespace_id")  # what any caller may be told
            check_request_id(request.request_id)  # kept in the in-flight table until released
            caller = current_caller.get()
            self.access.check_route(caller, request)  # before the fence: it tells gens
            if request.block_ids:  # no ids (a client picking a node to open on): none stale
                self.fence(request.namespace_id, request.generation)
            weights = None
            if request.HasField("weights"):
                w = request.weights
                weights = self.core.weights.override(
                    w.recompute, w.peer_fetch, w.load, w.utilization, w.queue
                )
            t0 = time.perf_counter()
            d = self.core.route(
                request.namespace_id,
                request.block_ids,
                weights,
                request.request_id,
                request.dry_run,
                caller.scope,
                self.access.inflight_cap(caller),
                *self.access.work_caps(caller),
            )
            decide_s = time.perf_counter() - t0  # no RPC encoding: as the gateway pays it
        except (errors.KvError, ValueError) as exc:  # ValueError: a negative weight override
            code = (
                status_for(exc)
                if isinstance(exc, errors.KvError)
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(exc))
        resp = decision_to_proto(d, self.core)
        resp.decide_us = decide_s * 1e6
        if self.observe is not None:
            self.observe(request, resp)
        if not caller.trusted:
            withhold_load(resp)
        return resp

    async def Release(self, request, context):
        # Another tenant's id is one this tenant never routed: the same empty answer as an
        # unknown or expired id, and nothing changes.
        try:
            check_request_id(request.request_id)
        except errors.KvError as exc:
            await context.abort(status_for(exc), str(exc))
        self.core.release(request.request_id, request.prefill_done, current_caller.get().scope)
        return router_pb2.ReleaseResponse()

    async def ListNodes(self, request, context):
        # Node addresses (gRPC and UCX) are for cluster members only.
        self.access.require_cluster(current_caller.get(), "ListNodes")
        out = []
        for node_id in sorted(self.core.nodes):
            st = self.core.nodes[node_id]
            r = st.record
            out.append(
                router_pb2.NodeInfo(
                    node_id=node_id,
                    address=r.address,
                    peer_address=r.peer_address,
                    device=r.device,
                    hbm_capacity_bytes=r.hbm_capacity_bytes,
                    nvme_capacity_bytes=r.nvme_capacity_bytes,
                    indexed_blocks=self.core.index.node_blocks(node_id)[0],
                    synced=st.synced,
                )
            )
        return router_pb2.ListNodesResponse(nodes=out)


class RouterServer:
    def __init__(
        self,
        cfg: RouterConfig,
        token: str | None = None,
        etcd_prefix: str | None = None,
        with_control: bool = False,
        gateway: GatewayConfig | None = None,
    ) -> None:
        """with_control: also run router/control.RouterControl (generation fencing, kill
        switch acknowledgements, presence under routers/); the router process does."""
        self.cfg = cfg
        self.with_control = with_control
        self.control: RouterControl | None = None
        self.core = RouterCore.from_config(cfg)
        self.owners = NamespaceOwners()
        self.token = token
        self.etcd_prefix = etcd_prefix
        self.port = 0
        self.server: grpc.aio.Server | None = None
        self.follower: ClusterFollower | None = None
        self.engine_feed: EngineFeed | None = None
        self._etcd: EtcdClient | None = None
        self.telemetry: RouterTelemetry | None = None  # Prometheus, tracing (router/metrics.py)
        self.gateway_cfg = gateway if gateway is not None and gateway.listen else None
        self.gateway: GatewayServer | None = None  # with --gateway-listen
        self.gateway_ready_file: str | None = None  # gets the gateway's host:port
        # reader -> how it takes engines/ records (verified with the engine record key)
        self.engine_records: dict[str, EngineRecordReader] = {}

    @property
    def address(self) -> str:
        return f"{self.cfg.listen.rsplit(':', 1)[0]}:{self.port}"

    async def start(self) -> None:
        Weights.from_config(self.cfg)  # validated once, before serving
        # The gateway's files (tokenizers, API keys, secrets, TLS) are read before anything
        # waits for etcd: a bad one stops the router at once, saying which.
        self.engine_records = engine_record_readers(self.cfg, self.gateway_cfg is not None)
        built = self._build_gateway(self.gateway_cfg) if self.gateway_cfg is not None else None
        self.telemetry = RouterTelemetry(self.cfg, self.core, self.engine_records)
        # The edge last: undecodable requests and unexpected errors get a precise status
        # on every method (kvstore/grpc_edge.py), callers are authenticated before the
        # servicer runs (router/access.py), and telemetry still times them.
        access = RouterAccess(self.cfg, self.owners)
        self.server = grpc.aio.server(
            interceptors=[*self.telemetry.interceptors, AuthEdge(access, log, self.cfg)],
            options=[
                ("grpc.so_reuseport", 0),
                *keepalive_options(self.cfg.keepalive_s, self.cfg.keepalive_timeout_s),
                *connection_options(self.cfg.max_connections, self.cfg.handshake_timeout_s),
            ],
        )
        self.servicer = RouterServicer(self.core, access)
        self.servicer.observe = self.telemetry.observe_route
        router_pb2_grpc.add_RouterServicer_to_server(self.servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = bind_port(self.server, self.cfg.listen, self.cfg.tls)
        self._etcd = EtcdClient(
            self.cfg.etcd_endpoints, self.etcd_prefix or DEFAULT_PREFIX, tls=self.cfg.tls
        )
        self.follower = ClusterFollower(
            self.core, self._etcd, self.cfg.router_id, self.token, self.owners, self.cfg.tls
        )
        self.follower.start()
        self.engine_feed = EngineFeed(  # vLLM KV events
            self.core.engines, self._etcd, records=self.engine_records["router"]
        )
        self.engine_feed.start()
        if self.with_control:  # generations and kill switch loaded before serving
            from router.control import RouterControl

            self.control = RouterControl(
                self._etcd, self.cfg.router_id, core=self.core, address=self.address
            )
            await self.control.start()
            self.servicer.fence = self.control.check
        if self.gateway_cfg is not None and built is not None:
            await self._start_gateway(self.gateway_cfg, built)
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("kvstore.v1.Router", health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "router %s serving on %s (etcd %s)",
            self.cfg.router_id,
            self.address,
            self.cfg.etcd_endpoints,
        )

    def _build_gateway(self, gcfg: GatewayConfig):
        from router.gateway.server import build_gateway

        def generation(ns_id: bytes) -> int | None:  # the control follows etcd once started
            return self.control.generation(ns_id) if self.control is not None else None

        try:
            return build_gateway(
                gcfg, self.core, generation, self.cfg.tls, self.engine_records["gateway"]
            )
        except ValueError as exc:
            raise StartupError(f"gateway: {exc}") from None

    async def _start_gateway(self, gcfg: GatewayConfig, gw) -> None:
        from router.gateway.server import GatewayServer

        self.gateway = GatewayServer(gcfg, gw, self._etcd, self.cfg.tls)
        endpoint = self.telemetry.endpoint if self.telemetry is not None else None
        if endpoint is not None:  # the operator's port has the gateway's page too
            endpoint.registry.register(gw.metrics.collector(gw.planner.engine_blocks))
        await self.gateway.start()
        if self.gateway_ready_file:
            write_ready_file(self.gateway_ready_file, self.gateway.address)

    async def stop(self, grace: float = 1.0) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace)
        if self.control is not None:
            await self.control.stop()
        if self.follower is not None:
            await self.follower.stop()
        if self.engine_feed is not None:
            await self.engine_feed.stop()
        if self._etcd is not None:
            await self._etcd.close()
        if self.telemetry is not None:
            self.telemetry.close()
        log.info("router %s stopped", self.cfg.router_id)


def engine_record_readers(
    cfg: RouterConfig, gateway: bool = False
) -> dict[str, EngineRecordReader]:
    """One reader of engines/ for the KV-event subscriber ("router") and one for the
    gateway, with the key from engine_record_key_file (StartupError naming the file when
    it cannot be read). Without one, records are taken as they stand: said at start when
    this router runs a gateway (it forwards prompts by them), else when a record appears."""
    secret = read_token_file("engine_record_key_file", cfg.engine_record_key_file)
    key = engine_record_key(secret) if secret else b""
    accept = cfg.engine_record_unsigned == "accept"
    if not key and gateway:
        log.warning(
            "engine records are not authenticated (no engine_record_key_file): whoever can "
            "write etcd can point the gateway's requests and the KV-event subscriber at a "
            "server of theirs (docs/security.md, Engine records)"
        )
    elif key and accept:
        log.warning(
            "engine records without a signature are taken (engine_record_unsigned: accept), "
            "as are those that verify: set refuse once every registrar has the key "
            "(docs/security.md, Engine records)"
        )
    return {
        name: EngineRecordReader(key, accept, said_unauthenticated=gateway)
        for name in ("router", "gateway")
    }


async def serve(
    cfg: RouterConfig,
    ready_file: str | None = None,
    token: str | None = None,
    etcd_prefix: str | None = None,
    gateway: GatewayConfig | None = None,
    gateway_ready_file: str | None = None,
) -> None:
    server = RouterServer(cfg, token, etcd_prefix, with_control=True, gateway=gateway)
    server.gateway_ready_file = gateway_ready_file
    check_ready_file(gateway_ready_file, "--gateway-ready-file")
    await run_until_signalled(server, ready_file, return_freed=True)
