"""Timing of refused probes: `python -m loadtest.probe_timing [--samples N]`.

Tenant B (globex) probes tenant A's (acme) namespace on a real agent process that
authenticates both, and on a real router following it through a real etcd, with three
kinds of probe per RPC (the agent's Lookup, Get, Pin, Peer.FetchBlocks; the router's
Route):
- cached: A's namespace, ids of a prefix A stored (N blocks, on the agent's pool, and in
  the router's index: probing starts once A's own dry-run Route finds all of them)
- uncached: A's namespace, ids of a prefix nobody stored
- nonexistent: a namespace of A's that was never opened anywhere
Each is refused (PERMISSION_DENIED, one message: tests/integration/test_attack_tenant.py
checks the answers); here the question is whether the *time* of the refusal tells them
apart. The kinds are interleaved in a random order, so drift of a shared machine hits
them alike.

For each RPC and each pair (cached vs uncached, cached vs nonexistent) a two-sided
Mann-Whitney U test (normal approximation, tie-corrected) and a bootstrapped 95% interval
of the difference of medians. `indistinguishable` is true when every pair's p-value is at
least ALPHA divided by the number of comparisons (Bonferroni). As a control that the test
can see a difference at all, A's own Get of its cached prefix (the work a refusal must
not do: BLOCKS blocks of 8 KiB read and sent) is compared with B's refused Get of it the
same way: `control_detects` should be true.

Ends with one JSON line on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from kvstore.devprocs import free_port
from kvstore.hashing import BlockId, hash_chain, pack_ids
from kvstore.namespace import Namespace
from kvstore.v1 import agent_pb2, agent_pb2_grpc, common_pb2, peer_pb2, peer_pb2_grpc
from kvstore.v1 import router_pb2, router_pb2_grpc
from loadtest.bench_agent import Agent, log

ALPHA = 0.01
TOKENS = {
    "acme": "acme-probe-token",
    "globex": "globex-probe-token",
    "_cluster": "cluster-probe-token",  # the router's identity (event streams)
}
SECRET = "probe-timing-secret"
BLOCKS = 64
KINDS = ("cached", "uncached", "nonexistent")


def spec(name: str) -> Namespace:
    return Namespace(
        tenant="acme",
        name=name,
        model_name="probe-model",
        model_revision="r1",
        adapter_id="none",
        adapter_revision="none",
        tokenizer_id="probe-tok",
        tokenizer_revision="r1",
        rope_type="default",
        rope_theta=10000.0,
        rope_scaling="none",
        attention_impl="sdpa",
        kv_dtype="float16",
        prompt_template_version="v1",
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        tp_rank=0,
        tp_size=1,
        block_size=16,
    )


def md(tenant: str) -> tuple:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def tokens(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 32000) for _ in range(BLOCKS * 16)]


def store_prefix(agent: agent_pb2_grpc.NodeAgentStub, ns: Namespace, ids: list[bytes]) -> None:
    """A opens its namespace and stores BLOCKS blocks (raw gRPC: no torch needed here)."""
    agent.OpenNamespace(
        agent_pb2.OpenNamespaceRequest(spec=common_pb2.Namespace(**ns.to_dict())),
        metadata=md("acme"),
        timeout=30,
    )
    root = ns.root(0, SECRET)
    first = agent_pb2.PutRequest(ns=ref(ns), root=root)
    parent = root
    for bid in ids:
        first.blocks.add(
            block_id=bid, parent_id=parent, data=hashlib.shake_128(bid).digest(ns.block_bytes)
        )
        parent = bid
    resp = agent.Put(iter([first]), metadata=md("acme"), timeout=30)
    if resp.stored != len(ids):
        raise RuntimeError(f"stored {resp.stored} of {len(ids)} blocks")


def ref(ns: Namespace) -> agent_pb2.NamespaceRef:
    return agent_pb2.NamespaceRef(namespace_id=ns.namespace_id, generation=0)


def probes(channel: grpc.Channel, router: grpc.Channel, ns: Namespace) -> dict:
    """RPC name -> fn(namespace, ids) making B's call (its refusal is the expected end)."""
    agent = agent_pb2_grpc.NodeAgentStub(channel)
    peer = peer_pb2_grpc.PeerStub(channel)
    route_stub = router_pb2_grpc.RouterStub(router)
    root = ns.root(0, SECRET)

    def lookup(n, ids):
        return agent.Lookup(
            agent_pb2.LookupRequest(ns=ref(n), block_ids=ids), metadata=md("globex")
        )

    def get(n, ids):
        req = agent_pb2.GetRequest(ns=ref(n), block_ids=ids, parent_id=root)
        return list(agent.Get(req, metadata=md("globex")))

    def pin(n, ids):
        return agent.Pin(agent_pb2.PinRequest(ns=ref(n), block_ids=ids), metadata=md("globex"))

    def fetch(n, ids):
        req = peer_pb2.FetchRequest(ns=ref(n), block_ids=ids, parent_id=root)
        return list(peer.FetchBlocks(req, metadata=md("globex")))

    def route(n, ids):
        req = router_pb2.RouteRequest(namespace_id=n.namespace_id, block_ids=ids)
        return route_stub.Route(req, metadata=md("globex"))

    return {"Lookup": lookup, "Get": get, "Pin": pin, "FetchBlocks": fetch, "Route": route}


