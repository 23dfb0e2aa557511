"""The checked-in generated protobuf code must be exactly what tools/genproto.sh makes
from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "kvstore" / "v1"


def test_generated_code_is_fresh(tmp_path):
    out = tmp_path / "gen"
    r = subprocess.run(
        ["bash", str(ROOT / "tools" / "genproto.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert r.returncode == 0, r.stderr
    generated = {p.name: p.read_bytes() for p in (out / "kvstore" / "v1").iterdir()}
    protos = sorted(p.stem for p in (ROOT / "proto" / "kvstore" / "v1").glob("*.proto"))
    for stem in protos:  # the generator really ran, for every .proto
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert stem + suffix in generated
    stale = sorted(
        name
        for name, data in generated.items()
        if not (CHECKED_IN / name).is_file() or (CHECKED_IN / name).read_bytes() != data
    )
    extra = sorted(
        p.name
        for p in CHECKED_IN.iterdir()
        if p.is_file() and p.suffix in (".py", ".pyi") and p.name not in generated
    )
    assert not stale, "stale generated files in kvstore/v1 (run tools/genproto.sh): " + ", ".join(
        stale
    )
    assert not extra, "files in kvstore/v1 that no .proto generates: " + ", ".join(extra)
