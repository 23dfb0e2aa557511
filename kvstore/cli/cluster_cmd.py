"""`kvctl cluster up|down|status`: a local development cluster (kvstore/devcluster/)."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.devcluster import ClusterError, EtcdUnreachable, NodeUnreachable, UpOptions
from kvstore.devcluster.status import ETCD_TIMEOUT_S
from kvstore.cli.control_run import nonempty, seconds
from kvstore.cli.discover import DEFAULT_STATE, STATE_ENV, state_dir
from kvstore.process import log_level
from kvstore.process import seconds as process_seconds

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_ETCD, EXIT_NODE = 0, 1, 2, 3, 4


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a local development cluster on 127.0.0.1: etcd, N node "
        "agents (CPU device) and a router, detached, with logs and pids in "
        "a state directory."
    )
    sub = parser.add_subparsers(dest="cluster_cmd", metavar="{up,down,status}")
    sub.required = True
    state_help = (
        f"directory for state, data and logs (default ${STATE_ENV}, else "
        f"{DEFAULT_STATE}; down and status also look for one in parent directories)"
    )
    p = sub.add_parser(
        "up",
        help="start etcd, agents and a router; wait until healthy",
        description="Start etcd, N agents and a router, wait until every one "
        "answers gRPC health and the router follows every agent, "
        "then print their addresses. etcd keeps its data from the last run in the state "
        "directory, as a production etcd would: namespaces and their generations (a flush "
        "stays in force on an agent that was down for it), quotas, the kill switch (up "
        "warns when it is on), the audit log; the last run's members are forgotten (their "
        "leases revoked). To start from nothing, remove the state directory after down "
        "(etcd/ alone is not enough: the agents' data would register their namespaces "
        "again at the old generations). Exit status: 0 up; "
        "1 a component exited or "
        "was not ready within --timeout (the error names it, what it waited for - ready "
        "file, health check, the router's view - its log file and the log's last lines; "
        "what this up started is stopped, logs stay in the state directory), or another "
        "up is starting there, or a cluster already runs there, or processes a killed up "
        "started still run there (down stops them; nothing is touched); 2 bad usage or a "
        "state directory that cannot be used.",
    )
    p.add_argument("--agents", type=int, default=2, help="number of node agents (default 2)")
    p.add_argument(
        "--engines",
        type=int,
        default=0,
        help="vLLM CPU engines (tiny local model, our connector, .venv-vllm) behind the "
        "router's OpenAI gateway, on the agents in turn (default 0: none, no gateway)",
    )
    p.add_argument("--state-dir", type=nonempty, help=state_help)
    p.add_argument("--pool-bytes", default="256MiB", help="device pool per agent (256MiB)")
    p.add_argument(
        "--slot-bytes", default="64KiB", help="largest block payload an agent accepts (64KiB)"
    )
    p.add_argument("--nvme-bytes", default="1GiB", help="RocksDB tier per agent (1GiB)")
    p.add_argument(
        "--lease-ttl", type=int, default=5, help="agent etcd lease TTL in seconds (default 5)"
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        default=180.0,
        help="seconds etcd, the agents, the router and the gateway have to come up, all "
        "together (default 180; vLLM engines have 600 more of their own); past it, exit 1 "
        "naming what was not ready",
    )
    p.add_argument(
        "--router-log-level",
        default="INFO",
        type=log_level,
        help="DEBUG logs every routing decision (default INFO)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="TLS on every port from a throwaway CA written to <state>/tls (ca.crt, and "
        "client.crt/client.key for kvctl and clients; kvctl finds them there by itself): "
        "mTLS, a client certificate required, on etcd, agents, router, peers and the "
        "engines; the gateway's HTTPS asks for none (its callers show API keys)",
    )
    p.add_argument(
        "--output",
        choices=("table", "json"),
        default="table",
        help="table: progress and addresses for people (default); json: one object "
        "with the state dir, etcd, router, agent and gateway addresses, progress omitted",
    )
    p = sub.add_parser(
        "down",
        help="stop the cluster (SIGTERM, then SIGKILL)",
        description="Stop the engines, then the router and agents (SIGTERM; they "
        "leave etcd cleanly), then etcd. Each also gets SIGCONT, so that a stopped "
        "(SIGSTOP) one runs again and handles SIGTERM; whatever is still running --grace "
        "seconds after SIGTERM is killed (SIGKILL). Progress on stderr: whom it waits "
        "for (pid, state, for how long) and whom it kills; the last line names what "
        "had to be killed. A cluster still starting is stopped too (its kvctl cluster up "
        "is told to stop and exits 1), and so is what a killed one left running, even "
        "a process it had not yet written down (each carries KVSTORE_DEV_CLUSTER=<state "
        "dir> in its environment). Data and logs stay in the state directory. "
        "Exit status: 0 stopped (killed ones included), 1 a process still there after "
        "SIGKILL (uninterruptible I/O), 2 a state directory that cannot be used.",
    )
    p.add_argument("--state-dir", type=nonempty, help=state_help)
    p.add_argument(
        "--grace",
        type=process_seconds(0, 3600),
        default=10.0,
        help="seconds each group (engines one by one, then the agents and the router, "
        "then etcd) has after SIGTERM before SIGKILL (default 10; 0: SIGKILL right after "
        "SIGTERM, so nothing stops cleanly: the agents' etcd leases expire instead of "
        "being revoked, and their pools are not written to NVMe)",
    )
    p = sub.add_parser(
        "status",
        help="show each process, its address and indexed blocks",
        description="Show etcd, every agent and the router: alive, healthy, "
        "address; per agent whether it is registered in etcd and "
        "how many blocks the router indexed for it. A component whose process is gone "
        "while something else answers at its address (restarted by hand) shows as "
        "'not ours': it counts as healthy, and down does not stop it. Exit status: 0 "
        "all healthy, 3 etcd unreachable, 4 an agent or the router "
        "unreachable, 1 no cluster (the error names what a killed up left running, or an "
        "up still starting), 2 a state directory or cluster.json that cannot be "
        "used (not a directory, unreadable, corrupt, an entry of an unknown kind).",
    )
    p.add_argument("--state-dir", type=nonempty, help=state_help)
    p.add_argument(
        "--output", choices=("table", "json"), default="table", help="table (default) or json"
    )
    p.add_argument(
        "--etcd-timeout",
        type=seconds,
        default=ETCD_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait for etcd's health and for its node listing, each (default "
        f"{ETCD_TIMEOUT_S:g}); past them etcd counts as unreachable (exit 3)",
    )


def _up(args) -> int:
    from kvstore.devcluster import up

    try:
        opts = UpOptions(
            args.agents,
            args.pool_bytes,
            args.slot_bytes,
            args.nvme_bytes,
            args.lease_ttl,
            args.timeout,
            args.router_log_level,
            tls=args.tls,
            engines=args.engines,
        )
    except ValueError as exc:
        print(f"kvctl cluster up: {exc}", file=sys.stderr)
        return EXIT_USAGE
    quiet = args.output == "json"
    say = (lambda _msg: None) if quiet else print
    st = up(state_dir(args.state_dir, look_up=False).value, opts, say=say)
    if quiet:
        print(
            json.dumps(
                {
                    "state_dir": st.state_dir,
                    "etcd_endpoint": st.etcd_endpoint,
                    "router_address": st.router_address,
                    "agents": {p.name: p.address for p in st.agents},
                    "gateway_url": st.gateway_url,
                    "metrics_url": st.metrics_url,
                    "tls_dir": st.tls_dir,
                },
                indent=2,
            )
        )
    return EXIT_OK


def _down(args) -> int:
    from kvstore.devcluster import STARTING_FILE, STATE_FILE, check_state_dir, down, starting

    state = state_dir(args.state_dir)
    path = check_state_dir(state.value)
    up_pid = starting(path)
    if up_pid is None and not any((path / f).exists() for f in (STATE_FILE, STARTING_FILE)):
        print(f"no local cluster in {state.value} ({state.source}); nothing to stop")
        return EXIT_OK
    if up_pid is not None:  # what an operator means by down: nothing left running
        print(f"kvctl cluster up (pid {up_pid or '?'}) is still starting a cluster in "
              f"{state.value}; stopping it and what it started")  # fmt: skip
    ended = down(state.value, args.grace, say=_progress)
    print(f"stopped {', '.join(e.name for e in ended)}" if ended else "nothing was running")
    killed = [e for e in ended if e.killed]
    if killed:
        who = ", ".join(f"{e.name} (pid {e.pid}, {e.state or 'gone'})" for e in killed)
        print(f"killed with SIGKILL (still running {args.grace:g}s after SIGTERM): {who}")
    survivors = [f"{e.name} (pid {e.pid})" for e in ended if e.survived]
    if survivors:
        print(f"kvctl cluster down: still there after SIGKILL (in uninterruptible I/O?): "
              f"{', '.join(survivors)}", file=sys.stderr)  # fmt: skip
        return EXIT_FAIL
    return EXIT_OK


def _progress(message: str) -> None:
    print(f"kvctl cluster down: {message}", file=sys.stderr, flush=True)


def render_status(report: dict) -> str:
    rows = [("COMPONENT", "PID", "STATE", "ADDRESS", "DETAIL")]
    for c in report["components"]:
        state = "up" if c["healthy"] else ("unhealthy" if c["alive"] else "dead")
        details = []
        if c.get("stranger"):
            state = "not ours"
            details.append(c["stranger"])
        if c["kind"] == "agent":
            details.append(
                f"{'registered' if c['registered'] else 'NOT registered'}, "
                f"{'synced' if c['synced'] else 'not synced'}, "
                f"{c['indexed_blocks']} blocks indexed"
            )
        detail = "; ".join(details)
        rows.append((c["name"], str(c["pid"]), state, c["address"] or "-", detail))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"cluster in {report['state_dir']} (up {report['uptime_s']}s)"]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    if report.get("gateway_url"):
        lines.append(f"gateway  {report['gateway_url']} (OpenAI API)")
    if report.get("metrics_url"):  # the gateway's metrics count every tenant: not on its port
        lines.append(f"metrics  {report['metrics_url']} (the router's and the gateway's)")
    return "\n".join(lines)


def _status(args) -> int:
    from kvstore.devcluster import status

    state = state_dir(args.state_dir)
    try:
        report = status(state.value, etcd_timeout=args.etcd_timeout)
    except ClusterError as exc:  # the same kind (its exit status), naming the source
        raise type(exc)(f"{exc} (state directory from {state.source})") from None
    print(json.dumps(report, indent=2) if args.output == "json" else render_status(report))
    comps = report["components"]
    if any(c["kind"] == "etcd" and not c["healthy"] for c in comps):
        return EXIT_ETCD
    if any(not c["healthy"] for c in comps):
        return EXIT_NODE
    return EXIT_OK


def cluster_command(args: argparse.Namespace) -> int:
    handler = {"up": _up, "down": _down, "status": _status}[args.cluster_cmd]
    try:
        return handler(args)
    except ClusterError as exc:
        print(f"kvctl cluster {args.cluster_cmd}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        done = (
            "; what it had started is stopped (logs stay in the state directory)"
            if args.cluster_cmd == "up"
            else ""
        )
        print(f"kvctl cluster {args.cluster_cmd}: interrupted{done}", file=sys.stderr)
        return EXIT_FAIL


__all__ = ["add_cluster_arguments", "cluster_command", "EtcdUnreachable", "NodeUnreachable"]
