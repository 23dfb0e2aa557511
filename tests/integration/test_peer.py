"""Peer-to-peer block transfer between two real agent processes on loopback: UCX (ucxx)
first, gRPC streaming as fallback (node_agent/peer/). B holds blocks, the test asks A to
Prefetch them from B, then reads them from A with a normal Get."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from support.common import (
    TEST_SECRET,
    AgentProc,
    free_port,
    make_namespace,
    prompt_tokens,
    python_json,
    wait_for,
)

from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.hashing import pack_ids
from kvstore.tiers.pool import POOL_MEMFD
from kvstore.v1 import common_pb2, peer_pb2, peer_pb2_grpc

# Without ucxx the agents run gRPC-only; the transport-agnostic tests still run.
needs_ucx = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="needs ucxx (pip install ucxx-cu12)"
)

SMALL = make_namespace()  # 4 KiB blocks
BIG = make_namespace(name="big", num_layers=32, num_kv_heads=8, head_dim=128)  # 2 MiB
# 256 KiB blocks: above the packed limit, so they travel in runs (one UCX message per run
# of blocks that lie back to back in the sender's pool).
MID = make_namespace(name="mid", num_layers=4, num_kv_heads=8, head_dim=128)
assert MID.block_bytes == 256 << 10
ROOT = Path(__file__).resolve().parents[2]
FAULT_SCRIPT = ROOT / "tests" / "support" / "peer_fault.py"
NOTIFY_SCRIPT = ROOT / "tests" / "support" / "ucx_notify.py"


def random_blocks(spec, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, spec.block_bytes), dtype=torch.uint8, generator=g)
    return [r.view(torch_dtype(spec.kv_dtype)).view(block_shape(spec)) for r in raw]


def ucx_lines(*agents) -> list[str]:
    """The lines of the agents' logs that speak of UCX: why a fetch that should have gone
    over UCX went over gRPC (a failure there is logged, then the next transport runs)."""
    return [line for a in agents for line in a.log.splitlines() if "ucx" in line.lower()]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    # Byte equality: random bytes viewed as floats include NaNs, which never compare equal.
    return len(a) == len(b) and all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b)
    )


def agent_config(workdir: Path, name: str, **overrides) -> dict:
    cfg = {
        "node_id": name,
        "listen": "127.0.0.1:0",
        "data_dir": str(workdir / "data"),
        "slot_bytes": "2MiB",
        "pool_bytes": "512MiB",
        "nvme_bytes": 0,
        "device": "cpu",
        "allow_unauthenticated": True,
        "expire_interval_s": 0.5,
        "peer_port": free_port(),
    }
    cfg.update(overrides)
    return cfg


class Cluster:
    """Agents started once for the module (each start costs seconds of imports): B holds
    blocks, A pulls them over UCX, G pulls with UCX disabled (gRPC only); the kill and
    freeze tests add a source of their own. Tests use their own prompts and compare
    counter deltas, so they do not see each other."""

    def __init__(self, root: Path) -> None:
        self.procs: dict[str, AgentProc] = {}
        self.clients: dict[str, KVClient] = {}
        for name, extra in (
            ("a", dict(pool_bytes="2GiB")),
            ("b", {}),
            ("g", dict(ucx_enabled=False, pool_bytes="64MiB")),
        ):
            self.start(root, name, **extra)

    def start(self, root: Path, name: str, **extra) -> AgentProc:
        proc = AgentProc(root / name, agent_config(root / name, name, **extra))
        self.procs[name] = proc
        proc.start()
        self.clients[name] = KVClient(
            proc.address,
            tenant_secret=TEST_SECRET,
            use_shm=name.startswith("b"),
            shm_bytes=64 << 20,
        )
        return proc

    def ucx(self, name: str) -> str:
        return f"127.0.0.1:{self.procs[name].config['peer_port']}"

    def seed(self, spec, n: int, seed: int, src: str = "b", dst: str = "a"):
        """Put an n-block prompt on `src`; returns (dst's handle, ids, tensors)."""
        cb = self.clients[src]
        nb = cb.open_namespace(spec)
        ids = cb.block_ids(nb, prompt_tokens(seed, n * spec.block_size))
        blocks = random_blocks(spec, n, seed)
        r = cb.put(nb, ids, blocks)
        assert r.stored == n
        return self.clients[dst].open_namespace(spec), ids, blocks

    def request(
        self, na, ids, src: str = "b", ucx: str | None = None, timeout_ms: int = 0
    ) -> peer_pb2.PrefetchRequest:
        return peer_pb2.PrefetchRequest(
            ns=na.ref,
            spec=common_pb2.Namespace(**na.spec.to_dict()),
            block_ids=pack_ids(ids),
            parent_id=na.root,
            peer_address=self.procs[src].address,
            peer_ucx_address=self.ucx(src) if ucx is None else ucx,
            timeout_ms=timeout_ms,
        )

    def peer_stub(self, dst: str) -> peer_pb2_grpc.PeerStub:
        return peer_pb2_grpc.PeerStub(self.clients[dst].channel)

    def prefetch(self, na, ids, dst: str = "a", **kw) -> peer_pb2.PrefetchResponse:
        return self.peer_stub(dst).Prefetch(self.request(na, ids, **kw), timeout=120)

    def counters(self, name: str) -> Counter:
        return Counter(dict(self.clients[name].stats().counters))

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        for p in self.procs.values():
            p.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("peer"))
    try:
        yield c
    finally:
        c.close()


