"""The NVMe tier of a real agent process: a real full filesystem (tmpfs) under its
RocksDB, RocksDB files damaged while it is stopped (it quarantines them and starts with an
empty tier, and says so in its log, its Stats and `kvctl nodes`), and what kill -9 loses
(bounded by nvme_flush_interval_s and nvme_flush_bytes)."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess

import pytest
import torch
from support.attack import TOKENS, tenants
from support.common import TEST_SECRET, make_namespace, prompt_tokens, wait_for
from support.nvme import BIG, DAMAGE, flip_sst_byte, mount_small_fs

from kvstore.coord.etcd import NodeRecord
from kvstore.cli.control_cmd import _tier_cells
from kvstore.cli.views import node_view
from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.events import Tier
from kvstore.store import BlockStore
from kvstore.tiers.pool import DevicePool
from kvstore.tiers.rocks import RocksTier

SPEC = make_namespace()


@pytest.fixture
def small_fs(tmp_path):
    yield from mount_small_fs(tmp_path)


@pytest.fixture
def mounted_data_dir(tmp_path):
    """A data_dir that is a filesystem's mount point (a volume in a pod): it cannot be
    renamed (EBUSY)."""
    yield from mount_small_fs(tmp_path, size="32m", filler=False)


def block_for(spec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(block_shape(spec), generator=g).to(torch_dtype(spec.kv_dtype))


def put_one(c: KVClient, ns, seed: int) -> bytes:
    """Put a one-block prompt (a chain root: it survives a crash without a parent)."""
    (bid,) = c.block_ids(ns, prompt_tokens(seed, ns.spec.block_size))
    r = c.put(ns, [bid], [block_for(ns.spec, seed)])
    assert (r.stored, r.already_present) == (1, 0)
    return bid


def nvme_stats(c: KVClient):
    st = c.stats()
    tier = next(t for t in st.tiers if t.tier == Tier.NVME)
    return tier, dict(st.counters)


def stop_exit_code(agent) -> int:
    agent.proc.send_signal(signal.SIGTERM)
    rc = agent.proc.wait(60)
    agent.proc = None
    return rc


# ------------------------------------------------------------------------ full disk
def test_full_disk_agent_serves_stops_cleanly_and_recovers(small_fs, spawn_agent):
    agent = spawn_agent(
        data_dir=str(small_fs / "data"),
        pool_bytes="512KiB",
        nvme_flush_bytes="1MiB",
        nvme_flush_interval_s=3600,
    )
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(BIG)
        ids = [put_one(c, ns, seed) for seed in range(120)]  # 7.5 MiB through 3 MiB
        tier, counters = nvme_stats(c)
        assert "writes failing" in tier.condition and "KiB free" in tier.condition
        assert counters["nvme_write_outages"] == 1 and counters["demotions"] > 0
        assert counters["nvme_spill_failed"] > 0
    assert agent.log.count("cannot write") == 1  # once, not per block
    assert stop_exit_code(agent) == 0
    assert "Traceback" not in agent.log

    agent.start()  # same data dir, the disk still full
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(BIG)
        tier, counters = nvme_stats(c)
        assert counters["recovered_blocks"] > 0 and tier.blocks == counters["recovered_blocks"]
        hits = [i for i, bid in enumerate(ids) if c.lookup(ns, [bid]).matched]
        assert len(hits) == counters["recovered_blocks"]
        got = c.get(ns, [ids[hits[0]]])
        assert torch.equal(got[0], block_for(BIG, hits[0]))


def test_full_disk_idle_agent_notices_space_came_back(small_fs, spawn_agent):
    """An agent that stops getting Puts once its disk is full: its health said "writes
    failing" until the next spill, however long ago space came back. The agent now
    re-probes at the end of each back-off. Its start warns that nvme_bytes is more than
    the whole filesystem, and the outage says how much free space RocksDB waits for."""
    data_dir = str(small_fs / "data")
    agent = spawn_agent(
        data_dir=data_dir,
        pool_bytes="512KiB",
        nvme_bytes="64MiB",
        nvme_flush_bytes="1MiB",
        nvme_flush_interval_s=3600,
    )
    assert (
        f"nvme_bytes (64.0 MiB) is more than the whole filesystem of data_dir {data_dir} "
        "(4.0 MiB)" in agent.log
    )
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(BIG)
        seed = 0
        while not nvme_stats(c)[0].condition:
            put_one(c, ns, seed)
            seed += 1
            assert seed < 500, "a 4 MiB disk never filled"
        tier, _ = nvme_stats(c)
        assert "writes failing" in tier.condition
        # RocksDB resumes once its largest memtable (nvme_flush_bytes / 2) fits
        assert "resumes by itself once about 512 KiB are free" in tier.condition
        (small_fs / "filler").unlink()  # space comes back; no Put from here on
        wait_for(
            lambda: not nvme_stats(c)[0].condition,
            120,
            interval=0.5,
            what="the idle agent to notice that NVMe writes work again",
        )
        assert nvme_stats(c)[1]["nvme_write_recoveries"] == 1
    assert agent.log.count("writes again") == 1
    assert stop_exit_code(agent) == 0


# ------------------------------------------------------------------ damaged files
def write_stopped_agent_db(data_dir) -> int:
    """What a stopped agent leaves: 40 prompts of 4 blocks, all on NVMe."""
    from support.store import prompt, put

    rocks = RocksTier(str(data_dir), 64 << 20)
    store = BlockStore(DevicePool(4, SPEC.block_bytes, "cpu"), rocks)
    store.open_namespace(SPEC)
    for seed in range(40):
        put(store, prompt(seed, 4)[1])
    store.persist_pool()
    rocks.close()
    return 160


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_unreadable_rocksdb_is_quarantined_and_reported(tmp_path, spawn_agent, damage):
    data_dir = tmp_path / "agent-0" / "data"
    write_stopped_agent_db(data_dir)
    DAMAGE[damage](data_dir)
    agent = spawn_agent(data_dir=str(data_dir))  # starts: no crash loop
    assert "NVMe tier unreadable" in agent.log and "starting with an empty" in agent.log
    (moved,) = glob.glob(f"{data_dir}.quarantine-*")
    assert glob.glob(f"{moved}/*.sst") or damage == "deleted-sst"
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        tier, counters = nvme_stats(c)
        assert counters["nvme_quarantined"] == 1
        assert tier.blocks == 0 and moved in tier.condition
        ns = c.open_namespace(SPEC)
        bid = put_one(c, ns, 7)  # the empty tier works
        assert c.lookup(ns, [bid]).matched == 1
    rec = NodeRecord(agent.config["node_id"], agent.address)
    view = asyncio.run(node_view(rec, None, 10.0))
    (nvme,) = [t for t in view.tiers if t.tier == "nvme"]
    assert "started empty" in nvme.condition
    assert "started empty" in _tier_cells(view)[1]  # the `kvctl nodes` cell


def test_unreadable_rocksdb_on_a_mount_point_is_quarantined_inside_it(
    mounted_data_dir, spawn_agent
):
    """os.rename(data_dir, …) raised EBUSY on a mount point: a traceback and a crash loop.
    The files now go to a quarantine directory inside it, on its own filesystem; RocksDB
    starts empty beside it, and again at the next start."""
    data_dir = str(mounted_data_dir)
    assert os.path.ismount(data_dir)
    write_stopped_agent_db(data_dir)
    flip_sst_byte(data_dir)
    agent = spawn_agent(data_dir=data_dir)
    assert "NVMe tier unreadable" in agent.log and "starting with an empty" in agent.log
    (moved,) = glob.glob(f"{data_dir}/quarantine-*")
    assert glob.glob(f"{moved}/*.sst") and not glob.glob(f"{data_dir}.quarantine-*")
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        tier, counters = nvme_stats(c)
        assert counters["nvme_quarantined"] == 1
        assert tier.blocks == 0 and moved in tier.condition
        ns = c.open_namespace(SPEC)
        bid = put_one(c, ns, 7)
    agent.restart()  # the quarantine directory inside does not trouble RocksDB
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        tier, counters = nvme_stats(c)
        assert counters["nvme_quarantined"] == 0 and counters["recovered_blocks"] == 1
        assert c.lookup(c.open_namespace(SPEC), [bid]).matched == 1
    assert glob.glob(f"{moved}/*.sst")
    assert "Traceback" not in agent.log


def test_unreadable_rocksdb_that_cannot_be_moved_stops_the_start_in_one_line(
    mounted_data_dir, spawn_agent
):
    """A read-only volume holding RocksDB files: RocksDB cannot open them and they cannot
    be moved aside either. One line says so, exit 1, no traceback."""
    data_dir = str(mounted_data_dir)
    write_stopped_agent_db(data_dir)
    subprocess.run(["mount", "-o", "remount,ro", data_dir], check=True)
    with pytest.raises(RuntimeError, match="agent exited with 1") as err:
        spawn_agent(data_dir=data_dir)
    said = str(err.value)
    assert "kvstore-agent: cannot start: NVMe tier unreadable (" in said
    assert "its files cannot be moved aside (Read-only file system" in said
    assert "Traceback" not in said


# ---------------------------------------------------------------- what kill -9 loses
def test_kill9_loses_nothing_flushed_by_the_interval(spawn_agent):
    agent = spawn_agent(pool_bytes="256KiB", nvme_flush_interval_s=0.2)  # 4 slots
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        for seed in range(30):
            put_one(c, ns, seed)
        tier, counters = nvme_stats(c)
        spilled, flushes = tier.blocks, counters["nvme_flushes"]
        assert spilled == 26
        # two more flushes: the second one started after the last spill
        wait_for(
            lambda: nvme_stats(c)[1]["nvme_flushes"] >= flushes + 2,
            60,
            what="two periodic NVMe flushes",
        )
    agent.kill()
    agent.start()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        tier, counters = nvme_stats(c)
        assert counters["recovered_blocks"] == spilled and tier.blocks == spilled
        assert counters["recovery_dropped"] == 0


def test_nvme_used_says_how_much_is_not_on_disk_yet(spawn_agent):
    """`nvme used` counted spilled blocks still only in RocksDB's memtables as on disk;
    a kill -9 loses them. Stats and `kvctl nodes` now say how much that is."""
    agent = spawn_agent(pool_bytes="256KiB", nvme_flush_interval_s=3600)  # 4 slots
    rec = NodeRecord(agent.config["node_id"], agent.address)
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        for seed in range(10):
            put_one(c, ns, seed)
        tier, _ = nvme_stats(c)
        assert tier.blocks == 6 and 0 < tier.unflushed_bytes
    cell = _tier_cells(asyncio.run(node_view(rec, None, 10.0)))[1]
    assert " unflushed)" in cell, cell
    agent.restart()  # a clean stop flushes: all of it is in SST files now
    rec = NodeRecord(agent.config["node_id"], agent.address)
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        tier, _ = nvme_stats(c)
        assert tier.blocks == 10 and tier.unflushed_bytes == 0
    assert "unflushed" not in _tier_cells(asyncio.run(node_view(rec, None, 10.0)))[1]


def test_a_tenants_stats_show_no_node_wide_unflushed_bytes(spawn_agent):
    """A tenant's Stats leave the node's occupancy out (every tenant's blocks are in it),
    but before the fix they carried the NVMe tier's unflushed_bytes: how much every
    tenant had spilled lately. Now only the cluster identity sees it."""
    agent = spawn_agent(
        pool_bytes="256KiB",  # 4 slots: 6 of 10 blocks spill
        nvme_flush_interval_s=3600,
        allow_unauthenticated=False,
        tenants=tenants(),
    )
    spec = make_namespace(tenant="acme")
    with KVClient(agent.address, token=TOKENS["acme"], tenant_secret=TEST_SECRET) as c:
        ns = c.open_namespace(spec)
        for seed in range(10):
            put_one(c, ns, seed)
        with KVClient(agent.address, token=TOKENS["_cluster"], use_shm=False) as op:
            node, _ = nvme_stats(op)
        assert node.blocks == 6 and 0 < node.unflushed_bytes
        for who in ("acme", "globex"):
            with KVClient(agent.address, token=TOKENS[who], use_shm=False) as t:
                tier, _ = nvme_stats(t)
            assert (tier.used_bytes, tier.blocks, tier.unflushed_bytes) == (0, 0, 0), (who, tier)
            assert tier.capacity_bytes == node.capacity_bytes


def test_kill9_loses_at_most_nvme_flush_bytes(spawn_agent):
    agent = spawn_agent(
        pool_bytes="512KiB", nvme_flush_bytes="1MiB", nvme_flush_interval_s=3600
    )  # only the byte budget flushes
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(BIG)
        seed = 0
        # Spill 3 MiB: a spill that meets both memtables full (a write stall, on a busy
        # host) is dropped instead, so count what reached the tier.
        while nvme_stats(c)[0].blocks < 48:
            put_one(c, ns, seed)
            seed += 1
            assert seed < 2000, "the NVMe tier takes no spills"
        spilled = nvme_stats(c)[0].blocks
    agent.kill()
    agent.start()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        recovered = nvme_stats(c)[1]["recovered_blocks"]
    # Two memtables of 512 KiB, each closed by the record that crosses its size.
    assert spilled - recovered <= (1 << 20) // BIG.block_bytes + 2
    assert recovered > 0
