"""What `kvctl status`, `nodes` and `stats` show, against real etcd, agent and router
processes: node-wide counters in stats (to the cluster identity only) and on the agent's
Prometheus page, degraded health with its reasons, a killed router, and a credential the
agents refuse."""

from __future__ import annotations

import hashlib
import json

import grpc
import pytest
from support.common import free_port, make_namespace
from support.control import AgentClient, agent_cfg, kvctl, kvctl_json
from support.metrics import scrape, val

SPEC = make_namespace()
TOKENS = {"_cluster": "cluster-token", "acme": "acme-token"}


@pytest.fixture(autouse=True)
def _no_leftover_env(monkeypatch):
    monkeypatch.delenv("KVSTORE_ETCD", raising=False)
    monkeypatch.delenv("KVSTORE_CLUSTER_TOKEN", raising=False)


def _tenants() -> dict:
    return {
        t: {"token_sha256": hashlib.sha256(tok.encode()).hexdigest()} for t, tok in TOKENS.items()
    }


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
):
    """Sends one tenant's token with every call (what KVClient does)."""

    def __init__(self, token: str) -> None:
        self.md = (("authorization", f"Bearer {token}"),)

    def _with(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with(details), requests)


def _client(address: str, tenant: str) -> AgentClient:
    from kvstore.v1 import agent_pb2_grpc

    c = AgentClient(address)
    c.stub = agent_pb2_grpc.NodeAgentStub(
        grpc.intercept_channel(c.channel, _Bearer(TOKENS[tenant]))
    )
    return c


def _token_file(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_stats_shows_node_counters_to_the_cluster_only(etcd, spawn_agent, tmp_path):
    """fenced_* / killswitch_* / nvme_* were in Stats but never in `kvctl stats`; the
    kill switch's were on no metrics page either."""
    port = free_port()
    agent = spawn_agent(
        **agent_cfg(etcd, tenants=_tenants(), allow_unauthenticated=False, metrics_port=port)
    )
    acme = _client(agent.address, "acme")
    acme.open(SPEC)
    ids = acme.put_chain(SPEC, 1, 4, 0)
    assert kvctl("killswitch", "on", "--reason", "test", etcd=etcd).returncode == 0
    assert acme.lookup(SPEC, ids, 0).matched == 0
    assert acme.get_count(SPEC, ids, 0) == 0
    with pytest.raises(grpc.RpcError) as refused:
        acme.put_chain(SPEC, 2, 2, 0)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    cluster = ("--token-file", _token_file(tmp_path, "cluster", TOKENS["_cluster"]))
    st = kvctl_json("stats", *cluster, etcd=etcd)
    counters = st["node_counters"]
    assert (counters["killswitch_lookups"], counters["killswitch_gets"]) == (1, 1), counters
    assert counters["killswitch_puts"] == 1 and counters["fenced_lookups"] == 0
    assert counters["nvme_quarantined"] == 0 and counters["nvme_write_outages"] == 0
    assert st["nodes"][0]["counters"]["killswitch_puts"] == 1
    r = kvctl("stats", *cluster, etcd=etcd)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("killswitch_puts"))
    assert row.split()[:4] == ["killswitch_puts", "1", "agent-0:", "1"], row
    assert "fenced_lookups" in r.stdout and "etcd lease not confirmed" in r.stdout

    # A tenant's Stats carries its own evictions only: no node-wide counter reaches it.
    tenant = ("--token-file", _token_file(tmp_path, "acme", TOKENS["acme"]))
    assert kvctl_json("stats", *tenant, etcd=etcd)["node_counters"] == {}
    r = kvctl("stats", *tenant, etcd=etcd)
    assert r.returncode == 0 and "node counters: none reported" in r.stdout, r.stdout

    page = scrape(port)
    for call in ("lookup", "get", "put"):
        assert val(page, "kvstore_killswitch_calls_total", call=call) == 1, call


def _json_out(r) -> dict:
    return json.loads(r.stdout)