class Delta:
    """Counter changes on one agent across a block of test code."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster, self.name = cluster, name
        self.before = cluster.counters(name)

    def now(self) -> Counter:
        after = self.cluster.counters(self.name)
        after.subtract(self.before)
        return +after  # drop zero entries


@needs_ucx
def test_prefetch_over_ucx_then_get_from_a_returns_equal_tensors(cluster):
    na, ids, blocks = cluster.seed(SMALL, 20, seed=1)
    ca = cluster.clients["a"]
    assert ca.lookup(na, ids).matched == 0
    da, db = Delta(cluster, "a"), Delta(cluster, "b")

    r = cluster.prefetch(na, ids)
    assert (r.present, r.fetched, r.transport, r.stopped) == (20, 20, "ucx", "")
    assert same_bytes(ca.get(na, ids), blocks)
    assert da.now()["peer_blocks_received"] == 20 and da.now()["peer_fetch_ucx"] == 1
    assert da.now()["peer_fetch_grpc"] == 0 and da.now()["peer_ucx_failures"] == 0
    assert db.now()["peer_blocks_served"] == 20

    again = cluster.prefetch(na, ids)  # everything local now: no transfer at all
    assert (again.present, again.fetched, again.transport) == (20, 0, "")
    assert da.now()["peer_blocks_received"] == 20


def free_slots(client: KVClient) -> int:
    return client.stats().tiers[0].slots_free


def test_prefetch_of_a_longer_prompt_stops_where_the_peer_stops(cluster):
    na, ids, blocks = cluster.seed(SMALL, 12, seed=2)
    longer = cluster.clients["a"].block_ids(na, prompt_tokens(2, 20 * SMALL.block_size))
    assert longer[:12] == ids
    free = free_slots(cluster.clients["a"])
    r = cluster.prefetch(na, longer)
    assert (r.present, r.fetched) == (12, 12)
    assert "peer holds only 12" in r.stopped
    assert same_bytes(cluster.clients["a"].get(na, longer), blocks)
    # A reserved 20 slots while its request was on the way; the 8 B lacked went back.
    assert free_slots(cluster.clients["a"]) == free - 12


@needs_ucx
def test_client_prefetch_asks_the_agent_to_pull_from_a_peer(cluster):
    na, ids, blocks = cluster.seed(SMALL, 9, seed=13)
    ca = cluster.clients["a"]
    r = ca.prefetch(na, ids, cluster.procs["b"].address, cluster.ucx("b"))
    assert (r.present, r.fetched, r.transport, r.stopped) == (9, 9, "ucx", "")
    assert same_bytes(ca.get(na, ids), blocks)
    # Nobody at the peer's addresses: a shorter answer saying why, not an error.
    other, ids2, _ = cluster.seed(SMALL, 3, seed=14)
    r = ca.prefetch(other, ids2, f"127.0.0.1:{free_port()}", timeout_ms=3000)
    assert (r.present, r.fetched, r.transport) == (0, 0, "grpc") and r.stopped, r


def test_peer_that_never_saw_the_namespace_opens_it_from_the_spec(cluster):
    unseen = make_namespace(name="unseen-by-b")
    na = cluster.clients["a"].open_namespace(unseen)
    ids = cluster.clients["a"].block_ids(na, prompt_tokens(3, 4 * unseen.block_size))
    free = free_slots(cluster.clients["a"])
    r = cluster.prefetch(na, ids)
    assert (r.present, r.fetched) == (0, 0) and "peer holds only 0" in r.stopped
    assert free_slots(cluster.clients["a"]) == free  # the slots reserved ahead went back
    cb = cluster.clients["b"]
    assert cb.lookup(cb.open_namespace(unseen), ids).matched == 0


def test_generation_fencing_on_the_pulling_agent(cluster):
    na, ids, _ = cluster.seed(SMALL, 4, seed=4)
    req = cluster.request(na, ids)
    req.ns.generation = na.generation + 3  # ahead of this node: refused, nothing moved
    da = Delta(cluster, "a")
    with pytest.raises(grpc.RpcError) as ei:
        cluster.peer_stub("a").Prefetch(req, timeout=30)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert da.now()["peer_blocks_received"] == 0


def test_grpc_fallback_when_ucx_is_disabled(cluster):
    na, ids, blocks = cluster.seed(SMALL, 20, seed=5, dst="g")
    dg = Delta(cluster, "g")
    r = cluster.prefetch(na, ids, dst="g")  # G runs with ucx_enabled=False
    assert (r.present, r.fetched, r.transport, r.stopped) == (20, 20, "grpc", "")
    assert same_bytes(cluster.clients["g"].get(na, ids), blocks)
    assert dg.now()["peer_fetch_grpc"] == 1 and dg.now()["peer_fetch_ucx"] == 0


@needs_ucx
def test_grpc_fallback_when_nothing_listens_on_the_ucx_address(cluster):
    na, ids, blocks = cluster.seed(SMALL, 10, seed=6)
    da = Delta(cluster, "a")
    r = cluster.prefetch(na, ids, ucx=f"127.0.0.1:{free_port()}")
    assert (r.present, r.fetched, r.transport, r.stopped) == (10, 10, "ucx+grpc", "")
    assert same_bytes(cluster.clients["a"].get(na, ids), blocks)
    assert da.now()["peer_ucx_failures"] == 1


def test_a_prefetch_from_an_address_that_is_no_peer_says_only_the_status(cluster):
    """The caller chooses the address a Prefetch pulls from, and `stopped` quoted what
    the network said: "Connection refused", "Connection reset by peer", "Domain name not
    found", "unknown service kvstore.v1.Peer": a port scan and a service probe of any
    host the agent reaches, for a tenant. Now it names the address and the status only
    (the agent's log keeps the rest)."""
    import contextlib
    import socket
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    na, ids, _ = cluster.seed(SMALL, 4, seed=61)
    other = grpc.server(futures.ThreadPoolExecutor(max_workers=2))  # gRPC, not a peer
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), other)
    grpc_port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    plain = socket.socket()  # not gRPC: takes the connection and closes it
    plain.bind(("127.0.0.1", 0))
    plain.listen()

    def close_each() -> None:
        with contextlib.suppress(OSError):  # until the listener is closed below
            while True:
                plain.accept()[0].close()

    closer = threading.Thread(target=close_each, daemon=True)
    closer.start()
    targets = {
        f"127.0.0.1:{free_port()}": "UNAVAILABLE",  # nothing listens
        f"127.0.0.1:{plain.getsockname()[1]}": "UNAVAILABLE",
        "no-such-host.invalid:50051": "UNAVAILABLE",
        f"127.0.0.1:{grpc_port}": "UNIMPLEMENTED",
    }
    try:
        for address, status in targets.items():
            req = cluster.request(na, ids, ucx="")
            req.peer_address = address
            r = cluster.peer_stub("a").Prefetch(req, timeout=60)
            assert (r.present, r.transport) == (0, "grpc"), r
            assert r.stopped == f"grpc: {address}: {status}", r.stopped
    finally:
        other.stop(0)
        plain.close()
    said = cluster.procs["a"].log
    assert "UNIMPLEMENTED Method not found" in said  # the operator still reads it


