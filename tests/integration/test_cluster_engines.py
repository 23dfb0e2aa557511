"""What `make run` shows, end to end (issue 16 item 3): `kvctl cluster up --agents 2
--engines 2` starts two vLLM CPU engines behind the gateway, and `python -m loadtest.demo`
sends OpenAI chat sessions of several tenants through it, printing per request the engine
chosen, the engine's `cached_tokens` and the TTFT, against round robin straight to the
engines, then both summaries and the ceiling; `kvctl cluster down` stops everything.

One cluster for the whole file (two engine starts). Run it under
`flock /tmp/kvstore-vllm.lock`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest
from support.common import ROOT

from kvstore.cli.discover import ETCD_ENV, STATE_ENV
from kvstore.devcluster import ClusterState
from kvstore.devprocs import alive
from kvstore.devengines import VLLM_PY

pytestmark = [
    pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm: run `make vllm-env`"),
    pytest.mark.timeout(1500),
]

# "  gateway  acme     session 0 turn 1    412 tokens -> engine-1  cached   384 ( 93%)  TTFT ..."
ROW = re.compile(
    r"^\s+(gateway|rr)\s+(\w+)\s+session (\d+) turn (\d+)\s+(\d+) tokens -> (\S+)\s+"
    r"cached\s+(\d+) \(\s*\d+%\)\s+TTFT\s+([\d.]+) ms",
    re.M,
)


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (ETCD_ENV, STATE_ENV)}
    env |= {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def test_make_runs_path_chat_through_the_gateway_against_round_robin(tmp_path):
    state = tmp_path / "cluster"
    up = _run("-m", "kvstore.cli", "cluster", "up", "--agents", "2", "--engines", "2",
              "--pool-bytes", "32MiB", "--state-dir", str(state), timeout=1300)  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        st = ClusterState.load(state)
        engines = {p.name for p in st.procs if p.kind == "engine"}
        assert len(engines) == 2 and st.gateway_url
        # Where the gateway is, and its metrics: on the router's port, not the tenants'.
        table = _run("-m", "kvstore.cli", "cluster", "status", "--state-dir", str(state))
        assert f"gateway  {st.gateway_url}" in table.stdout, table.stdout
        assert f"metrics  {st.metrics_url}" in table.stdout, table.stdout
        assert "kvstore_gateway_inflight" in httpx.get(st.metrics_url, timeout=10).text
        assert httpx.get(st.gateway_url + "/metrics", timeout=10).status_code == 404
        demo = _run("-m", "loadtest.demo", "--state-dir", str(state), "--tenants", "2",
                    "--sessions", "1", "--turns", "2")  # fmt: skip
        assert demo.returncode == 0, demo.stderr + demo.stdout
        out = demo.stdout
        rows = ROW.findall(out)
        by_mode = {m: [r for r in rows if r[0] == m] for m in ("gateway", "rr")}
        # 2 tenants x 1 session x 2 turns, in each mode, every one answered by an engine
        assert [len(v) for v in by_mode.values()] == [4, 4], out
        assert {r[5] for r in rows} <= engines, out
        assert all(float(r[7]) > 0 for r in rows)
        # A session's second turn starts with its first: through the gateway it lands
        # where that prefix is cached and the engine reports cached tokens.
        second = [r for r in by_mode["gateway"] if r[3] == "1"]
        assert second and all(int(r[6]) > 0 for r in second), out
        assert re.search(r"ceiling \(one unbounded cache over the same prompts\):\s+[\d.]+%", out)
        for name in ("cache-aware", "round robin"):
            assert re.search(rf"{name}\s+cached-token share\s+[\d.]+%\s+TTFT p50\s+[\d.]+ ms", out)
    finally:
        down = _run("-m", "kvstore.cli", "cluster", "down", "--state-dir", str(state),
                    "--grace", "10")  # fmt: skip
    assert down.returncode == 0, down.stderr + down.stdout
    assert [p.name for p in st.procs if alive(p.pid, p.kind)] == []
