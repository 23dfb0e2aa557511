"""A bare `kvctl status` after `make run` / `kvctl cluster up` talks to that cluster: a
real `kvctl cluster up` in a temp dir, then kvctl with no flags from there and from a
subdirectory; explicit --etcd and $KVSTORE_STATE_DIR still win, and with no cluster left
the error says what was looked at (precedence details: tests/unit/test_kvctl_discover.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from support.common import PY, ROOT, free_port

from kvstore.cli.discover import ETCD_ENV, STATE_ENV
from kvstore.devcluster import ClusterState


def _kvctl(cwd, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in (ETCD_ENV, STATE_ENV)}
    base["PYTHONPATH"] = str(ROOT)  # this checkout's kvctl, whatever the directory
    return subprocess.run(
        [PY, "-m", "kvstore.cli", *args],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture
def project(tmp_path):
    work = tmp_path / "project"
    (work / "src" / "deep").mkdir(parents=True)
    yield work
    state = work / ".state" / "cluster"
    if (state / "cluster.json").exists():
        _kvctl(work, "cluster", "down", "--state-dir", str(state), "--grace", "5")


def test_bare_kvctl_status_talks_to_the_cluster_started_here(project, tmp_path):
    r = _kvctl(project, "status")
    assert r.returncode == 2 and r.stdout == "", r.stderr  # a configuration problem
    assert "no cluster to talk to (none is configured)" in r.stderr and str(project) in r.stderr
    assert "make run" in r.stderr and "127.0.0.1:2379" not in r.stderr

    up = _kvctl(project, "cluster", "up", "--agents", "1", "--pool-bytes", "32MiB")
    assert up.returncode == 0, up.stderr
    st = ClusterState.load(project / ".state" / "cluster")

    r = _kvctl(project, "status", "--output", "json")
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    assert view["etcd_endpoints"] == [st.etcd_endpoint] and view["health"] == "healthy"
    assert [n["node_id"] for n in view["nodes"]] == ["agent-0"]
    assert [r_["address"] for r_ in view["routers"]] == [st.router_address]
    r = _kvctl(project / "src" / "deep", "status")  # from a subdirectory: the same cluster
    assert r.returncode == 0 and "agents:      1/1 reachable" in r.stdout, r.stderr
    assert _kvctl(project / "src", "cluster", "status").returncode == 0

    dead = f"127.0.0.1:{free_port()}"
    r = _kvctl(project, "status", "--etcd", dead, "--etcd-timeout", "1")  # --etcd wins
    assert r.returncode == 3 and f"etcd unreachable at {dead}" in r.stderr
    assert "etcd from --etcd" in r.stderr
    r = _kvctl(project, "status", **{STATE_ENV: str(tmp_path / "elsewhere")})
    assert r.returncode == 2 and f"${STATE_ENV}=" in r.stderr  # the variable wins too

    down = _kvctl(project / "src" / "deep", "cluster", "down", "--grace", "5")
    assert down.returncode == 0 and "agent-0" in down.stdout, down.stderr
    r = _kvctl(project, "status")
    assert r.returncode == 2 and "no cluster to talk to" in r.stderr
