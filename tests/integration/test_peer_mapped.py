"""Direct reads through a mapping of the serving agent's host pool
(node_agent/peer/ucx/mapped.py): real agents over real UCX, the fault injector of
tests/support/peer_fault.py for what a real agent never does, and PoolMappings against
another process's memfd."""

from __future__ import annotations

import fcntl
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from support.common import TEST_SECRET, free_port, prompt_tokens, wait_for

from kvstore import checksum as cks
from kvstore.client import KVClient
from kvstore.tiers.pool import DevicePool
from node_agent.peer.errors import PeerTransportError
from node_agent.peer.ucx.mapped import PoolMappings
from tests.integration.test_peer import (
    BIG,
    MID,
    Cluster,
    Delta,
    needs_ucx,
    random_blocks,
    run_fake_peer,
    same_bytes,
)


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    """test_peer's agents: B holds blocks, A pulls them."""
    c = Cluster(tmp_path_factory.mktemp("peer-mapped"))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def injector(tmp_path):
    """Starts tests/support/peer_fault.py in a mode; its UCX address."""
    procs: list[subprocess.Popen] = []

    def start(mode: str, blocks) -> str:
        proc, address = run_fake_peer(tmp_path, mode, blocks)
        procs.append(proc)
        return address

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def maps_of(pid: int) -> list[tuple[str, str]]:
    """(permissions, name) of each mapping of process `pid`."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            out.append((parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


@needs_ucx
def test_agents_of_one_host_copy_blocks_out_of_a_read_only_mapping_of_the_peers_pool(agents):
    """B's pool is a sealed memfd; A maps it read-only (its own pool is the other
    kvstore-pool mapping, read-write) and copies each block out in one fused pass."""
    na, ids, blocks = agents.seed(BIG, 12, seed=71)
    da, db = Delta(agents, "a"), Delta(agents, "b")
    r = agents.prefetch(na, ids)
    assert (r.present, r.fetched, r.transport, r.stopped) == (12, 12, "ucx", ""), r
    assert same_bytes(agents.clients["a"].get(na, ids), blocks)
    sent, got = db.now(), da.now()
    assert sent["peer_direct_chunks"] == 1 and sent["peer_payload_messages"] == 0, sent
    assert got["peer_blocks_mapped"] == 12 and got["peer_blocks_direct"] == 12, got
    assert got["peer_checksum_mismatch"] == 0, got
    pools = [p for p, name in maps_of(agents.procs["a"].proc.pid) if "memfd:kvstore-pool" in name]
    assert sorted(pools) == ["r--s", "rw-s"], pools


@needs_ucx
def test_a_corrupt_block_in_a_mapped_pool_is_a_miss_from_that_block_on(agents, injector):
    """The digest of what the fused pass wrote into A's slot is checked against the
    server's checksum before the block is visible."""
    na, ids, blocks = agents.seed(MID, 20, seed=72)
    da = Delta(agents, "a")
    r = agents.prefetch(na, ids, ucx=injector("mapped-corrupt", blocks))  # flips block 11
    assert (r.present, r.transport) == (11, "ucx"), r
    assert "checksum mismatch" in r.stopped
    assert same_bytes(agents.clients["a"].get(na, ids), blocks[:11])
    d = da.now()
    assert d["peer_checksum_mismatch"] == 1 and d["peer_blocks_mapped"] == 20, d


@needs_ucx
@pytest.mark.parametrize(
    "mode,seed,transport,counters",
    [
        # A memfd without F_SEAL_SHRINK could be cut short under the mapping (the reader
        # would fault): the fetcher reads those blocks with process_vm_readv instead.
        ("mapped-unsealed", 73, "ucx", {"peer_blocks_direct": 20, "peer_blocks_mapped": 0}),
        # A block outside the pool named is a malformed chunk: gRPC finishes the Prefetch.
        ("mapped-outside", 74, "ucx+grpc", {"peer_ucx_failures": 1, "peer_blocks_mapped": 0}),
    ],
    ids=["unsealed-read-with-process_vm_readv", "outside-the-pool-grpc-finishes"],
)
def test_a_pool_the_fetcher_must_not_map_costs_no_block(
    agents, injector, mode, seed, transport, counters
):
    na, ids, blocks = agents.seed(MID, 20, seed=seed)
    da = Delta(agents, "a")
    r = agents.prefetch(na, ids, ucx=injector(mode, blocks))
    assert (r.present, r.fetched, r.transport, r.stopped) == (20, 20, transport, ""), r
    assert same_bytes(agents.clients["a"].get(na, ids), blocks)
    d = da.now()
    assert {k: d[k] for k in counters} == counters, d