def test_concurrent_prefetches_of_overlapping_blocks_transfer_each_block_once(cluster):
    n = 96
    na, ids, blocks = cluster.seed(BIG, n, seed=7)
    da = Delta(cluster, "a")
    results: dict[str, peer_pb2.PrefetchResponse] = {}

    def run(name: str, k: int) -> None:
        results[name] = cluster.prefetch(na, ids[:k])

    threads = [
        threading.Thread(target=run, args=("long", n)),
        threading.Thread(target=run, args=("short", 64)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["long"].present == n and results["short"].present == 64
    d = da.now()
    assert d["peer_blocks_received"] == n  # the 64 shared blocks came over once
    assert results["long"].waited + results["short"].waited == d["peer_dedup_blocks"] > 0
    assert same_bytes(cluster.clients["a"].get(na, ids), blocks)


@needs_ucx
def test_peer_killed_mid_transfer_is_a_bounded_miss_and_nothing_wrong_is_stored(cluster, tmp_path):
    """B2 is killed once the first blocks arrived. Mapped reads move 640 MiB in tens of
    ms on a quick host, so the kill can land after the last block (make test saw it
    once): that try killed nothing mid-transfer, so it is made again with another source
    and prompt (at most 3 tries; A's pool holds all three)."""
    n = 320  # 640 MiB: long enough to kill B2 in the middle
    for attempt in range(3):
        src = f"b2-{attempt}"
        cluster.start(tmp_path, src, pool_bytes="1GiB")
        na, ids, blocks = cluster.seed(BIG, n, seed=8 + 20 * attempt, src=src)
        da = Delta(cluster, "a")
        call = cluster.peer_stub("a").Prefetch.future(
            cluster.request(na, ids, src=src, timeout_ms=20_000), timeout=60
        )
        wait_for(
            lambda call=call, da=da: call.done() or da.now()["peer_blocks_received"] > 0,
            timeout=60,
            interval=0.01,
            what="the transfer to start",
        )
        cluster.procs[src].kill()
        r = call.result(timeout=60)  # returns (within the 20 s bound), never hangs
        if r.present < n:
            break
    assert r.present < n and r.fetched == r.present, r
    assert r.stopped and r.transport.startswith("ucx")
    # Whatever A stored is exactly B2's data, and A keeps serving.
    got = cluster.clients["a"].get(na, ids)
    assert len(got) == r.present and same_bytes(got, blocks[: r.present])
    assert da.now()["peer_checksum_mismatch"] == 0


@needs_ucx
def test_frozen_peer_is_a_miss_at_the_deadline(cluster, tmp_path):
    """B3 is stopped (SIGSTOP) once the first blocks arrived: alive but silent, so only
    the deadline can end the Prefetch, with the blocks that came before it.

    The fetcher A3 asks for 8 MiB chunks (4 blocks): B3 announces at most two chunks
    ahead of the fetcher's releases, so B3 must keep answering for 60 chunks, and a stop
    that lands any time in the transfer leaves chunks unannounced (what the fetcher reads
    of an announced chunk it reads from B3's memory itself, stopped or not). A stop can
    still land after the last chunk on a host that deschedules this test long enough: that
    try froze nothing, so it is made again with another prompt (at most 3 tries; the
    pools hold all three, so no try evicts another's blocks)."""
    b3 = cluster.start(tmp_path, "b3", pool_bytes="1600MiB")
    cluster.start(tmp_path, "a3", pool_bytes="1600MiB", peer={"batch_bytes": "8MiB"})
    n = 240  # 480 MiB
    late = []
    for attempt in range(3):
        na, ids, blocks = cluster.seed(BIG, n, seed=12 + attempt, src="b3", dst="a3")
        da = Delta(cluster, "a3")
        call = cluster.peer_stub("a3").Prefetch.future(
            cluster.request(na, ids, src="b3", timeout_ms=4_000), timeout=60
        )
        wait_for(
            lambda call=call, da=da: call.done() or da.now()["peer_blocks_received"] > 0,
            timeout=60,
            interval=0.005,
            what="the transfer to start",
        )
        b3.proc.send_signal(signal.SIGSTOP)
        try:
            r = call.result(timeout=60)
        finally:
            b3.proc.send_signal(signal.SIGCONT)
        if r.present < n:
            break
        late.append(r)  # every block came before the stop: nothing was frozen
    else:
        pytest.fail(f"the stop landed after the transfer's end in 3 tries: {late}")
    assert r.transport == "ucx", r  # the deadline left no time for gRPC
    assert "deadline" in r.stopped or "timed out" in r.stopped, r.stopped
    got = cluster.clients["a3"].get(na, ids)
    assert len(got) == r.present and same_bytes(got, blocks[: r.present])


@needs_ucx
def test_a_prefetch_into_a_full_pool_evicts_older_chains_not_its_own(cluster, tmp_path):
    """A4's pool (128 slots) holds a 100-block chain when a second one of 100 blocks
    comes, in 25 chunks of 4: room is made by evicting the older chain's tail. The
    transfer reserves a chunk while the one before it is still landing, and the value
    policy ranks the new chain's shallow, never-hit tail below the older chain's deeper
    leaf: without the store holding each landed chunk's last block for the next one, the
    new chain evicted itself: it stopped at 20 of 100, 'block 24 was not stored'."""
    cluster.start(tmp_path, "b4", pool_bytes="512MiB")
    cluster.start(tmp_path, "a4", pool_bytes="256MiB", peer={"batch_bytes": "8MiB"})
    older, ids_old, _ = cluster.seed(BIG, 100, seed=40, src="b4", dst="a4")
    r = cluster.prefetch(older, ids_old, dst="a4", src="b4")
    assert (r.present, r.stopped) == (100, ""), r
    na, ids, blocks = cluster.seed(BIG, 100, seed=41, src="b4", dst="a4")
    r = cluster.prefetch(na, ids, dst="a4", src="b4")
    assert (r.present, r.stopped, r.transport) == (100, "", "ucx"), r
    assert same_bytes(cluster.clients["a4"].get(na, ids), blocks)
    assert 0 < cluster.clients["a4"].lookup(older, ids_old).matched <= 28  # its tail made room


# ------------------------------------------------------------------- fault injection
def run_fake_peer(tmp_path: Path, mode: str, blocks, env: dict[str, str] | None = None):
    """tests/support/peer_fault.py: a UCX listener speaking the peer protocol that corrupts a
    payload ('corrupt') or dies after the first chunk ('die'); `env`: more of its
    environment."""
    data = tmp_path / f"fake-{mode}.npy"
    np.save(data, np.stack([b.view(torch.uint8).reshape(-1).numpy() for b in blocks]))
    port_file = tmp_path / f"fake-{mode}.port"
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.Popen(
        [sys.executable, str(FAULT_SCRIPT), mode, str(data), str(port_file)],
        cwd=ROOT,
        env=env,
        stdout=open(tmp_path / f"fake-{mode}.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    port = wait_for(
        lambda: port_file.exists() and port_file.read_text().strip(), 30, what="fake peer port"
    )
    return proc, f"127.0.0.1:{port}"


@pytest.fixture
def fake_peer(tmp_path):
    procs: list[subprocess.Popen] = []

    def start(*args):
        proc, address = run_fake_peer(tmp_path, *args)
        procs.append(proc)
        return address

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@needs_ucx
@pytest.mark.parametrize(
    "spec,mode",
    [(SMALL, "corrupt"), (MID, "corrupt"), (MID, "direct-corrupt")],
    ids=["packed", "in-place", "direct-reads"],
)
def test_checksum_mismatch_over_ucx_is_a_miss_from_that_block_on(cluster, fake_peer, spec, mode):
    """Packed: the fused copy + verify pass catches it; in place: the digest of its
    message, taken as the message landed; direct reads: the digest each block's read
    took."""
    na, ids, blocks = cluster.seed(spec, 20, seed=9 if mode == "corrupt" else 19)
    da = Delta(cluster, "a")
    r = cluster.prefetch(na, ids, ucx=fake_peer(mode, blocks))  # flips block 11
    assert (r.present, r.transport) == (11, "ucx"), r
    assert "checksum mismatch" in r.stopped
    assert same_bytes(cluster.clients["a"].get(na, ids), blocks[:11])
    d = da.now()
    assert d["peer_checksum_mismatch"] == 1
    assert d["peer_blocks_direct"] == (20 if mode == "direct-corrupt" else 0), d


@needs_ucx
def test_a_peer_the_kernel_will_not_let_us_read_gets_payload_messages_after(cluster, fake_peer):
    """Direct reads from a process that is not the peer's (here: one that does not
    exist) are not made: that transfer fails, and the Prefetch finishes it over gRPC;
    the fetcher then stops offering direct reads to that peer, whose next answer comes
    as UCX payload messages."""
    na, ids, blocks = cluster.seed(MID, 20, seed=44)
    fake = fake_peer("direct-gone", blocks)
    da = Delta(cluster, "a")
    r = cluster.prefetch(na, ids, ucx=fake)
    assert (r.present, r.fetched, r.transport, r.stopped) == (20, 20, "ucx+grpc", ""), r
    assert same_bytes(cluster.clients["a"].get(na, ids), blocks)
    d = da.now()
    assert d["peer_direct_not_owner"] == 1 and d["peer_ucx_failures"] == 1, d
    assert d["peer_blocks_direct"] == 0, d
    # The fake serves its rows whatever ids are asked: they arrive under these ones.
    na2, ids2, _ = cluster.seed(MID, 20, seed=45)
    da = Delta(cluster, "a")
    r = cluster.prefetch(na2, ids2, ucx=fake)
    assert (r.present, r.fetched, r.transport, r.stopped) == (20, 20, "ucx", ""), r
    assert same_bytes(cluster.clients["a"].get(na2, ids2), blocks)
    d = da.now()
    assert d["peer_blocks_direct"] == 0 and d["peer_direct_refused"] == 0, d


def _pool_address_of(pid: int, payload: bytes, slot_bytes: int) -> int | None:
    """Where `payload` lies in process `pid`'s host pool (its kvstore-pool mapping),
    read through /proc/PID/mem; None when it is not there."""
    with open(f"/proc/{pid}/maps") as f:
        pools = [line.split() for line in f if POOL_MEMFD in line]
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for cols in pools:
            lo, hi = (int(x, 16) for x in cols[0].split("-"))
            for addr in range(lo, hi, slot_bytes):
                mem.seek(addr)
                if mem.read(len(payload)) == payload:
                    return addr
    return None


@needs_ucx
def test_a_peer_a_caller_names_cannot_have_the_agent_read_another_process(cluster, tmp_path):
    """Whoever answers a Prefetch's peer address writes the chunk header that names the
    process to read from. A listener a caller named (its own, here the fault injector)
    names agent B, and where B holds a block it must not get (a block of another
    namespace: another tenant's, the caller guessing its checksum). A reads nothing from
    B: it reads only from the process that holds the listener it reached."""
    blocks = cluster.seed(MID, 1, seed=46)[2]  # B holds it, in another namespace
    payload = blocks[0].view(torch.uint8).reshape(-1).numpy().tobytes()
    b = cluster.procs["b"]
    addr = _pool_address_of(b.proc.pid, payload, MID.block_bytes)
    if addr is None:
        pytest.skip("B's pool is not a kvstore-pool mapping on this host")
    liar, address = run_fake_peer(
        tmp_path,
        "direct-other",
        blocks,
        env={"FAKE_OTHER_PID": str(b.proc.pid), "FAKE_OTHER_ADDRS": str(addr)},
    )
    try:
        other = make_namespace(name="mine", num_layers=4, num_kv_heads=8, head_dim=128)
        na = cluster.clients["a"].open_namespace(other)
        ids = cluster.clients["a"].block_ids(na, prompt_tokens(47, MID.block_size))
        da = Delta(cluster, "a")
        r = cluster.prefetch(na, ids, ucx=address)  # gRPC: B, which holds none of them
        assert r.present == 0, r
        assert "named a process that is not the far end" in r.stopped, r
        d = da.now()
        assert d["peer_direct_not_owner"] == 1 and d["peer_blocks_direct"] == 0, d
        assert cluster.clients["a"].lookup(na, ids).matched == 0
    finally:
        liar.kill()
        liar.wait(10)


@needs_ucx
def test_ucx_peer_dying_mid_transfer_falls_back_to_grpc(cluster, fake_peer):
    na, ids, blocks = cluster.seed(SMALL, 20, seed=10)
    da = Delta(cluster, "a")
    r = cluster.prefetch(na, ids, ucx=fake_peer("die", blocks))  # one chunk, then exits
    assert (r.present, r.fetched, r.transport, r.stopped) == (20, 20, "ucx+grpc", ""), r
    assert same_bytes(cluster.clients["a"].get(na, ids), blocks)
    d = da.now()
    assert d["peer_ucx_failures"] == 1 and d["peer_blocks_received"] == 20


@needs_ucx
def test_prefetch_forwards_the_callers_token_and_checks_access(spawn_agent):
    """The UCX path bypasses the gRPC edge: B checks the token A forwards in the request."""
    tokens = {"acme": "acme-token", "other": "other-token"}
    tenants = {
        t: {"token_sha256": hashlib.sha256(tok.encode()).hexdigest()} for t, tok in tokens.items()
    }
    cfg = dict(allow_unauthenticated=False, tenants=tenants)
    b_port = free_port()
    b = spawn_agent(peer_port=b_port, **cfg)
    a = spawn_agent(peer_port=free_port(), **cfg)
    with (
        KVClient(b.address, token="acme-token", tenant_secret=TEST_SECRET) as cb,
        KVClient(a.address, token="acme-token", tenant_secret=TEST_SECRET, use_shm=False) as ca,
    ):
        nb = cb.open_namespace(SMALL)
        ids = cb.block_ids(nb, prompt_tokens(11, 6 * SMALL.block_size))
        blocks = random_blocks(SMALL, 6, 11)
        assert cb.put(nb, ids, blocks).stored == 6
        na = ca.open_namespace(SMALL)
        req = peer_pb2.PrefetchRequest(
            ns=na.ref,
            spec=common_pb2.Namespace(**SMALL.to_dict()),
            block_ids=pack_ids(ids),
            parent_id=na.root,
            peer_address=b.address,
            peer_ucx_address=f"127.0.0.1:{b_port}",
        )
        stub = peer_pb2_grpc.PeerStub(ca.channel)
        for token, code in (
            ("other-token", grpc.StatusCode.PERMISSION_DENIED),
            (None, grpc.StatusCode.UNAUTHENTICATED),
        ):
            md = (("authorization", f"Bearer {token}"),) if token else ()
            with pytest.raises(grpc.RpcError) as ei:
                stub.Prefetch(req, metadata=md, timeout=30)
            assert ei.value.code() == code
        r = stub.Prefetch(req, metadata=(("authorization", "Bearer acme-token"),), timeout=60)
        assert (r.present, r.transport, r.stopped) == (6, "ucx", ""), r
        assert same_bytes(ca.get(na, ids), blocks)


@needs_ucx
@pytest.mark.parametrize("spec", [SMALL, BIG], ids=["packed", "runs"])
def test_a_peer_refusing_the_request_leaves_no_slot_reserved(spawn_agent, spec):
    """A reserves the first batch's slots while its request travels; B refuses it (more
    blocks than B takes per request): nothing moves, no fallback, every slot is back."""
    b_port = free_port()
    mem = dict(slot_bytes="2MiB", pool_bytes="64MiB")
    b = spawn_agent(peer_port=b_port, max_blocks_per_request=4, **mem)
    a = spawn_agent(peer_port=free_port(), **mem)
    with (
        KVClient(b.address, tenant_secret=TEST_SECRET) as cb,
        KVClient(a.address, tenant_secret=TEST_SECRET, use_shm=False) as ca,
    ):
        nb = cb.open_namespace(spec)
        ids = cb.block_ids(nb, prompt_tokens(12, 6 * spec.block_size))
        assert cb.put(nb, ids[:4], random_blocks(spec, 4, 12)).stored == 4
        na = ca.open_namespace(spec)
        free = free_slots(ca)
        r = ca.prefetch(na, ids, b.address, f"127.0.0.1:{b_port}")
        assert (r.present, r.fetched, r.transport) == (0, 0, "ucx"), r
        assert "refused" in r.stopped and "INVALID_ARGUMENT" in r.stopped, r.stopped
        assert free_slots(ca) == free
        assert Counter(dict(ca.stats().counters))["peer_ucx_failures"] == 0


@needs_ucx
def test_a_packed_answer_of_no_blocks_keeps_the_connection_in_step(cluster):
    """A receives a packed chunk's payload before its header has come (the receive posted
    right behind the header's), so B sends a payload message even for a chunk of no
    blocks: an answer that B holds nothing of leaves the kept connection usable, and
    the next Prefetch over it lands its own blocks intact."""
    na, ids, blocks = cluster.seed(SMALL, 6, seed=31)
    assert cluster.prefetch(na, ids).present == 6  # the connection A keeps to B
    missing = cluster.clients["a"].block_ids(na, prompt_tokens(32, 6 * SMALL.block_size))
    da = Delta(cluster, "a")
    r = cluster.prefetch(na, missing)
    assert (r.present, r.fetched, r.transport) == (0, 0, "ucx"), r
    assert "holds only 0" in r.stopped, r.stopped
    na, ids, blocks = cluster.seed(SMALL, 6, seed=33)
    r = cluster.prefetch(na, ids)
    assert (r.present, r.fetched, r.transport, r.stopped) == (6, 6, "ucx", ""), r
    assert same_bytes(cluster.clients["a"].get(na, ids), blocks)
    d = da.now()
    assert d["peer_ucx_failures"] == 0 and d["peer_ucx_reconnects"] == 0, d
    assert d["peer_ucx_connects"] == 0, d  # both answers came over the kept connection


@pytest.mark.parametrize("transport", ["ucx", "grpc"])
def test_small_blocks_arrive_intact_over_several_packed_batches(
    spawn_agent, monkeypatch, transport
):
    """Small blocks travel a whole batch per message (node_agent/peer/ucx/wire.packed):
    several batches and a short last one, two prompts over the kept connection."""
    if transport == "ucx" and importlib.util.find_spec("ucxx") is None:
        pytest.skip("needs ucxx (pip install ucxx-cu12)")
    monkeypatch.setenv("KVSTORE_PEER_BATCH_BYTES", str(16 * SMALL.block_bytes))  # agents
    b_port = free_port()
    b = spawn_agent(peer_port=b_port, slot_bytes="4KiB")
    a = spawn_agent(peer_port=free_port(), slot_bytes="4KiB")
    n = 100  # six batches of 16 and one of 4
    with (
        KVClient(b.address, tenant_secret=TEST_SECRET) as cb,
        KVClient(a.address, tenant_secret=TEST_SECRET, use_shm=False) as ca,
    ):
        nb, na = cb.open_namespace(SMALL), ca.open_namespace(SMALL)
        stub = peer_pb2_grpc.PeerStub(ca.channel)
        for seed in (21, 22):
            ids = cb.block_ids(nb, prompt_tokens(seed, n * SMALL.block_size))
            blocks = random_blocks(SMALL, n, seed)
            assert cb.put(nb, ids, blocks).stored == n
            req = peer_pb2.PrefetchRequest(
                ns=na.ref,
                spec=common_pb2.Namespace(**SMALL.to_dict()),
                block_ids=pack_ids(ids),
                parent_id=na.root,
                peer_address=b.address,
                peer_ucx_address=f"127.0.0.1:{b_port}" if transport == "ucx" else "",
            )
            r = stub.Prefetch(req, timeout=60)
            assert (r.present, r.fetched, r.transport, r.stopped) == (n, n, transport, ""), r
            assert same_bytes(ca.get(na, ids), blocks)
        counters = Counter(dict(ca.stats().counters))
        assert counters["peer_blocks_received"] == 2 * n
        assert counters["peer_checksum_mismatch"] == 0
        assert counters[f"peer_{transport}_failures"] == 0


@needs_ucx
@pytest.mark.parametrize("in_place", ["1", "0"], ids=["in-place", "staged"])
def test_large_blocks_move_between_slots_in_place_or_through_staging(
    spawn_agent, monkeypatch, in_place
):
    """In place, B sends from borrowed pool slots and A receives into reserved ones (one
    message per run of adjacent slots); with KVSTORE_PEER_IN_PLACE=0 (what a GPU pool does
    without the device hash or a UCX built with CUDA) both sides copy through host
    staging buffers. Either way the blocks arrive intact."""
    monkeypatch.setenv("KVSTORE_PEER_BATCH_BYTES", str(5 * MID.block_bytes))  # agents
    monkeypatch.setenv("KVSTORE_PEER_IN_PLACE", in_place)
    big = dict(slot_bytes="256KiB", pool_bytes="16MiB", nvme_bytes=0)
    b_port = free_port()
    b = spawn_agent(peer_port=b_port, **big)
    a = spawn_agent(peer_port=free_port(), **big)
    n = 12  # chunks of 5, 5 and 2 blocks
    with (
        KVClient(b.address, tenant_secret=TEST_SECRET, use_shm=False) as cb,
        KVClient(a.address, tenant_secret=TEST_SECRET, use_shm=False) as ca,
    ):
        nb, na = cb.open_namespace(MID), ca.open_namespace(MID)
        ids = cb.block_ids(nb, prompt_tokens(51, n * MID.block_size))
        blocks = random_blocks(MID, n, 51)
        assert cb.put(nb, ids, blocks).stored == n
        r = ca.prefetch(na, ids, b.address, f"127.0.0.1:{b_port}")
        assert (r.present, r.fetched, r.transport, r.stopped) == (n, n, "ucx", ""), (
            r,
            ucx_lines(a, b),
        )
        assert same_bytes(ca.get(na, ids), blocks)
        sent, got = Counter(dict(cb.stats().counters)), Counter(dict(ca.stats().counters))
    moved = n if in_place == "1" else 0
    assert (sent["peer_blocks_borrowed"], got["peer_blocks_in_place"]) == (moved, moved)
    assert got["peer_blocks_received"] == n and got["peer_checksum_mismatch"] == 0


def put_one_by_one(client: KVClient, chains) -> None:
    """Put the chains block by block, taking turns: their slots interleave in the pool
    (a fresh pool hands out slots in order), so no two blocks of a chain are adjacent."""
    for i in range(max(len(ids) for _, ids, _ in chains)):
        for handle, ids, blocks in chains:
            if i < len(ids):
                parent = ids[i - 1] if i else None
                assert client.put(handle, ids[i : i + 1], blocks[i : i + 1], parent).stored == 1


@needs_ucx
@pytest.mark.parametrize("direct", [False, True], ids=["messages", "direct-reads"])
def test_runs_of_adjacent_slots_and_fragmented_pools_on_either_side(
    spawn_agent, monkeypatch, direct
):
    """UCX messages (peer.same_host_reads off): blocks lying back to back in B's pool
    travel as one message per run; A receives a run in place when the slots it reserved
    lie back to back too, else into staging and copies in its verifying pass. Direct
    reads: A reads every block into its own slot wherever either lies, nothing staged and
    no payload message, one release per chunk. Every layout arrives intact, over several
    chunks."""
    monkeypatch.setenv("KVSTORE_PEER_BATCH_BYTES", str(5 * MID.block_bytes))  # agents
    monkeypatch.setenv("KVSTORE_PEER_SAME_HOST_READS", "1" if direct else "0")
    big = dict(slot_bytes="256KiB", pool_bytes="32MiB", nvme_bytes=0)
    b_port = free_port()
    b = spawn_agent(peer_port=b_port, **big)
    a = spawn_agent(peer_port=free_port(), policies={"acme/short": {"ttl_seconds": 1}}, **big)
    n = 12  # chunks of 5, 5 and 2 blocks
    with (
        KVClient(b.address, tenant_secret=TEST_SECRET, use_shm=False) as cb,
        KVClient(a.address, tenant_secret=TEST_SECRET, use_shm=False) as ca,
    ):
        nb = cb.open_namespace(MID)

        def chain(client, handle, seed):
            return (
                handle,
                client.block_ids(handle, prompt_tokens(seed, n * MID.block_size)),
                random_blocks(MID, n, seed),
            )

        contiguous_on_b = chain(cb, nb, 31)
        assert cb.put(*contiguous_on_b).stored == n
        scattered_on_b = chain(cb, nb, 32)
        put_one_by_one(cb, [scattered_on_b, chain(cb, nb, 33)])
        # A: interleave a chain that expires with one that stays, so that once it expired
        # the free slots A hands out next lie two apart.
        short = chain(
            ca,
            ca.open_namespace(
                make_namespace(name="short", num_layers=4, num_kv_heads=8, head_dim=128)
            ),
            34,
        )
        put_one_by_one(ca, [short, chain(ca, ca.open_namespace(MID), 35)])
        wait_for(lambda: ca.stats().tiers[0].blocks == n, timeout=15)  # swept: slots free
        na = ca.open_namespace(MID)
        stub = peer_pb2_grpc.PeerStub(ca.channel)
        before = Counter(dict(ca.stats().counters))
        layouts = ((contiguous_on_b, n, 3), (scattered_on_b, 0, n))
        if direct:
            layouts = ((contiguous_on_b, 0, 0), (scattered_on_b, 0, 0))
        for (_, ids, blocks), staged, messages in layouts:
            sent = Counter(dict(cb.stats().counters))
            direct_before = before["peer_blocks_direct"]
            req = peer_pb2.PrefetchRequest(
                ns=na.ref,
                spec=common_pb2.Namespace(**MID.to_dict()),
                block_ids=pack_ids(ids),
                parent_id=na.root,
                peer_address=b.address,
                peer_ucx_address=f"127.0.0.1:{b_port}",
            )
            r = stub.Prefetch(req, timeout=60)
            assert (r.present, r.fetched, r.transport, r.stopped) == (n, n, "ucx", ""), (
                r,
                ucx_lines(a, b),
            )
            assert same_bytes(ca.get(na, ids), blocks)
            after = Counter(dict(ca.stats().counters))
            # The first prompt lands in the expired chain's slots (two apart): staged.
            assert after["peer_blocks_staged"] - before["peer_blocks_staged"] == staged
            assert after["peer_blocks_direct"] - direct_before == (n if direct else 0)
            before = after
            # B: one message per chunk when its blocks lie back to back, else one each.
            now = Counter(dict(cb.stats().counters))
            assert now["peer_payload_messages"] - sent["peer_payload_messages"] == messages
            assert now["peer_direct_chunks"] - sent["peer_direct_chunks"] == (3 if direct else 0)
        assert before["peer_checksum_mismatch"] == 0 and before["peer_ucx_failures"] == 0


def test_runs_and_spans_follow_memory_layout():
    from node_agent.peer.staging import runs_of, spans
    from node_agent.peer.ucx.wire import check_runs

    arena = np.arange(8 * 4, dtype=np.uint8)
    slot = [arena[i * 4 : (i + 1) * 4] for i in range(8)]
    bufs = [slot[0], slot[1], slot[2], slot[5], slot[4], slot[6], slot[7]]
    assert runs_of(bufs, 4) == [3, 1, 1, 2]
    got = spans(bufs, [3, 1, 1, 2], 4)
    assert [bytes(g) for g in got] == [
        bytes(arena[0:12]),
        bytes(arena[20:24]),
        bytes(arena[16:20]),
        bytes(arena[24:32]),
    ]
    got[0][5] = 99  # a span is a view: receiving into it fills the slots
    assert slot[1][1] == 99
    assert spans(bufs, [4, 3], 4) is None  # slots 2 and 5 are not adjacent
    assert runs_of(slot, 4, cap=3) == [3, 3, 2]  # runs cut at a message-size cap
    ro = slot[0].view()
    ro.flags.writeable = False
    assert not spans([ro, slot[1]], [2], 4)[0].flags.writeable
    assert check_runs([], 3) == [1, 1, 1]
    assert check_runs([2, 1], 3) == [2, 1]
    for bad in ([2, 2], [3, 0], [4]):
        with pytest.raises(Exception, match="malformed chunk"):
            check_runs(bad, 3)


def test_the_last_message_of_a_transfer_is_cut_in_halves():
    """tapered: the last run split down to TAIL_MESSAGE_BYTES (or one block), the blocks
    all still there and in order; runs already that small are left alone."""
    from node_agent.peer.ucx.wire import TAIL_MESSAGE_BYTES, tapered

    mib = 1 << 20
    assert TAIL_MESSAGE_BYTES == 2 * mib
    assert tapered([8, 8, 8], 2 * mib) == [8, 8, 4, 2, 1, 1]
    assert tapered([3, 5], 2 * mib) == [3, 3, 1, 1]
    assert tapered([64], 256 << 10) == [32, 16, 8, 8]  # stops at 2 MiB: 8 x 256 KiB
    assert tapered([2], 256 << 10) == [2]
    assert tapered([1], 16 * mib) == [1]  # one block more than the tail size: left whole
    assert tapered([], 2 * mib) == []


@needs_ucx
def test_large_blocks_arrive_intact_with_the_last_message_tapered(spawn_agent, monkeypatch):
    """UCX messages (peer.same_host_reads off): 2 MiB blocks lying back to back in B's
    pool: one chunk of 12 travels as a message of 8 blocks, then the last run of 4 cut
    into 2, 1 and 1 (wire.tapered), received in place and verified."""
    monkeypatch.setenv("KVSTORE_PEER_SAME_HOST_READS", "0")
    big = dict(slot_bytes="2MiB", pool_bytes="64MiB", nvme_bytes=0)
    b_port = free_port()
    b = spawn_agent(peer_port=b_port, **big)
    a = spawn_agent(peer_port=free_port(), **big)
    with (
        KVClient(b.address, tenant_secret=TEST_SECRET, use_shm=False) as cb,
        KVClient(a.address, tenant_secret=TEST_SECRET, use_shm=False) as ca,
    ):
        nb, na = cb.open_namespace(BIG), ca.open_namespace(BIG)
        ids = cb.block_ids(nb, prompt_tokens(41, 12 * BIG.block_size))
        blocks = random_blocks(BIG, 12, 41)
        assert cb.put(nb, ids, blocks).stored == 12
        r = ca.prefetch(na, ids, b.address, f"127.0.0.1:{b_port}")
        assert (r.present, r.fetched, r.transport, r.stopped) == (12, 12, "ucx", ""), r
        assert same_bytes(ca.get(na, ids), blocks)
        sent, got = Counter(dict(cb.stats().counters)), Counter(dict(ca.stats().counters))
    assert sent["peer_payload_messages"] == 4 and sent["peer_direct_chunks"] == 0, sent
    assert got["peer_blocks_in_place"] == 12 and got["peer_blocks_direct"] == 0, got
    assert got["peer_blocks_stored"] == 12 and got["peer_checksum_mismatch"] == 0, got


@needs_ucx
def test_agents_of_one_host_read_large_blocks_from_each_other_directly(cluster):
    """Same kernel, same PID namespace: A reads B's borrowed slots itself (direct reads)
    into the slots it reserved, hashing each block as it lands; B sends no payload
    message, only the chunk's header, and keeps the blocks borrowed until A's release.
    Small blocks still travel packed."""
    na, ids, blocks = cluster.seed(BIG, 12, seed=42)
    da, db = Delta(cluster, "a"), Delta(cluster, "b")
    r = cluster.prefetch(na, ids)
    assert (r.present, r.fetched, r.transport, r.stopped) == (12, 12, "ucx", ""), r
    assert same_bytes(cluster.clients["a"].get(na, ids), blocks)
    sent, got = db.now(), da.now()
    assert sent["peer_direct_chunks"] == 1 and sent["peer_payload_messages"] == 0, sent
    assert sent["peer_blocks_borrowed"] == 12, sent
    assert got["peer_blocks_direct"] == 12 and got["peer_blocks_in_place"] == 12, got
    assert got["peer_blocks_stored"] == 12 and got["peer_checksum_mismatch"] == 0, got
    sn, sids, sblocks = cluster.seed(SMALL, 6, seed=43)
    db = Delta(cluster, "b")
    r = cluster.prefetch(sn, sids)
    assert (r.present, r.transport) == (6, "ucx"), r
    assert same_bytes(cluster.clients["a"].get(sn, sids), sblocks)
    assert db.now()["peer_direct_chunks"] == 0


def test_control_frames_carry_their_length_and_refuse_impossible_ones():
    """One UCX message per control message: length, then bytes (post_control/recv_control)."""
    import asyncio

    from node_agent.peer.errors import PeerTransportError
    from node_agent.peer.ucx.wire import (
        MAX_CONTROL_BYTES,
        control_buffer,
        post_control,
        recv_control,
    )

    class Wire:  # stands in for a UCX endpoint: what was sent is what the next recv gets
        data = b""

        async def send(self, frame):
            self.data = frame.tobytes()

        async def recv(self, buf):
            buf[: len(self.data)] = np.frombuffer(self.data, dtype=np.uint8)

    async def round_trip(wire, payload):
        await post_control(wire, payload)
        return await recv_control(wire, buf)

    buf = control_buffer()
    wire = Wire()
    assert asyncio.run(round_trip(wire, b"hello")) == b"hello"
    assert asyncio.run(round_trip(wire, b"")) == b""  # stale bytes in the buffer do not leak
    wire.data = (MAX_CONTROL_BYTES + 1).to_bytes(4, "little") + b"x"
    with pytest.raises(PeerTransportError, match="claiming"):
        asyncio.run(recv_control(wire, buf))
    # A frame shorter than the length it claims reads zeros past its end, not the bytes
    # of the message before it (the receive does not say how many bytes came): a peer
    # sent a request, then only a length, and was served the first request again.
    secret = b"Bearer someone-elses-token" * 4
    assert asyncio.run(round_trip(wire, secret)) == secret
    wire.data = len(secret).to_bytes(4, "little")
    assert asyncio.run(recv_control(wire, buf)) == bytes(len(secret))
    assert not buf.any()  # and nothing of either is left
    # Nor bytes a frame brought past the length it claimed.
    wire.data = (2).to_bytes(4, "little") + b"ok" + b"LEFTOVER-REQUEST-BYTES"
    assert asyncio.run(recv_control(wire, buf)) == b"ok"
    wire.data = (26).to_bytes(4, "little")
    assert asyncio.run(recv_control(wire, buf)) == bytes(26)


@needs_ucx
def test_completions_reach_the_event_loop_through_the_lean_notifier():
    """init_ucx has ucxx start wire._notify as its request notifier thread: 500 small
    messages sent at once and echoed back at once (bursts of completions, several per
    wake-up) all complete, intact and in order, and ucxx's own stop ends the thread (an
    agent's exit waits for it). wire.notifier_state, which a UCX connect that times out
    reports, follows the thread."""
    got = python_json(str(NOTIFY_SCRIPT), "500")
    assert got == {
        "ours": True,
        "state": "alive",
        "echoed": True,
        "stopped": True,
        "state_after": "not running",  # what a connect that times out then reports
    }, got


@needs_ucx
def test_direct_reads_between_agents_with_unequal_staging_sets(spawn_agent, monkeypatch):
    """Six chunks, the server keeping fewer in flight (staging_sets 3) than the fetcher
    (6): the fetcher releases each chunk as soon as it has read it, not when it stores it,
    so the server's next header never waits on a release the fetcher holds back (which
    would stall the transfer until the io timeout)."""
    monkeypatch.setenv("KVSTORE_PEER_BATCH_BYTES", str(2 * MID.block_bytes))  # agents
    mem = dict(slot_bytes="256KiB", pool_bytes="16MiB", nvme_bytes=0)
    b_port = free_port()
    b = spawn_agent(peer_port=b_port, **mem)
    a = spawn_agent(peer_port=free_port(), peer={"staging_sets": 6}, **mem)
    n = 12
    with (
        KVClient(b.address, tenant_secret=TEST_SECRET, use_shm=False) as cb,
        KVClient(a.address, tenant_secret=TEST_SECRET, use_shm=False) as ca,
    ):
        nb, na = cb.open_namespace(MID), ca.open_namespace(MID)
        ids = cb.block_ids(nb, prompt_tokens(61, n * MID.block_size))
        blocks = random_blocks(MID, n, 61)
        assert cb.put(nb, ids, blocks).stored == n
        r = ca.prefetch(na, ids, b.address, f"127.0.0.1:{b_port}", timeout_ms=8000)
        assert (r.present, r.fetched, r.transport, r.stopped) == (n, n, "ucx", ""), r
        assert same_bytes(ca.get(na, ids), blocks)
        sent, got = Counter(dict(cb.stats().counters)), Counter(dict(ca.stats().counters))
    assert sent["peer_direct_chunks"] == 6 and got["peer_blocks_direct"] == n, (sent, got)
    assert got["peer_ucx_failures"] == 0


@needs_ucx
def test_a_mismatch_in_one_direct_chunk_leaves_no_slot_reserved(
    spawn_agent, monkeypatch, fake_peer
):
    """Chunks of 5, block 11 corrupt: chunks 1-2 and block 10 are stored, and the chunk
    read after the bad one (already posted when the mismatch stopped the transfer) gives
    its slots back instead of keeping them reserved for good."""
    monkeypatch.setenv("KVSTORE_PEER_BATCH_BYTES", str(5 * MID.block_bytes))  # agents
    a = spawn_agent(slot_bytes="256KiB", pool_bytes="16MiB", nvme_bytes=0)
    with KVClient(a.address, tenant_secret=TEST_SECRET, use_shm=False) as ca:
        na = ca.open_namespace(MID)
        ids = ca.block_ids(na, prompt_tokens(62, 20 * MID.block_size))
        blocks = random_blocks(MID, 20, 62)
        free = free_slots(ca)
        r = ca.prefetch(na, ids, a.address, fake_peer("direct-corrupt", blocks))
        assert (r.present, r.transport) == (11, "ucx"), r
        assert "checksum mismatch" in r.stopped
        assert same_bytes(ca.get(na, ids), blocks[:11])
        got = Counter(dict(ca.stats().counters))
        assert got["peer_blocks_direct"] >= 15 and got["peer_checksum_mismatch"] == 1, got
        assert free_slots(ca) == free - 11


def test_a_peer_address_that_is_not_host_port_is_refused_before_any_pull(cluster):
    """gRPC takes other targets too (unix:..., dns:...), and wraps a port over 65535 round
    to another one: 127.0.0.1:(port + 65536) reached the real peer. Each is refused,
    INVALID_ARGUMENT naming the field, before anything is opened or pulled."""
    na, ids, _ = cluster.seed(SMALL, 2, seed=91)
    port = int(cluster.procs["b"].address.rsplit(":", 1)[1])
    before = cluster.counters("a")
    stub = cluster.peer_stub("a")
    for field, bad in (
        ("peer_address", f"127.0.0.1:{port + 65536}"),
        ("peer_address", "127.0.0.1:0"),
        ("peer_address", "unix:/tmp/agent.sock"),
        ("peer_address", "ipv4:127.0.0.1:80"),
        ("peer_address", "::::"),
        ("peer_address", "h" * 5000 + ":80"),
        ("peer_address", "[not-v6]:80"),
        ("peer_ucx_address", "not-an-address"),
        ("peer_ucx_address", "127.0.0.1:99999"),
    ):
        req = cluster.request(na, ids)
        setattr(req, field, bad)
        with pytest.raises(grpc.RpcError) as ei:
            stub.Prefetch(req, timeout=30)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, ei.value.details())
        assert ei.value.details().startswith(field), ei.value.details()
        assert len(ei.value.details()) < 200
    assert cluster.counters("a") == before  # nothing pulled, nothing opened
    # Names and bracketed IPv6 addresses are addresses (nothing listens on these).
    for good in ("localhost:1", "[::1]:1", "agent-0.kvstore-headless.ns.svc:50051"):
        req = cluster.request(na, ids, ucx="")
        req.peer_address = good
        r = stub.Prefetch(req, timeout=60)
        assert r.present == 0 and r.stopped, (good, r)
