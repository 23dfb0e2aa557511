"""Helpers for the NVMe fault tests: a real small filesystem (tmpfs) to fill, RocksDB
files damaged the way disks damage them, and a RocksTier whose writes can be made to fail."""

from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path

import pytest
from support.common import make_namespace

from kvstore.tiers.rocks import RocksTier

# 64 KiB blocks: a 4 MiB filesystem fills after a few dozen spills.
BIG = make_namespace(name="big", num_layers=8, num_kv_heads=4, head_dim=32)
assert BIG.block_bytes == 64 << 10
ENOSPC = "IO error: No space left on device: While appending to file: 000042.sst"


def mount_small_fs(tmp_path, size: str = "4m", filler: bool = True):
    """For a `small_fs` fixture: a real tmpfs of `size` mounted for the test (unmounted
    afterwards), with a 1 MiB filler file the test may delete to give space back."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root")
    mnt = tmp_path / "small-fs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        check=False,
        capture_output=True,
        text=True,
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    if filler:
        (mnt / "filler").write_bytes(b"\0" * (1 << 20))
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


class FailingTier(RocksTier):
    """A real RocksTier whose RocksDB writes raise what RocksDB raises on a full disk
    while `failing` is set (fault injection at the one call that writes)."""

    failing = False
    writes = 0

    def _write(self, wb) -> None:
        self.writes += 1
        if self.failing:
            raise Exception(ENOSPC)  # noqa: TRY002 - what rocksdict raises
        super()._write(wb)


# ------------------------------------------------------------- damaged RocksDB files
def largest_sst(path) -> Path:
    ssts = glob.glob(os.path.join(path, "*.sst"))
    assert ssts, f"no SST files in {path}"
    return Path(max(ssts, key=os.path.getsize))


def flip_sst_byte(path) -> None:
    sst = largest_sst(path)
    raw = bytearray(sst.read_bytes())
    raw[len(raw) // 3] ^= 0x5A  # inside a data block
    sst.write_bytes(bytes(raw))


def truncate_sst(path) -> None:
    sst = largest_sst(path)
    os.truncate(sst, sst.stat().st_size // 2)


def damage_footer(path) -> None:
    sst = largest_sst(path)
    raw = bytearray(sst.read_bytes())
    raw[-20] ^= 0xFF
    sst.write_bytes(bytes(raw))


def damage_manifest(path) -> None:
    (manifest,) = glob.glob(os.path.join(path, "MANIFEST-*"))
    raw = bytearray(Path(manifest).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    Path(manifest).write_bytes(bytes(raw))


def delete_current(path) -> None:
    os.unlink(os.path.join(path, "CURRENT"))


def delete_sst(path) -> None:
    os.unlink(largest_sst(path))


DAMAGE = {
    "flipped-sst-byte": flip_sst_byte,
    "truncated-sst": truncate_sst,
    "damaged-footer": damage_footer,
    "damaged-manifest": damage_manifest,
    "deleted-current": delete_current,
    "deleted-sst": delete_sst,
}
