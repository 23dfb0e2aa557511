"""The connector behind vLLM's own OpenAI server, seen as its users see it (issue 15): the
tokens kvstore served show in each response's `prompt_tokens_details.cached_tokens`, in
vLLM's own Prometheus counters, in the agent's per-tenant metrics and in `kvctl stats`,
each engine request counted once; a connector config missing a field leaves the reason in
the engine's log and the engine serving, recomputing everything.

vLLM's own prefix cache is off, so every cached token came through kvstore; a third
engine with it on shows that what the engine's own cache served is not counted as
kvstore's. Three engine starts (vLLM's api_server through its registrar,
kvstore.devengines), real etcd and agent.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest
from support.common import free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families
from support.control import AgentClient, agent_cfg, kvctl_json

from kvstore.devengines import VLLM_PY, EngineLaunch, start_engine, stop_engine

MODEL = "tiny"
BLOCK = 32
TENANT = "acme"

pytestmark = [
    pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm: run `make vllm-env`"),
    pytest.mark.timeout(900),
]


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(151)
    a = [rng.randrange(1, 1000) for _ in range(200)]
    return {"A": a, "B": a[:100] + [rng.randrange(1, 1000) for _ in range(100)]}


def _complete(url: str, prompt: list[int]) -> tuple[str, int]:
    """(text, cached tokens) of a greedy completion of `prompt` (token ids)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    details = out["usage"].get("prompt_tokens_details") or {}
    return out["choices"][0]["text"], int(details.get("cached_tokens") or 0)


def _agent_counter(port: int, name: str) -> float:
    """One of the agent's per-tenant counters, for TENANT (absent: fails, named)."""
    page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            if s.name == name and s.labels.get("tenant") == TENANT:
                return s.value
    raise AssertionError(f"no sample {name}{{tenant={TENANT}}}")


def _vllm_counter(url: str, name: str) -> float:
    """One of vLLM's counters, summed over its labels (one engine here)."""
    page = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


class Engines:
    """engines(name, agent, ...) -> (launch, log path); stop_all(); `tmpdir`: the TMPDIR
    the engines (and everything else this test starts) were given."""

    def __init__(self, start, procs: list, tmpdir: Path) -> None:
        self._start, self._procs, self.tmpdir = start, procs, tmpdir

    def __call__(self, *args, **kwargs) -> tuple[EngineLaunch, Path]:
        return self._start(*args, **kwargs)

    def stop_all(self) -> None:
        while self._procs:
            stop_engine(self._procs.pop().pid)


@pytest.fixture
def engines(tmp_path, etcd, monkeypatch):
    """Engines that are all stopped at the end."""
    model = tmp_path / "tiny-llama"
    subprocess.run(
        [str(VLLM_PY), "-m", "loadtest.vllm_model", str(model), "--seed", "1"],
        check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )  # fmt: skip
    (tmp_path / "kv.secret").write_text("vllm-server-secret")
    # the engines' temporary directory, not the host's /tmp; short (under the host's):
    # vLLM's socket paths in it must fit 107 bytes, and tmp_path is too long for that
    tmpdir = Path(tempfile.mkdtemp(prefix="kvs-"))
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    procs: list = []

    def start(
        name: str, agent, tenant: str = TENANT, prefix_caching: bool = False
    ) -> tuple[EngineLaunch, Path]:
        launch = EngineLaunch(
            name, free_port(), str(model), MODEL, agent.address, agent.config["node_id"],
            tenant, str(tmp_path / "kv.secret"), etcd.endpoint, str(tmp_path / name),
            block_size=BLOCK, prefix_caching=prefix_caching,
        )  # fmt: skip
        proc = start_engine(launch, new_session=True)
        procs.append(proc)
        log = Path(launch.workdir) / "engine.log"

        def healthy() -> bool:
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            try:
                return httpx.get(launch.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 400, 0.5, what=f"engine {name} answering /health")
        return launch, log

    running = Engines(start, procs, tmpdir)
    yield running
    running.stop_all()
    shutil.rmtree(tmpdir, ignore_errors=True)


