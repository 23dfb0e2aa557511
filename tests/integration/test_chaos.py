"""loadtest/chaos.py end to end in a tiny configuration: two agents, two tenants, a few
seconds of load and one of each fault (real etcd, agents, router, RocksDB, tmpfs when
root). Goals other than wrong_bytes are findings the harness reports, not assertions
here: every figure must be present and sane, and no byte read may be wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ["kill9", "sigstop", "disk_full", "router_kill", "etcd_restart", "damage_sst"]
TTL = 2


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@pytest.mark.timeout(900)  # a busy host slows agent restarts; the run is bounded anyway
def test_chaos_runs_every_fault_and_reports_every_figure():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.chaos",
            "--minutes",
            "0.1",
            "--agents",
            "2",
            "--tenants",
            "2",
            "--rate",
            "5",
            "--lease-ttl-s",
            str(TTL),
            "--warmup-s",
            "4",
            "--fault-every-s",
            "0",
            "--tail-s",
            "2",
            "--stop-s",
            "3",
            "--disk-hold-s",
            "1",
            "--disk-mb",
            "128",
            "--seed",
            "7",
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]  # exactly one JSON line on stdout
    r = json.loads(lines[0])

    assert r["wrong_bytes"] == 0 and r["wrong_blocks"] == 0, r
    assert r["ops"] > 0 and r["attempts"] >= r["ops"], r
    assert r["verified_blocks"] > 0 and r["verified_bytes"] == r["verified_blocks"] * 8192
    assert sum(r["served_by"].values()) == r["ops"]
    assert set(r["served_by"]) <= {"agent-0", "agent-1"}
    assert all(
        isinstance(k, str) and isinstance(v, int) and v > 0 for k, v in r["client_errors"].items()
    )
    assert _number(r["max_unavailable_s"]) and r["max_unavailable_s"] >= 0
    assert r["nvme_census_blocks"] >= r["nvme_recovered_blocks"] >= 0
    ratio = r["nvme_recovered_ratio"]
    if r["nvme_census_blocks"]:
        assert ratio == round(r["nvme_recovered_blocks"] / r["nvme_census_blocks"], 3)
    else:
        assert ratio is None
    assert isinstance(r["slot_leaks"], int) and r["slot_leaks"] >= 0
    assert set(r["slot_leaks_per_agent"]) == {"agent-0", "agent-1"}
    assert r["rss_drift_pct"] is None or _number(r["rss_drift_pct"])
    assert r["rss_per_agent"], "RSS was never sampled"
    assert r["lease_ttl_s"] == TTL and _number(r["nvme_bound_s"]) and r["nvme_bound_s"] > 0

    # One of each fault, in the schedule's order; disk_full only when it was not skipped.
    skipped = r["skipped_faults"]
    assert set(skipped) <= {"disk_full"} and all(skipped.values())
    assert [f["kind"] for f in r["faults"]] == [k for k in FAULTS if k not in skipped]
    for f in r["faults"]:
        assert f["target"] and _number(f["at_s"]) and f["duration_s"] >= 0, f
        assert "skipped" not in f["detail"], f
    kill = next(f for f in r["faults"] if f["kind"] == "kill9")
    assert kill["detail"]["census_blocks"] == r["nvme_census_blocks"]
    damage = next(f for f in r["faults"] if f["kind"] == "damage_sst")
    assert damage["detail"]["mode"] == "flip" and damage["detail"]["file"].endswith(".sst")

    goals = r["goals"]
    assert set(goals) == {
        "wrong_bytes",
        "slot_leaks",
        "max_unavailable_s",
        "nvme_recovered_ratio",
        "rss_drift_pct",
    }
    assert goals["max_unavailable_s"]["limit"] == 2 * TTL
    for name, g in goals.items():
        assert g["value"] == r[name]
        want = g["value"] is not None and (
            g["value"] <= g["limit"] if g["cmp"] == "<=" else g["value"] >= g["limit"]
        )
        assert g["ok"] is want, (name, g)
    assert goals["wrong_bytes"]["ok"]


def test_chaos_refuses_an_unknown_fault_with_a_message():
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.chaos", "--faults", "kill9,meteor"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown fault(s) meteor" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_disk_full_fills_the_tmpfs_whatever_the_space_left(tmp_path):
    """The disk_full fault's ballast fills the filesystem and returns, even when the room
    left ends just short of a megabyte (a buffered file kept the refused bytes and raised
    ENOSPC again when closed: the harness failed mid-run)."""
    from loadtest.chaos_cluster import clear_disk, fill_disk

    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mnt)], check=True)
    try:
        for used in (0, 528384, 70000):  # 528384: 1020 KiB left, 4 KiB short of 1 MiB
            (mnt / "used").write_bytes(b"\0" * used)
            written = fill_disk(mnt)
            assert os.statvfs(mnt).f_bavail == 0, used
            assert written == (mnt / "chaos-ballast").stat().st_size > 0
            clear_disk(mnt)
            assert not (mnt / "chaos-ballast").exists()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
