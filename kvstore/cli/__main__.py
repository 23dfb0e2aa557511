"""`python -m kvstore.cli` / `kvctl`: the operator CLI.

Exit status: 0 ok, 1 failure, 2 bad usage, 3 etcd unreachable, 4 node unreachable,
5 a flush or kill switch change not acknowledged in time (or interrupted once committed),
130 interrupted (Ctrl-C) before anything was written, 141 the reader of its output went
away (`| head`), as a shell reports a command killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

from kvstore.cli.analyze import add_analyze_arguments, analyze_command
from kvstore.cli.cluster_cmd import add_cluster_arguments, cluster_command
from kvstore.cli.control_cmd import register as register_control_commands
from kvstore.cli.plan import add_plan_arguments, plan_command
from kvstore.errors import clip


def _version() -> str:
    """The installed kvstore's version (pyproject.toml), or where it runs from a tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstore")
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"


_QUOTED = re.compile(r"'[^']{81,}'|\"[^\"]{81,}\"")


class _Parser(argparse.ArgumentParser):
    """argparse, with the values its errors quote cut at 80 characters (and their length
    said), as kvctl's own messages cut them: a 100 kB argument is not echoed back whole."""

    def error(self, message: str):
        super().error(_QUOTED.sub(lambda m: clip(m.group()[1:-1]), message))

    def parse_known_args(self, args=None, namespace=None):
        """Arguments no parser knows are refused by the command's own parser, with its
        usage ('kvctl status --bogus' showed kvctl's top-level usage)."""
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {clip(' '.join(extras), bare=True)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvctl",
        description="Operator CLI for kvstore, the distributed KV-cache store.",
        epilog="Exit status: 0 ok, 1 failure, 2 bad usage, 3 etcd unreachable, "
        "4 node unreachable, 5 not acknowledged in time (or Ctrl-C once committed), "
        "130 Ctrl-C before anything was written, 141 its output's reader went away "
        "(| head). 'kvctl COMMAND --help' "
        "describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"kvctl {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    commands = (
        (
            "cluster",
            "local development cluster: up, down, status",
            add_cluster_arguments,
            cluster_command,
        ),
        (
            "plan",
            "capacity planning: KV bytes per token, blocks per tier",
            add_plan_arguments,
            plan_command,
        ),
        (
            "analyze",
            "prefix-ceiling analysis of a prompt trace",
            add_analyze_arguments,
            analyze_command,
        ),
    )
    for name, help_, add, run in commands:
        p = sub.add_parser(name, help=help_)
        add(p)
        p.set_defaults(func=run)
    register_control_commands(sub)  # flush, killswitch, quota, status, nodes, stats, audit
    return parser


def joined_negatives(argv: list[str]) -> list[str]:
    """`--hbm -5GiB` as `--hbm=-5GiB`: argparse takes a value that starts with '-' for
    an option and says only "expected one argument"; joined, the option's own check
    says what is wrong with it (no kvctl option takes a negative value)."""
    out: list[str] = []
    for arg in argv:
        prev = out[-1] if out else ""
        if re.match(r"-\.?\d", arg) and prev.startswith("--") and "=" not in prev:
            out[-1] = f"{prev}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = joined_negatives(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # here, not at interpreter exit, where a failure is a traceback
        return rc
    except BrokenPipeError:
        # The reader went away (`kvctl status | head -5`): stop quietly, like other CLIs,
        # with the status they exit with then (killed by SIGPIPE), not failure's 1.
        # stdout goes to /dev/null so the interpreter's flush at exit does not fail again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # no real stdout (in-process callers)
            pass
        return 128 + signal.SIGPIPE  # 141, what a shell reports for `yes | head -1`


if __name__ == "__main__":
    sys.exit(main())
