"""Peer-transfer benchmark: `python -m loadtest.bench_peer`.

Two real agents on this machine: B holds prompts of 2 MiB blocks (Llama-3-8B, 16 tokens,
fp16), A pulls them with Peer.Prefetch, once over UCX and once over the gRPC fallback
(each round a fresh prompt, so every block really moves). The time is the whole Prefetch
call as a client sees it: B's verified store reads, the wire, A's verified store writes
(after one warm-up Prefetch, A reuses its connection to B as it does in service).

Reported (one JSON line on stdout at the end; progress on stderr):
- limit_gbps: what the transport itself moves between two processes here, measured in the
  same run: `ucx_perftest -t tag_bw -s 2097152` over UCX_TLS=tcp with the transport
  selection of the agents' transfers: their UCX settings (node_agent/peer/ucx/wire.ucx_env)
  and endpoints that handle peer failure (-e) as theirs do (limit_method), or a raw Python
  socket loopback when ucx_perftest is not found; limit_transport: what UCX selected for
  it (beside ucx_transport, what it selected for the agents)
- limit_uncached_gbps / ucx_ratio_uncached: context, not the goal: the goal's perftest
  (TCP, the agents' settings and lanes) with messages of limit_uncached_bytes, twice the
  largest CPU cache (64 MiB with a 32 MiB L3), so that each message's bytes come from and
  go to memory, not the cache, as the agents' distinct 2 MiB blocks do; one message that
  large carries fewer per-message costs than as many 2 MiB ones, so it is the transport's
  limit for memory out of the cache, not a figure below it
- limit_shm_gbps: the same perftest over shared memory (UCX_TLS=sm,self), the limit of the
  path between agents of one host (the default run), limit_shm_transport
- limit_free_gbps / ucx_ratio_free: context, not the goal: perftest over TCP as it picks
  by itself, without peer-failure handling (which lets UCX stripe each message over
  several TCP interfaces; the agents cannot: a dead peer must fail their transfers),
  limit_free_transport
- limit_shm_footprint_gbps / ucx_ratio_shm_footprint: context, not the goal: the copy
  the agents' CMA transfers make, without UCX and without verification: one process
  reading a Prefetch's bytes of distinct memory out of another's with process_vm_readv,
  in 16 MiB reads into distinct memory of its own (blocks x 2 MiB each side); perftest's
  shared-memory figure reads the same 2 MiB buffer into the same 2 MiB buffer every
  time, from the CPU cache
- limit_footprint_gbps / ucx_ratio_footprint: context, not the goal: a raw TCP socket
  between two processes streaming one Prefetch's bytes of distinct memory (blocks x 2 MiB
  each side, as the agents move them); perftest reuses the same 2 MiB buffers for every
  message, and they stay in the CPU cache
- ucx_gbps / grpc_gbps: median Prefetch bandwidth over the rounds; ucx_best_gbps. A
  round's ucx figure is --burst Prefetches timed back to back (as the limit times
  hundreds of messages in a row after a warm-up) after a first one, reported apart as
  ucx_cold_gbps (median): the first call after seconds of idling
- ucx_ratio / ucx_ratio_shm: median of ucx / limit per round, against the TCP and the
  shared-memory limit (each UCX round right after the limit measurements: the load on a
  shared machine changes quickly, and pairing keeps the ratios honest); ucx_ratio is the
  goal of `--tcp`, ucx_ratio_shm that of the default run
- payload_path: how the payloads moved, from the agents' counters: "mapped reads" (agents
  of one host: A maps B's pool, a sealed memfd, read-only and copies each block out in one
  fused copy+hash pass: node_agent/peer/ucx/mapped.py), "direct reads"
  (agents of one host: A reads B's borrowed slots itself with process_vm_readv, the same
  kernel copy as UCX's CMA transport, in copy_threads threads, each block hashed as it
  lands; UCX carries the control messages: node_agent/peer/ucx/direct.py) or "ucx
  messages" (`--tcp`, or `--no-direct-reads`: KVSTORE_PEER_SAME_HOST_READS=0);
  direct_blocks: blocks A read either way, mapped_blocks: of those, through the mapping
- ucx_transport: what carried UCX's payload messages, from UCX's own account of the
  protocol the sending agent's endpoint selected for 2 MiB tag messages
  (UCX_PROTO_INFO=y), e.g. "cma/memory: rendezvous zero-copy read from remote"; with
  direct reads only the control messages travel over UCX
- batch_blocks: blocks per chunk of 2 MiB blocks (the agents' peer.batch_bytes,
  kvstore/config.PeerConfig; KVSTORE_PEER_* to override); `--tcp` runs both agents with
  KVSTORE_PEER_SHARED_MEMORY=0 (payloads on TCP)
- prefetch_60x8k_ms_ucx / prefetch_60x8k_ms_grpc: median latency of a Prefetch of 60
  blocks of 8 KiB (the replay's tiny model), on two more agents with 8 KiB slots: the
  per-call and per-message costs that bandwidth figures hide (`--small-rounds`; each
  round one call per transport back to back, the order alternating);
  prefetch_60x8k_ucx_minus_grpc_ms: the median over rounds of each round's UCX time
  minus its gRPC time (paired: both calls under the same load), and
  prefetch_60x8k_ucx_no_slower_share the share of rounds in which UCX took no longer;
  prefetch_60x8k_ucx_no_slower: the goal, UCX's median at or below gRPC's
- `--contended`: the same 60 x 8 KiB figures again (contended_*) on fresh agents
  while bench_agent's --contended load runs beside them (one core copying 64 MiB
  buffers, as an engine beside the agents would keep it busy); contended_load_gbps:
  what the load copied meanwhile
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loadtest import bench_agent
from kvstore.client import KVClient
from kvstore.client.convert import block_shape
from kvstore.config import AgentConfig, load_config
from kvstore.devprocs import free_port
from kvstore.hashing import pack_ids
from kvstore.namespace import Namespace
from kvstore.tiers.pool import host_memory
from kvstore.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from node_agent.peer.ucx.wire import ucx_env

MiB = 1 << 20
BLOCK = 2 * MiB
SMALL_BLOCKS = 60  # a replay prompt's worth of 8 KiB blocks


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Agent(bench_agent.Agent):
    """A bench agent with a UCX peer listener on a known port."""

    def __init__(self, workdir: Path, name: str, **cfg) -> None:
        self.peer_port = free_port()
        super().__init__(
            workdir,
            **{
                "node_id": name,
                "slot_bytes": "2MiB",
                "nvme_bytes": 0,
                "peer_port": self.peer_port,
                **cfg,
            },
        )
        self.ucx_address = f"127.0.0.1:{self.peer_port}"


# ------------------------------------------------------------------ transport limit
def find_perftest() -> tuple[str, dict] | None:
    """ucx_perftest from PATH or from the libucx wheel ucxx brings (with its libraries)."""
    path = shutil.which("ucx_perftest")
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    if path:
        return path, env
    try:
        import libucx
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    if not binary.exists():
        return None
    env["LD_LIBRARY_PATH"] = f"{root / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
    return str(binary), env


@dataclass(frozen=True, slots=True)
class Perftest:
    """One ucx_perftest measurement: GB/s, and what carried the 2 MiB messages."""

    gbps: float
    transport: str


def cache_bytes() -> int:
    """The largest CPU cache of this host (sysfs), 32 MiB where sysfs does not say."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, IndexError):
            continue
    return max(sizes, default=32 * MiB)


