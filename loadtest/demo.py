"""Demo workload against a running local cluster (`kvctl cluster up`).

A few tenants, each with a shared system prompt, run multi-turn chat sessions: every
turn's prompt is the system prompt plus the whole conversation so far. Each request goes
through ClusterClient: route, load the cached prefix from the chosen agent, "prefill" the
rest (random KV for a tiny model layout), store the new blocks there, release the route.
The sessions of a turn run concurrently, so the router's load term has something to do.

The same workload then runs again with round-robin routing, in a fresh namespace so
neither run sees the other's blocks, and both are printed side by side with the ceiling
(an unbounded single cache over the same prompts).

Then, when the cluster runs vLLM engines behind the router's OpenAI gateway (`kvctl
cluster up --engines N`, what `make run` starts), OpenAI chat sessions of the same tenants
go through the gateway and, beside them, straight to the engines by round robin; each
request prints the engine that served it, `cached_tokens` from the engine's usage and
the TTFT (loadtest/chat_workload.py).

    python -m loadtest.demo --state-dir .state/cluster
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvstore.devcluster import ClusterError, ClusterState
from kvstore.client.cluster import ClusterClient, ClusterNamespace
from kvstore.hashing import hash_chain
from kvstore.namespace import Namespace

TINY = dict(
    model_name="demo-tiny",
    model_revision="r1",
    adapter_id="none",
    adapter_revision="none",
    tokenizer_id="demo-tok",
    tokenizer_revision="r1",
    rope_type="default",
    rope_theta=10000.0,
    rope_scaling="none",
    attention_impl="sdpa",
    kv_dtype="float16",
    prompt_template_version="v1",
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    tp_rank=0,
    tp_size=1,
    block_size=16,
)
TENANTS = ("acme", "globex", "initech")
ENGINE_BLOCK = 32  # kvstore.devengines.EngineLaunch's block size
# Each session's own history outweighs the tenant's shared system prompt, as in chat and
# agent loops: with a short history, round robin finds most of every prompt (the shared
# system prompt) on either engine and routing has little to win.
GATEWAY_WORKLOAD = {"system_words": 200, "user_words": 120}


@dataclass(frozen=True, slots=True)
class Request:
    index: int
    tenant: str
    session: int
    turn: int
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Result:
    request: Request
    node: str
    cached_tokens: int


def build_workload(tenants: int, sessions: int, turns: int, seed: int) -> list[list[Request]]:
    """Rounds of requests (one per live session per turn), deterministic for a seed."""
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> list[int]:
        return [rng.randrange(1, 32000) for _ in range(rng.randint(lo, hi))]

    systems = {t: text(400, 900) for t in TENANTS[:tenants]}
    history = {(t, s): list(systems[t]) for t in systems for s in range(sessions)}
    rounds, index = [], itertools.count()
    for turn in range(turns):
        batch = []
        for (tenant, s), hist in history.items():
            hist.extend(text(40, 160))  # the user's message
            batch.append(Request(next(index), tenant, s, turn, tuple(hist)))
            hist.extend(text(40, 160))  # the assistant's reply, part of the next prompt
        rng.shuffle(batch)  # sessions do not arrive in a fixed order
        rounds.append(batch)
    return rounds


def _one(cc: ClusterClient, ns: ClusterNamespace, req: Request, address: str | None) -> Result:
    hit = cc.fetch(ns, req.tokens, address=address)
    spec = ns.spec
    kv = torch.randn(
        spec.num_layers, 2, len(req.tokens), spec.num_kv_heads, spec.head_dim, dtype=torch.float16
    )
    if hit.cached_blocks:  # the cached prefix is what prefill would reuse
        kv[:, :, : hit.cached_tokens] = torch.cat(hit.hit.blocks, dim=2)
    cc.store(ns, hit, req.tokens, kv)
    return Result(req, hit.node_id or address, hit.cached_tokens)


def run(
    router: str, rounds: list[list[Request]], ns_name: str, round_robin: bool, out
) -> list[Result]:
    clients = {
        t: ClusterClient(router, tenant_secret=f"demo-secret-{t}", use_shm=False)
        for t in {r.tenant for batch in rounds for r in batch}
    }
    try:
        names = {n.address: n.node_id for n in next(iter(clients.values())).nodes()}
        cycle = itertools.cycle(sorted(names))
        spaces = {
            t: c.open_namespace(Namespace(tenant=t, name=ns_name, **TINY))
            for t, c in clients.items()
        }
        results = []
        with ThreadPoolExecutor(max_workers=8) as pool:
            for batch in rounds:
                futs = [
                    pool.submit(
                        _one,
                        clients[r.tenant],
                        spaces[r.tenant],
                        r,
                        next(cycle) if round_robin else None,
                    )
                    for r in batch
                ]
                for f in futs:
                    res = f.result()
                    res = Result(res.request, names.get(res.node, res.node), res.cached_tokens)
                    r = res.request
                    print(
                        f"  #{r.index:<3} {r.tenant:<8} session {r.session} turn {r.turn}  "
                        f"{len(r.tokens):5d} tokens -> {res.node:<8} cached "
                        f"{res.cached_tokens:5d} ({res.cached_tokens / len(r.tokens):4.0%})",
                        file=out,
                    )
                    results.append(res)
        return results
    finally:
        for c in clients.values():
            c.close()


def ceiling(rounds: list[list[Request]], block_size: int) -> tuple[int, int]:
    """(cached tokens, requests with a hit) of one unbounded cache over the same prompts."""
    seen: dict[str, set[bytes]] = {}
    cached = hits = 0
    root = bytes(16)
    for batch in rounds:
        keep = []
        for r in batch:
            ids = hash_chain(root, list(r.tokens), block_size)
            have = seen.setdefault(r.tenant, set())
            n = next((i for i, b in enumerate(ids) if b not in have), len(ids))
            cached += n * block_size
            hits += n > 0
            keep.append((r.tenant, ids))
        for tenant, ids in keep:  # a round's requests run concurrently: no intra-round hits
            seen[tenant].update(ids)
    return cached, hits


def summary(results: list[Result]) -> tuple[float, float, dict[str, int]]:
    prompt = sum(len(r.request.tokens) for r in results)
    cached = sum(r.cached_tokens for r in results)
    per_node: dict[str, int] = {}
    for r in results:
        per_node[r.node] = per_node.get(r.node, 0) + 1
    return cached / prompt, sum(r.cached_tokens > 0 for r in results) / len(results), per_node


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.demo",
        description="Demo workload on the local cluster: cache-aware "
        "routing against round-robin, side by side.",
    )
    p.add_argument(
        "--state-dir",
        default=".state/cluster",
        help="state directory of `kvctl cluster up` (default .state/cluster)",
    )
    p.add_argument("--tenants", type=int, default=3, choices=range(1, len(TENANTS) + 1))
    p.add_argument("--sessions", type=int, default=2, help="chat sessions per tenant")
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.sessions < 1 or args.turns < 1:
        p.error("--sessions and --turns must be >= 1")
    try:
        state = ClusterState.load(args.state_dir)
    except ClusterError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    rounds = build_workload(args.tenants, args.sessions, args.turns, args.seed)
    nonce = f"{int(time.time())}-{random.randrange(1 << 16):04x}"
    t0 = time.monotonic()
    print(f"cache-aware routing via {state.router_address} (namespace demo-{nonce}):")
    aware = run(state.router_address, rounds, f"demo-{nonce}", False, sys.stdout)
    print(f"\nround-robin routing (namespace demo-rr-{nonce}):")
    rr = run(state.router_address, rounds, f"demo-rr-{nonce}", True, sys.stdout)
    n = sum(len(b) for b in rounds)
    prompt = sum(len(r.tokens) for b in rounds for r in b)
    c_tok, c_req = ceiling(rounds, TINY["block_size"])
    rows = [("", "cache-aware", "round-robin", "ceiling")]
    (a_tok, a_req, a_nodes), (r_tok, r_req, r_nodes) = summary(aware), summary(rr)
    rows.append(
        ("token-weighted hit rate", f"{a_tok:.1%}", f"{r_tok:.1%}", f"{c_tok / prompt:.1%}")
    )
    rows.append(("request-weighted hit rate", f"{a_req:.1%}", f"{r_req:.1%}", f"{c_req / n:.1%}"))
    rows.append(("requests per node", _fmt(a_nodes), _fmt(r_nodes), "-"))
    print(
        f"\n{n} requests, {prompt} prompt tokens per run, "
        f"{time.monotonic() - t0:.1f}s for both runs"
    )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    if state.gateway_url:
        gateway_demo(state, args.state_dir, args.tenants, args.sessions, min(args.turns, 3))
    return 0


def gateway_demo(
    state: ClusterState, state_dir: str, tenants: int, sessions: int, turns: int
) -> None:
    import asyncio
    import json
    from pathlib import Path

    from loadtest.chat_workload import Workload, ceiling as chat_ceiling, run as chat
    from router.gateway.prompt import PromptCodec

    codec = PromptCodec.load(str(Path(state_dir) / "model"))  # the ceiling's token ids

    keys = {t: k for k, t in json.loads(Path(state.gateway_keys).read_text()).items()}
    engines = {p.name: p.address for p in state.procs if p.kind == "engine"}
    # Prompts of this run's own (a seed per run): the agents keep their blocks across
    # `make stop` / `make run`, and a second run over the same prompts found every turn
    # cached in both modes (97.4 % each), showing nothing of routing.
    seed = random.randrange(1, 1 << 30)
    w = Workload(tuple(TENANTS[:tenants]), sessions, turns, seed=seed, **GATEWAY_WORKLOAD)

    def show(mode: str, t) -> None:
        where = f"  [{t.priced}]" if t.priced else ""
        print(
            f"  {mode:<8} {t.tenant:<8} session {t.session} turn {t.turn}  "
            f"{t.prompt_tokens:5d} tokens -> {t.engine:<9} cached {t.cached_tokens:5d} "
            f"({t.cached_tokens / max(1, t.prompt_tokens):4.0%})  TTFT {t.ttft_ms:7.1f} ms{where}"
        )

    results = {}
    for mode, title in (("gateway", f"through the gateway {state.gateway_url} (cache-aware; "
                                    "[blocks where the router priced them])"),
                        ("rr", "round robin straight to the engines")):  # fmt: skip
        print(f"\nOpenAI chat, {title}:")
        results[mode] = asyncio.run(
            chat(w, mode, state.gateway_url, keys, engines, on_turn=show, codec=codec)
        )
    top = chat_ceiling(results["gateway"], ENGINE_BLOCK)
    print(f"\n  ceiling (one unbounded cache over the same prompts): {top:6.1%}")
    for mode, rows in results.items():
        ttft = sorted(t.ttft_ms for t in rows)
        share = sum(t.cached_tokens for t in rows) / max(1, sum(t.prompt_tokens for t in rows))
        name = {"gateway": "cache-aware", "rr": "round robin"}[mode]
        print(
            f"  {name:<12} cached-token share {share:6.1%}  TTFT p50 {ttft[len(ttft) // 2]:7.1f} ms"
        )


def _fmt(per_node: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(per_node.items()))


if __name__ == "__main__":
    sys.exit(main())
