"""`kvctl cluster status`'s table: where the gateway and the metrics are, when the
cluster has them, after the components."""

from __future__ import annotations

import pytest

from kvstore.cli.cluster_cmd import render_status

pytestmark = pytest.mark.unit


def _report(**extra) -> dict:
    agent = {"name": "agent-0", "kind": "agent", "pid": 7, "healthy": True, "alive": True,
             "address": "127.0.0.1:5", "registered": True, "synced": True,
             "indexed_blocks": 3}  # fmt: skip
    return {"state_dir": "/s", "uptime_s": 4, "components": [agent], **extra}


def test_the_table_names_the_gateway_and_the_metrics_page():
    out = render_status(
        _report(gateway_url="http://127.0.0.1:8000", metrics_url="http://127.0.0.1:9/metrics")
    ).splitlines()
    assert out[0] == "cluster in /s (up 4s)"
    assert out[2].split()[:3] == ["agent-0", "7", "up"]
    assert out[3:] == [
        "gateway  http://127.0.0.1:8000 (OpenAI API)",
        "metrics  http://127.0.0.1:9/metrics (the router's and the gateway's)",
    ]


def test_a_cluster_without_a_gateway_shows_neither():
    out = render_status(_report(gateway_url="", metrics_url="")).splitlines()
    assert len(out) == 3 and not any(ln.startswith(("gateway", "metrics")) for ln in out)
