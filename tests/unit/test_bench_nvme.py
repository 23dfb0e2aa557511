"""loadtest/bench_nvme.py end to end in a tiny configuration (2 blocks, 1 round): one JSON
line with every figure, each encrypted one set against the plaintext one of the run."""

from __future__ import annotations

import json

from loadtest import bench_nvme

MOVES = ("demote", "promote", "recover")
FIGURES = [f"nvme_{w}{s}_gbps" for w in MOVES for s in ("", "_enc")]
FIGURES += ["aesgcm_seal_gbps", "aesgcm_open_gbps"]


def test_bench_nvme_reports_every_figure_in_one_json_line(capsys):
    rc = bench_nvme.main(["--blocks", "2", "--rounds", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    res = json.loads(out[0])
    assert all(res[k] > 0 for k in FIGURES), res
    for w in ("demote", "promote"):
        ratio = res[f"nvme_{w}_enc_gbps"] / res[f"nvme_{w}_gbps"]
        assert abs(res[f"nvme_{w}_enc_ratio"] - ratio) < 0.005 * ratio  # 4 digits each
    assert res["ok"] == (res["missed"] == []) == (rc == 0)


def test_a_figure_below_its_limit_is_reported():
    res = {"nvme_demote_enc_ratio": 0.9, "nvme_promote_enc_ratio": 0.2}
    assert bench_nvme.check(res) == ["nvme_promote_enc_ratio 0.20 < 0.5"]
