"""Local development cluster: one etcd, N node agents (CPU device, small pools) and a
router on 127.0.0.1, detached from the shell that started them.

Everything lives under a state directory::

    cluster.json          what runs where (pids, addresses, logs)
    up.lock               flock-ed by `up` for its whole run (its pid): a second `up`
                          is refused, `down` stops a starting one
    starting.json         while `up` runs: what it has started (a killed `up`'s are
                          stopped by `down`; while they run, `up` is refused and
                          `status` names them)
    etcd/  etcd.log       etcd data (kept from one `up` to the next, as the agents'
                          data/ is; `up` forgets the last run's members) and log
    agent-<i>/            agent.json (config), data/ (RocksDB), agent.log
    router/               router.log
    model/, engine-<i>/   with --engines: the tiny model; each engine's engine.log
    tls/                  with --tls: a throwaway CA (ca.crt), the processes' pair
                          (server.crt/.key; the engines serve HTTPS with it) and a
                          client pair for kvctl, tests and the engines' connectors and
                          registrars (client.crt/.key); kvstore/tls_ca.py

`up` starts the processes in their own sessions (a Ctrl-C in the shell does not reach
them), waits until each answers gRPC health and the router has every agent in sync, and
writes cluster.json. `down` sends SIGTERM and SIGCONT (agents revoke their etcd leases;
a stopped process runs again to handle it), then SIGKILL after a grace period, saying
whom it waits for and whom it killed. `status` reports each process and what the router has indexed.

state.py holds the state files (cluster.json, starting.json, the up lock), launch.py
starts and configures each process, up.py, down.py and status.py the commands.
"""

from __future__ import annotations

from kvstore.devcluster.down import down, stop_procs
from kvstore.devcluster.launch import (
    UpOptions,
    agent_slot_bytes,
    engine_launch,
    engine_record_key_file,
    etcd_command,
)
from kvstore.devcluster.state import (
    LOCK_FILE,
    STARTING_FILE,
    STATE_FILE,
    BadStateDir,
    ClusterError,
    ClusterState,
    EtcdUnreachable,
    NodeUnreachable,
    Proc,
    check_state_dir,
    left_running,
    named,
    starting,
)
from kvstore.devcluster.status import status
from kvstore.devcluster.up import up

__all__ = [
    "LOCK_FILE",
    "STARTING_FILE",
    "STATE_FILE",
    "BadStateDir",
    "ClusterError",
    "ClusterState",
    "EtcdUnreachable",
    "NodeUnreachable",
    "Proc",
    "UpOptions",
    "agent_slot_bytes",
    "check_state_dir",
    "down",
    "engine_launch",
    "engine_record_key_file",
    "etcd_command",
    "left_running",
    "named",
    "starting",
    "status",
    "stop_procs",
    "up",
]
