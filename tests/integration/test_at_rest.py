"""Encryption at rest on a real agent process (encryption.enabled, key files in a
directory): blocks demoted to NVMe come back identical after a restart while RocksDB's
files hold none of their bytes; a key rotation across a restart keeps old blocks readable;
removing a key or flipping a byte of a record (agent stopped) makes a miss that is dropped
and counted, and the block is put again fine; an unusable key file stops the start."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import torch
from support.common import PY, ROOT, TEST_SECRET, flip_rocks_byte, make_namespace, open_rocks_raw
from support.common import prompt_tokens, wait_for

from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.events import Tier
from kvstore.tiers.sealing import generate_key

SPEC = make_namespace()
SEEDS = range(12)  # 12 one-block prompts through a pool of 4 slots: 8 spill at once


def block_for(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(block_shape(SPEC), generator=g).to(torch_dtype(SPEC.kv_dtype))


def add_key(keys: Path, name: str) -> None:
    keys.mkdir(mode=0o700, exist_ok=True)
    path = keys / name
    path.write_bytes(generate_key())
    path.chmod(0o400)


def encrypted_agent(spawn_agent, keys: Path):
    return spawn_agent(
        pool_bytes="256KiB",  # 4 slots of 64 KiB
        encryption={"enabled": True, "keys_dir": str(keys)},
    )


def put_prompts(c: KVClient, ns, seeds) -> dict[int, bytes]:
    ids = {}
    for seed in seeds:
        (bid,) = c.block_ids(ns, prompt_tokens(seed, SPEC.block_size))
        assert c.put(ns, [bid], [block_for(seed)]).stored == 1
        ids[seed] = bid
    return ids


def readable(c: KVClient, ns, ids: dict[int, bytes]) -> set[int]:
    """Seeds whose block is served, each checked byte for byte."""
    out = set()
    for seed, bid in ids.items():
        if c.lookup(ns, [bid]).matched:
            (got,) = c.get(ns, [bid])
            assert torch.equal(got, block_for(seed))
            out.add(seed)
    return out


def counters(c: KVClient) -> dict[str, int]:
    return dict(c.stats().counters)


def nvme_blocks(c: KVClient) -> int:
    return next(t.blocks for t in c.stats().tiers if t.tier == Tier.NVME)


def stop(agent) -> None:
    agent.proc.send_signal(signal.SIGTERM)  # a clean stop writes the pool to NVMe too
    assert agent.proc.wait(60) == 0
    agent.proc = None


def disk_bytes(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())


def sealing_key_ids(data_dir: str) -> list[int]:
    db = open_rocks_raw(data_dir)
    try:
        blocks = db.get_column_family("blocks")
        out = [int.from_bytes(v[5:9], "little") for v in blocks.values()]
        del blocks
    finally:
        db.close()
    return sorted(out)


def test_encrypted_restart_rotation_and_key_removal(spawn_agent, tmp_path):
    keys = tmp_path / "keys"
    add_key(keys, "acme.1.key")
    agent = encrypted_agent(spawn_agent, keys)
    data_dir = agent.config["data_dir"]
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        old = put_prompts(c, ns, SEEDS)
        assert nvme_blocks(c) == 8 and counters(c)["nvme_encrypted"] == 1
    stop(agent)
    disk = disk_bytes(Path(data_dir))
    leaked = [s for s in SEEDS if block_for(s).numpy().tobytes()[:64] in disk]
    assert leaked == [], "plaintext KV in RocksDB's files"
    assert sealing_key_ids(data_dir) == [1] * 12

    add_key(keys, "acme.2.key")  # rotation: the new key seals, the old one still opens
    agent.start()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        assert counters(c)["recovery_dropped"] == 0
        assert readable(c, ns, old) == set(SEEDS)  # promoted from NVMe, identical
        new = put_prompts(c, ns, range(100, 112))
    stop(agent)
    assert set(sealing_key_ids(data_dir)) == {1, 2}

    (keys / "acme.1.key").unlink()  # retired: what it sealed is a miss, dropped
    agent.start()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        cs = counters(c)
        assert cs["nvme_open_failed_unknown_key"] == cs["recovery_dropped"] > 0
        assert cs["recovery_dropped"] == 12
        assert readable(c, ns, {**old, **new}) == set(range(100, 112))
    stop(agent)
    assert sealing_key_ids(data_dir) == [2] * 12  # dropped from RocksDB, not left behind
    assert "failed to open (unknown_key)" in agent.log
    assert agent.log.count("failed to open") == 1  # once per cause, not per record
    assert "Traceback" not in agent.log


def test_a_tampered_record_is_a_dropped_counted_miss_then_put_again(spawn_agent, tmp_path):
    keys = tmp_path / "keys"
    add_key(keys, "acme.1.key")
    agent = encrypted_agent(spawn_agent, keys)
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        ids = put_prompts(c, ns, SEEDS)
    stop(agent)
    flip_rocks_byte(agent.config["data_dir"], SPEC.namespace_id + ids[3], offset=200)
    agent.start()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        cs = counters(c)
        assert cs["nvme_open_failed_tampered"] == 1 and cs["recovery_dropped"] == 1
        assert readable(c, ns, ids) == set(SEEDS) - {3}  # a miss, never wrong bytes
        put_prompts(c, ns, [3])  # recomputed and put again
        assert readable(c, ns, ids) == set(SEEDS)
    assert "failed to open (tampered)" in agent.log and "Traceback" not in agent.log


def _agent_with_keys(tmp_path: Path, keys: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "node_agent", "--listen", "127.0.0.1:0", "--device", "cpu"]
        + ["--pool-bytes", "4MiB", "--slot-bytes", "64KiB", "--allow-unauthenticated"]
        + ["--data-dir", str(tmp_path / "data")],
        cwd=ROOT,
        env=dict(os.environ, KVSTORE_ENCRYPTION_ENABLED="1", KVSTORE_ENCRYPTION_KEYS_DIR=str(keys)),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_world_readable_key_file_stops_the_start_with_one_clear_line(tmp_path):
    keys = tmp_path / "keys"
    add_key(keys, "acme.1.key")
    (keys / "acme.1.key").chmod(0o644)
    r = _agent_with_keys(tmp_path, keys)
    assert r.returncode == 1
    assert (
        f"kvstore-agent: cannot start: encryption at rest: {keys}/acme.1.key: key file "
        "mode 0644 lets any user read or change it; chmod 0400" in r.stderr
    )
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was written


def test_a_key_added_while_running_seals_new_records_and_old_ones_stay_readable(
    spawn_agent, tmp_path
):
    """Rotation without a restart: the agent watches its key directory."""
    keys = tmp_path / "keys"
    add_key(keys, "acme.1.key")
    agent = encrypted_agent(spawn_agent, keys)
    data_dir = agent.config["data_dir"]
    with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        old = put_prompts(c, ns, SEEDS)  # 8 spill to NVMe under key 1
        assert nvme_blocks(c) == 8 and counters(c)["nvme_key_reloads"] == 0

        # A file that may not be used yet (world-readable, as a copy before its chmod):
        # refused and counted; key 1 goes on sealing.
        (keys / "acme.2.key").write_bytes(generate_key())
        (keys / "acme.2.key").chmod(0o644)
        wait_for(lambda: counters(c)["nvme_key_reload_errors"] == 1, what="refused change")
        (keys / "acme.2.key").chmod(0o400)  # now usable: key 2 is the highest, it seals
        wait_for(lambda: counters(c)["nvme_key_reloads"] == 1, what="key files reloaded")

        assert readable(c, ns, old) == set(SEEDS)  # key 1's records open, identical
        new = put_prompts(c, ns, range(100, 112))
        assert readable(c, ns, new) == set(range(100, 112))
        assert agent.proc.poll() is None
    stop(agent)
    ids = sealing_key_ids(data_dir)
    # Every record written after the reload is sealed under key 2, the rest under key 1.
    assert ids.count(2) >= 8 and set(ids) == {1, 2}, ids
    assert "key files changed: keys for 1 tenants, active ids {'acme': 2}" in agent.log
    assert "Traceback" not in agent.log
