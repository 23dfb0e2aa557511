"""What kvctl's control-plane commands share (kvstore/cli/control_cmd.py lists them):
argument types, exit codes, finding etcd and credentials, running a command against
etcd with its failures turned into messages and exit codes, Ctrl-C and an etcd lost
after a commit, tables and JSON, and the options every command takes."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence

from kvstore import errors
from kvstore.cli import discover
from kvstore.cli.discover import ETCD_ENV, STATE_ENV
from kvstore.cli.views import SEEN_WINDOW_S
from kvstore.config import TLSConfig, read_token_file, tls_fields
from kvstore.coord.admin_records import AckProgress
from kvstore.coord.etcd import EtcdClient
from kvstore.errors import StartupError, clip, shown
from kvstore.namespace import tenant_name_problem
from kvstore.process import seconds as process_seconds
from kvstore.tls import TLSFilesError, read_files

OK, FAILED, USAGE, ETCD_DOWN, NODE_DOWN, NOT_ACKED = 0, 1, 2, 3, 4, 5
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it
TOKEN_ENV = "KVSTORE_CLUSTER_TOKEN"


class Usage(Exception):
    """Bad command line: exit 2."""


# ------------------------------------------------------------------------ plumbing
# Timeouts and waits: 0, negative or NaN ones made every call time out at once,
# reported as an unreachable etcd or agent.
seconds = process_seconds(0.001, 86400)


def count(text: str) -> int:
    """An argparse type: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def duration(text: str) -> float:
    """An argparse type: seconds, or a number with s, m, h or d (24h, 90m)."""
    t = text.strip().lower()
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}.get(t[-1:], 0)
    try:
        value = float(t[:-1] if unit else t) * (unit or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a duration like 24h or 90m, got {text!r}"
        ) from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return value


MAX_TENANT_CHARS = 256  # a namespace spec, its tenant included, is at most 2 KiB


def tenant_arg(text: str) -> str:
    """An argparse type for a tenant name (`quota`, `stats --tenant`, `namespaces
    --tenant`): the namespaces' rule, and a length a tenant can have."""
    if len(text) > MAX_TENANT_CHARS:
        raise argparse.ArgumentTypeError(
            f"tenant name {clip(text)} is longer than {MAX_TENANT_CHARS} characters: no "
            "tenant can have it"
        )
    if problem := tenant_name_problem(text):
        raise argparse.ArgumentTypeError(f"tenant name {clip(text)} {problem}")
    return text


