"""kvctl control-plane commands: flush, killswitch, quota, namespaces, status, nodes, stats,
audit.

Every command takes `--output table|json` (tables for people, JSON for scripts; progress
lines go to stderr either way) and finds etcd from `--etcd`, else `--state-dir` (a local
cluster's cluster.json), else $KVSTORE_ETCD, else $KVSTORE_STATE_DIR, else the
.state/cluster of `make run` in this directory or a parent (kvstore/cli/discover.py).

Exit codes: 0 ok, 1 failure, 2 bad usage, 3 etcd unreachable (nothing changed), 4 node
unreachable or missing, 5 a flush or kill switch change committed but not acknowledged by
every live member in time (or etcd went away, or Ctrl-C, before that was confirmed),
130 Ctrl-C before anything was written.

The commands live in change_cmd.py (flush, killswitch: the ones that commit a change and
wait for its acknowledgements), views_cmd.py (status, nodes, stats, namespaces) and
quota_cmd.py (quota, audit); what they share in control_run.py.
"""

from __future__ import annotations

from kvstore.cli import change_cmd, quota_cmd, views_cmd
from kvstore.cli.change_cmd import cmd_flush, cmd_killswitch
from kvstore.cli.quota_cmd import cmd_audit, cmd_quota
from kvstore.cli.views_cmd import _tier_cells, cmd_namespaces, cmd_nodes, cmd_stats, cmd_status

__all__ = [
    "_tier_cells",
    "cmd_audit",
    "cmd_flush",
    "cmd_killswitch",
    "cmd_namespaces",
    "cmd_nodes",
    "cmd_quota",
    "cmd_stats",
    "cmd_status",
    "register",
]


def register(sub) -> None:
    """Add the control-plane subcommands to kvctl's subparsers (in the order --help
    lists them); each sets `func`."""
    change_cmd.register(sub)
    quota_cmd.register_quota(sub)
    views_cmd.register(sub)
    quota_cmd.register_audit(sub)
