"""`kvctl cluster up --tls --engines 1` (issue 18): the dev cluster with a real vLLM CPU
engine runs every HTTP hop with mTLS. A chat request reaches the engine through the
gateway over HTTPS with the dev CA, and its repeat is served from cache; the engine
itself answers only HTTPS with a certificate of the dev CA (plaintext and a client
without a certificate are refused); its KV events reach the router on loopback; `kvctl
cluster status` sees it healthy over HTTPS; `kvctl cluster down` stops every process,
the engine's whole session included.

One engine start for the whole file. Run it under `flock /tmp/kvstore-vllm.lock`."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
from urllib.parse import urlsplit

import httpx
import pytest
from support.common import PY, ROOT, wait_for

from kvstore.cli.discover import ETCD_ENV, STATE_ENV
from kvstore.devcluster import ClusterState
from kvstore.devprocs import alive
from kvstore.devengines import DEMO_KEYS, MODEL_NAME, VLLM_PY

pytestmark = [
    pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm: run `make vllm-env`"),
    pytest.mark.timeout(1500),
]

ACME = {"authorization": f"Bearer {next(k for k, t in DEMO_KEYS.items() if t == 'acme')}"}


def _kvctl(cwd, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (ETCD_ENV, STATE_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([PY, "-m", "kvstore.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _contexts(tls_dir: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(the dev CA alone, the dev CA with the client pair)."""
    bare = ssl.create_default_context(cafile=f"{tls_dir}/ca.crt")
    paired = ssl.create_default_context(cafile=f"{tls_dir}/ca.crt")
    paired.load_cert_chain(f"{tls_dir}/client.crt", f"{tls_dir}/client.key")
    return bare, paired


def _cached(resp: httpx.Response) -> int:
    usage = resp.json()["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _engine_blocks(url: str) -> int:
    """Blocks the router indexed in the engine's own cache, from its KV events (the
    gateway's metrics, on the router's Prometheus port)."""
    page = httpx.get(url, timeout=10).text
    found = re.findall(r"^kvstore_gateway_engine_cached_blocks\{.*\} (\S+)$", page, re.M)
    return sum(int(float(m)) for m in found)


def _check_the_running_cluster(work, st: ClusterState) -> None:
    bare, paired = _contexts(st.tls_dir)
    assert st.gateway_url.startswith("https://127.0.0.1:")
    (engine,) = [p for p in st.procs if p.kind == "engine"]
    assert engine.address.startswith("https://127.0.0.1:")
    words = " ".join(f"w{(i * 7919) % 900 + 5}" for i in range(160))  # > 2 blocks of 32
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": words}],
            "max_tokens": 4, "temperature": 0.0}  # fmt: skip
    with httpx.Client(verify=bare, timeout=300) as gw:
        first = gw.post(st.gateway_url + "/v1/chat/completions", json=body, headers=ACME)
        assert first.status_code == 200, first.text
        # The engine's KV events reached the router over the loopback-only sockets.
        wait_for(lambda: _engine_blocks(st.metrics_url) > 0, 120, 0.5,
                 what="the router to index the engine's cache")  # fmt: skip
        second = gw.post(st.gateway_url + "/v1/chat/completions", json=body, headers=ACME)
        assert second.status_code == 200, second.text
    assert _cached(second) >= 32 and _cached(second) > _cached(first)
    port = urlsplit(engine.address).port
    with pytest.raises(httpx.TransportError):  # plaintext on the engine's port
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
    with pytest.raises(httpx.TransportError):  # HTTPS without a client certificate
        httpx.get(engine.address + "/health", verify=bare, timeout=30)
    assert httpx.get(engine.address + "/health", verify=paired, timeout=30).status_code == 200
    r = _kvctl(work, "cluster", "status", "--output", "json")
    assert r.returncode == 0, r.stderr + r.stdout
    rows = {c["name"]: c for c in json.loads(r.stdout)["components"]}
    assert rows[engine.name]["healthy"] is True


def test_cluster_up_tls_with_an_engine_serves_chat_over_mtls_and_stops(tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    state = work / ".state" / "cluster"
    up = _kvctl(work, "cluster", "up", "--tls", "--agents", "1", "--engines", "1",
                "--pool-bytes", "32MiB", timeout=1300)  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        st = ClusterState.load(state)
        _check_the_running_cluster(work, st)
    finally:
        down = _kvctl(work, "cluster", "down", "--state-dir", str(state), "--grace", "10")
    assert down.returncode == 0, down.stderr + down.stdout
    assert [p.name for p in st.procs if alive(p.pid, p.kind)] == []
    (engine,) = [p for p in st.procs if p.kind == "engine"]
    with pytest.raises(ProcessLookupError):  # vLLM and its engine core went with it
        os.killpg(engine.pid, 0)
