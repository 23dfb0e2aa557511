"""Router index benchmark: memory per (block, node) entry and route latency at scale.

Builds the router's index the way a router does (STORED events per node) for 64 nodes and
>= 1,000,000 distinct blocks with a realistic shape: prompt families (system prompts,
shared documents) whose prefix lives on 1-3 home nodes, each family continued by
conversations stored on one or two of those nodes, so every block sits on 1-3 nodes and
every node's store is prefix-consistent. Then it routes 32k-token prompts (2048 blocks:
a family prefix, part of a conversation, new blocks after that) and prints progress on
stderr and ONE JSON line on stdout:

    nodes, blocks, entries, bytes_per_entry (+ how it was measured), route_p50_us,
    route_p99_us, route_tokens_p50_us (same prompts as tokens, hashing included),
    routes_per_s, replicas_identical (a second index fed the same events in another
    node order decides identically on every probe, stateful routing included),
    apply_blocks_per_s and rebuild_s (block ids that second index applied per second,
    STORED events in their packed form as the follower passes them, and the time it
    took to index every node's blocks: what a restarted router spends on its index while
    snapshots arrive; no tracemalloc running, unlike build_s), index_bytes (the id
    table's own size), the same route figures at --baseline-nodes over as many blocks
    (route_growth: route_cpu_p50_us here / there), and each goal of issue #19 against
    its limit (limits, within_limits)

    python -m loadtest.bench_router [--blocks 1000000] [--nodes 64] [--probes 1000]
        [--baseline-nodes 64]
    python -m loadtest.bench_router --entries 100000000 --nodes 1024   (memory alone)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
import tracemalloc

import numpy as np

from kvstore.coord.etcd import NodeRecord
from kvstore.hashing import hash_chain_packed
from router.routing import RouterCore
from router.scoring import Weights

BLOCK = 16
PROMPT_BLOCKS = 2048
ROOT = bytes(range(16))
NS_ID = bytes(16)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Workload:
    """Families of prompts as token arrays; block ids come from the real chain hash."""

    def __init__(self, target_blocks: int, n_nodes: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.nodes = [f"node-{i:04d}" for i in range(n_nodes)]
        self.events: dict[str, list[bytes]] = {n: [] for n in self.nodes}  # packed ids
        self.families: list[tuple[np.ndarray, list[str], list[np.ndarray]]] = []
        self.blocks = 0
        while self.blocks < target_blocks:
            self._family()

    def _tokens(self, n_blocks: int) -> np.ndarray:
        return self.np_rng.integers(0, 128_000, n_blocks * BLOCK, dtype=np.int32)

    def _family(self) -> None:
        prefix = self._tokens(self.rng.randint(32, 256))
        homes = self.rng.sample(self.nodes, self.rng.choice((1, 1, 2, 2, 3)))
        ids = hash_chain_packed(ROOT, prefix, BLOCK)
        for n in homes:
            self.events[n].append(ids)
        self.blocks += len(ids) // 16
        convs = []
        for _ in range(self.rng.randint(1, 4)):
            tail = self._tokens(self.rng.randint(16, 400))
            full = hash_chain_packed(ROOT, np.concatenate([prefix, tail]), BLOCK)
            new = full[len(ids) :]
            for n in self.rng.sample(homes, self.rng.randint(1, min(2, len(homes)))):
                self.events[n].append(new)
            self.blocks += len(new) // 16
            convs.append(tail)
        self.families.append((prefix, homes, convs))

    def probe_tokens(self, i: int) -> np.ndarray:
        """A 32k-token prompt: a family prefix, some of a conversation, then new tokens
        (one probe in eight is entirely new)."""
        if i % 8 == 7:
            return self._tokens(PROMPT_BLOCKS)
        prefix, _, convs = self.families[self.rng.randrange(len(self.families))]
        conv = convs[self.rng.randrange(len(convs))]
        keep = conv[: self.rng.randint(0, len(conv) // BLOCK) * BLOCK]
        head = np.concatenate([prefix, keep])[: PROMPT_BLOCKS * BLOCK]
        return np.concatenate([head, self._tokens(PROMPT_BLOCKS - len(head) // BLOCK)])


def make_core(nodes: list[str], utils: list[float]) -> RouterCore:
    # 100 Gbps between nodes: peer fetches are cheaper than recompute, so the peer
    # pricing path runs too (at the 1 Gbps default it never does for 2 MiB blocks).
    core = RouterCore(Weights(), prefill_tokens_per_s=8000.0, peer_gbps=100.0)
    for n, u in zip(nodes, utils):
        core.upsert_node(NodeRecord(n, f"10.0.0.{len(core.nodes)}:50051", utilization=u))
        core.mark_synced(n)
    return core


def feed(core: RouterCore, events: dict[str, list[bytes]], order: list[str]) -> None:
    for node in order:
        for packed in events[node]:
            core.index.store(node, packed)


def measure_build(wl: Workload, utils: list[float], use_tracemalloc: bool):
    gc.collect()
    rss0 = _rss_bytes()
    if use_tracemalloc:
        tracemalloc.start()
    t0 = time.perf_counter()
    core = make_core(wl.nodes, utils)
    feed(core, wl.events, wl.nodes)
    build_s = time.perf_counter() - t0
    gc.collect()
    if use_tracemalloc:
        used, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        how = "tracemalloc (Python allocations held by the index after building it)"
    else:
        used = _rss_bytes() - rss0
        how = "RSS delta across building the index"
    return core, used, how, build_s


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def time_routes(core: RouterCore, probes: list[bytes]) -> tuple[list[float], list[float], float]:
    """Wall and CPU (this thread) microseconds per route, and routes per second. CPU time
    is what the route costs; wall time also counts waiting for a core on a busy host."""
    lat, cpu = [], []
    t_all = time.perf_counter()
    for i, packed in enumerate(probes):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        d = core.route(NS_ID, packed, request_id=f"r{i}")
        lat.append((time.perf_counter_ns() - t0) / 1000)
        cpu.append((time.thread_time_ns() - c0) / 1000)
        core.release(d.request_id)
    return lat, cpu, len(probes) / (time.perf_counter() - t_all)


def decisions_match(a: RouterCore, b: RouterCore, probes: list[bytes]) -> bool:
    for packed in probes:
        if (
            a.route(NS_ID, packed, dry_run=True).scores
            != b.route(NS_ID, packed, dry_run=True).scores
        ):
            return False
    # Stateful: the same request sequence without releases moves load identically.
    for i, packed in enumerate(probes[:200]):
        if (
            a.route(NS_ID, packed, request_id=f"s{i}").scores
            != b.route(NS_ID, packed, request_id=f"s{i}").scores
        ):
            return False
    return True


# Issue #19 item 3's goals, each figure against its limit in the JSON line.
LIMITS = {"route_p50_us": ("<=", 40.0), "bytes_per_entry": ("<=", 50.0)}
LIMITS["apply_blocks_per_s"] = (">=", 1_000_000)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace, n_nodes: int, full: bool) -> dict:
    """Build, route and (when `full`) rebuild a replica at `n_nodes`; the figures."""
    t0 = time.perf_counter()
    wl = Workload(args.blocks, n_nodes, args.seed)
    say(
        f"[{n_nodes} nodes] workload: {wl.blocks} blocks in {len(wl.families)} families "
        f"({time.perf_counter() - t0:.1f}s)"
    )
    rng = random.Random(args.seed + 1)
    utils = [round(rng.random() * 0.9, 2) for _ in wl.nodes]
    core, used, how, build_s = measure_build(wl, utils, args.memory == "tracemalloc")
    entries = core.index.entries
    say(
        f"index: {len(core.index)} blocks, {entries} entries, {used / 2**20:.1f} MiB, "
        f"{core.index.distinct_masks} distinct masks, built in {build_s:.1f}s"
    )
    probe_tokens = [wl.probe_tokens(i) for i in range(args.probes)]
    probes = [hash_chain_packed(ROOT, t, BLOCK) for t in probe_tokens]
    lat, cpu, rps = time_routes(core, probes)
    out = {
        "nodes": n_nodes,
        "blocks": len(core.index),
        "entries": entries,
        "bytes_per_entry": round(used / entries, 1),
        "bytes_per_entry_method": how,
        "index_bytes": core.index.nbytes,
        "route_p50_us": round(statistics.median(lat), 1),
        "route_p99_us": round(percentile(lat, 0.99), 1),
        "route_cpu_p50_us": round(statistics.median(cpu), 1),
        "routes_per_s": round(rps),
        "build_s": round(build_s, 1),
    }
    say(
        f"routes: p50 {out['route_p50_us']}us p99 {out['route_p99_us']}us "
        f"(cpu p50 {out['route_cpu_p50_us']}us), {rps:.0f}/s"
    )
    if full:
        out.update(_full(args, wl, utils, core, probe_tokens, probes))
    return out


def _full(args, wl: Workload, utils: list[float], core: RouterCore, probe_tokens, probes) -> dict:
    tok_lat = []
    for toks in probe_tokens[: args.token_probes]:
        t1 = time.perf_counter_ns()
        core.route_tokens(NS_ID, ROOT, toks, BLOCK, dry_run=True)
        tok_lat.append((time.perf_counter_ns() - t1) / 1000)
    hits = sum(1 for pk in probes if core.route(NS_ID, pk, dry_run=True).chosen.local_blocks)
    say(f"{hits}/{len(probes)} probes routed to a node holding a prefix")
    replica = make_core(wl.nodes, utils)
    gc.collect()
    t_apply = time.perf_counter()
    feed(replica, wl.events, list(reversed(wl.nodes)))
    apply_s = time.perf_counter() - t_apply
    applied = sum(len(pk) // 16 for evs in wl.events.values() for pk in evs)
    say(f"replica: {applied} block ids applied in {apply_s:.1f}s")
    return {
        "route_tokens_p50_us": round(statistics.median(tok_lat), 1),
        "prompt_blocks": PROMPT_BLOCKS,
        "probes": len(probes),
        "probes_with_cached_prefix": hits,
        "apply_blocks_per_s": round(applied / apply_s),
        "rebuild_s": round(apply_s, 2),
        "replicas_identical": decisions_match(core, replica, probes),
    }


def scale(args: argparse.Namespace) -> dict:
    """The index alone at `args.entries` (block, node) entries: random ids in batches of
    4,096 stored on 1-3 of `args.nodes` nodes (as the workload's blocks are), no prompts.
    What the router holds at a size the token workload cannot reach on one host."""
    rng = random.Random(args.seed)
    nodes = [f"node-{i:04d}" for i in range(args.nodes)]
    core = make_core(nodes, [0.0] * len(nodes))
    gc.collect()
    rss0 = _rss_bytes()
    tracemalloc.start()
    t0, applied = time.perf_counter(), 0
    while core.index.entries < args.entries:
        packed = rng.randbytes(16 * 4096)
        for node in rng.sample(nodes, rng.choice((1, 1, 2, 2, 3))):
            core.index.store(node, packed)
            applied += 4096
    apply_s = time.perf_counter() - t0
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    entries = core.index.entries
    return {
        "mode": "scale",
        "nodes": args.nodes,
        "blocks": len(core.index),
        "entries": entries,
        "index_bytes": core.index.nbytes,
        "bytes_per_entry": round(used / entries, 1),
        "bytes_per_entry_method": "tracemalloc (Python allocations held by the index)",
        "rss_delta_bytes": _rss_bytes() - rss0,
        "apply_blocks_per_s": round(applied / apply_s),
        "build_s": round(apply_s, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_router", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--blocks", type=int, default=1_000_000, help="distinct blocks to index")
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--probes", type=int, default=1000, help="prompts routed")
    p.add_argument(
        "--token-probes",
        type=int,
        default=200,
        help="prompts routed from tokens (hashing included)",
    )
    p.add_argument(
        "--baseline-nodes",
        type=int,
        default=64,
        help="also route over as many blocks at this many nodes (0: skip)",
    )
    p.add_argument(
        "--entries",
        type=int,
        default=0,
        help="only build an index of this many (block, node) entries from random ids and "
        "report its memory (no prompts, no routes)",
    )
    p.add_argument("--memory", choices=("tracemalloc", "rss"), default="tracemalloc")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    if args.blocks < 1 or args.nodes < 1 or args.probes < 1 or args.baseline_nodes < 0:
        p.error("--blocks, --nodes and --probes must be >= 1, --baseline-nodes >= 0")
    if args.entries:
        print(json.dumps(scale(args)))
        return 0
    out = run(args, args.nodes, full=True)
    if args.baseline_nodes and args.baseline_nodes != args.nodes:
        gc.collect()
        base = run(args, args.baseline_nodes, full=False)
        out["baseline_nodes"] = args.baseline_nodes
        out["baseline_route_p50_us"] = base["route_p50_us"]
        out["baseline_route_cpu_p50_us"] = base["route_cpu_p50_us"]
        out["route_growth"] = round(out["route_cpu_p50_us"] / base["route_cpu_p50_us"], 2)
    out["limits"] = {k: f"{op} {v}" for k, (op, v) in LIMITS.items()}
    out["within_limits"] = {
        k: (out[k] <= v if op == "<=" else out[k] >= v) for k, (op, v) in LIMITS.items()
    }
    print(json.dumps(out))
    return 0 if out["replicas_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
