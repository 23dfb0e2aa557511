"""Peer settings reach the agent through its one configuration system (kvstore/config.py:
AgentConfig.peer, KVSTORE_PEER_<FIELD> as its env layer): a bad one stops the agent at
start with one line naming it, never a silent default."""

from __future__ import annotations

import os
import subprocess

from support.common import PY, ROOT


def _start_agent(tmp_path, **peer_env: str) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_AGENT_", "KVSTORE_PEER_"))
    }
    env.update(peer_env)
    return subprocess.run(
        [
            PY,
            "-m",
            "node_agent",
            "--listen",
            "127.0.0.1:0",
            "--device",
            "cpu",
            "--pool-bytes",
            "4MiB",
            "--slot-bytes",
            "64KiB",
            "--nvme-bytes",
            "0",
            "--data-dir",
            str(tmp_path / "data"),
            "--allow-unauthenticated",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_agent_with_a_misspelt_peer_boolean_refuses_to_start(tmp_path):
    """Before, KVSTORE_PEER_IN_PLACE=flase silently meant False and the agent ran."""
    r = _start_agent(tmp_path, KVSTORE_PEER_IN_PLACE="flase")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "bad configuration: KVSTORE_PEER_IN_PLACE: expected a boolean, got 'flase'" in r.stderr
    assert "Traceback" not in r.stderr


def test_agent_with_an_unknown_peer_variable_refuses_to_start(tmp_path):
    r = _start_agent(tmp_path, KVSTORE_PEER_BATCH_SIZE="64MiB")  # the field is batch_bytes
    assert r.returncode == 2, r.stderr[-2000:]
    assert "unknown peer settings in the environment: KVSTORE_PEER_BATCH_SIZE" in r.stderr
    assert "Traceback" not in r.stderr