def test_status_lists_why_it_is_degraded(etcd, spawn_agent, start_router, tmp_path):
    """An NVMe tier that started empty (its files unreadable, quarantined) made status say
    `health: degraded` with exit 0 and no reason given."""
    from support.nvme import delete_current

    from kvstore.tiers.rocks import RocksTier

    start_router()
    data_dir = tmp_path / "damaged" / "data"
    RocksTier(str(data_dir), 64 << 20).close()
    delete_current(data_dir)
    spawn_agent(**agent_cfg(etcd, data_dir=str(data_dir)))
    r = kvctl("status", etcd=etcd)
    assert r.returncode == 0, (r.stdout, r.stderr)  # degraded, still serving: documented
    assert "health:      degraded" in r.stdout
    assert "  - agent-0/nvme: started empty: unreadable files moved to " in r.stdout, r.stdout
    st = kvctl_json("status", etcd=etcd)
    assert st["health"] == "degraded" and st["degraded_tiers"][0].startswith("agent-0/nvme")


def test_a_killed_router_is_unreachable_at_once(etcd, spawn_agent, start_router):
    """Router rows came from etcd alone: a router killed with -9 stayed `up` until its
    lease expired, while a killed agent was UNREACHABLE at once. Its record is held here
    under a lease of the test's (fault injection: the killed router's lease not expired
    yet, however long the checks take)."""
    import asyncio
    import signal

    from kvstore.coord.etcd import EtcdClient

    spawn_agent(**agent_cfg(etcd))
    router = start_router("r0")
    assert kvctl("status", etcd=etcd).returncode == 0

    async def hold_record_of_killed_router(check):
        async with EtcdClient(etcd.endpoint) as client:
            record = await client.get("routers/r0")
            assert record is not None
            router.stop(signal.SIGKILL)
            lease = await client.grant(60)
            await client.put("routers/r0", record.value, lease=lease)
            try:
                await asyncio.to_thread(check)
            finally:
                await client.revoke(lease)

    def check():
        r = kvctl("status", "--node-timeout", "2", etcd=etcd)
        assert r.returncode == 4, (r.stdout, r.stderr)
        assert "health:      degraded" in r.stdout
        row = next(line for line in r.stdout.splitlines() if line.startswith("router:r0"))
        assert "UNREACHABLE" in row, r.stdout
        assert "  - router r0 at " in r.stdout
        assert "kvctl status: router r0 at " in r.stderr and "is unreachable" in r.stderr
        r = kvctl("nodes", "--node-timeout", "2", etcd=etcd)
        assert r.returncode == 4 and "UNREACHABLE" in r.stdout, (r.stdout, r.stderr)
        st = kvctl_json("status", "--node-timeout", "2", etcd=etcd, expect_rc=4)
        (rec,) = st["routers"]
        assert rec["reachable"] is False and rec["error"], rec

    asyncio.run(hold_record_of_killed_router(check))


def test_a_refused_credential_is_not_an_unreachable_node(etcd, spawn_agent, tmp_path):
    """A wrong --token-file was reported as UNREACHABLE (exit 4); an empty one was taken
    for no token at all."""
    spawn_agent(**agent_cfg(etcd, tenants=_tenants(), allow_unauthenticated=False))
    wrong = _token_file(tmp_path, "wrong", "not-the-token\n")
    r = kvctl("nodes", "--token-file", wrong, etcd=etcd)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "AUTH REFUSED" in r.stdout and "UNREACHABLE" not in r.stdout, r.stdout
    assert f"refused the credential (--token-file {wrong})" in r.stderr, r.stderr
    assert "unreachable" not in r.stderr
    r = kvctl("stats", "--token-file", wrong, etcd=etcd)
    assert r.returncode == 1 and "PARTIAL: summed over 0 of 1 agents" in r.stdout, r.stdout
    r = kvctl("nodes", etcd=etcd)  # no token at all
    assert r.returncode == 1 and "(no token): pass the cluster token" in r.stderr, r.stderr
    empty = _token_file(tmp_path, "empty", "\n")
    r = kvctl("status", "--token-file", empty, etcd=etcd)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"--token-file {empty} is empty" in r.stderr
    good = _token_file(tmp_path, "good", TOKENS["_cluster"])
    r = kvctl("nodes", "--token-file", good, etcd=etcd)
    assert r.returncode == 0 and " up " in r.stdout, (r.stdout, r.stderr)