def uncached_message_bytes() -> int:
    """A message twice the largest cache, in whole 2 MiB blocks: perftest's buffers on
    both sides then stream from and to memory (limit_uncached_gbps)."""
    return max(BLOCK, -(-2 * cache_bytes() // BLOCK) * BLOCK)


def perftest_gbps(
    binary: str,
    env: dict,
    tls: str,
    iters: int,
    as_agents: bool | None = None,
    devices: str = "",
    size: int = BLOCK,
) -> Perftest:
    """tag_bw of `size` messages (2 MiB, a block) between two processes; `iters` counts
    2 MiB messages (larger ones are as many bytes in fewer messages, and the warm-up
    shrinks alike); perftest prints MB/s = MiB/s.
    `as_agents` (the agents' shared_memory setting): with the agents' UCX settings
    (node_agent/peer/ucx/wire.ucx_env) and, given, on the network `devices` UCX put the
    agents' lanes on (their endpoints handle peer failure, and UCX keeps such a
    connection to the one interface it was made on): the transports, lanes and protocol
    UCX selects for the agents' transfers. (perftest -e would not do: its endpoints are
    not made through a listener, and UCX then picks another protocol.) None: perftest's
    own choice (on TCP it may stripe a message over several interfaces)."""
    env = dict(env, UCX_TLS=tls, UCX_PROTO_INFO="y")
    if as_agents is not None:
        env.update(ucx_env(as_agents))
    if devices:
        env["UCX_NET_DEVICES"] = devices
    out = None
    for _ in range(3):  # a server that died (its port taken meanwhile): start another
        got = _perftest_once(binary, env, iters, size)
        if isinstance(got, Perftest):
            return got
        out = got
    tail = f"{out.stdout[-500:]} {out.stderr[-500:]}" if out is not None else ""
    raise RuntimeError(f"ucx_perftest gave no result: {tail}")


def _perftest_once(binary: str, env: dict, iters: int, size: int):
    """One perftest server and its client: the Perftest, else the client's last output
    (None: the client never ran)."""
    port = free_port()
    server = subprocess.Popen(
        [binary, "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    out = None
    try:
        for _ in range(50):  # the server needs a moment before it accepts
            time.sleep(0.1)
            if server.poll() is not None:  # gone: this port is no use
                return out
            out = subprocess.run(
                [
                    binary,
                    "127.0.0.1",
                    "-p",
                    str(port),
                    "-t",
                    "tag_bw",
                    "-s",
                    str(size),
                    "-n",
                    str(max(8, iters * BLOCK // size)),
                    "-w",
                    str(max(2, 20 * BLOCK // size)),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            final = [ln for ln in out.stdout.splitlines() if ln.startswith("Final:")]
            if final:
                gbps = float(final[-1].split()[6]) * MiB / 1e9
                return Perftest(gbps, selected_protocol(out.stdout + out.stderr))
        return out
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(10)


def socket_gbps(total: int = 1 << 30) -> float:
    """Raw loopback TCP between two threads, 2 MiB sends (stand-in for ucx_perftest)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    got = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        buf = bytearray(BLOCK)
        with conn:
            while got[0] < total:
                n = conn.recv_into(buf)
                if not n:
                    break
                got[0] += n

    t = threading.Thread(target=sink)
    t.start()
    payload = b"\0" * BLOCK
    with socket.create_connection(("127.0.0.1", port)) as c:
        start = time.perf_counter()
        for _ in range(total // BLOCK):
            c.sendall(payload)
        t.join(60)
        elapsed = time.perf_counter() - start
    srv.close()
    return total / elapsed / 1e9


# The receiving side of footprint_socket_gbps, in a process of its own (no torch import):
# pre-touched distinct memory, filled in 2 MiB receives one after another.
_SINK = """
import mmap, socket, sys
import numpy as np
port, footprint, total, block = map(int, sys.argv[1:])
mem = mmap.mmap(-1, footprint)
if hasattr(mmap, "MADV_HUGEPAGE"):
    mem.madvise(mmap.MADV_HUGEPAGE)
np.frombuffer(mem, dtype=np.uint8)[:] = 0
view = memoryview(mem)
with socket.create_connection(("127.0.0.1", port)) as c:
    got = 0
    while got < total:
        off = got % footprint
        n = c.recv_into(view[off:off + min(block, footprint - off)])
        if not n:
            sys.exit("sender went away")
        got += n
    c.sendall(b"k")
"""


def footprint_socket_gbps(footprint: int, passes: int = 3) -> float:
    """Raw loopback TCP between two processes streaming `footprint` bytes of distinct,
    pre-touched memory on each side (one Prefetch's worth: what the agents move), `passes`
    times over, in 2 MiB sends. ucx_perftest reuses the same 2 MiB buffers for every
    message, which stay in the CPU cache; this is the same transport without that help."""
    src = np.frombuffer(host_memory(footprint), dtype=np.uint8)
    src[:] = np.random.default_rng(0).integers(0, 256, footprint, dtype=np.uint8)
    total = footprint * passes
    with socket.create_server(("127.0.0.1", 0)) as srv:
        sink = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _SINK,
                str(srv.getsockname()[1]),
                str(footprint),
                str(total),
                str(BLOCK),
            ]
        )
        try:
            srv.settimeout(60)
            conn, _ = srv.accept()  # the sink's memory is touched before it connects
            with conn:
                view = memoryview(src)
                start = time.perf_counter()
                for i in range(total // BLOCK):
                    off = (i * BLOCK) % footprint
                    conn.sendall(view[off : off + BLOCK])
                conn.settimeout(60)
                if conn.recv(1) != b"k":
                    raise RuntimeError("footprint socket sink failed")
                elapsed = time.perf_counter() - start
        finally:
            if sink.wait(60) != 0:
                raise RuntimeError(f"footprint socket sink exited with {sink.returncode}")
    return total / elapsed / 1e9


# The reading side of footprint_cma_gbps, in a process of its own (no torch import): its
# own pre-touched distinct memory, filled from the other process's with process_vm_readv.
_CMA_READER = """
import ctypes, mmap, os, sys, time
import numpy as np
pid, addr, footprint, passes, piece = map(int, sys.argv[1:])
mem = mmap.mmap(-1, footprint)
if hasattr(mmap, "MADV_HUGEPAGE"):
    mem.madvise(mmap.MADV_HUGEPAGE)
dst = np.frombuffer(mem, dtype=np.uint8)
dst[:] = 0
base = dst.ctypes.data
libc = ctypes.CDLL(None, use_errno=True)
class Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
start = time.perf_counter()
for _ in range(passes):
    for off in range(0, footprint, piece):
        n = min(piece, footprint - off)
        local, remote = Iov(base + off, n), Iov(addr + off, n)
        got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got != n:
            sys.exit(f"process_vm_readv: {got} of {n} bytes, errno {ctypes.get_errno()}")
print(footprint * passes / (time.perf_counter() - start) / 1e9)
"""


def footprint_cma_gbps(footprint: int, passes: int = 3) -> float | None:
    """GB/s of CMA reads (process_vm_readv, the copy UCX's cma transport makes for the
    agents) from `footprint` bytes of distinct, pre-touched memory in this process into as
    many of another process's, in 16 MiB reads (the agents' payload messages), `passes`
    times over; None where the reads are not allowed (ptrace restrictions)."""
    mem = host_memory(footprint)
    src = np.frombuffer(mem, dtype=np.uint8)
    src[:] = np.random.default_rng(0).integers(0, 256, footprint, dtype=np.uint8)
    args = [os.getpid(), src.ctypes.data, footprint, passes, 16 * MiB]
    out = subprocess.run(
        [sys.executable, "-c", _CMA_READER, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    del src
    mem.close()
    if out.returncode != 0:
        log(f"CMA footprint reads failed: {out.stderr[-300:]}")
        return None
    return float(out.stdout.strip())


@dataclass(frozen=True, slots=True)
class Limits:
    """How the transport limits are measured (transport_limit): `tcp()` the goal's limit,
    `shm()` the same over shared memory, `free()` TCP as perftest chooses by itself,
    `uncached()` the goal's limit with messages larger than the CPU cache (context);
    the last three None where they cannot be measured."""

    method: str
    tcp: Callable[[str], Perftest]  # on these devices ('' for UCX's choice)
    shm: Callable[[], Perftest | None] | None
    free: Callable[[], Perftest | None] | None
    uncached: Callable[[str], Perftest | None] | None = None


def transport_limit(iters: int) -> Limits:
    """Perftest over TCP and over shared memory with the agents' transport selection
    (perftest_gbps as_agents), and over TCP as perftest picks; a raw socket loopback
    when ucx_perftest is missing or does not run."""

    def sock(_devices: str = "") -> Perftest:
        return Perftest(socket_gbps(), "python socket")

    found = find_perftest()
    if found is None:
        log("ucx_perftest not found: raw socket loopback as the limit")
        return Limits("python socket", sock, None, None)
    binary, env = found
    try:
        perftest_gbps(binary, env, "tcp", 20, False)  # it runs here (libraries, loopback)?
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        log(f"ucx_perftest does not run ({exc}): raw socket loopback as the limit")
        return Limits("python socket", sock, None, None)

    def maybe(tls: str, as_agents: bool | None) -> Callable[[], Perftest | None]:
        def run() -> Perftest | None:
            try:
                return perftest_gbps(binary, env, tls, iters, as_agents)
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
                log(f"perftest over {tls} failed: {exc}")
                return None

        return run

    def uncached(devices: str) -> Perftest | None:
        size = uncached_message_bytes()
        try:
            return perftest_gbps(binary, env, "tcp", iters, False, devices, size)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            log(f"perftest over tcp with {size} B messages failed: {exc}")
            return None

    return Limits(
        "ucx_perftest tcp, the agents' UCX settings and lanes",
        lambda devices: perftest_gbps(binary, env, "tcp", iters, False, devices),
        maybe("sm,self", True),
        maybe("tcp", None),
        uncached,
    )


def used_transports(agent_log: Path) -> str:
    """What carries messages of 8 KiB and more from a UCX_PROTO_INFO=y agent: the last
    'tagged message by ucp_tag_send*' table UCX printed is the sending endpoint's
    configuration after wireup (the first one is the TCP configuration a listener
    connection starts with). 'transport: protocol'."""
    if not agent_log.exists():
        return "unknown"
    return selected_protocol(agent_log.read_text(errors="replace"))


def selected_protocol(text: str) -> str:
    """The last 'tagged message by ucp_tag_send* from host memory' table in UCX_PROTO_INFO
    output: 'transport: protocol' of its last row (the largest messages)."""
    last = "unknown"
    in_table = False
    if text:
        for line in text.splitlines():
            cells = [c.strip() for c in line.split("|")]
            if len(cells) >= 3 and "tagged message by ucp_tag_send* from host" in cells[2]:
                in_table = True
            elif in_table and len(cells) >= 5 and cells[1].endswith("..inf"):
                last = f"{cells[3]}: {cells[2].removeprefix('(?) ')}"
                in_table = False
    return last


# ----------------------------------------------------------------------- transfers
def seed_prompts(cb: KVClient, spec: Namespace, rounds: int, blocks: int):
    """Put `rounds` prompts of `blocks` blocks on B (distinct ids, shared payloads)."""
    nb = cb.open_namespace(spec)
    gen = torch.Generator().manual_seed(1)
    payload = [
        torch.randint(0, 256, (spec.block_bytes,), dtype=torch.uint8, generator=gen)
        .view(torch.float16)
        .view(block_shape(spec))
        for _ in range(blocks)
    ]
    prompts = []
    for r in range(rounds):
        tokens = np.arange(r * blocks * 16, (r + 1) * blocks * 16, dtype=np.int32) + 7
        ids = cb.block_ids(nb, tokens)
        assert cb.put(nb, ids, payload).stored == blocks
        prompts.append(ids)
    return prompts


def prefetch(stub, a: Agent, b: Agent, na, ids, ucx: bool, block: int = BLOCK) -> float:
    """One Prefetch of a prompt A does not hold; GB/s as the caller sees it."""
    req = peer_pb2.PrefetchRequest(
        ns=na.ref,
        spec=common_pb2.Namespace(**na.spec.to_dict()),
        block_ids=pack_ids(ids),
        parent_id=na.root,
        peer_address=b.address,
        peer_ucx_address=b.ucx_address if ucx else "",
        timeout_ms=120_000,
    )
    t = time.perf_counter()
    r = stub.Prefetch(req, timeout=180)
    dt = time.perf_counter() - t
    want = "ucx" if ucx else "grpc"
    if r.present != len(ids) or r.transport != want:
        raise RuntimeError(f"{want} prefetch incomplete: {r}")
    return len(ids) * block / dt / 1e9


KEYS = (
    "limit",
    "limit_shm",
    "limit_free",
    "limit_uncached",
    "limit_footprint",
    "limit_shm_footprint",
    "ucx",
    "ucx_cold",
    "grpc",
)


def tcp_devices(transport: str) -> str:
    """The network devices of the TCP lanes in a selected_protocol() answer ('tcp/lo'
    -> 'lo'; '52% on tcp/lo and 48% on tcp/eth0: ...' -> 'lo,eth0'); '' when none."""
    lanes = transport.split(":")[0]
    return ",".join(re.findall(r"tcp/([\w.-]+)", lanes))


def round_limits(
    limits: Limits, footprint: int, out: dict, protocols: dict, devices: str, cma: bool
) -> None:
    """One round's limits into `out` (and what carried them into `protocols`); the TCP
    limit on `devices`, those of the agents' TCP lanes; `cma`: the agents move payloads
    with CMA reads (not --tcp), and the CMA footprint figure is measured."""
    tcp = lambda: limits.tcp(devices)  # noqa: E731
    uncached = (lambda: limits.uncached(devices)) if limits.uncached else None  # noqa: E731
    for key, fn in (
        ("limit", tcp),
        ("limit_shm", limits.shm),
        ("limit_free", limits.free),
        ("limit_uncached", uncached),
    ):
        got = fn() if fn is not None else None
        if got is not None:
            out[key].append(got.gbps)
            protocols[key] = got.transport
    out["limit_footprint"].append(footprint_socket_gbps(footprint))
    got_cma = footprint_cma_gbps(footprint) if cma else None
    if got_cma is not None:
        out["limit_shm_footprint"].append(got_cma)


def measure(
    a: Agent,
    b: Agent,
    na,
    prompts,
    rounds: int,
    burst: int,
    limits: Limits,
    protocols: dict,
    cma: bool = True,
) -> dict[str, list[float]]:
    """Interleaved rounds: limits, UCX, gRPC. This machine's load moves a lot from second
    to second; pairing each UCX figure with limits taken just before keeps the ratios
    meaningful. A round's UCX figure is `burst` Prefetches back to back (bytes over their
    total time) after one that is only counted as `ucx_cold`: the first call after the
    seconds the limits take finds the agents' threads asleep and their caches cold, while
    ucx_perftest, the limit, warms up and then times hundreds of messages in a row."""
    out: dict[str, list[float]] = {k: [] for k in KEYS}
    ratios: dict[str, list[float]] = {}
    it = iter(prompts)
    with KVClient(a.address, use_shm=False) as ca:
        stub = peer_pb2_grpc.PeerStub(ca.channel)
        prefetch(stub, a, b, na, next(it), ucx=True)  # warm-up: connection, buffers
        # UCX printed the sending endpoint's lanes at the warm-up (UCX_PROTO_INFO=y)
        devices = tcp_devices(used_transports(b.workdir / "agent.log"))
        for r in range(rounds):
            had = {k: len(v) for k, v in out.items()}
            round_limits(limits, len(prompts[0]) * BLOCK, out, protocols, devices, cma)
            out["ucx_cold"].append(prefetch(stub, a, b, na, next(it), ucx=True))
            # bytes over the burst's total time (each call moves the same bytes)
            ucx = burst / sum(
                1 / prefetch(stub, a, b, na, next(it), ucx=True) for _ in range(burst)
            )
            out["ucx"].append(ucx)
            out["grpc"].append(prefetch(stub, a, b, na, next(it), ucx=False))
            for key in (
                "limit",
                "limit_shm",
                "limit_free",
                "limit_uncached",
                "limit_footprint",
                "limit_shm_footprint",
            ):
                if len(out[key]) > had[key]:  # measured this round
                    name = "ratio" + key.removeprefix("limit")
                    ratios.setdefault(name, []).append(ucx / out[key][-1])
            now = {k: f"{v[-1]:.2f}" if len(v) > had[k] else "-" for k, v in out.items()}
            log(
                f"  round {r}: limit tcp {now['limit']}  shm {now['limit_shm']}  tcp as "
                f"perftest picks {now['limit_free']}  tcp uncached {now['limit_uncached']}  "
                f"socket over the footprint "
                f"{now['limit_footprint']}  CMA over the footprint {now['limit_shm_footprint']}"
                f"  ucx {now['ucx']} (first call {now['ucx_cold']})"
                f"  grpc {now['grpc']} GB/s"
            )
    return {**out, **ratios}


def small_latency(workdir: Path, rounds: int, tag: str = "") -> dict[str, float]:
    """Median ms of a Prefetch of SMALL_BLOCKS 8 KiB blocks, per transport (fresh blocks
    every call; one warm-up call each, as in service the connection is kept). Each round
    times one Prefetch per transport back to back, the order alternating from round to
    round: the load on a shared host moves within seconds, and pairing exposes both
    transports to the same load. Also the paired figures: `diff`, the median over rounds
    of that round's UCX time minus its gRPC time (below 0: UCX faster), and `le`, the
    share of rounds in which UCX took no longer than gRPC."""
    spec = bench_agent.llama3_8b("peer-small", num_layers=2, num_kv_heads=2, head_dim=32)
    assert spec.block_bytes == 8192
    agents: list[Agent] = []
    times: dict[str, list[float]] = {"ucx": [], "grpc": []}
    try:
        for name in ("b", "a"):
            agents.append(
                Agent(
                    workdir / f"small{tag}-{name}",
                    f"peer-small-{name}",
                    pool_bytes="64MiB",
                    slot_bytes="8KiB",
                )
            )
        b, a = agents
        with KVClient(b.address, tenant_secret="bench", use_shm=False) as cb:
            prompts = iter(seed_prompts(cb, spec, 2 * (rounds + 1), SMALL_BLOCKS))
        with KVClient(a.address, tenant_secret="bench", use_shm=False) as ca:
            na = ca.open_namespace(spec)
            stub = peer_pb2_grpc.PeerStub(ca.channel)
            for r in range(rounds + 1):
                order = ("ucx", "grpc") if r % 2 else ("grpc", "ucx")
                for transport in order:
                    gbps = prefetch(
                        stub, a, b, na, next(prompts), transport == "ucx", spec.block_bytes
                    )
                    if r:  # round 0 warms both up
                        times[transport].append(SMALL_BLOCKS * spec.block_bytes / gbps / 1e6)
    finally:
        for ag in agents:
            ag.stop()
    out = {t: round(statistics.median(v), 2) for t, v in times.items()}
    diffs = [u - g for u, g in zip(times["ucx"], times["grpc"])]
    out["diff"] = round(statistics.median(diffs), 3)
    out["le"] = round(sum(d <= 0 for d in diffs) / len(diffs), 3)
    for t, v in times.items():
        log(f"  {SMALL_BLOCKS} x 8 KiB over {t}: p50 {out[t]} ms (min {min(v):.2f})")
    log(f"  UCX minus gRPC per round: median {out['diff']} ms; UCX no slower in {out['le']:.0%}")
    return out


def small_figures(small: dict[str, float], prefix: str = "") -> dict[str, object]:
    """The JSON fields of a small_latency result (empty: the phase was skipped)."""
    if not small:
        return {}
    return {
        f"{prefix}prefetch_60x8k_ms_ucx": small["ucx"],
        f"{prefix}prefetch_60x8k_ms_grpc": small["grpc"],
        f"{prefix}prefetch_60x8k_ucx_minus_grpc_ms": small["diff"],
        f"{prefix}prefetch_60x8k_ucx_no_slower_share": small["le"],
        f"{prefix}prefetch_60x8k_ucx_no_slower": small["ucx"] <= small["grpc"],
    }


def contended_small(workdir: Path, rounds: int) -> dict[str, object]:
    """The 60 x 8 KiB figures again beside bench_agent's --contended load (one core
    copying 64 MiB buffers, as an engine beside the agents would keep it busy)."""
    log("60 x 8 KiB Prefetches beside a CPU and memory load ...")
    with bench_agent.MemoryLoad() as load:
        small = small_latency(workdir, rounds, "-contended")
    out = small_figures(small, "contended_")
    out["contended_load_gbps"] = round(load.gbps, 2)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.bench_peer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--blocks", type=int, default=64, help="2 MiB blocks per prompt")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (limits, UCX, gRPC)")
    ap.add_argument(
        "--burst",
        type=int,
        default=3,
        help="UCX Prefetches timed back to back per round, after a first one",
    )
    ap.add_argument("--perftest-iters", type=int, default=200)
    ap.add_argument(
        "--small-rounds",
        type=int,
        default=30,
        help="rounds of the 60 x 8 KiB latency figure (0: skip it)",
    )
    ap.add_argument(
        "--contended",
        action="store_true",
        help="also the 60 x 8 KiB figure beside a CPU and memory load (contended_*)",
    )
    ap.add_argument(
        "--tcp",
        action="store_true",
        help="agents keep payloads on TCP (KVSTORE_PEER_SHARED_MEMORY=0)",
    )
    ap.add_argument(
        "--no-direct-reads",
        action="store_true",
        help="payloads as UCX messages between agents of this host too "
        "(KVSTORE_PEER_SAME_HOST_READS=0)",
    )
    args = ap.parse_args(argv)
    spec = bench_agent.llama3_8b("peer")
    n_prompts = 1 + args.rounds * (args.burst + 2)
    pool = f"{n_prompts * args.blocks * 2 + 16}MiB"
    # The agents inherit these: UCX prints the protocols it selects per endpoint config.
    os.environ["UCX_PROTO_INFO"] = "y"
    if args.tcp:
        os.environ["KVSTORE_PEER_SHARED_MEMORY"] = "0"
    if args.no_direct_reads:
        os.environ["KVSTORE_PEER_SAME_HOST_READS"] = "0"
    result: dict = {
        "block_bytes": BLOCK,
        "blocks": args.blocks,
        "rounds": args.rounds,
        "burst": args.burst,
        # what the agents load: their files leave `peer` to the environment
        "batch_blocks": load_config(AgentConfig, env_prefix="KVSTORE_AGENT_").peer.batch_for(BLOCK),
    }
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        limits = transport_limit(args.perftest_iters)
        protocols: dict[str, str] = {}
        agents: list[Agent] = []
        try:
            agents.append(Agent(Path(tmp) / "b", "peer-b", pool_bytes=pool))
            agents.append(Agent(Path(tmp) / "a", "peer-a", pool_bytes=pool))
            b, a = agents
            with KVClient(
                b.address, tenant_secret="bench", use_shm=True, shm_bytes=args.blocks * BLOCK
            ) as cb:
                prompts = seed_prompts(cb, spec, n_prompts, args.blocks)
            with KVClient(a.address, tenant_secret="bench", use_shm=False) as ca:
                na = ca.open_namespace(spec)
            log(f"{args.rounds} rounds of {args.blocks} blocks")
            m = measure(a, b, na, prompts, args.rounds, args.burst, limits, protocols, not args.tcp)
            with KVClient(a.address, tenant_secret="bench", use_shm=False) as ca:
                counters = dict(ca.stats().counters)
                direct_blocks = counters.get("peer_blocks_direct", 0)
                mapped_blocks = counters.get("peer_blocks_mapped", 0)
        finally:
            for ag in agents:
                ag.stop()
        transport = used_transports(Path(tmp) / "b" / "agent.log")
        small = small_latency(Path(tmp), args.small_rounds) if args.small_rounds else {}
        busy = contended_small(Path(tmp), args.small_rounds) if args.contended else {}
    med = {k: round(statistics.median(v), 3) if v else None for k, v in m.items()}
    result.update(
        limit_gbps=med["limit"],
        limit_method=limits.method,
        limit_transport=protocols.get("limit"),
        limit_shm_gbps=med["limit_shm"],
        limit_shm_transport=protocols.get("limit_shm"),
        limit_free_gbps=med["limit_free"],
        limit_free_transport=protocols.get("limit_free"),
        limit_uncached_gbps=med["limit_uncached"],
        limit_uncached_bytes=uncached_message_bytes() if limits.uncached else None,
        limit_footprint_gbps=med["limit_footprint"],
        limit_shm_footprint_gbps=med["limit_shm_footprint"],
        ucx_gbps=med["ucx"],
        ucx_cold_gbps=med["ucx_cold"],
        grpc_gbps=med["grpc"],
        ucx_ratio=med.get("ratio"),
        ucx_ratio_shm=med.get("ratio_shm"),
        ucx_ratio_free=med.get("ratio_free"),
        ucx_ratio_uncached=med.get("ratio_uncached"),
        ucx_ratio_footprint=med["ratio_footprint"],
        ucx_ratio_shm_footprint=med.get("ratio_shm_footprint"),
        ucx_best_gbps=round(max(m["ucx"]), 3),
        payload_path=(
            "mapped reads" if mapped_blocks else "direct reads" if direct_blocks else "ucx messages"
        ),
        direct_blocks=direct_blocks,
        mapped_blocks=mapped_blocks,
        ucx_transport=transport,
    )
    result.update(small_figures(small))
    result.update(busy)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