def nonempty(text: str) -> str:
    """An argparse type for --etcd and --state-dir: an empty value is a mistake (a
    variable that did not expand), not "look for a cluster elsewhere"."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset shell variable?)")
    return text


def _endpoints(args) -> discover.Found:
    from kvstore.devcluster import ClusterError

    try:
        return discover.etcd(args.etcd, args.state_dir)
    except ClusterError as exc:
        raise Usage(str(exc)) from None


def cluster_token(args) -> str | None:
    """The cluster token, and (args.token_source) where it came from, for messages. An
    empty or unreadable --token-file is bad usage, never "no token"."""
    if getattr(args, "token_file", None) is not None:
        args.token_source = f"--token-file {args.token_file}"
        try:
            return read_token_file("--token-file", args.token_file)
        except StartupError as exc:
            raise Usage(str(exc)) from None
    token = os.environ.get(TOKEN_ENV) or None
    args.token_source = f"${TOKEN_ENV}" if token else "no token"
    return token


def _tls(args, target: discover.Found) -> TLSConfig | None:
    """The flags' files (all three), else the discovered cluster's client pair."""
    flags = tls_fields(args.tls_ca, args.tls_cert, args.tls_key)
    if flags is None:
        return target.tls
    try:
        tls = TLSConfig(**flags)
    except ValueError as exc:
        raise Usage(f"--tls-ca, --tls-cert and --tls-key go together ({exc})") from None
    try:
        read_files(tls)
    except TLSFilesError as exc:  # names the file that cannot be read
        raise Usage(str(exc)) from None
    return tls


def run(args, body) -> int:
    """Open etcd, run `body(etcd)` (a coroutine function returning an exit code), and
    turn every failure into a message on stderr and its exit code. `args.tls` is set to
    the mTLS files every connection presents (None: plaintext)."""
    target = discover.Found("", "")

    async def main() -> int:
        nonlocal target
        target = _endpoints(args)
        args.tls = _tls(args, target)
        async with EtcdClient(target.value, timeout=args.etcd_timeout, tls=args.tls) as etcd:
            return await body(etcd)

    try:
        return asyncio.run(main())
    except discover.NoCluster as exc:  # nothing configured: usage, not an etcd outage
        print(f"kvctl {args.kvctl_command}: {exc}", file=sys.stderr)
        return USAGE
    except Usage as exc:
        print(f"kvctl {args.kvctl_command}: {exc}", file=sys.stderr)
        return USAGE
    except ValueError as exc:  # also errors.InvalidArgument: bad endpoints, sizes, names
        print(f"kvctl {args.kvctl_command}: {exc}", file=sys.stderr)
        return USAGE
    except errors.Unavailable as exc:
        print(
            f"kvctl {args.kvctl_command}: {exc}\n  (etcd from {target.source}; "
            f"{_etcd_hint(str(exc), getattr(args, 'tls', None))}; no change was made unless "
            "stated above)",
            file=sys.stderr,
        )
        return ETCD_DOWN
    except errors.KvError as exc:
        print(f"kvctl {args.kvctl_command}: {exc}", file=sys.stderr)
        return FAILED
    except (KeyboardInterrupt, asyncio.CancelledError):
        return _interrupted(args)


def _etcd_hint(error: str, tls: TLSConfig | None) -> str:
    """What to check when etcd could not be reached, from how the connection failed."""
    if "handshake" in error.lower():
        return (
            "the TLS handshake failed: --tls-ca must be the CA that signed etcd's "
            "certificate, and --tls-cert/--tls-key a client pair that etcd's CA signed"
        )
    if tls is None and "Socket closed" in error:
        return (
            "it closed the connection at once, as an etcd that serves TLS does to a "
            "plaintext client: pass --tls-ca, --tls-cert and --tls-key (a local cluster's "
            "are under <state dir>/tls, found with --state-dir)"
        )
    return f"is etcd running? pass --etcd HOST:PORT, --state-dir, or set ${ETCD_ENV}"


def _interrupted(args) -> int:
    """Ctrl-C. A flush or kill switch change committed (its transaction, once sent, is
    awaited to its answer: kvstore/coord/admin.txn_response) is in force: exit 5, as when
    etcd went away; before that nothing was written: 130, the shell's Ctrl-C status."""
    command = args.kvctl_command
    revision = getattr(args, _COMMITTED, None)
    if revision is not None:
        print(
            f"kvctl {command}: interrupted: COMMITTED at etcd revision {revision}, "
            "acknowledgements unconfirmed. The change is in force: members refuse the old "
            "state as soon as they see it (`kvctl audit` records it as unconfirmed; "
            "`kvctl nodes` shows the members; repeating the command is safe).",
            file=sys.stderr,
        )
        return NOT_ACKED
    if getattr(args, "commits", False):
        print(f"kvctl {command}: interrupted; nothing changed", file=sys.stderr)
    else:
        print(f"kvctl {command}: interrupted", file=sys.stderr)
    return INTERRUPTED


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def table(headers: list[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; every cell shown() (None as "-")."""
    cells = [[shown(c) for c in headers]]
    cells += [["-" if c is None else shown(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def progress_printer(what: str):
    def show(p: AckProgress) -> None:
        waiting = f"; waiting for {', '.join(p.missing)}" if p.missing else ""
        print(
            f"{what}: {len(p.acked)}/{len(p.members)} acknowledged{waiting}",
            file=sys.stderr,
            flush=True,
        )

    return show


# ------------------------------------------------------- committing commands
_COMMITTED = "_kvctl_committed_revision"


def committed_hook(args, show):
    """Wrap an on_commit callback so that args remembers the change was committed."""

    def hook(*a) -> None:
        setattr(args, _COMMITTED, a[-1])  # the revision is the last argument
        show(*a)

    return hook


def unconfirmed(args, command: str, exc: Exception) -> int:
    """etcd failed: before the commit nothing changed (re-raised: exit 3); after it the
    change is in force and only its acknowledgements are unconfirmed (exit 5)."""
    revision = getattr(args, _COMMITTED, None)
    if revision is None:
        raise exc
    if args.output == "json":
        print_json({"ok": False, "committed": True, "revision": revision, "error": str(exc)})
    print(
        f"kvctl {command}: COMMITTED at etcd revision {revision}, but etcd became "
        f"unreachable before every acknowledgement was seen, so they are unconfirmed "
        f"({exc}). The change is in force: members refuse the old state as soon as they "
        "see it. Once etcd answers, check `kvctl audit` and `kvctl nodes`; repeating the "
        "command is safe.",
        file=sys.stderr,
    )
    return NOT_ACKED


def add_common(p: argparse.ArgumentParser, nodes: bool = False) -> None:
    p.add_argument(
        "--etcd",
        metavar="ENDPOINTS",
        type=nonempty,
        help=f"etcd host:port[,host:port] (default ${ETCD_ENV}, else the local "
        f"cluster of ${STATE_ENV} or of .state/cluster here or in a parent)",
    )
    p.add_argument(
        "--state-dir",
        type=nonempty,
        help="a local cluster's state directory (kvctl cluster up, make run): use its etcd",
    )
    p.add_argument("--output", "-o", choices=["table", "json"], default="table")
    p.add_argument(
        "--etcd-timeout",
        type=seconds,
        default=3.0,
        metavar="S",
        help="seconds per etcd call (default 3)",
    )
    found = "default: the local cluster's tls/ when it runs with mTLS"
    p.add_argument("--tls-ca", metavar="FILE", help=f"mTLS: the cluster's CA ({found})")
    p.add_argument("--tls-cert", metavar="FILE", help="mTLS: client certificate")
    p.add_argument("--tls-key", metavar="FILE", help="mTLS: client key")
    if nodes:
        p.add_argument(
            "--token-file",
            help=f"cluster token for the agents' Stats (default ${TOKEN_ENV}); an agent "
            "that refuses it is AUTH REFUSED (exit 1); an empty or unreadable file is refused "
            "(exit 2)",
        )
        p.add_argument(
            "--node-timeout",
            type=seconds,
            default=3.0,
            metavar="S",
            help="seconds to wait for each agent's Stats and each router's health check "
            "(default 3)",
        )
        p.add_argument(
            "--seen-window",
            type=duration,
            default=SEEN_WINDOW_S,
            metavar="DURATION",
            help="an agent or router seen within this long (e.g. 24h, 30m; default 24h) "
            "but not registered now is reported missing (health degraded, exit 4), or "
            "stopped when it stopped cleanly (SIGTERM; informational, not exit 4); "
            "`kvctl nodes forget ID` drops a decommissioned one",
        )
