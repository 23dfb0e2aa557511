"""Prometheus metrics of real agent and router processes: a known workload, then a scrape
of /metrics whose values must equal what the workload did (tokens, requests, hit lengths,
RPC counts) and what the agent's own Stats RPC reports (occupancy, evictions)."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

import pytest
import torch
from support.cluster import agent_config
from support.common import PY, ROOT, TEST_SECRET, free_port, make_namespace, prompt_tokens, wait_for
from support.metrics import scrape, val

from kvstore.telemetry import MetricsEndpoint, metrics_bind_host
from kvstore.client import KVClient
from kvstore.client.cluster import ClusterClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.config import AgentConfig, RouterConfig, load_config

ACME = make_namespace(tenant="acme")
GLOBEX = make_namespace(tenant="globex")
BS = ACME.block_size
NB = ACME.block_bytes
KiB = 1 << 10


def blocks_for(seed: int, n: int, spec=ACME) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(block_shape(spec), generator=g).to(torch_dtype(spec.kv_dtype)) for _ in range(n)
    ]


def store(client: KVClient, ns, seed: int, n_blocks: int) -> list[int]:
    tokens = prompt_tokens(seed, n_blocks * BS)
    usage = client.store(ns, tokens, blocks_for(seed, n_blocks, ns.spec))
    assert usage.cache_write_tokens == n_blocks * BS
    return tokens


def rpc_count(m: dict, method: str) -> float:
    return m.get(("kvstore_rpc_duration_seconds_count", frozenset({("method", method)})), 0)


# ----------------------------------------------------------------------------- agent
def test_agent_metrics_equal_the_workload(spawn_agent):
    port = free_port()
    # 8 pool slots: the third prompt evicts (demotes) blocks to NVMe.
    agent = spawn_agent(metrics_port=port, pool_bytes=f"{8 * 64}KiB")
    with (
        KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as a,
        KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as g,
    ):
        ns_a, ns_g = a.open_namespace(ACME), g.open_namespace(GLOBEX)
        t1 = store(a, ns_a, 1, 4)
        t2 = store(g, ns_g, 2, 3)
        store(a, ns_a, 3, 4)
        hit = a.fetch(ns_a, t1 + prompt_tokens(99, BS))  # 5 blocks looked up, 4 cached
        assert hit.cached_blocks == 4
        assert a.fetch(ns_a, prompt_tokens(7, 2 * BS + 8)).cached_blocks == 0  # 2 blocks
        assert g.fetch(ns_g, t2).cached_blocks == 3  # over the gRPC stream this time
        stats = {t.tenant: t for t in a.stats().tenants}
        counters = dict(a.stats().counters)
        hbm_blocks = a.stats().tiers[0].blocks
    assert f"metrics at http://127.0.0.1:{port}/metrics" in agent.log
    m = wait_for(
        lambda: (lambda m: m if rpc_count(m, "Stats") == 3 else None)(scrape(port)),
        10,
        what="the scrape to show every RPC",
    )

    # Request- and token-weighted hit rates, per tenant, exactly as issued.
    expect = {"acme": (2, 1, 7 * BS, 4 * BS, 4 * BS), "globex": (1, 1, 3 * BS, 3 * BS, 3 * BS)}
    for tenant, (req, req_hit, tokens, hit_tokens, saved) in expect.items():
        assert val(m, "kvstore_requests_total", tenant=tenant) == req
        assert val(m, "kvstore_requests_hit_total", tenant=tenant) == req_hit
        assert val(m, "kvstore_lookup_tokens_total", tenant=tenant) == tokens
        assert val(m, "kvstore_lookup_hit_tokens_total", tenant=tenant) == hit_tokens
        assert val(m, "kvstore_saved_prefill_tokens_total", tenant=tenant) == saved
    # Hit lengths: acme 64 and 0 tokens, globex 48.
    assert val(m, "kvstore_hit_length_tokens_count", tenant="acme") == 2
    assert val(m, "kvstore_hit_length_tokens_sum", tenant="acme") == 4 * BS
    assert val(m, "kvstore_hit_length_tokens_bucket", tenant="acme", le="0") == 1
    assert val(m, "kvstore_hit_length_tokens_bucket", tenant="globex", le="32") == 0
    assert val(m, "kvstore_hit_length_tokens_bucket", tenant="globex", le="64") == 1

    # Occupancy per tier and tenant: what the agent's accounting (Stats) says.
    for tenant, st in stats.items():
        assert val(m, "kvstore_tier_bytes", tier="hbm", tenant=tenant) == st.hbm_bytes
        assert val(m, "kvstore_tier_bytes", tier="nvme", tenant=tenant) == st.nvme_bytes
    hbm = sum(val(m, "kvstore_tier_blocks", tier="hbm", tenant=t) for t in stats)
    # A block in the pool is charged its whole slot (spawn_agent's 64 KiB), not its payload.
    assert hbm == hbm_blocks and sum(st.hbm_bytes for st in stats.values()) == hbm * 64 * KiB
    assert sum(st.nvme_bytes for st in stats.values()) > 0  # the eviction demoted some
    assert val(m, "kvstore_tier_capacity_bytes", tier="hbm") == 8 * 64 * KiB
    assert val(m, "kvstore_tier_capacity_bytes", tier="nvme") == 64 * KiB * KiB
    evicted = val(m, "kvstore_evictions_total", tier="hbm", reason="capacity")
    assert evicted == counters["evict_hbm_capacity"] > 0
    assert val(m, "kvstore_evictions_total", tier="hbm", reason="quota") == 0
    assert val(m, "kvstore_tier_moves_total", to="nvme") == counters["demotions"]
    assert val(m, "kvstore_tier_moves_total", to="hbm") == counters.get("promotions", 0)

    # One timing per RPC: 3 opens+puts, 3 lookups, 2 gets (the miss fetched nothing).
    for method, n in (
        ("OpenNamespace", 2),
        ("RegisterShm", 1),
        ("Put", 3),
        ("Lookup", 3),
        ("Get", 2),
    ):
        assert rpc_count(m, method) == n, method
        assert val(m, "kvstore_rpc_duration_seconds_bucket", method=method, le="+Inf") == n
    assert not any(k[0].startswith("kvstore_rpc") and ("method", "Check") in k[1] for k in m)


def test_metrics_host_follows_listen_unless_set():
    assert metrics_bind_host("", "0.0.0.0:50051") == "0.0.0.0"
    assert metrics_bind_host("", "127.0.0.1:0") == "127.0.0.1"
    assert metrics_bind_host("", "[::1]:50051") == "::1"
    assert metrics_bind_host("10.0.0.5", "0.0.0.0:50051") == "10.0.0.5"
    cfg = load_config(
        AgentConfig,
        None,
        None,
        {
            "metrics_port": "9400",
            "metrics_host": "0.0.0.0",
            "metrics_open": "true",
            "otlp_endpoint": "http://collector:4317",
        },
    )
    assert (cfg.metrics_port, cfg.metrics_host, cfg.otlp_endpoint) == (
        9400,
        "0.0.0.0",
        "http://collector:4317",
    )
    assert RouterConfig().metrics_host == "" and RouterConfig().otlp_endpoint == ""


@pytest.mark.parametrize("config", [AgentConfig, RouterConfig])
def test_a_metrics_page_beyond_loopback_needs_a_token_or_metrics_open(config, tmp_path):
    """The page holds every tenant's counts: beyond loopback it is refused at start
    without a token file, unless metrics_open says so; loopback stays open (development)."""
    with pytest.raises(ValueError, match="would show every tenant's counts"):
        load_config(config, None, None, {"metrics_port": "9400", "listen": "0.0.0.0:50051"})
    with pytest.raises(ValueError, match="on 10.0.0.5 would show"):
        load_config(config, None, None, {"metrics_port": "9400", "metrics_host": "10.0.0.5"})
    for ok in (
        {"metrics_token_file": str(tmp_path / "token")},
        {"metrics_open": "true"},
        {"metrics_host": "127.0.0.1"},
        {"metrics_host": "::1"},
        {"metrics_port": "0"},
    ):
        load_config(config, None, None, {"metrics_port": "9400", "listen": "0.0.0.0:1", **ok})


def _get(port: int, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_an_agent_with_a_metrics_token_serves_its_page_to_that_token_only(spawn_agent, tmp_path):
    """A real agent (metrics_token_file): no header, another token, a Basic header, the
    token without its scheme: 401 and nothing of the page; the token: the page."""
    (tmp_path / "metrics-token").write_text("scrape-secret\n")
    port = free_port()
    agent = spawn_agent(metrics_port=port, metrics_token_file=str(tmp_path / "metrics-token"))
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as client:
        store(client, client.open_namespace(ACME), 1, 2)
    for headers in (
        None,
        {"Authorization": "Bearer not-the-token"},
        {"Authorization": "Basic c2NyYXBlLXNlY3JldA=="},
        {"Authorization": "scrape-secret"},
    ):
        status, body = _get(port, headers)
        assert status == 401 and "kvstore_" not in body and "acme" not in body, (headers, body)
    status, body = _get(port, {"Authorization": "Bearer scrape-secret"})
    assert status == 200 and 'tenant="acme"' in body


def test_an_unreadable_metrics_token_file_stops_the_agent_at_start(tmp_path):
    """A page meant to be guarded is never served open: a missing or empty token file is
    one line and exit 1."""
    (tmp_path / "empty").write_text("\n")
    for path, said in ((tmp_path / "missing", "No such file"), (tmp_path / "empty", "is empty")):
        cfg = {
            "listen": "127.0.0.1:0", "data_dir": str(tmp_path / "data"), "device": "cpu",
            "pool_bytes": "4MiB", "slot_bytes": "64KiB", "nvme_bytes": 0,
            "allow_unauthenticated": True, "metrics_port": free_port(),
            "metrics_token_file": str(path),
        }  # fmt: skip
        (tmp_path / "agent.json").write_text(json.dumps(cfg))
        r = subprocess.run(
            [PY, "-m", "node_agent", "--config", str(tmp_path / "agent.json")],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert r.returncode == 1 and f"metrics_token_file {path}" in r.stderr, r.stderr
        assert said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_busy_metrics_port_is_a_clear_error():
    first = MetricsEndpoint("127.0.0.1", free_port())
    try:
        busy = f"could not serve metrics on 127.0.0.1:{first.port}"
        with pytest.raises(RuntimeError, match=busy):
            MetricsEndpoint("127.0.0.1", first.port)
        with pytest.raises(ValueError, match="metrics port"):
            MetricsEndpoint("127.0.0.1", 0)
    finally:
        first.close()


# ---------------------------------------------------------------- router and flush
def test_router_decisions_and_agent_flush_duration(etcd, spawn_agent, start_router):
    agent_port, router_port = free_port(), free_port()
    agent = spawn_agent(**agent_config(etcd, metrics_port=agent_port))
    router = start_router(config={"metrics_port": router_port})
    node = agent.config["node_id"]
    with ClusterClient(router.address, tenant_secret=TEST_SECRET, use_shm=False) as cc:
        ns = cc.open_namespace(ACME)
        tokens = prompt_tokens(5, 6 * BS)
        hit = cc.fetch(ns, tokens)
        cc.store(ns, hit, tokens, blocks_for(5, 6))
        router.wait_nodes({node: 6})
        routes = [cc.fetch(ns, tokens[: n * BS]) for n in (6, 3, 6)]
        for r in routes:
            cc.release(r)
    assert [r.route.matched_blocks for r in routes] == [6, 3, 6]
    m = scrape(router_port)
    assert val(m, "kvstore_router_decisions_total", node=node) == 4  # the first one too
    assert val(m, "kvstore_router_matched_blocks_count") == 4
    assert val(m, "kvstore_router_matched_blocks_sum") == 15
    assert val(m, "kvstore_router_recompute_blocks_sum") == 6  # only the cold first route
    assert val(m, "kvstore_router_cost_count") == 4
    # One more Route: open_namespace's dry run (no blocks) picks the agent to open on.
    assert val(m, "kvstore_rpc_duration_seconds_count", method="Route") == 5
    assert val(m, "kvstore_router_indexed_blocks", node=node) == 6
    assert val(m, "kvstore_router_nodes", state="synced") == 1

    before = scrape(agent_port)
    assert ("kvstore_flush_duration_seconds_count", frozenset()) not in before or val(
        before, "kvstore_flush_duration_seconds_count"
    ) == 0
    r = subprocess.run(
        [PY, "-m", "kvstore.cli", "flush", "acme/chat", "--etcd", etcd.endpoint, "-o", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)
    m = scrape(agent_port)
    assert val(m, "kvstore_flush_duration_seconds_count") == 1
    assert val(m, "kvstore_removed_blocks_total", reason="flush") == 6
    assert val(m, "kvstore_tier_bytes", tier="hbm", tenant="acme") == 0
