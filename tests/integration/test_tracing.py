"""Tracing across components, in one process so an in-memory exporter sees every span: a
real etcd, a router and two agents on gRPC in the test's event loop, clients in a worker
thread. Client spans, the router's Route, the agents' Lookup/Get and the peer hop
(Prefetch on A -> FetchBlocks on B) must share one trace through W3C metadata, carry
counts and node names, and never a token id. Then a real agent process exporting over
OTLP/gRPC to a collector the test runs."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest
import torch
from support.common import TEST_SECRET, make_namespace, wait_for
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvstore.telemetry import TRACER, otlp_endpoint, trace_metadata
from kvstore.client import KVClient
from kvstore.client.cluster import ClusterClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.config import AgentConfig, RouterConfig
from kvstore.hashing import pack_ids
from kvstore.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from node_agent.server import AgentServer
from router.server import RouterServer

SPEC = make_namespace()
BS = SPEC.block_size
N_BLOCKS = 4
# Token ids far from any small count or size, so a leak into an attribute is unmistakable.
TOKENS = [1_000_003 + 7919 * i for i in range(N_BLOCKS * BS)]


@pytest.fixture(scope="module")
def spans():
    """The process-wide tracer provider (settable once) with an in-memory exporter."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # later spans are dropped, not kept in memory


def blocks_for(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(block_shape(SPEC), generator=g).to(torch_dtype(SPEC.kv_dtype)) for _ in range(n)
    ]


def agent_cfg(tmp_path, name: str, etcd) -> AgentConfig:
    return AgentConfig(
        node_id=name,
        listen="127.0.0.1:0",
        data_dir=str(tmp_path / name),
        pool_bytes=4 << 20,
        slot_bytes=64 << 10,
        nvme_bytes=0,
        device="cpu",
        allow_unauthenticated=True,
        etcd_endpoints=etcd.endpoint,
        lease_ttl_s=2,
        ucx_enabled=False,
    )


def workload(router: str, a: str, b: str) -> None:
    """Blocks stored on B; a routed fetch (to B, which holds them); A pulls them from B."""
    with KVClient(b, tenant_secret=TEST_SECRET, use_shm=False) as cb:
        cb.store(cb.open_namespace(SPEC), TOKENS, blocks_for(1, N_BLOCKS))
    with ClusterClient(router, tenant_secret=TEST_SECRET, use_shm=False) as cc:
        wait_for(
            lambda: any(n.indexed_blocks == N_BLOCKS and n.synced for n in cc.nodes()),
            20,
            what="the router to index B's blocks",
        )
        ns = cc.open_namespace(SPEC)
        hit = cc.fetch(ns, TOKENS)
        assert hit.cached_blocks == N_BLOCKS and hit.address == b
        cc.release(hit)
    with KVClient(a, tenant_secret=TEST_SECRET, use_shm=False) as ca:
        na = ca.open_namespace(SPEC)
        req = peer_pb2.PrefetchRequest(
            ns=na.ref,
            spec=common_pb2.Namespace(**SPEC.to_dict()),
            block_ids=pack_ids(ca.block_ids(na, TOKENS)),
            parent_id=na.root,
            peer_address=b,
        )
        with TRACER.start_as_current_span("test.prefetch"):
            r = peer_pb2_grpc.PeerStub(ca.channel).Prefetch(req, timeout=30)
        assert (r.present, r.fetched, r.transport) == (N_BLOCKS, N_BLOCKS, "grpc")


async def run_cluster(tmp_path, etcd) -> tuple[str, str]:
    agents = [AgentServer(agent_cfg(tmp_path, name, etcd)) for name in ("agent-a", "agent-b")]
    router = RouterServer(
        RouterConfig(
            router_id="router-t",
            listen="127.0.0.1:0",
            etcd_endpoints=etcd.endpoint,
            allow_unauthenticated=True,
        )
    )
    started = []
    try:
        for server in (*agents, router):
            await server.start()
            started.append(server)
        await asyncio.wait_for(
            asyncio.to_thread(workload, router.address, agents[0].address, agents[1].address), 90
        )
    finally:
        for server in reversed(started):
            await server.stop(0)
    return agents[0].cfg.node_id, agents[1].cfg.node_id


def one(spans, name: str, **attrs):
    found = [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in attrs.items())
    ]
    assert len(found) == 1, (name, attrs, [(s.name, dict(s.attributes)) for s in spans])
    return found[0]


def test_trace_spans_client_router_agent_and_peer(tmp_path, etcd, spans):
    spans.clear()
    node_a, node_b = asyncio.run(run_cluster(tmp_path, etcd))
    # B's FetchBlocks span ends when A cancels the drained stream: it may trail Prefetch.
    done = wait_for(
        lambda: (lambda got: got if any(s.name.endswith("/FetchBlocks") for s in got) else None)(
            spans.get_finished_spans()
        ),
        10,
        what="the peer's FetchBlocks span",
    )

    fetch = one(done, "kvstore.cluster.fetch")
    # (open_namespace's dry run picking the agent to open on is a Route of its own.)
    route = one(done, "/kvstore.v1.Router/Route", **{"kvstore.dry_run": False})
    lookup = one(done, "/kvstore.v1.NodeAgent/Lookup", **{"kvstore.matched_blocks": N_BLOCKS})
    get = one(done, "/kvstore.v1.NodeAgent/Get", **{"kvstore.node": node_b})
    for server_span in (route, lookup, get):  # children of the client span, across gRPC
        assert server_span.kind == trace.SpanKind.SERVER
        assert server_span.context.trace_id == fetch.context.trace_id
        assert server_span.parent.span_id == fetch.context.span_id
        assert server_span.parent.is_remote
    assert route.attributes["kvstore.node"] == node_b
    assert route.attributes["kvstore.matched_blocks"] == N_BLOCKS
    assert lookup.attributes["kvstore.tenant"] == "acme"
    assert lookup.attributes["kvstore.node"] == node_b
    assert get.attributes["kvstore.blocks"] == N_BLOCKS
    assert get.attributes["kvstore.bytes"] == N_BLOCKS * SPEC.block_bytes
    assert get.attributes["kvstore.hbm_blocks"] == N_BLOCKS
    assert fetch.attributes["kvstore.cached_blocks"] == N_BLOCKS

    parent = one(done, "test.prefetch")
    prefetch = one(done, "/kvstore.v1.Peer/Prefetch")
    pull = one(done, "/kvstore.v1.Peer/FetchBlocks")
    assert prefetch.parent.span_id == parent.context.span_id
    assert prefetch.attributes["kvstore.node"] == node_a
    assert prefetch.attributes["kvstore.fetched_blocks"] == N_BLOCKS
    assert prefetch.attributes["kvstore.transport"] == "grpc"
    assert pull.attributes["kvstore.node"] == node_b
    assert pull.context.trace_id == parent.context.trace_id
    assert pull.parent.span_id == prefetch.context.span_id

    assert_no_tokens(done)