def test_served_tokens_show_in_usage_vllm_counters_agent_metrics_and_kvctl_stats(
    engines, etcd, spawn_agent
):
    p = _prompts()
    port = free_port()
    agent = spawn_agent(**agent_cfg(etcd, metrics_port=port))
    launch, _ = engines("e0", agent)
    url = launch.url

    a_text, a_cached = _complete(url, p["A"])  # nothing stored yet: a miss, then saved
    assert a_cached == 0
    held = lambda: AgentClient(agent.address).stats().tiers[0].blocks  # noqa: E731
    wait_for(lambda: held() >= 200 // BLOCK, 60, 0.2, what="A's blocks saved to the agent")
    again = _complete(url, p["A"])  # every full block but the last prompt token's
    assert again == (a_text, (200 - 1) // BLOCK * BLOCK)
    b_text, b_cached = _complete(url, p["B"])  # B shares A's first 100 tokens: 3 blocks
    assert b_cached == 3 * BLOCK
    served = again[1] + b_cached

    # vLLM's own counters: what its connector reported, all of it kvstore's (no prefix
    # cache of its own here).
    wait_for(
        lambda: _vllm_counter(url, "vllm:external_prefix_cache_hits_total") == served,
        30, 0.2, what="vLLM's external prefix cache hits",
    )  # fmt: skip
    assert _vllm_counter(url, "vllm:prompt_tokens_cached_total") == served
    assert _vllm_counter(url, "vllm:prefix_cache_hits_total") == 0

    # The agent: three engine requests, each counted once (a Lookup, and for the hits a
    # Get: one request), two of them hits; the tokens its Gets served are vLLM's.
    assert _agent_counter(port, "kvstore_requests_total") == 3
    assert _agent_counter(port, "kvstore_requests_hit_total") == 2
    assert _agent_counter(port, "kvstore_lookup_hit_tokens_total") == (6 + 3) * BLOCK
    assert _agent_counter(port, "kvstore_saved_prefill_tokens_total") == served
    (t,) = kvctl_json("stats", "--tenant", TENANT, etcd=etcd)["tenants"]
    assert (t["lookups"], t["lookup_hits"]) == (3, 2)
    assert (t["lookup_blocks"], t["lookup_hit_blocks"]) == (3 * 6, 6 + 3)
    assert t["request_hit_rate"] == pytest.approx(2 / 3)

    # A connector config without a tenant: refused with the reason in the engine's log;
    # the engine still serves, recomputing, with the same output.
    launch2, log2 = engines("e1", agent, tenant="")
    assert _complete(launch2.url, p["A"]) == (a_text, 0)
    log = log2.read_text(errors="replace")
    assert (
        "kvstore connector disabled, recomputing everything: kv_connector_extra_config lacks tenant"
    ) in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert kvctl_json("stats", "--tenant", TENANT, etcd=etcd)["tenants"][0]["lookups"] == 3

    # vLLM's own prefix cache on: a fresh engine gets A from kvstore, then A again from
    # its own cache. That second request is the engine's hit, not kvstore's: the
    # connector tells the agent which blocks the engine holds (caller_held), and the
    # tenant's rates gain one request, hit, of A's 6 blocks, not two.
    launch3, _ = engines("e2", agent, prefix_caching=True)
    assert _complete(launch3.url, p["A"]) == again  # from kvstore
    assert _vllm_counter(launch3.url, "vllm:prefix_cache_hits_total") == 0
    assert _complete(launch3.url, p["A"]) == again  # from the engine's own cache
    wait_for(
        lambda: _vllm_counter(launch3.url, "vllm:prefix_cache_hits_total") == 6 * BLOCK,
        30, 0.2, what="vLLM's own prefix cache hits",
    )  # fmt: skip
    (t,) = kvctl_json("stats", "--tenant", TENANT, etcd=etcd)["tenants"]
    assert (t["lookups"], t["lookup_hits"]) == (4, 3)
    assert (t["lookup_blocks"], t["lookup_hit_blocks"]) == (4 * 6, 6 + 3 + 6)

    # Each engine's IPC sockets and torch.distributed file store lie in a directory of
    # its own under TMPDIR while it runs (kvstore/integrations/engine_tmp.py), and go
    # with it: stopped, the three engines leave nothing in the temporary directory (vLLM
    # left ~8 files per engine in /tmp when it was stopped by a signal).
    made = sorted(engines.tmpdir.iterdir())
    assert [d.name.startswith("kvstore-vllm-") for d in made] == [True] * 3, made
    assert all(any(d.iterdir()) for d in made), made  # vLLM put its files there
    engines.stop_all()
    assert sorted(engines.tmpdir.iterdir()) == []
