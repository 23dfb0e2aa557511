"""mTLS on every hop, with real processes and trustme certificates (tests/support/tls.py):
etcd serving TLS with client-certificate auth, agents and a router with `tls` set, the
client library presenting the client pair. Everything works over mTLS, peers pull over
UCX (handshake signed with the agents' certificates) and gRPC; a plaintext client, one
without a client certificate and one with another CA's are refused on every port;
rewritten files take effect for new connections without a restart; `kvctl cluster up
--tls` then a bare `kvctl status` works."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections import Counter

import grpc
import pytest
import torch
from support.common import PY, ROOT, TEST_SECRET, free_port, make_namespace, prompt_tokens
from support.common import wait_for
from support.tls import handshake_error, write_pair

from kvstore.cli.discover import ETCD_ENV, STATE_ENV
from kvstore.client import KVClient
from kvstore.client.cluster import ClusterClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.config import TLSConfig
from kvstore.coord.etcd import EtcdClient
from kvstore import errors
from kvstore.devcluster import ClusterState
from kvstore.tls import channel
from kvstore.v1 import agent_pb2, agent_pb2_grpc

SPEC = make_namespace()  # 4 KiB blocks


def blocks_for(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, SPEC.block_bytes), dtype=torch.uint8, generator=g)
    return [r.view(torch_dtype(SPEC.kv_dtype)).view(block_shape(SPEC)) for r in raw]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b)
    )


def tls_agent(spawn_agent, pki, etcd=None, tls: TLSConfig | None = None, **cfg):
    if etcd is not None:
        cfg.update(etcd_endpoints=etcd.endpoint, lease_ttl_s=2)
    return spawn_agent(peer_port=free_port(), **pki.section(tls), **cfg)


def counters(client: KVClient) -> Counter:
    return Counter(dict(client.stats().counters))


def stats_code(address: str, tls: TLSConfig | None) -> grpc.StatusCode:
    """The status of one Stats call over a fresh channel presenting `tls`."""
    with channel(address, tls) as ch:
        try:
            agent_pb2_grpc.NodeAgentStub(ch).Stats(agent_pb2.StatsRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def etcd_lists(endpoint: str, tls: TLSConfig | None) -> bool:
    async def main() -> bool:
        async with EtcdClient(endpoint, timeout=3.0, tls=tls) as c:
            await c.list_nodes()
            return True

    try:
        return asyncio.run(main())
    except errors.KvError:
        return False


def test_a_cluster_with_mtls_on_every_port_serves_routes_and_moves_blocks(
    spawn_agent, pki, tls_etcd, start_tls_router
):
    a = tls_agent(spawn_agent, pki, tls_etcd)
    b = tls_agent(spawn_agent, pki, tls_etcd)
    g = tls_agent(spawn_agent, pki, tls_etcd, ucx_enabled=False)  # pulls over gRPC only
    router = start_tls_router()
    router.wait_nodes({"agent-0", "agent-1", "agent-2"})  # ListNodes over mTLS; etcd over TLS
    nodes = router.nodes()
    with ClusterClient(router.address, tenant_secret=TEST_SECRET, tls=pki.client) as cc:
        ns = cc.open_namespace(SPEC)
        tokens = prompt_tokens(1, 6 * SPEC.block_size)
        kv = torch.cat([x for x in blocks_for(6, 1)], dim=2)
        miss = cc.fetch(ns, tokens)  # Route over mTLS, then the agent over mTLS
        assert miss.cached_tokens == 0
        assert cc.store(ns, miss, tokens, kv).cache_write_tokens == 6 * SPEC.block_size
        hit = cc.fetch(ns, tokens)
        assert hit.cached_tokens == 6 * SPEC.block_size
    for dst, transport in ((a, "ucx"), (g, "grpc")):
        with (
            KVClient(b.address, tenant_secret=TEST_SECRET, tls=pki.client) as cb,
            KVClient(dst.address, tenant_secret=TEST_SECRET, tls=pki.client) as cd,
        ):
            nb = cb.open_namespace(SPEC)
            seed = 10 if transport == "ucx" else 11
            ids = cb.block_ids(nb, prompt_tokens(seed, 8 * SPEC.block_size))
            blocks = blocks_for(8, seed)
            assert cb.put(nb, ids, blocks).stored == 8
            nd = cd.open_namespace(SPEC)
            ucx = nodes["agent-1"].peer_address if transport == "ucx" else ""
            r = cd.prefetch(nd, ids, b.address, ucx)
            assert (r.present, r.fetched, r.transport, r.stopped) == (8, 8, transport, "")
            assert same_bytes(cd.get(nd, ids), blocks)
    with KVClient(b.address, tenant_secret=TEST_SECRET, tls=pki.client, use_shm=False) as cb:
        assert counters(cb)["peer_ucx_auth_refused"] == 0


def test_plaintext_no_certificate_and_another_cas_certificate_are_refused_on_every_port(
    spawn_agent, pki, tls_etcd, start_tls_router
):
    a = tls_agent(spawn_agent, pki, tls_etcd)
    router = start_tls_router()
    router.wait_nodes({"agent-0"})
    for address in (a.address, router.address, tls_etcd.endpoint):
        assert handshake_error(address, pki.client, pki.client.ca_file) == ""  # the control
        assert handshake_error(address, None, pki.client.ca_file) != ""
        assert handshake_error(address, pki.stranger, pki.client.ca_file) != ""
    for tls in (None, pki.stranger):
        assert stats_code(a.address, tls) == grpc.StatusCode.UNAVAILABLE
        with ClusterClient(router.address, tls=tls, timeout=5) as cc:
            with pytest.raises(Exception) as ei:
                cc.nodes()
            assert "UNAVAILABLE" in str(ei.value)
        assert not etcd_lists(tls_etcd.endpoint, tls)
    assert stats_code(a.address, pki.client) == grpc.StatusCode.OK
    assert etcd_lists(tls_etcd.endpoint, pki.client)


def test_the_ucx_listener_refuses_a_peer_without_a_cluster_certificate(spawn_agent, pki):
    """B holds blocks; A (no TLS at all) and S (a certificate of another CA) ask for them
    over UCX, then over gRPC: both refused at the handshake, nothing moves."""
    b = tls_agent(spawn_agent, pki)
    a = spawn_agent(peer_port=free_port())
    s = tls_agent(spawn_agent, pki, tls=pki.stranger)
    with KVClient(b.address, tenant_secret=TEST_SECRET, tls=pki.client) as cb:
        nb = cb.open_namespace(SPEC)
        ids = cb.block_ids(nb, prompt_tokens(3, 4 * SPEC.block_size))
        assert cb.put(nb, ids, blocks_for(4, 3)).stored == 4
        ucx = f"127.0.0.1:{b.config['peer_port']}"
        own_ca = pki.stranger_own_ca
        for puller, tls in ((a, None), (s, pki.stranger)):
            # Our client trusts the puller's own certificate (S's is from the other CA).
            mine = TLSConfig(own_ca, pki.client.cert_file, pki.client.key_file) if tls else None
            with KVClient(puller.address, tenant_secret=TEST_SECRET, tls=mine) as cp:
                r = cp.prefetch(cp.open_namespace(SPEC), ids, b.address, ucx, timeout_ms=10_000)
                assert (r.present, r.fetched) == (0, 0) and r.stopped, r
        assert counters(cb)["peer_ucx_auth_refused"] == 2


def test_rotated_files_are_used_by_new_connections_without_a_restart(spawn_agent, pki):
    a = tls_agent(spawn_agent, pki)
    pid = a.proc.pid
    assert stats_code(a.address, pki.client) == grpc.StatusCode.OK
    import trustme

    new_ca = trustme.CA()  # rotate the whole trust: new CA, new server and client pairs
    server_dir = os.path.dirname(pki.server.cert_file)
    write_pair(new_ca, pki.directory / "cluster", "server", "127.0.0.1", "localhost")
    new_client = write_pair(new_ca, pki.directory / "rotated", "client", "kvstore-client")
    assert os.path.dirname(pki.server.ca_file) == server_dir
    wait_for(
        lambda: stats_code(a.address, new_client) == grpc.StatusCode.OK,
        30,
        what="the agent to take the new certificates",
    )
    old_client = TLSConfig(new_client.ca_file, pki.client.cert_file, pki.client.key_file)
    assert stats_code(a.address, old_client) == grpc.StatusCode.UNAVAILABLE  # old CA gone
    assert a.proc.pid == pid and a.proc.poll() is None
    assert "TLS files changed on disk" in a.log


def _kvctl(cwd, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (ETCD_ENV, STATE_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [PY, "-m", "kvstore.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_kvctl_cluster_up_tls_then_a_bare_status(tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    state = work / ".state" / "cluster"
    up = _kvctl(work, "cluster", "up", "--tls", "--agents", "1", "--pool-bytes", "32MiB")
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        st = ClusterState.load(state)
        assert st.tls_dir == str(state / "tls")
        for name in ("ca.crt", "client.crt", "client.key"):
            assert (state / "tls" / name).is_file()
        r = _kvctl(work, "status", "--output", "json")
        assert r.returncode == 0, r.stderr
        view = json.loads(r.stdout)
        assert view["health"] == "healthy" and [n["node_id"] for n in view["nodes"]] == ["agent-0"]
        r = _kvctl(work, "cluster", "status")
        assert r.returncode == 0, r.stderr + r.stdout
        # Without the client pair nothing answers: the cluster really runs with mTLS.
        agent = st.agents[0].address
        assert stats_code(agent, None) == grpc.StatusCode.UNAVAILABLE
        assert etcd_lists(st.etcd_endpoint, None) is False
        assert stats_code(agent, st.client_tls) == grpc.StatusCode.OK
    finally:
        _kvctl(work, "cluster", "down", "--state-dir", str(state), "--grace", "5")


def test_kvctl_to_a_tls_etcd_says_what_to_check(tmp_path, tls_etcd, pki):
    """kvctl without the client pair got "Socket closed ... is etcd running?", and with a
    CA that did not sign etcd's certificate also a line of gRPC's own log first."""
    env = {k: v for k, v in os.environ.items() if k not in (ETCD_ENV, "GRPC_VERBOSITY")}
    env["PYTHONPATH"] = str(ROOT)
    at = ["--etcd", tls_etcd.endpoint]

    def kvctl(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PY, "-m", "kvstore.cli", "status", *at, *flags],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    plain = kvctl()
    assert plain.returncode == 3, plain.stderr
    assert "pass --tls-ca, --tls-cert and --tls-key" in plain.stderr, plain.stderr
    own_ca = ["--tls-ca", pki.stranger_own_ca]  # not the CA that signed etcd's certificate
    wrong = kvctl(*own_ca, "--tls-cert", pki.stranger.cert_file, "--tls-key", pki.stranger.key_file)
    assert wrong.returncode == 3, wrong.stderr
    assert "the TLS handshake failed: --tls-ca must be the CA" in wrong.stderr, wrong.stderr
    assert wrong.stderr.startswith("kvctl status: etcd unreachable"), wrong.stderr  # no log line
    right = ["--tls-ca", pki.client.ca_file, "--tls-cert", pki.client.cert_file]
    assert kvctl(*right, "--tls-key", pki.client.key_file).returncode == 0


def test_unreadable_tls_files_are_a_configuration_error_not_a_traceback(tmp_path, pki):
    cfg = tmp_path / "agent.json"
    missing = str(tmp_path / "missing.crt")
    cfg.write_text(
        json.dumps(
            {
                "data_dir": str(tmp_path / "d"),
                "device": "cpu",
                "tls": {"ca_file": missing, "cert_file": pki.server.cert_file, "key_file": "k"},
            }
        )
    )
    r = subprocess.run(
        [PY, "-m", "node_agent", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot read the CA file (tls.ca_file) {missing}" in r.stderr
    r = _kvctl(tmp_path, "status", "--etcd", "127.0.0.1:1", "--tls-ca", pki.client.ca_file)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "cert_file, key_file must be set with ca_file" in r.stderr
