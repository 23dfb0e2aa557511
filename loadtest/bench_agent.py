"""Node-agent data-plane benchmark: `python -m loadtest.bench_agent`.

Measures in one run, on this machine, against real agent processes:
- memcpy_gbps: one large host copy (1 GiB, one thread, best of 3), the limit the transfer
  figures are set against (shm_put_ratio, shm_get_ratio)
- memcpy_block_gbps: the same 1 GiB copied in 2 MiB pieces, the block size the agent
  copies. glibc copies one large call another way (4 pages at a time; here from 256 MiB,
  a threshold it derives from the cache size); on some hosts that path runs ~1.7x its
  path for smaller copies, and memcpy_gbps is then a figure one thread copying
  block-sized pieces does not reach
- memcpy_round_gbps / shm_put_ratio_paired / shm_get_ratio_paired: memcpy_gbps's copy
  (1 GiB, one call, one thread) measured again in every round, best of 2, just before
  the round's staging area is filled; the paired ratios are the median over rounds of
  that round's Put (Get) over that round's limit. On a shared host the speed of memory
  and of the core drift by 10-20% within a run, and a limit measured once, at the start,
  sets a figure against a host that may no longer be there (bench_peer pairs its ratios
  the same way). shm_put_ratio / shm_get_ratio stay set against memcpy_gbps
- shm_put_b2b_gbps / shm_get_b2b_gbps: the same-host Put and Get of a batch again, five
  times back to back (median), nothing done between the calls: the agent's cores kept
  busy. The rounds of shm_put_gbps (below) fill the staging area between calls, as an
  engine's work does between its Puts, and the agent's cores idle meanwhile: here a
  Put after 20 ms of idling took ~1.3x one made back to back (the host's handling of
  an idle virtual CPU, most likely: docs/benchmarks.md). The goal figures are the
  rounds'
- memcpy_batch_gbps: a one-thread copy of one batch's size (128 MiB), timed in every round
  between the shared-memory Put and Get (median), which shows how far the host's load
  moved while the run went on
- cpu_probe_us: a fixed piece of work that touches no memory beyond the core's own cache
  (XXH64 of a 256 KiB buffer, 40 times: 10 MiB), timed just after every timed
  shared-memory Put and Get (median); cpu_probe_spread: the slowest of those probes over
  the fastest, how far the core itself slowed while the run went on (on a shared virtual
  machine a core can run ~1.7x slower for stretches of a second, nothing else running in
  the guest)
- shm_put_gbps / shm_get_gbps: 2 MiB blocks (Llama-3-8B, 16 tokens, fp16) through a running
  agent over the same-host shared-memory path (put from, and get into, the staging area)
- shm_put_copy_gbps / shm_get_copy_gbps: the same including the copy between caller-owned
  tensors and the staging area (KVClient.put / KVClient.get)
- grpc_put_gbps / grpc_get_gbps: the same blocks through gRPC only
- hash_mtok_s: chained block hashing of a 32k-token prompt (million tokens per second)
- lookup_2000_us: p50 of KVClient.lookup for a 2,000-block prompt, agent holding >= 100k
  blocks, as a same-host client makes it (over the agent's local lane, kvstore/lane.py);
  lookup_2000_grpc_us: the same call from a client that stays on gRPC (use_shm=False);
  grpc_floor_us: p50 round trip of a gRPC health check on the same agent and channel (the
  floor any unary RPC pays here); lookup_2000_inproc_us: the store's own Lookup, in process
- nvme_demote_gbps / nvme_promote_gbps and the same with encryption at rest
  (nvme_*_enc_gbps, *_enc_ratio against the plaintext figure of this run): the store's
  moves to and from the RocksDB tier, see loadtest/bench_nvme.py
- shm_put_control_us / shm_get_control_us: the same-host Put and Get of one batch of 4 KiB
  blocks (the copy next to nothing: the control path alone, median of 10), and
  shm_put_control_share, its share of this run's 2 MiB-block Put
- staging_page_kib / pool_page_kib: the page size that backs most of the staging area
  and of the device pool in the agent (where the copies run; /proc/<agent>/smaps: 2048
  when most is on transparent huge pages), beside the kernel's settings for them
  (thp_enabled for anonymous memory, thp_shmem_enabled for memfds: the staging area and
  the pool are memfds, which MADV_COLLAPSE puts on huge pages whatever shmem_enabled says)
`--contended`: also the same-host figures while a load runs beside them, as an engine
beside the agent would: a process copying 64 MiB buffers in a loop, pinned to one core
(contended_memcpy_gbps, contended_shm_put_gbps / _get_gbps and their ratios;
contended_load_gbps: what the load itself copied meanwhile).
`--tls`: the agent figures are measured twice in the run, against a plaintext agent
first (plain_<figure>), then with the agents on mTLS (a throwaway CA, kvstore/tls_ca.py)
and every client presenting the client pair (the figures under their usual names);
tls_ratio_<figure> is TLS over plaintext, and tls_same_host_over_limit lists the
same-host figures (shared memory, the local lane: local paths with no TLS on them) that
TLS cost more than 5%. The gRPC figures pay TLS.
Ends with one JSON line on stdout; progress goes to stderr.

Each timed call starts with nothing of the previous round still held: `got = c.get(...)`
frees the previous round's 64 output tensors (128 MiB) only after the new call returns,
inside the timed region. Whether glibc had served those from the heap or from mmap (its
threshold adapts to the order of earlier frees) made that free cost ~0 or ~15 ms (a
munmap of 32k pages), which once made shm_get_gbps look bimodal across runs.

The benchmark's own torch runs single-threaded: after a parallel tensor copy (filling the
staging area) torch's OpenMP workers spin for a while, and on a small host that spinning
takes the cores the agent's copy threads need for the very transfer being timed (an
inference worker fills staging from the GPU, with no such spinning).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import pages
from kvstore.checksum import checksum
from kvstore.client import KVClient
from kvstore.config import TLSConfig
from kvstore.hashing import NATIVE, hash_chain, hash_chain_packed
from kvstore.store import BlockStore, PackedIds, PutItem
from kvstore.tiers.pool import POOL_MEMFD, DevicePool
from loadtest.bench_nvme import llama3_8b, nvme_rates

GiB = 1 << 30
MiB = 1 << 20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def memcpy_gbps(size: int = GiB, reps: int = 3, pieces: tuple[int, ...] = (GiB,)) -> list[float]:
    """One thread copying `size` bytes, one piece of each size in `pieces` a call; best
    of `reps` for each, over one pair of buffers."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    rates = []
    for piece in pieces:
        best = 0.0
        for _ in range(reps):
            t = time.perf_counter()
            for o in range(0, size, piece):
                np.copyto(dst[o : o + piece], src[o : o + piece])
            best = max(best, size / (time.perf_counter() - t) / 1e9)
        rates.append(best)
    return rates