@needs_ucx
def test_a_dead_peers_pool_is_unmapped_without_waiting_for_another_fetch(spawn_agent):
    """A's mapping would keep B's pool memory alive after B exits: A's sweeper drops it
    within seconds (mapped.SWEEP_S), no further fetch needed."""
    mem = dict(slot_bytes="256KiB", pool_bytes="16MiB", nvme_bytes=0)
    b_port = free_port()
    b = spawn_agent(peer_port=b_port, **mem)
    a = spawn_agent(peer_port=free_port(), **mem)
    with (
        KVClient(b.address, tenant_secret=TEST_SECRET, use_shm=False) as cb,
        KVClient(a.address, tenant_secret=TEST_SECRET, use_shm=False) as ca,
    ):
        nb, na = cb.open_namespace(MID), ca.open_namespace(MID)
        ids = cb.block_ids(nb, prompt_tokens(75, 8 * MID.block_size))
        blocks = random_blocks(MID, 8, 75)
        assert cb.put(nb, ids, blocks).stored == 8
        r = ca.prefetch(na, ids, b.address, f"127.0.0.1:{b_port}", timeout_ms=8000)
        assert (r.present, r.transport) == (8, "ucx"), r
        assert same_bytes(ca.get(na, ids), blocks)
        assert dict(ca.stats().counters)["peer_blocks_mapped"] == 8

        def mapped_pools() -> int:
            return sum(
                1 for p, n in maps_of(a.proc.pid) if p == "r--s" and "memfd:kvstore-pool" in n
            )

        assert mapped_pools() == 1
        b.kill()
        wait_for(lambda: mapped_pools() == 0, 30, what="A dropping the dead peer's pool")


def test_an_agent_that_reads_no_peer_directly_keeps_an_anonymous_pool(spawn_agent):
    """Only a pool other agents would read directly anyway is put in a memfd."""
    on = spawn_agent(peer_port=free_port())
    off = spawn_agent(peer_port=free_port(), peer={"same_host_reads": False})
    assert any("memfd:kvstore-pool" in n for _, n in maps_of(on.proc.pid))
    assert not any("memfd:kvstore-pool" in n for _, n in maps_of(off.proc.pid))


# ------------------------------------------------------------- PoolMappings, the pool
HOLDER = textwrap.dedent(
    """
    import fcntl, mmap, os, sys
    import numpy as np
    seals = fcntl.F_SEAL_SHRINK if sys.argv[1] == "sealed" else 0
    fd = os.memfd_create("kvstore-pool", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 20)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    arr = np.frombuffer(mmap.mmap(fd, 1 << 20, flags=mmap.MAP_SHARED), dtype=np.uint8)
    arr[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
    print(os.getpid(), fd, arr.ctypes.data, arr.nbytes, flush=True)
    sys.stdin.read()
    """
)


@pytest.fixture
def holder():
    """Another process holding a 1 MiB memfd as an agent holds its pool: (pid, fd,
    base, size, its bytes, the process)."""
    procs = []

    def start(kind: str = "sealed"):
        p = subprocess.Popen(
            [sys.executable, "-c", HOLDER, kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        pid, fd, base, size = map(int, p.stdout.readline().split())
        want = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
        return pid, fd, base, size, want, p

    yield start
    for p in procs:
        p.kill()
        p.wait(10)


def test_pool_mappings_read_another_process_pool_and_drop_it_once_that_process_is_gone(
    holder,
):
    pid, fd, base, size, want, proc = holder()
    maps = PoolMappings()
    views = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    addrs = [base, base + 8192, base + size - 4096]
    digests = maps.read_into(pid, fd, base, size, views, addrs, threads=2)
    for view, addr, digest in zip(views, addrs, digests):
        assert np.array_equal(view, want[addr - base : addr - base + 4096])
        assert digest == cks.checksum(view)
    assert len(maps) == 1
    maps.read_into(pid, fd, base, size, views[:1], addrs[:1], threads=1)
    assert len(maps) == 1  # the same mapping again
    with pytest.raises(PeerTransportError, match="outside its pool"):
        maps.read_into(pid, fd, base, size, views[:1], [base + size - 100], threads=1)
    proc.kill()
    proc.wait(10)
    maps.sweep()
    assert len(maps) == 0  # its memory is freed once nothing maps it
    with pytest.raises(OSError):
        maps.read_into(pid, fd, base, size, views[:1], addrs[:1], threads=1)


def test_pool_mappings_refuse_a_file_not_sealed_against_shrinking(holder):
    pid, fd, base, size, _, _ = holder("unsealed")
    maps = PoolMappings()
    with pytest.raises(OSError, match="not sealed against shrinking"):
        maps.read_into(pid, fd, base, size, [np.zeros(64, np.uint8)], [base], threads=1)
    with pytest.raises(OSError, match="not a pool of"):  # a size that is not the file's
        maps.read_into(pid, fd, base, size * 2, [np.zeros(64, np.uint8)], [base], threads=1)
    assert len(maps) == 0


def pool_fds() -> list[int]:
    """This process's descriptors of pool memfds."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:kvstore-pool"):
                out.append(int(name))
        except OSError:  # the listing's own descriptor, gone
            pass
    return out


def test_a_shareable_host_pool_is_a_memfd_sealed_against_resizing_at_its_tensor():
    pool = DevicePool(4, 64 << 10, "cpu", shareable=True)
    share = pool.share
    assert share is not None
    assert (share.base, share.size) == (pool.tensor.data_ptr(), 4 * (64 << 10))
    assert os.readlink(f"/proc/self/fd/{share.fd}").startswith("/memfd:kvstore-pool")
    seals = fcntl.fcntl(share.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW, seals
    assert os.fstat(share.fd).st_mode & 0o777 == 0o400  # its user may read it, no more
    with pytest.raises(OSError):
        os.ftruncate(share.fd, 0)
    pool.tensor[1, :5] = 7  # the tensor is the shared memory
    assert os.pread(share.fd, 5, 64 << 10) == b"\x07" * 5
    assert pool_fds() == [share.fd]
    del pool, share
    gc.collect()
    assert pool_fds() == []  # closed with the pool: its memory goes with the mapping
    assert DevicePool(4, 64 << 10, "cpu").share is None  # anonymous unless asked
