"""Gateway benchmark; prints ONE JSON line.

Overhead: the router's gateway in front of two stand-in OpenAI workers
(loadtest/standin_openai.py: canned answers at once, so the gateway is the bottleneck),
against calling the workers directly, in the same run: `gateway_added_p50_ms` /
`gateway_added_p99_ms` (sequential requests, interleaved, p(via) - p(direct), one client
and the same stand-ins for both), `gateway_rps` / `direct_rps` (concurrent clients, in
alternating rounds: on a shared host the load shifts within seconds, and a direct phase
followed by a gateway phase compared two different hosts), and
the CPU the router process spends per request (`gateway_cpu_ms_per_request`: what a
shared, loaded host does not change, unlike wall-clock latency). The stand-ins register
the engines' namespace, so every request takes the whole path: tokenizing, chain ids,
the router's cost function, the forward. Every socket on the way sets TCP_NODELAY
(httpx's sync client by itself, aiohttp's connections, the gateway's and the
stand-ins' listeners): without it a keep-alive answer can wait ~40 ms for a delayed ACK.

vLLM (`--vllm`): two vLLM CPU engines (tiny model, our connector, one agent each) behind
the gateway, a multi-tenant multi-turn chat workload (tenants share a system prompt among
their sessions), streaming: TTFT p50/p99 and the cached-token share through the gateway
(the router's cost function), against round robin (`rr_`) and consistent hashing of the
session (`chash_`) to the same engines directly, each mode under its own cache_salt so no
mode reuses another's KV; `ceiling` is the share an unbounded single cache would get.

    python -m loadtest.bench_gateway [--vllm] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvstore import devcluster
from kvstore.devcluster import UpOptions, engine_record_key_file
from kvstore.devengines import KV_TENANT
from kvstore.namespace import Namespace
from loadtest.vllm_model import write_word_tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise SystemExit(f"bench_gateway: timed out waiting for {what}")


def _engines(url: str) -> int:
    try:
        return int(httpx.get(url + "/health", timeout=2).json()["engines"])
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def _namespace_file(state: Path) -> Path:
    """An engine's namespace as its connector publishes it: the gateway hashes prompts
    into chain ids with it and prices them, as it does for vLLM engines."""
    spec = Namespace(tenant=KV_TENANT, name="bench", model_name=MODEL, model_revision="r1",
                     adapter_id="none", adapter_revision="none", tokenizer_id="word",
                     tokenizer_revision="r1", rope_type="default", rope_theta=10000.0,
                     rope_scaling="none", attention_impl="sdpa", kv_dtype="float16",
                     prompt_template_version="v1", num_layers=2, num_kv_heads=2, head_dim=16,
                     tp_rank=0, tp_size=1, block_size=16)  # fmt: skip
    path = state / "namespace.json"
    path.write_text(json.dumps(spec.to_dict()))
    return path


def _standins(state: Path, etcd: str, n: int) -> tuple[list[str], list[subprocess.Popen]]:
    urls, procs = [], []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ns_file = _namespace_file(state)
    for i in range(n):
        ready = state / f"standin-{i}.ready"
        ready.unlink(missing_ok=True)
        log = open(state / f"standin-{i}.log", "ab")
        cmd = [sys.executable, "-m", "loadtest.standin_openai", "--ready-file", str(ready),
               "--name", f"w{i}"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        _wait(ready.exists, 60, "a stand-in worker")
        url = "http://" + ready.read_text().strip()
        urls.append(url)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvstore.integrations.vllm_serve", "--engine-id", f"w{i}",
             "--url", url, "--node-id", "agent-0", "--model", MODEL, "--etcd-endpoints", etcd,
             "--namespace-file", str(ns_file),
             "--record-key-file", str(engine_record_key_file(state / "cluster"))],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
    return urls, procs


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _body(i: int) -> dict:
    prompt = " ".join(f"w{(i * 31 + k) % 990 + 5}" for k in range(128))
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4}


def _latency(gw: str, direct: list[str], key: str, n: int) -> dict:
    auth = {"authorization": f"Bearer {key}"}
    via_ms, direct_ms = [], []
    with httpx.Client(timeout=30) as c:
        for i in range(n + 20):
            t0 = time.perf_counter()
            assert c.post(direct[i % len(direct)] + "/v1/completions", json=_body(i)).is_success
            t1 = time.perf_counter()
            assert c.post(gw + "/v1/completions", json=_body(i), headers=auth).is_success
            t2 = time.perf_counter()
            if i >= 20:  # warm-up: connections, caches
                direct_ms.append((t1 - t0) * 1000)
                via_ms.append((t2 - t1) * 1000)
    return {
        "gateway_added_p50_ms": statistics.median(via_ms) - statistics.median(direct_ms),
        "gateway_added_p99_ms": _pct(via_ms, 0.99) - _pct(direct_ms, 0.99),
        "direct_p50_ms": statistics.median(direct_ms),
        "via_p50_ms": statistics.median(via_ms),
    }


async def _rps(
    urls: list[str], headers: dict, n: int, first: int = 0, concurrency: int = 32
) -> float:
    """Seconds `n` requests take from `concurrency` clients (the prompts of
    _body(first..first + n))."""
    todo = iter(range(first, first + n))
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as c:

        async def worker() -> None:
            for i in todo:
                r = await c.post(urls[i % len(urls)] + "/v1/completions", json=_body(i),
                                 headers=headers)  # fmt: skip
                assert r.is_success, r.text

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0


RPS_ROUNDS = 4  # direct, then through the gateway, this many times


def _throughput(
    gw: str, direct: list[str], auth: dict, n: int, router: int, workers: list[int]
) -> dict:
    """Requests per second direct and through the gateway over `n` requests each, in
    alternating rounds, and the CPU per request of the router and of the workers in the
    gateway's rounds."""
    direct_s = gateway_s = cpu_s = wcpu_s = 0.0
    per_round = max(1, n // RPS_ROUNDS)
    for r in range(RPS_ROUNDS):  # the same prompts as one phase of n would send
        direct_s += asyncio.run(_rps(direct, {}, per_round, r * per_round))
        cpu0, wcpu0 = _cpu_s(router), sum(_cpu_s(w) for w in workers)
        gateway_s += asyncio.run(_rps([gw], auth, per_round, r * per_round))
        cpu_s += _cpu_s(router) - cpu0
        wcpu_s += sum(_cpu_s(w) for w in workers) - wcpu0
    total = per_round * RPS_ROUNDS
    return {
        "direct_rps": total / direct_s,
        "gateway_rps": total / gateway_s,
        # CPU per request does not depend on what else the machine runs; wall-clock
        # latency on a shared, loaded machine does.
        "gateway_cpu_ms_per_request": cpu_s * 1000 / total,
        "worker_cpu_ms_per_request": wcpu_s * 1000 / total,
    }


def overhead(requests: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        state = Path(tmp)
        tok = write_word_tokenizer(state / "tokenizer")
        opts = UpOptions(
            agents=1,
            pool_bytes="16MiB",
            nvme_bytes="64MiB",
            gateway_tokenizers=((MODEL, str(tok)),),
            router_log_level="WARNING",
        )
        st = devcluster.up(state / "cluster", opts, say=lambda _m: None)
        procs: list[subprocess.Popen] = []
        try:
            urls, procs = _standins(state, st.etcd_endpoint, 2)
            _wait(lambda: _engines(st.gateway_url) == 2, 60, "the stand-ins in the gateway")
            key = next(iter(json.loads(Path(st.gateway_keys).read_text())))
            lat = _latency(st.gateway_url, urls, key, requests)
            auth = {"authorization": f"Bearer {key}"}
            router = next(p.pid for p in st.procs if p.kind == "router")
            workers = [p.pid for p in procs[::2]]
            rates = _throughput(st.gateway_url, urls, auth, requests * 2, router, workers)
            for k in ("gateway_cpu_ms_per_request", "worker_cpu_ms_per_request"):
                lat[k] = rates.pop(k)
            lat["load_average_1m"] = os.getloadavg()[0]
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)
            devcluster.down(state / "cluster", grace_s=5)
    return {
        **{k: round(v, 3) for k, v in lat.items()},
        "gateway_rps": round(rates["gateway_rps"], 1),
        "direct_rps": round(rates["direct_rps"], 1),
        "overhead_requests": requests,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--vllm", action="store_true", help="also the run on vLLM CPU engines")
    a = ap.parse_args()
    out = overhead(a.requests)
    out["goals"] = {
        "gateway_added_p50_ms<=2": out["gateway_added_p50_ms"] <= 2,
        "gateway_rps>=0.5*direct_rps": out["gateway_rps"] >= 0.5 * out["direct_rps"],
    }
    if a.vllm:
        from loadtest.bench_gateway_vllm import goals, vllm_run

        res = vllm_run()
        out.update(res)
        out["goals"] |= goals(res)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