def timed(fn, n, ids) -> tuple[float, str]:
    t = time.perf_counter()
    try:
        fn(n, ids)
        answer = "OK"
    except grpc.RpcError as exc:
        answer = f"{exc.code().name}: {exc.details()}"
    return time.perf_counter() - t, answer


def mann_whitney_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided p-value of the Mann-Whitney U test, normal approximation with the tie
    correction (samples here are in the thousands)."""
    n1, n2 = len(a), len(b)
    both = np.concatenate([a, b])
    order = both.argsort(kind="mergesort")
    ranks = np.empty(len(both))
    sorted_vals = both[order]
    i = 0
    while i < len(both):  # average ranks over ties
        j = i
        while j + 1 < len(both) and sorted_vals[j + 1] == sorted_vals[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    u = ranks[:n1].sum() - n1 * (n1 + 1) / 2
    _, counts = np.unique(both, return_counts=True)
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - (counts**3 - counts).sum() / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (u - n1 * n2 / 2) / np.sqrt(var)
    return math.erfc(abs(float(z)) / math.sqrt(2))


def median_diff_ci(a: np.ndarray, b: np.ndarray, rounds: int = 2000) -> tuple[float, float]:
    """Bootstrapped 95% interval of median(a) - median(b), in microseconds."""
    rng = np.random.default_rng(0)
    d = [np.median(rng.choice(a, len(a))) - np.median(rng.choice(b, len(b))) for _ in range(rounds)]
    lo, hi = np.percentile(d, [2.5, 97.5])
    return round(float(lo) * 1e6, 2), round(float(hi) * 1e6, 2)


def summary(xs: list[float]) -> dict[str, float]:
    arr = np.array(xs)
    return {
        "p50_us": round(float(np.percentile(arr, 50)) * 1e6, 1),
        "p99_us": round(float(np.percentile(arr, 99)) * 1e6, 1),
    }


def compare(a: list[float], b: list[float]) -> dict[str, object]:
    x, y = np.array(a), np.array(b)
    return {
        "mann_whitney_p": round(mann_whitney_p(x, y), 4),
        "median_diff_ci_us": median_diff_ci(x, y),
    }


def wait_until(what: str, ready: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def router_indexed(router: grpc.Channel, ns: Namespace, ids: list[bytes]) -> Callable[[], bool]:
    """True once A's own dry-run Route finds every block of its prefix on a node."""
    stub = router_pb2_grpc.RouterStub(router)
    req = router_pb2.RouteRequest(
        namespace_id=ns.namespace_id, block_ids=pack_ids(ids), dry_run=True
    )

    def ready() -> bool:
        try:
            resp = stub.Route(req, metadata=md("acme"), timeout=5)
        except grpc.RpcError:
            return False
        return any(c.local_blocks == len(ids) for c in resp.candidates)

    return ready


