"""The vLLM part of loadtest/bench_gateway.py: two vLLM CPU engines (tiny model, our
connector, one agent each; `kvctl cluster up --engines 2` in a temporary state dir) and a
multi-tenant multi-turn chat workload (loadtest/chat_workload.py) through the gateway,
by round robin and by consistent hashing of the session straight to the engines. The
three modes' turns are interleaved (turn t of each, in an order rotated every turn,
before turn t + 1 of any): run one mode after another, the first (the gateway's) met the
engines' first real requests and the host load of another moment than the others did.
Run alone it prints ONE JSON line with its goals (what `bench_gateway --vllm` adds):

    python -m loadtest.bench_gateway_vllm [--sessions 3] [--turns 4] [--rounds 3]
                                          [--requests-file F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

from kvstore import devcluster
from kvstore.devcluster import UpOptions
from loadtest.chat_workload import MODES, Turn, Workload, ceiling, run_interleaved
from router.gateway.prompt import PromptCodec

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


def _warm_up(engines: dict[str, str]) -> None:
    """A few requests on every engine under a salt no mode uses: the first requests of a
    fresh vLLM engine are slower."""
    import httpx

    for url in engines.values():
        for i in range(3):
            body = {"model": "tiny", "max_tokens": 2, "cache_salt": "warm-up",
                    "messages": [{"role": "user", "content": f"w{i} " * 300}]}  # fmt: skip
            httpx.post(url + "/v1/chat/completions", json=body, timeout=300).raise_for_status()


def vllm_run(
    tenants: int = 3, sessions: int = 3, turns: int = 4, rounds: int = 3, requests_file: str = ""
) -> dict:
    """`rounds` workloads of new conversations (seeds 1, 2, ...) one after another, each
    mode's figures over all of them: one round is 36 requests a mode, and one stalled
    engine step (1-2 s on this shared host) moves a median of 36 by hundreds of ms.
    `requests_file`: also write every request (mode, round, session, turn, engine, cached
    tokens, TTFT, the gateway's pricing; no text) there, one JSON object a line."""
    names = ("acme", "globex", "initech")[:tenants]
    ws = [Workload(names, sessions, turns, seed=1 + r) for r in range(rounds)]
    with tempfile.TemporaryDirectory(prefix="bench-gateway-vllm-") as tmp:
        state = Path(tmp) / "cluster"
        opts = UpOptions(agents=2, engines=2, pool_bytes="64MiB", nvme_bytes="256MiB")
        st = devcluster.up(state, opts, say=lambda _m: None)
        try:
            keys = {t: k for k, t in json.loads(Path(st.gateway_keys).read_text()).items()}
            engines = {p.name: p.address for p in st.procs if p.kind == "engine"}
            _warm_up(engines)
            codec = PromptCodec.load(str(state / "model"))
            runs = asyncio.run(run_interleaved(ws, MODES, st.gateway_url, keys, engines,
                                               codec=codec))  # fmt: skip
            out = _report(runs)
            if requests_file:
                _write_requests(requests_file, runs)
            out["pull_cost_by_agent"] = asyncio.run(_pull_costs(st.etcd_endpoint))
            out["gateway_retries"] = _retries(st.metrics_url)
        finally:
            devcluster.down(state, grace_s=20)
    return out


def _report(runs: dict[str, list[Turn]]) -> dict:
    out: dict = {"mode_order": "interleaved per turn, rotated",
                 "rounds": 1 + max(t.round for t in runs["gateway"])}  # fmt: skip
    for mode, prefix in (("gateway", ""), ("rr", "rr_"), ("chash", "chash_")):
        out |= _figures(prefix, runs[mode])
    res = runs["gateway"]
    out["ceiling"] = round(ceiling(res, BLOCK), 4)
    # The ceiling's token ids are the engine's own (gateway tokenizer = vLLM's).
    out["ceiling_ids_match"] = all(len(t.prompt_ids) == t.prompt_tokens for t in res)
    per: dict[str, int] = {}
    for t in res:
        per[t.engine] = per.get(t.engine, 0) + 1
    out["requests_per_engine"] = per
    # Requests the router sent where a peer pull was priced in (hinted).
    out["peer_hinted_requests"] = sum(
        " peer=" in t.priced and " peer=0 " not in t.priced for t in res
    )
    out["vllm_requests_per_mode"] = len(res)
    return out


def _write_requests(path: str, runs: dict[str, list[Turn]]) -> None:
    with open(path, "w") as f:
        for mode, turns in runs.items():
            for t in turns:
                row = {"mode": mode, "round": t.round, "tenant": t.tenant,
                       "session": t.session, "turn": t.turn,
                       "engine": t.engine, "prompt_tokens": t.prompt_tokens,
                       "cached_tokens": t.cached_tokens, "ttft_ms": round(t.ttft_ms, 1),
                       "priced": t.priced}  # fmt: skip
                f.write(json.dumps(row) + "\n")


def _retries(metrics_url: str) -> float:
    """Forwards the gateway retried on another engine (a failed forward suspends the
    engine): any would tilt the comparison, so the JSON line shows them. From the router's
    Prometheus port, where the gateway's metrics are."""
    import httpx

    page = httpx.get(metrics_url, timeout=30).text
    return sum(
        float(line.split()[-1])
        for line in page.splitlines()
        if line.startswith("kvstore_gateway_retries_total")
    )


async def _pull_costs(etcd: str) -> dict[str, dict[str, float]]:
    """Each agent's measured peer-pull fit as the router prices it (its etcd record)."""
    from kvstore.coord.etcd import EtcdClient

    async with EtcdClient(etcd) as c:
        nodes = await c.list_nodes()
    return {
        n.node_id: {
            "fixed_ms": n.pull_fixed_ms,
            "ms_per_mib": n.pull_ms_per_mib,
            "samples": n.pull_samples,
        }  # fmt: skip
        for n in nodes
    }


def goals(res: dict) -> dict[str, bool]:
    return {
        "ttft_p50_ms<rr_and_chash": res["ttft_p50_ms"]
        < min(res["rr_ttft_p50_ms"], res["chash_ttft_p50_ms"]),
        "cached_token_share>=0.9*ceiling": res["cached_token_share"] >= 0.9 * res["ceiling"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="workloads of new conversations")
    ap.add_argument("--requests-file", default="", help="write every request here (JSON lines)")
    a = ap.parse_args()
    if not 1 <= a.tenants <= 3:
        ap.error("--tenants must be 1, 2 or 3")
    for name in ("sessions", "turns", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    load = os.getloadavg()[0]
    res = vllm_run(a.tenants, a.sessions, a.turns, a.rounds, a.requests_file)
    res["load_average_1m"] = {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)}
    res["goals"] = goals(res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