class Agent:
    def __init__(self, workdir: Path, **cfg) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        conf = {
            "node_id": "bench",
            "listen": "127.0.0.1:0",
            "device": "cpu",
            "data_dir": str(workdir / "data"),
            "allow_unauthenticated": True,
            "default_policy": {"persist": False},
        }
        conf.update(cfg)
        (workdir / "agent.json").write_text(json.dumps(conf))
        ready = workdir / "ready"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "node_agent",
                "--config",
                str(workdir / "agent.json"),
                "--ready-file",
                str(ready),
                "--log-level",
                "WARNING",
            ],
            stdout=open(workdir / "agent.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while not (ready.exists() and ready.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"agent {conf['node_id']} failed to start: "
                    + (workdir / "agent.log").read_text()[-2000:]
                )
            time.sleep(0.05)
        self.address = ready.read_text().strip()

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _rate(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def _paired(nbytes: int, times: list[float], limit_times: list[float]) -> float:
    """Median over rounds of (nbytes moved in times[r]) / (memcpy's rate in round r)."""
    return statistics.median(nbytes * lim / (t * GiB) for t, lim in zip(times, limit_times))


@dataclass(frozen=True, slots=True)
class BenchTls:
    """--tls: what the agents present (`server`) and what the clients present (`client`)."""

    server: TLSConfig | None = None
    client: TLSConfig | None = None

    def agent_cfg(self) -> dict:
        s = self.server
        if s is None:
            return {}
        return {"tls": {"ca_file": s.ca_file, "cert_file": s.cert_file, "key_file": s.key_file}}


THP = Path("/sys/kernel/mm/transparent_hugepage")


def thp_setting(name: str) -> str:
    """The kernel's choice in /sys/kernel/mm/transparent_hugepage/<name> ("always [madvise]
    never" -> "madvise"), or "" where there is none."""
    try:
        text = (THP / name).read_text()
    except OSError:
        return ""
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else text.strip()


def agent_pages(pid: int, pool_bytes: int) -> dict[str, object]:
    """The pages behind the agent's mapping of the staging area and its device pool."""
    maps = pages.mappings(pid)
    staging = [m for m in maps if m.name.startswith("/memfd:kvstore-staging")]
    # The pool is the agent's memfd (kvstore.tiers.pool.shared_host_memory) or, where none
    # could be had, its one anonymous mapping of (at least, if the kernel merged it with a
    # neighbour) the pool's size.
    pool = [m for m in maps if m.name.startswith(f"/memfd:{POOL_MEMFD}")] or [
        m for m in maps if not m.name and m.size_kib * 1024 >= pool_bytes
    ]
    out: dict[str, object] = {
        "thp_enabled": thp_setting("enabled"),
        "thp_shmem_enabled": thp_setting("shmem_enabled"),
    }
    for key, found in (("staging", staging), ("pool", pool)):
        if found:
            m = max(found, key=lambda m: m.rss_kib)
            out[f"{key}_page_kib"] = m.page_kib
            out[f"{key}_huge_share"] = m.huge_share
    return out


_PROBE = np.ones(256 << 10, dtype=np.uint8)  # stays in the core's L2


def cpu_probe() -> float:
    """Seconds a fixed in-cache task takes now (see cpu_probe_us in the docstring)."""
    t = time.perf_counter()
    for _ in range(40):
        checksum(_PROBE)
    return time.perf_counter() - t


def _timed_memcpy(dst: np.ndarray, src: np.ndarray) -> float:
    t = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t


def transfer(
    address: str,
    shm: bool,
    batch: int,
    rounds: int,
    tls: BenchTls = BenchTls(),
    agent: Agent | None = None,
    pool_bytes: int = 0,
) -> dict[str, object]:
    """Put and Get of `batch` blocks, `rounds` times; with `agent` (shm), the pages behind
    its staging and pool mappings too."""
    out: dict[str, object] = {}
    with KVClient(
        address, tenant_secret="bench", use_shm=shm, shm_bytes=batch * 2 * MiB, tls=tls.client
    ) as c:
        ns = c.open_namespace(llama3_8b("shm" if shm else "grpc"))
        nbytes = batch * ns.block_bytes
        gen = torch.Generator().manual_seed(1)
        blocks = [torch.randn((32, 2, 16, 8, 128), generator=gen).half() for _ in range(batch)]
        put_t, get_t, memcpy_t, probe_t = [], [], [], []
        limit_t: list[float] = []  # memcpy_gbps's copy, again in every round
        got = None
        if shm:  # one batch's size, and memcpy_gbps's 1 GiB, touched before the first round
            copy_src = np.ones(nbytes, dtype=np.uint8)
            copy_dst = np.zeros(nbytes, dtype=np.uint8)  # mapped lazily: touched next
            np.copyto(copy_dst, copy_src)
            limit_src = np.ones(GiB, dtype=np.uint8)
            limit_dst = np.zeros(GiB, dtype=np.uint8)
            np.copyto(limit_dst, limit_src)
        for r in range(rounds):
            ids = c.block_ids(ns, np.arange(r * batch * 16, (r + 1) * batch * 16, dtype=np.int32))
            if shm:
                limit_t.append(min(_timed_memcpy(limit_dst, limit_src) for _ in range(2)))
                views = c.staging_views(ns, batch)
                for v, b in zip(views, blocks):
                    v.copy_(b)
                t = time.perf_counter()
                assert c.put_staged(ns, ids).stored == batch
                put_t.append(time.perf_counter() - t)
                probe_t.append(cpu_probe())  # after: it would warm the caches for the call
                memcpy_t.append(_timed_memcpy(copy_dst, copy_src))
                got = None  # freed outside the timed region (see the docstring)
                t = time.perf_counter()
                got = c.get_views(ns, ids)
                get_t.append(time.perf_counter() - t)
                probe_t.append(cpu_probe())
                assert len(got) == batch and torch.equal(got[-1], blocks[-1])
            else:
                t = time.perf_counter()
                assert c.put(ns, ids, blocks).stored == batch
                put_t.append(time.perf_counter() - t)
                got = None
                t = time.perf_counter()
                got = c.get(ns, ids)
                get_t.append(time.perf_counter() - t)
            assert len(got) == batch and torch.equal(got[0], blocks[0])
        key = "shm" if shm else "grpc"
        out[f"{key}_put_gbps"] = _rate(nbytes, put_t)
        out[f"{key}_get_gbps"] = _rate(nbytes, get_t)
        if shm:
            out["local_lane"] = c.uses_local_lane
            out["memcpy_batch_gbps"] = _rate(nbytes, memcpy_t)
            out.update(back_to_back(c, ns, batch))
            out["memcpy_round_gbps"] = _rate(GiB, limit_t)
            out["shm_put_ratio_paired"] = _paired(nbytes, put_t, limit_t)
            out["shm_get_ratio_paired"] = _paired(nbytes, get_t, limit_t)
            out["cpu_probe_us"] = statistics.median(probe_t) * 1e6
            out["cpu_probe_spread"] = max(probe_t) / min(probe_t)
            if agent is not None:  # while the client's region is still mapped there
                out.update(agent_pages(agent.proc.pid, pool_bytes))
            out.update(control_cost(c, batch, float(statistics.median(put_t))))
            # Last: KVClient.get allocates its 64 output tensors (128 MiB) a call and frees
            # the last call's. Run between the rounds above, that churn slowed the agent's
            # first writes into pool slots in some runs (see copy_rounds).
            put_copy_t, get_copy_t = copy_rounds(c, ns, blocks, rounds)
            out["shm_put_copy_gbps"] = _rate(nbytes, put_copy_t)
            out["shm_get_copy_gbps"] = _rate(nbytes, get_copy_t)
    return out


def copy_rounds(
    c: KVClient, ns, blocks: list[torch.Tensor], rounds: int
) -> tuple[list[float], list[float]]:
    """KVClient.put and KVClient.get (the copies between caller-owned tensors and the
    staging area included) of `blocks`, `rounds` times under fresh ids: seconds per call.

    Run after the shared-memory rounds, not between them: each get allocates 128 MiB of
    output tensors and frees the previous call's. On this project's virtual machines
    (their balloon reports freed guest pages to the host at once) that churn made the
    agent's first write into each pool slot cost 30-60 us for seconds after, in about a
    third of the agent processes, with no page fault, migration or compaction counted in
    the guest: 10 of 27 standalone processes writing into a pool mapped as the agent maps
    it were slow beside a 128 MiB allocate/free loop, 0 of 6 without it, and 0 of 8 with
    it while the guest held freed pages back from the host for 20 s
    (docs/benchmarks.md, 2026-12-07 19:59)."""
    batch = len(blocks)
    put_t, get_t = [], []
    got = None
    for r in range(rounds):
        ids = c.block_ids(
            ns, np.arange(10**6 + r * batch * 16, 10**6 + (r + 1) * batch * 16, dtype=np.int32)
        )
        t = time.perf_counter()
        c.put(ns, ids, blocks)
        put_t.append(time.perf_counter() - t)
        got = None  # freed outside the timed region (see the module docstring)
        t = time.perf_counter()
        got = c.get(ns, ids)
        get_t.append(time.perf_counter() - t)
        assert len(got) == batch and torch.equal(got[0], blocks[0])
    return put_t, get_t


def back_to_back(c: KVClient, ns, batch: int, calls: int = 5) -> dict[str, float]:
    """`calls` same-host Puts of `batch` blocks (the staging area as the last round left
    it, under fresh ids: every block really copied), then as many Gets, each call right
    after the one before."""
    base = 2 * 10**6
    id_sets = [
        c.block_ids(
            ns, np.arange(base + k * batch * 16, base + (k + 1) * batch * 16, dtype=np.int32)
        )
        for k in range(calls)
    ]
    put_t, get_t = [], []
    for ids in id_sets:
        t = time.perf_counter()
        assert c.put_staged(ns, ids).stored == batch
        put_t.append(time.perf_counter() - t)
    for ids in id_sets:
        got = None  # the previous call's views freed outside the timed region
        t = time.perf_counter()
        got = c.get_views(ns, ids)
        get_t.append(time.perf_counter() - t)
        assert len(got) == batch
    nbytes = batch * ns.block_bytes
    return {"shm_put_b2b_gbps": _rate(nbytes, put_t), "shm_get_b2b_gbps": _rate(nbytes, get_t)}


def control_cost(c: KVClient, batch: int, put_s: float, rounds: int = 10) -> dict[str, float]:
    """The same-host Put and Get of `batch` blocks of 4 KiB (the copy next to nothing):
    what the control path alone costs per call (lane, protobuf, interceptors, the store's
    bookkeeping), and its share of the 2 MiB-block Put of this run (`put_s`)."""
    ns = c.open_namespace(llama3_8b("control", num_layers=1, num_kv_heads=1, head_dim=64))
    put_t, get_t = [], []
    for r in range(rounds):
        ids = c.block_ids(ns, np.arange(r * batch * 16, (r + 1) * batch * 16, dtype=np.int32))
        t = time.perf_counter()
        assert c.put_staged(ns, ids).stored == batch
        put_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert len(c.get_views(ns, ids)) == batch
        get_t.append(time.perf_counter() - t)
    put_us = statistics.median(put_t) * 1e6
    return {
        "shm_put_control_us": put_us,
        "shm_get_control_us": statistics.median(get_t) * 1e6,
        "shm_put_control_share": put_us / 1e6 / put_s,
    }


# The load of --contended: what an inference engine beside the agent does to it, one core
# busy and the memory bus shared. Pinned to one core (the last), copying 64 MiB buffers
# until SIGTERM, then it prints what it copied (GB/s).
_LOAD = """
import os, signal, sys, time
import numpy as np
os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
src = np.ones(64 << 20, np.uint8); dst = np.zeros_like(src)
done, t0 = 0, time.perf_counter()
def stop(*_):
    print(done / (time.perf_counter() - t0) / 1e9, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    np.copyto(dst, src)
    done += src.size
"""


class MemoryLoad:
    """The --contended load, as a context manager; `gbps` once it has stopped."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.gbps = 0.0

    def __enter__(self) -> "MemoryLoad":
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LOAD], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the --contended load did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        self.gbps = float(out.strip() or 0)


def contended(workdir: Path, args) -> dict[str, object]:
    """memcpy and the shared-memory figures again, with MemoryLoad running beside them."""
    pool = 2 * (args.rounds * 2 + 2) * args.batch * 2 * MiB
    agent = Agent(workdir, pool_bytes=pool, slot_bytes=2 * MiB, nvme_bytes=0)
    out: dict[str, object] = {}
    try:
        with MemoryLoad() as load:
            out["memcpy_gbps"] = memcpy_gbps()[0]
            got = transfer(agent.address, True, args.batch, args.rounds)
        out["load_gbps"] = load.gbps
    finally:
        agent.stop()
    for k in (
        "shm_put_gbps",
        "shm_get_gbps",
        "shm_put_copy_gbps",
        "shm_get_copy_gbps",
        "memcpy_batch_gbps",
        "memcpy_round_gbps",
        "shm_put_ratio_paired",
        "shm_get_ratio_paired",
    ):
        out[k] = got[k]
    m = float(out["memcpy_gbps"])  # type: ignore[arg-type]
    out["shm_put_ratio"] = float(got["shm_put_gbps"]) / m  # type: ignore[arg-type]
    out["shm_get_ratio"] = float(got["shm_get_gbps"]) / m  # type: ignore[arg-type]
    return {f"contended_{k}": v for k, v in out.items()}


def hash_rate(tokens: int = 32768, reps: int = 50) -> float:
    toks = np.random.default_rng(0).integers(0, 128000, tokens, dtype=np.int32)
    root = bytes(16)
    hash_chain_packed(root, toks, 16)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        hash_chain_packed(root, toks, 16)
        times.append(time.perf_counter() - t)
    return tokens / statistics.median(times) / 1e6


def lookup_latency(
    workdir: Path, n_blocks: int, reps: int, tls: BenchTls = BenchTls()
) -> dict[str, float]:
    ns_spec = llama3_8b("lookup", num_layers=1, num_kv_heads=1, head_dim=8)  # 512 B blocks
    agent = Agent(
        workdir,
        pool_bytes=(n_blocks + 4096) * 512,
        slot_bytes=512,
        nvme_bytes=0,
        max_blocks_per_request=4096,
        **tls.agent_cfg(),
    )
    out: dict[str, float] = {}
    try:
        with (
            KVClient(
                agent.address, tenant_secret="bench", shm_bytes=2000 * 512, tls=tls.client
            ) as local,
            KVClient(agent.address, tenant_secret="bench", use_shm=False, tls=tls.client) as remote,
        ):
            if not local.uses_local_lane:
                raise RuntimeError("the same-host client did not get the agent's local lane")
            ns = local.open_namespace(ns_spec)
            payload = [torch.zeros((1, 2, 16, 1, 8), dtype=torch.float16)] * 2000
            chains = []
            for k in range(n_blocks // 2000):
                ids = local.block_ids(ns, np.arange(k * 10**6, k * 10**6 + 32000, dtype=np.int32))
                local.put(ns, ids, payload)
                chains.append(ids)
            out["lookup_blocks_held"] = local.stats().tiers[0].blocks
            for key, c in (("lookup_2000_us", local), ("lookup_2000_grpc_us", remote)):
                times = []
                for i in range(reps):
                    ids = chains[i % len(chains)]
                    t = time.perf_counter()
                    r = c.lookup(ns, ids)
                    times.append(time.perf_counter() - t)
                    assert r.matched == 2000
                out[key] = statistics.median(times) * 1e6
            health = health_pb2_grpc.HealthStub(remote.channel)
            floor = []
            for _ in range(reps):
                t = time.perf_counter()
                health.Check(health_pb2.HealthCheckRequest())
                floor.append(time.perf_counter() - t)
            out["grpc_floor_us"] = statistics.median(floor) * 1e6
            return out
    finally:
        agent.stop()


def lookup_inproc(n_blocks: int, reps: int) -> float:
    """The store's Lookup alone: 2,000-block prompts against n_blocks held."""
    spec = llama3_8b("lookup", num_layers=1, num_kv_heads=1, head_dim=8)
    store = BlockStore(DevicePool(n_blocks + 16, 512, "cpu"), None)
    st = store.open_namespace(spec)
    payload = bytes(512)
    chains = []
    for k in range(n_blocks // 2000):
        ids = hash_chain(bytes(16), np.arange(k * 10**6, k * 10**6 + 32000, dtype=np.int32), 16)
        store.put(
            st.ns_id, 0, [PutItem(b, p, payload) for b, p in zip(ids, [bytes(16)] + ids[:-1])]
        )
        chains.append(PackedIds(b"".join(ids)))
    times = []
    for i in range(reps):
        t = time.perf_counter()
        r = store.lookup(st.ns_id, 0, chains[i % len(chains)])
        times.append(time.perf_counter() - t)
        assert r.matched == 2000
    return statistics.median(times) * 1e6


def agent_figures(workdir: Path, args, tls: BenchTls) -> dict[str, object]:
    """The figures measured against a running agent: transfers, then lookups."""
    out: dict[str, object] = {}
    pool = 2 * (args.rounds * 2 + 2) * args.batch * 2 * MiB
    agent = Agent(
        workdir / "xfer", pool_bytes=pool, slot_bytes=2 * MiB, nvme_bytes=0, **tls.agent_cfg()
    )
    try:
        log("shared-memory path ...")
        out.update(transfer(agent.address, True, args.batch, args.rounds, tls, agent, pool))
        log("gRPC path ...")
        out.update(transfer(agent.address, False, args.batch, args.rounds, tls))
    finally:
        agent.stop()
    log(f"lookup with {args.lookup_blocks} blocks held ...")
    out.update(lookup_latency(workdir / "lookup", args.lookup_blocks, 300, tls))
    return out


# Same-host figures (shared memory and the local lane: no TLS on them), and whether a
# higher value is better; TLS may cost them at most TLS_SAME_HOST_LIMIT.
SAME_HOST = {
    "shm_put_gbps": True,
    "shm_get_gbps": True,
    "shm_put_copy_gbps": True,
    "shm_get_copy_gbps": True,
    "lookup_2000_us": False,
}
TLS_SAME_HOST_LIMIT = 0.05


def tls_against(plain: dict[str, object], tls: dict[str, object]) -> dict[str, object]:
    """The plaintext baseline (plain_<figure>), each figure's TLS/plaintext ratio
    (tls_ratio_<figure>), and the same-host figures TLS cost more than the limit."""
    out: dict[str, object] = {f"plain_{k}": v for k, v in plain.items() if k != "local_lane"}
    over = []
    for k, v in plain.items():
        if isinstance(v, float) and v > 0 and isinstance(tls.get(k), float):
            ratio = float(tls[k]) / v  # type: ignore[arg-type]
            out[f"tls_ratio_{k}"] = ratio
            if k in SAME_HOST:
                worse = (1 - ratio) if SAME_HOST[k] else (ratio - 1)
                if worse > TLS_SAME_HOST_LIMIT:
                    over.append(k)
    out["tls_same_host_over_limit"] = over
    out["tls_same_host_limit"] = TLS_SAME_HOST_LIMIT
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="2 MiB blocks per transfer")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--lookup-blocks", type=int, default=100_000)
    p.add_argument("--nvme-blocks", type=int, default=64, help="2 MiB blocks per NVMe round")
    p.add_argument(
        "--tls",
        action="store_true",
        help="agents and clients with mTLS, against a plaintext baseline in the same run",
    )
    p.add_argument(
        "--contended",
        action="store_true",
        help="also the same-host figures beside a CPU and memory load (contended_*)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # see the module docstring
    res: dict[str, object] = {
        "block_bytes": 2 * MiB,
        "batch_blocks": args.batch,
        "native": NATIVE,
        "tls": args.tls,
        "contended": args.contended,
    }
    log("memcpy ...")
    res["memcpy_gbps"], res["memcpy_block_gbps"] = memcpy_gbps(pieces=(GiB, 2 * MiB))
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        if args.tls:  # the plaintext baseline first, in the same run
            from kvstore.tls_ca import make_dev_pki

            log("plaintext baseline ...")
            plain = agent_figures(Path(tmp) / "plain", args, BenchTls())
            pki = make_dev_pki(str(Path(tmp) / "tls"))
            log("with mTLS ...")
            res.update(agent_figures(Path(tmp) / "tls", args, BenchTls(pki.server, pki.client)))
            res.update(tls_against(plain, res))
        else:
            res.update(agent_figures(Path(tmp), args, BenchTls()))
        if args.contended:
            log("shared-memory path beside a memory load ...")
            res.update(contended(Path(tmp) / "contended", args))
        log("hashing ...")
        res["hash_mtok_s"] = hash_rate()
        res["lookup_2000_inproc_us"] = lookup_inproc(args.lookup_blocks, 300)
    log("NVMe tier, plaintext and encrypted ...")
    res.update(nvme_rates(args.nvme_blocks))
    m = res["memcpy_gbps"]
    res["shm_get_ratio"] = res["shm_get_gbps"] / m
    res["shm_put_ratio"] = res["shm_put_gbps"] / m
    res["shm_put_b2b_ratio"] = res["shm_put_b2b_gbps"] / m
    res["shm_get_b2b_ratio"] = res["shm_get_b2b_gbps"] / m
    res = {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
