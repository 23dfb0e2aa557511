"""The vLLM part of loadtest/bench_gateway.py: two vLLM CPU engines (tiny model, our
connector, one agent each; `kvctl cluster up --engines 2` in a temporary state dir) and a
multi-tenant multi-turn chat workload (loadtest/chat_workload.py) through the gateway,
then by round robin and by consistent hashing of the session straight to the engines."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

from kvstore import devcluster
from kvstore.devcluster import UpOptions
from loadtest.chat_workload import Turn, Workload, ceiling, run

BLOCK = 32  # kvstore.devengines.EngineLaunch's default block size


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _figures(prefix: str, turns: list[Turn]) -> dict:
    prompt = sum(t.prompt_tokens for t in turns)
    ttft = [t.ttft_ms for t in turns]
    return {
        f"{prefix}ttft_p50_ms": round(_pct(ttft, 0.5), 1),
        f"{prefix}ttft_p99_ms": round(_pct(ttft, 0.99), 1),
        f"{prefix}cached_token_share": round(sum(t.cached_tokens for t in turns) / prompt, 4),
    }


def vllm_run(tenants: int = 3, sessions: int = 3, turns: int = 4) -> dict:
    w = Workload(("acme", "globex", "initech")[:tenants], sessions, turns)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-vllm-") as tmp:
        state = Path(tmp) / "cluster"
        opts = UpOptions(agents=2, engines=2, pool_bytes="64MiB", nvme_bytes="256MiB")
        st = devcluster.up(state, opts, say=lambda _m: None)
        try:
            keys = {t: k for k, t in json.loads(Path(st.gateway_keys).read_text()).items()}
            engines = {p.name: p.address for p in st.procs if p.kind == "engine"}
            out: dict = {}
            for mode, prefix in (("gateway", ""), ("rr", "rr_"), ("chash", "chash_")):
                res = asyncio.run(run(w, mode, st.gateway_url, keys, engines))
                out |= _figures(prefix, res)
                if mode == "gateway":
                    out["ceiling"] = round(ceiling(res, BLOCK), 4)
            out["vllm_requests_per_mode"] = len(res)
        finally:
            devcluster.down(state, grace_s=20)
    return out