def measure(address: str, router_address: str, samples: int) -> dict[str, object]:
    a_ns, ghost = spec("probe-secret"), spec("probe-never-opened")
    root = BlockId(a_ns.root(0, SECRET))
    cached = hash_chain(root, tokens(1), 16)
    uncached = hash_chain(root, tokens(2), 16)
    channel = grpc.insecure_channel(address)
    router = grpc.insecure_channel(router_address)
    store_prefix(agent_pb2_grpc.NodeAgentStub(channel), a_ns, cached)
    wait_until("the router to index A's prefix", router_indexed(router, a_ns, cached))
    cases = {
        "cached": (a_ns, pack_ids(cached)),
        "uncached": (a_ns, pack_ids(uncached)),
        "nonexistent": (ghost, pack_ids(cached)),
    }
    rpcs = probes(channel, router, a_ns)
    own = agent_pb2_grpc.NodeAgentStub(channel)

    def own_get(n, ids):  # A reads its own cached prefix: the work a refusal skips
        req = agent_pb2.GetRequest(ns=ref(n), block_ids=ids, parent_id=root)
        return list(own.Get(req, metadata=md("acme")))

    order = [(r, k) for r in rpcs for k in KINDS for _ in range(samples)]
    order += [("own", "cached")] * samples
    random.Random(7).shuffle(order)
    for r in rpcs:  # warm every path once
        for k in KINDS:
            timed(rpcs[r], *cases[k])
    times: dict[tuple[str, str], list[float]] = {key: [] for key in set(order)}
    answers: dict[str, set[str]] = {r: set() for r in rpcs}
    for r, k in order:
        fn = own_get if r == "own" else rpcs[r]
        dt, answer = timed(fn, *cases[k])
        times[(r, k)].append(dt)
        if r != "own":
            answers[r].add(answer)
    channel.close()
    router.close()
    comparisons = len(rpcs) * 2
    per_rpc: dict[str, object] = {}
    worst = 1.0
    for r in rpcs:
        entry: dict[str, object] = {k: summary(times[(r, k)]) for k in KINDS}
        for other in ("uncached", "nonexistent"):
            c = compare(times[(r, "cached")], times[(r, other)])
            entry[f"cached_vs_{other}"] = c
            worst = min(worst, float(c["mann_whitney_p"]))  # type: ignore[arg-type]
        entry["answers"] = sorted(answers[r])
        per_rpc[r] = entry
    control = compare(times[("own", "cached")], times[("Get", "cached")])
    threshold = ALPHA / comparisons
    return {
        "samples_per_kind": samples,
        "blocks": BLOCKS,
        "rpcs": per_rpc,
        "one_answer_each": all(len(a) == 1 for a in answers.values()),
        "min_p": round(worst, 4),
        "threshold_p": threshold,
        "indistinguishable": worst >= threshold,
        "control_own_get": {**summary(times[("own", "cached")]), **control},
        "control_detects": float(control["mann_whitney_p"]) < threshold,  # type: ignore[arg-type]
    }


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def start_etcd(workdir: Path) -> tuple[subprocess.Popen, str]:
    """A real etcd (Debian's etcd-server) on free ports; (process, client endpoint)."""
    from kvstore.devprocs import etcd_healthy

    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [shutil.which("etcd") or "/usr/bin/etcd", "--name", "probe",
         "--data-dir", str(workdir / "etcd"), "--listen-client-urls", client,
         "--advertise-client-urls", client, "--listen-peer-urls", peer,
         "--initial-advertise-peer-urls", peer, "--initial-cluster", f"probe={peer}",
         "--log-level", "warn"],
        stdout=open(workdir / "etcd.log", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    endpoint = client.removeprefix("http://")
    wait_until("etcd", lambda: proc.poll() is None and etcd_healthy(endpoint))
    return proc, endpoint


def start_router(workdir: Path, etcd: str, tenants: dict) -> tuple[subprocess.Popen, str]:
    """A real router authenticating the same tenants; (process, its address)."""
    cfg, ready = workdir / "router.json", workdir / "router.ready"
    cfg.write_text(json.dumps({"tenants": tenants, "allow_unauthenticated": False}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "--router-id", "probe", "--listen", "127.0.0.1:0",
         "--etcd-endpoints", etcd, "--ready-file", str(ready), "--config", str(cfg),
         "--log-level", "WARNING"],
        env=dict(os.environ, KVSTORE_CLUSTER_TOKEN=TOKENS["_cluster"]),
        stdout=open(workdir / "router.log", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("router exited: " + (workdir / "router.log").read_text()[-2000:])
        return ready.exists() and bool(ready.read_text().strip())

    wait_until("the router", up)
    return proc, ready.read_text().strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1000, help="probes per RPC and kind")
    args = ap.parse_args()
    tenants = {
        t: {"token_sha256": hashlib.sha256(tok.encode()).hexdigest()} for t, tok in TOKENS.items()
    }
    with tempfile.TemporaryDirectory(prefix="probe-timing-") as tmp:
        work = Path(tmp)
        etcd, endpoint = start_etcd(work)
        procs = [etcd]
        try:
            agent = Agent(
                work / "agent",
                pool_bytes="16MiB",
                slot_bytes="64KiB",
                nvme_bytes=0,
                allow_unauthenticated=False,
                tenants=tenants,
                etcd_endpoints=endpoint,
                ucx_enabled=False,
            )
            procs.append(agent.proc)
            router, router_address = start_router(work, endpoint, tenants)
            procs.append(router)
            log(
                f"agent at {agent.address}, router at {router_address}; "
                f"{args.samples} probes per RPC and kind"
            )
            out = measure(agent.address, router_address, args.samples)
        finally:
            for proc in reversed(procs):
                _stop(proc)
    print(json.dumps(out))
    sys.exit(0 if out["indistinguishable"] and out["one_answer_each"] else 1)


if __name__ == "__main__":
    main()
