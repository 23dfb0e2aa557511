"""The agent's Stats and `kvctl nodes` name what an agent hashes and checksums with:
"native avx2" / "native scalar", or "python (<why>)" for the slow fallback."""

from __future__ import annotations

import json

from support.control import AgentClient, agent_cfg

from kvstore import native
from kvstore.cli.__main__ import main as kvctl_main
from kvstore.native import OFF_ENV

FALLBACK_LOG = "use the pure-Python fallback"


def test_agent_stats_and_kvctl_nodes_name_the_hashing_path(etcd, spawn_agent, monkeypatch, capsys):
    fast = spawn_agent(**agent_cfg(etcd))
    monkeypatch.setenv(OFF_ENV, "1")  # the next agent inherits it
    slow = spawn_agent(**agent_cfg(etcd))
    monkeypatch.delenv(OFF_ENV)
    assert AgentClient(fast.address).stats().native_accel == native.active()
    assert AgentClient(slow.address).stats().native_accel == f"python (disabled by {OFF_ENV})"
    assert FALLBACK_LOG in slow.log and FALLBACK_LOG not in fast.log

    capsys.readouterr()
    assert kvctl_main(["nodes", "--etcd", etcd.endpoint, "--output", "json"]) == 0
    nodes = {n["node_id"]: n for n in json.loads(capsys.readouterr().out)["nodes"]}
    assert nodes["agent-0"]["native_accel"] == native.active()
    assert nodes["agent-1"]["native_accel"] == f"python (disabled by {OFF_ENV})"
    assert kvctl_main(["nodes", "--etcd", etcd.endpoint]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[-1] == "hashing"
    assert next(ln for ln in table if ln.startswith("agent-1")).endswith(
        f"python (disabled by {OFF_ENV})"
    )