def test_local_lane_calls_carry_the_trace(tmp_path, spans):
    """Same-host calls skip gRPC (the local lane) but not tracing: the agent's spans are
    children of the caller's, as over gRPC."""
    spans.clear()
    cfg = AgentConfig(
        node_id="agent-l",
        listen="127.0.0.1:0",
        data_dir=str(tmp_path / "l"),
        pool_bytes=4 << 20,
        slot_bytes=64 << 10,
        nvme_bytes=0,
        device="cpu",
        allow_unauthenticated=True,
        ucx_enabled=False,
    )

    def work(address: str) -> None:
        with KVClient(address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as c:
            assert c.uses_local_lane
            ns = c.open_namespace(SPEC)
            with TRACER.start_as_current_span("test.lane"):
                c.store(ns, TOKENS, blocks_for(2, N_BLOCKS))
                assert c.fetch(ns, TOKENS).cached_blocks == N_BLOCKS

    async def run() -> None:
        agent = AgentServer(cfg)
        await agent.start()
        try:
            await asyncio.wait_for(asyncio.to_thread(work, agent.address), 60)
        finally:
            await agent.stop(0)

    asyncio.run(run())
    done = spans.get_finished_spans()
    parent = one(done, "test.lane")
    fetch, store = one(done, "kvstore.client.fetch"), one(done, "kvstore.client.store")
    for name, client_span in (("Put", store), ("Lookup", fetch), ("Get", fetch)):
        server = one(done, f"/kvstore.v1.NodeAgent/{name}")
        assert server.kind == trace.SpanKind.SERVER
        assert server.context.trace_id == parent.context.trace_id
        assert server.parent.span_id == client_span.context.span_id and server.parent.is_remote
    assert (
        one(done, "/kvstore.v1.NodeAgent/Lookup").attributes["kvstore.matched_blocks"] == N_BLOCKS
    )
    assert_no_tokens(done)


def assert_no_tokens(spans) -> None:
    """Attribute values are scalars, none of them a token id or holding one as text."""
    token_text = [str(t) for t in TOKENS]
    for s in spans:
        for key, value in s.attributes.items():
            assert isinstance(value, (str, int, float, bool)), (s.name, key, value)
            if isinstance(value, int):
                assert value not in TOKENS, (s.name, key, value)
            if isinstance(value, str):
                assert not any(t in value for t in token_text), (s.name, key, value)


def test_trace_metadata_is_unchanged_without_an_active_span(spans):
    md = (("authorization", "Bearer x"),)
    assert trace_metadata(md) is md and trace_metadata(None) is None
    with TRACER.start_as_current_span("outer") as span:
        got = dict(trace_metadata(md))
    assert got["authorization"] == "Bearer x"
    assert got["traceparent"].split("-")[1] == format(span.get_span_context().trace_id, "032x")


# ------------------------------------------------------------------ OTLP export
class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace collector: keeps (service.name, span name, attributes)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, dict]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                res = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        attrs = {a.key: a.value for a in sp.attributes}
                        self.spans.append((res.get("service.name", ""), sp.name, attrs))
        return trace_service_pb2.ExportTraceServiceResponse()


def test_agent_exports_spans_over_otlp_when_configured(spawn_agent):
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        agent = spawn_agent(otlp_endpoint=f"http://127.0.0.1:{port}")
        with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
            ns = c.open_namespace(SPEC)
            c.store(ns, TOKENS, blocks_for(2, N_BLOCKS))
            assert c.lookup(ns, c.block_ids(ns, TOKENS)).matched == N_BLOCKS
        agent.stop()  # a clean stop flushes the batched spans
        names = {(svc, name) for svc, name, _ in collector.spans}
        assert ("kvstore-agent", "/kvstore.v1.NodeAgent/Lookup") in names
        assert ("kvstore-agent", "/kvstore.v1.NodeAgent/Put") in names
        lookup = next(a for _, n, a in collector.spans if n.endswith("/Lookup"))
        assert lookup["kvstore.matched_blocks"].int_value == N_BLOCKS
        assert lookup["kvstore.node"].string_value == agent.config["node_id"]
    finally:
        server.stop(0)


def test_otlp_endpoint_comes_from_config_then_env(monkeypatch):
    for key in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(key, raising=False)
    assert otlp_endpoint("") == ""  # off by default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://all:4317")
    assert otlp_endpoint("") == "http://all:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert otlp_endpoint("") == "http://traces:4317"
    assert otlp_endpoint("http://config:4317") == "http://config:4317"
