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
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

from kvstore.coord.admin import ROUTER_MEMBER, AckProgress, ControlPlane, Quota
from kvstore.config import TLSConfig, read_token_file, tls_fields
from kvstore.coord.etcd import EtcdClient
from kvstore.process import seconds as process_seconds
from kvstore.tls import TLSFilesError, read_files
from kvstore import errors
from kvstore.errors import StartupError, clip
from kvstore.namespace import tenant_name_problem
from kvstore.units import format_size, parse_size
from kvstore.cli import discover
from kvstore.cli.discover import ETCD_ENV, STATE_ENV
from kvstore.cli.views import (
    EVICTION_REASONS,
    SEEN_WINDOW_S,
    ClusterView,
    cluster_view,
    node_counter_meaning,
)
from kvstore.coord.seen import forget as forget_seen

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
MAX_REASON_CHARS = 1024  # the kill switch's reason: etcd and every audit listing hold it


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


def _token(args) -> str | None:
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


def _run(args, body) -> int:
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
            f"kvctl {args.kvctl_command}: {exc}\n  (etcd from {target.source}; is etcd "
            f"running? pass --etcd HOST:PORT, --state-dir, or set ${ETCD_ENV}; no change "
            "was made unless stated above)",
            file=sys.stderr,
        )
        return ETCD_DOWN
    except errors.KvError as exc:
        print(f"kvctl {args.kvctl_command}: {exc}", file=sys.stderr)
        return FAILED
    except (KeyboardInterrupt, asyncio.CancelledError):
        return _interrupted(args)


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


def _json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def table(headers: list[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _progress_printer(what: str):
    def show(p: AckProgress) -> None:
        waiting = f"; waiting for {', '.join(p.missing)}" if p.missing else ""
        print(
            f"{what}: {len(p.acked)}/{len(p.members)} acknowledged{waiting}",
            file=sys.stderr,
            flush=True,
        )

    return show


# ----------------------------------------------------------------------- commands
_COMMITTED = "_kvctl_committed_revision"


def _committed_hook(args, show):
    """Wrap an on_commit callback so that args remembers the change was committed."""

    def hook(*a) -> None:
        setattr(args, _COMMITTED, a[-1])  # the revision is the last argument
        show(*a)

    return hook


def _unconfirmed(args, command: str, exc: Exception) -> int:
    """etcd failed: before the commit nothing changed (re-raised: exit 3); after it the
    change is in force and only its acknowledgements are unconfirmed (exit 5)."""
    revision = getattr(args, _COMMITTED, None)
    if revision is None:
        raise exc
    if args.output == "json":
        _json({"ok": False, "committed": True, "revision": revision, "error": str(exc)})
    print(
        f"kvctl {command}: COMMITTED at etcd revision {revision}, but etcd became "
        f"unreachable before every acknowledgement was seen, so they are unconfirmed "
        f"({exc}). The change is in force: members refuse the old state as soon as they "
        "see it. Once etcd answers, check `kvctl audit` and `kvctl nodes`; repeating the "
        "command is safe.",
        file=sys.stderr,
    )
    return NOT_ACKED


def cmd_flush(args) -> int:
    args.commits = True  # Ctrl-C before its commit: "nothing changed" (_interrupted)
    tenant, sep, name = args.target.partition("/")
    if not sep or not tenant or not name or "/" in name:
        print(
            f"kvctl flush: target must be TENANT/NAMESPACE, got {clip(args.target)}",
            file=sys.stderr,
        )
        return USAGE
    if len(args.target) > MAX_TENANT_CHARS + 1 + 2048:  # longer than any spec's name
        print(
            f"kvctl flush: target {clip(args.target)} is longer than any namespace's name",
            file=sys.stderr,
        )
        return USAGE

    async def body(etcd) -> int:
        cp = ControlPlane(etcd)
        if not args.unregistered and (problem := await cp.flush_target_problem(tenant, name)):
            print(
                f"kvctl flush: {problem} Nothing was flushed or written (`kvctl namespaces "
                f"--tenant {clip(tenant.strip().lower() or tenant)[1:-1]}` lists the names). "
                "To flush "
                "copies of a name that agents opened while etcd was unreachable and have "
                "not registered yet, pass --unregistered.",
                file=sys.stderr,
            )
            return FAILED

        def committed(flushed, revision: int) -> None:
            gens = (
                ", ".join(
                    f"{f.ns_hex[:12]} {f.old_generation}->{f.new_generation}" for f in flushed
                )
                or "no namespace record in etcd: the name only, for unregistered copies"
            )
            print(
                f"flush: committed at etcd revision {revision} ({gens}); waiting for "
                "acknowledgements",
                file=sys.stderr,
                flush=True,
            )

        try:
            rep = await cp.flush(
                tenant,
                name,
                args.timeout,
                _progress_printer("flush"),
                _committed_hook(args, committed),
            )
        except errors.Unavailable as exc:
            return _unconfirmed(args, "flush", exc)
        p = rep.progress
        for m in p.left:
            print(
                f"flush: {m} left (its lease expired or was revoked) without acknowledging: "
                + (
                    "it routes by load only until it re-announced itself and re-read the "
                    "generations"
                    if m.startswith(ROUTER_MEMBER)
                    else "it fences itself and re-reads generations before serving again"
                ),
                file=sys.stderr,
                flush=True,
            )
        if args.output == "json":
            _json(
                {
                    "ok": rep.ok,
                    "tenant": tenant,
                    "name": name,
                    "revision": rep.revision,
                    "namespaces": [asdict(f) for f in rep.namespaces],
                    "members": list(p.members),
                    "acknowledged": list(p.acked),
                    "missing": list(p.missing),
                    "left_without_ack": list(p.left),
                    "blocks_scheduled_for_deletion": p.dropped,
                    "unregistered_flushed": p.unregistered,
                    "elapsed_s": round(rep.elapsed_s, 3),
                }
            )
        else:
            print(
                table(
                    ["namespace id", "name", "generation"],
                    [
                        [f.ns_hex, f.name, f"{f.old_generation} -> {f.new_generation}"]
                        for f in rep.namespaces
                    ],
                )
            )
            print(
                f"nodes acknowledged:  {len(p.acked)}/{len(p.members)}"
                + (f" ({', '.join(p.acked)})" if p.acked else "")
            )
            print(f"blocks scheduled for deletion: {p.dropped}")
            if p.unregistered:
                print(
                    f"flushed on agents before their etcd registration: {p.unregistered} namespaces"
                )
            print(f"time taken: {rep.elapsed_s:.2f}s")
        if rep.ok:
            return OK
        print(
            f"kvctl flush: generation committed at etcd revision {rep.revision}, but "
            f"{', '.join(p.missing)} did not acknowledge within {args.timeout:g}s; "
            "they cannot serve the old generation once they catch up. Check them with "
            "`kvctl nodes`.",
            file=sys.stderr,
        )
        return NOT_ACKED

    return _run(args, body)


def cmd_killswitch(args) -> int:
    args.commits = args.state != "status"  # see cmd_flush

    async def body(etcd) -> int:
        cp = ControlPlane(etcd)
        if args.state == "status":
            if args.reason:
                raise Usage("--reason goes with `killswitch on` only, not status")
            on, info = await cp.killswitch()
            if args.output == "json":
                _json({"enabled": on, **({"info": info} if info else {})})
            else:
                extra = (
                    f" (reason: {info.get('reason') or '-'}, by {info.get('by', '?')})"
                    if on
                    else ""
                )
                print(f"kill switch: {'ON' if on else 'off'}{extra}")
            return OK
        on = args.state == "on"
        if args.reason and not on:
            raise Usage(f"--reason goes with `killswitch on` only, not {args.state}")
        if len(args.reason) > MAX_REASON_CHARS:
            raise Usage(
                f"--reason is {len(args.reason)} characters; at most {MAX_REASON_CHARS} "
                "(it is stored with the switch and in the audit log)"
            )
        if on and not args.reason.strip():
            raise Usage(
                'killswitch on needs --reason "…" (recorded with the switch and in the '
                "audit log: who reads it next needs to know why)"
            )
        try:
            rep = await cp.set_killswitch(
                on,
                args.reason,
                args.timeout,
                _progress_printer(f"kill switch {args.state}"),
                _committed_hook(
                    args,
                    lambda rev: print(
                        f"kill switch {args.state}: set at etcd revision {rev}; "
                        "waiting for acknowledgements",
                        file=sys.stderr,
                        flush=True,
                    ),
                ),
            )
        except errors.Unavailable as exc:
            return _unconfirmed(args, "killswitch", exc)
        p = rep.progress
        if rep.was_on is not None:
            w = rep.was_on
            print(
                f"kill switch on: it was ON already (reason: {w.get('reason') or '-'}, by "
                f"{w.get('by', '?')}); its reason is now yours",
                file=sys.stderr,
            )
        if args.output == "json":
            _json(
                {
                    "ok": rep.ok,
                    "enabled": on,
                    "changed": rep.changed,
                    **({"was_on": rep.was_on} if rep.was_on is not None else {}),
                    "revision": rep.revision,
                    "members": list(p.members),
                    "acknowledged": list(p.acked),
                    "missing": list(p.missing),
                    "elapsed_s": round(rep.elapsed_s, 3),
                }
            )
        else:
            print(
                "kill switch ON: every lookup misses, writes are refused"
                if on
                else "kill switch off: caching resumes"
                if rep.changed
                else "kill switch already off: nothing changed"
            )
            print(
                f"nodes acknowledged: {len(p.acked)}/{len(p.members)}; "
                f"time taken: {rep.elapsed_s:.2f}s"
            )
        if rep.ok:
            return OK
        if not rep.changed:
            print(
                f"kvctl killswitch: the kill switch is off in etcd, but the last "
                f"acknowledgement of {', '.join(p.missing)} still says on, and none came "
                f"within {args.timeout:g}s. Check them with `kvctl nodes`.",
                file=sys.stderr,
            )
            return NOT_ACKED
        print(
            f"kvctl killswitch: set in etcd, but {', '.join(p.missing)} did not "
            f"acknowledge within {args.timeout:g}s",
            file=sys.stderr,
        )
        return NOT_ACKED

    return _run(args, body)


def _quota_rows(quotas: dict[str, Quota]) -> list[list]:
    def one(v):
        return "(config)" if v is None else "unlimited" if v == 0 else format_size(v)

    return [[t, one(q.hbm_limit_bytes), one(q.nvme_limit_bytes)] for t, q in quotas.items()]


def cmd_quota(args) -> int:
    for flag, value in (
        ("--hbm", getattr(args, "hbm", None)),
        ("--nvme", getattr(args, "nvme", None)),
    ):
        if value is not None and value.strip().startswith("-"):  # before looking for etcd
            print(
                f"kvctl quota set: {flag} cannot be negative, got {clip(value)} (0: no limit)",
                file=sys.stderr,
            )
            return USAGE

    async def body(etcd) -> int:
        cp = ControlPlane(etcd)
        if args.action == "set":
            if args.hbm is None and args.nvme is None:
                raise Usage("quota set needs --hbm and/or --nvme (0 removes a limit)")
            quota = Quota(
                None if args.hbm is None else parse_size(args.hbm),
                None if args.nvme is None else parse_size(args.nvme),
            )
            if not await etcd.list_namespaces(args.tenant):
                unknown = (
                    f"no namespace of tenant {args.tenant!r} is registered in etcd (a typo? "
                    "`kvctl namespaces` lists the tenants)"
                )
                if args.strict:
                    print(f"kvctl quota set: {unknown}; nothing set (--strict)", file=sys.stderr)
                    return FAILED
                print(
                    f"kvctl quota set: warning: {unknown}; setting it anyway, for when the "
                    "tenant first opens one",
                    file=sys.stderr,
                )
            quotas = {args.tenant: await cp.set_quota(args.tenant, quota)}
            print(
                "kvctl quota set: stored in etcd; each agent applies it when its quota "
                "watch delivers it (normally within a second; an agent cut off from etcd "
                "applies it once it reconnects). kvctl does not wait for the agents: "
                f"`kvctl stats --tenant {args.tenant}` shows the limits they apply.",
                file=sys.stderr,
            )
        elif args.action == "get":
            q = await cp.get_quota(args.tenant)
            if q is None:
                print(
                    f"kvctl quota get: tenant {args.tenant!r} has no quota in etcd (the "
                    "agents' configured limits apply)",
                    file=sys.stderr,
                )
                return FAILED
            quotas = {args.tenant: q}
        elif args.action == "clear":
            if not await cp.clear_quota(args.tenant):
                print(f"kvctl quota clear: tenant {args.tenant!r} has no quota", file=sys.stderr)
                return FAILED
            quotas = {}
        else:
            quotas = await cp.list_quotas()
        if args.output == "json":
            _json({t: json.loads(q.to_json()) for t, q in quotas.items()})
        elif quotas:
            print(table(["tenant", "hbm per node", "nvme per node"], _quota_rows(quotas)))
        else:
            print("no quotas set" if args.action == "list" else f"quota of {args.tenant} removed")
        return OK

    return _run(args, body)


async def _no_such_tenant(etcd, tenant: str) -> str:
    """'' when `tenant` has a namespace registered in etcd, else a message with the
    registered tenants it may mean (case aside, or a letter or two off)."""
    tenants = sorted({r.tenant for r in await etcd.list_namespaces("")})
    if tenant in tenants:
        return ""
    near = [t for t in tenants if t.lower() == tenant.strip().lower()]
    near += [t for t in difflib.get_close_matches(tenant, tenants, n=3) if t not in near]
    hint = f" Did you mean {' or '.join(near)}?" if near else ""
    return (
        f"no such tenant {clip(tenant)}: no namespace of it is registered in etcd.{hint} "
        "(`kvctl namespaces` lists the tenants)"
    )


def cmd_namespaces(args) -> int:
    async def body(etcd) -> int:
        records = await etcd.list_namespaces(args.tenant or "")
        if args.tenant and not records:  # a note: a tenant yet to start lists nothing
            print(f"kvctl namespaces: {await _no_such_tenant(etcd, args.tenant)}", file=sys.stderr)
        counts: dict[str, int] = {}
        for r in records:
            counts[r.tenant] = counts.get(r.tenant, 0) + 1
        if args.output == "json":
            _json(
                {
                    "tenants": counts,
                    **({"namespaces": [asdict(r) for r in records]} if args.tenant else {}),
                }
            )
        elif args.tenant:
            print(
                table(
                    ["namespace id", "name", "model", "generation"],
                    [[r.ns_hex, r.name, r.model_name, r.generation] for r in records],
                )
                if records
                else f"no such tenant {args.tenant}: it has no namespaces in etcd"
            )
            print(
                f"\n{args.tenant}: {len(records)} namespaces (limit: the agents' "
                "max_namespaces_per_tenant, default 1024)"
            )
        else:
            print(
                table(["tenant", "namespaces"], sorted(counts.items()))
                if counts
                else "no namespaces in etcd"
            )
        return OK

    return _run(args, body)


def _tier_cells(node) -> list[str]:
    out = []
    for name in ("hbm", "nvme"):
        t = next((t for t in node.tiers if t.tier == name), None)
        out.append(
            "-"
            if t is None
            else f"{format_size(t.used_bytes)} / {format_size(t.capacity_bytes)} "
            f"({t.blocks} blk"
            + (f", {format_size(t.unflushed_bytes)} unflushed" if t.unflushed_bytes else "")
            + ")"
            + (f" [{t.condition}]" if t.condition else "")
        )
    return out


def _nodes_table(view: ClusterView) -> str:
    rows = [
        [
            n.node_id,
            n.address,
            n.device or "-",
            "up" if n.reachable else "AUTH REFUSED" if n.auth_refused else "UNREACHABLE",
            *_tier_cells(n),
            f"{100 * n.utilization:.0f}%" if n.reachable else "-",
            n.in_flight if n.reachable else "-",
            n.native_accel or "-",
        ]
        for n in view.nodes
    ]
    rows += [
        [
            f"router:{r.get('router_id', '?')}",
            r.get("address") or "-",
            "-",
            "UNREACHABLE" if r.get("reachable") is False else "up",
            "-",
            "-",
            "-",
            "-",
            "-",
        ]
        for r in view.routers
    ]
    rows += [
        [
            m.member_id if m.kind == "agent" else f"router:{m.member_id}",
            m.address or "-",
            "-",
            f"MISSING (last seen {m.ago()})",
            "-",
            "-",
            "-",
            "-",
            "-",
        ]
        for m in view.missing
    ]
    rows += [
        [
            m.member_id if m.kind == "agent" else f"router:{m.member_id}",
            m.address or "-",
            "-",
            f"stopped ({m.ago()})",
            "-",
            "-",
            "-",
            "-",
            "-",
        ]
        for m in view.stopped
    ]
    return table(
        [
            "node",
            "address",
            "device",
            "state",
            "hbm used / capacity",
            "nvme used / capacity",
            "pool util",
            "in flight",
            "hashing",
        ],
        rows,
    )


async def _view(etcd, args, tenant: str | None = None) -> ClusterView:
    return await cluster_view(
        etcd,
        _token(args),
        args.node_timeout,
        tenant,
        tls=args.tls,
        seen_window_s=args.seen_window,
    )


def _unreachable_exit(view: ClusterView, args, routers: bool = False) -> int:
    """Name every unreachable or missing agent (and router) on stderr; 4 if any, or
    (`routers`: status, nodes) if a registered router does not answer its health check
    or (status) no router is registered while agents are expected; else 1 if agents
    refused kvctl's credential."""
    command = args.kvctl_command
    for n in view.nodes:
        if not n.reachable and not n.auth_refused:
            print(
                f"kvctl {command}: node {n.node_id} at {n.address} is unreachable: {n.error}",
                file=sys.stderr,
            )
    down = view.unreachable_routers if routers or command == "nodes" else []
    for r in down:
        print(
            f"kvctl {command}: router {r.get('router_id', '?')} at {r.get('address')} is "
            f"unreachable: {r.get('error')}",
            file=sys.stderr,
        )
    for m in view.missing:
        print(
            f"kvctl {command}: {m.describe()}; if it was decommissioned: "
            f"kvctl nodes forget {m.member_id}",
            file=sys.stderr,
        )
    no_router = routers and not view.routers and (view.nodes or view.missing)
    if no_router:
        print(f"kvctl {command}: no router registered in etcd", file=sys.stderr)
    if view.unreachable or down or view.missing or no_router:
        return NODE_DOWN
    return _auth_refused_exit(view, command, getattr(args, "token_source", ""))


def _auth_refused_exit(view: ClusterView, command: str, source: str) -> int:
    """1 when agents answered but refused kvctl's credential (they are up; what they hold
    is unread), naming where the credential came from."""
    if not view.auth_refused:
        return OK
    source = source or "no token"
    hint = (
        f"pass the cluster token with --token-file or ${TOKEN_ENV}"
        if source == "no token"
        else f"is {source} the cluster token (the agents' tenants._cluster)?"
    )
    print(
        f"kvctl {command}: AUTH REFUSED: {', '.join(view.auth_refused)} answered but "
        f"refused the credential ({source}): {hint}",
        file=sys.stderr,
    )
    return FAILED


async def _forget(etcd, args) -> int:
    """`kvctl nodes forget ID`: delete a decommissioned member's seen record."""
    if not args.member:
        raise Usage("nodes forget needs the id of an agent or router")
    mid = args.member
    live = {n.node_id for n in await etcd.list_nodes()}
    _, routers = await etcd.list("routers/")
    live |= {"router:" + kv.key[len("routers/") :] for kv in routers}
    if mid in live or f"router:{mid}" in live:
        print(
            f"kvctl nodes forget: {mid} is live (registered in etcd): stop it first, "
            "or its record is written again",
            file=sys.stderr,
        )
        return FAILED
    gone = await forget_seen(etcd, mid)
    if not gone:
        print(f"kvctl nodes forget: no member {mid!r} was seen", file=sys.stderr)
        return FAILED
    await ControlPlane(etcd).audit("nodes-forget", mid, True, f"deleted {', '.join(gone)}")
    if args.output == "json":
        _json({"forgotten": mid, "deleted": gone})
    else:
        print(f"forgot {mid}: kvctl status no longer expects it")
    return OK


def cmd_status(args) -> int:
    async def body(etcd) -> int:
        view = await _view(etcd, args)
        if args.output == "json":
            d = view.to_dict()
            d.pop("tenants")
            _json(d)
        else:
            e = view.etcd
            up = len(view.nodes) - len(view.unreachable)
            print(f"health:      {view.health}")
            print(
                f"etcd:        {','.join(view.etcd_endpoints)} (v{e['version']}, revision "
                f"{e['revision']}, {format_size(e['db_size_bytes'])})"
            )
            print(f"kill switch: {'ON' if view.killswitch else 'off'}")
            absent = [f"{len(view.missing_agents)} missing"] if view.missing_agents else []
            if view.stopped_agents:
                absent.append(f"{len(view.stopped_agents)} stopped")
            print(
                f"agents:      {up}/{view.expected_agents} reachable"
                + (f" ({', '.join(absent)})" if absent else "")
            )
            print(
                f"routers:     {len(view.routers)}"
                + ("" if view.routers else " (none registered: engines cannot route)")
            )
            print(f"namespaces:  {view.namespaces}")
            print(f"quotas:      {len(view.quotas)} tenants")
            for problem in view.members_down + view.degraded_tiers:
                print(f"  - {problem}")
            for m in view.stopped:  # informational: it left etcd itself
                print(f"  - {m.describe()}")
            if view.nodes or view.routers or view.missing or view.stopped:
                print()
                print(_nodes_table(view))
        return _unreachable_exit(view, args, routers=True)

    return _run(args, body)


def cmd_nodes(args) -> int:
    async def body(etcd) -> int:
        if args.action == "forget":
            return await _forget(etcd, args)
        if args.action is not None or args.member is not None:
            raise Usage("usage: kvctl nodes [forget ID]")
        view = await _view(etcd, args)
        if args.output == "json":
            _json(
                {
                    "nodes": [n.to_dict() for n in view.nodes],
                    "routers": list(view.routers),
                    "missing": [m.to_dict() for m in view.missing],
                    "stopped": [m.to_dict() for m in view.stopped],
                }
            )
        elif view.nodes or view.routers or view.missing or view.stopped:
            print(_nodes_table(view))
        else:
            print("no agents or routers registered in etcd")
        return _unreachable_exit(view, args)

    return _run(args, body)


def cmd_stats(args) -> int:
    async def body(etcd) -> int:
        view = await _view(etcd, args, args.tenant)
        tenants = view.tenants(args.tenant)
        if args.tenant and not tenants and (unknown := await _no_such_tenant(etcd, args.tenant)):
            print(f"kvctl stats: {unknown}", file=sys.stderr)  # a note, as for namespaces
        ev = view.evictions()
        if args.output == "json":
            _json(
                {
                    "tenants": [t.to_dict() for t in tenants],
                    "evictions": ev,
                    "node_counters": view.node_counters(),
                    "agents_summed": sum(n.reachable for n in view.nodes),
                    "agents_expected": view.expected_agents,
                    "missing": [m.to_dict() for m in view.missing_agents],
                    "stopped": [m.to_dict() for m in view.stopped_agents],
                    "nodes": [
                        {
                            "node_id": n.node_id,
                            "reachable": n.reachable,
                            "evictions": n.evictions,
                            "counters": n.counters,
                            "tenants": [t.to_dict() for t in n.tenants],
                        }
                        for n in view.nodes
                    ],
                }
            )
        else:
            print(
                table(
                    [
                        "tenant",
                        "lookups",
                        "hit rate (requests)",
                        "hit rate (tokens)",
                        "hbm used: all nodes (max/node)",
                        "nvme used: all nodes (max/node)",
                        "hbm quota/node",
                        "nvme quota/node",
                    ],
                    [
                        [
                            t.tenant,
                            t.lookups,
                            _pct(t.request_hit_rate),
                            _pct(t.token_hit_rate),
                            f"{format_size(t.hbm_bytes)} ({format_size(t.hbm_node_max_bytes)})",
                            f"{format_size(t.nvme_bytes)} ({format_size(t.nvme_node_max_bytes)})",
                            format_size(t.hbm_limit_bytes) if t.hbm_limit_bytes else "-",
                            format_size(t.nvme_limit_bytes) if t.nvme_limit_bytes else "-",
                        ]
                        for t in tenants
                    ],
                )
                if tenants
                else "no tenant activity"
            )
            if tenants:
                n = max(t.nodes for t in tenants)
                print(
                    f"(used: summed over {n} node{'s' if n != 1 else ''}, the most on one "
                    "node in brackets; quotas are per node)"
                )
            print()
            whose = f" of tenant {args.tenant}" if args.tenant else ""
            print(
                table(
                    ["eviction reason", "blocks", "meaning"],
                    [[k, v, EVICTION_REASONS[k]] for k, v in ev.items()],
                )
                + (f"\n(evictions of {args.tenant}'s blocks only)" if args.tenant else "")
                if ev
                else f"no evictions{whose}"
            )
            if not args.tenant:
                print()
                print(_node_counters_table(view))
        summed = sum(n.reachable for n in view.nodes)
        if summed < view.expected_agents and args.output != "json":
            short = (
                view.unreachable + view.auth_refused + [m.member_id for m in view.missing_agents]
            )
            print(
                f"\nPARTIAL: summed over {summed} of {view.expected_agents} agents "
                f"({', '.join(short)} not counted)"
            )
        return _unreachable_exit(view, args)

    return _run(args, body)


def _node_counters_table(view: ClusterView) -> str:
    """Node-wide counters summed over agents, with the agents that counted any."""
    counters = view.node_counters()
    if not counters:
        return (
            "node counters: none reported (the agents give them to the cluster identity "
            "only: pass the cluster token, --token-file)"
        )
    rows = []
    for k, v in counters.items():
        on = [f"{n.node_id}: {n.counters[k]}" for n in view.nodes if n.counters.get(k)]
        rows.append([k, v, ", ".join(on) or "-", node_counter_meaning(k)])
    return table(["node counter", "total", "agents", "meaning"], rows)


def cmd_audit(args) -> int:
    async def body(etcd) -> int:
        records = await ControlPlane(etcd).audit_log(args.limit)
        if args.output == "json":
            _json([asdict(r) for r in records])
        elif records:
            print(
                table(
                    ["when (UTC)", "who", "action", "target", "ok", "result"],
                    [
                        [
                            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.at)),
                            r.who,
                            r.action,
                            r.target,
                            "yes" if r.ok else "NO",
                            r.result
                            + (
                                f" (reason: {clip(r.params['reason'], 60)[1:-1]})"
                                if r.action == "killswitch" and r.params.get("reason")
                                else ""
                            ),
                        ]
                        for r in records
                    ],
                )
            )
        else:
            print("no admin actions recorded")
        return OK

    return _run(args, body)


# ------------------------------------------------------------------------- parsers
def _common(p: argparse.ArgumentParser, nodes: bool = False) -> None:
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
            "that refuses it is AUTH REFUSED (exit 1); an empty file is refused (exit 2)",
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


def register(sub) -> None:
    """Add the control-plane subcommands to kvctl's subparsers; each sets `func`."""
    _register_actions(sub)
    _register_views(sub)


def _register_actions(sub) -> None:
    p = sub.add_parser(
        "flush",
        help="atomically flush a namespace (bump its generation)",
        description="Raise the generation of every namespace record named "
        "TENANT/NAMESPACE (all specs and revisions under that name; a 32-hex "
        "namespace id selects one) in one etcd transaction, then wait until "
        "every live agent and router acknowledged it. Once it returns 0, no "
        "Lookup, Get or Route anywhere hits the old generation.",
    )
    p.add_argument("target", metavar="TENANT/NAMESPACE")
    p.add_argument(
        "--timeout",
        type=seconds,
        default=30.0,
        metavar="S",
        help="how long to wait for acknowledgements (default 30; exit 5 after)",
    )
    p.add_argument(
        "--unregistered",
        action="store_true",
        help="flush the name even though no namespace of it is registered in etcd: "
        "copies agents opened while etcd was unreachable, registration pending (writes "
        "the name's flush marker, which stays; exit 1 if no agent held one). Without "
        "it such a target is refused and nothing is written",
    )
    _common(p)
    p.set_defaults(func=cmd_flush, kvctl_command="flush")

    p = sub.add_parser(
        "killswitch",
        help="make every lookup miss and refuse writes",
        description="on: every lookup on every node misses and writes are "
        "refused, until off; the state lives in etcd and survives restarts.",
    )
    p.add_argument("state", choices=["on", "off", "status"])
    p.add_argument(
        "--reason",
        default="",
        help="why (required with on): recorded with the switch and in the audit log; at "
        f"most {MAX_REASON_CHARS} characters, refused with off and status",
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        default=30.0,
        metavar="S",
        help="how long on and off wait for acknowledgements (default 30; exit 5 after)",
    )
    _common(p)
    p.set_defaults(func=cmd_killswitch, kvctl_command="killswitch")

    p = sub.add_parser(
        "quota",
        help="per-tenant byte quotas (per node, per tier)",
        description="Quotas are per-node limits of a tenant's bytes in each "
        "tier, applied live by every agent. A tenant over its quota has its "
        "own blocks evicted; writes that cannot fit get RESOURCE_EXHAUSTED.",
    )
    qs = p.add_subparsers(dest="action", required=True)
    for action, helptext in (
        ("set", "set or change limits (0: unlimited)"),
        ("get", "show one tenant's limits"),
        ("clear", "remove a tenant's quota (configured limits apply)"),
        ("list", "every tenant with a quota"),
    ):
        q = qs.add_parser(action, help=helptext)
        if action != "list":
            q.add_argument("tenant", type=tenant_arg)
        if action == "set":
            q.add_argument(
                "--hbm",
                metavar="SIZE",
                help="device pool bytes per node, e.g. 10GiB; 0 removes the limit "
                "(unlimited, whatever the agents' config says)",
            )
            q.add_argument(
                "--nvme",
                metavar="SIZE",
                help="NVMe bytes per node, e.g. 200GiB; 0 removes the limit",
            )
            q.add_argument(
                "--strict",
                action="store_true",
                help="refuse (exit 1) a tenant with no namespace registered in etcd "
                "(default: warn and set it, for a tenant yet to start)",
            )
            q.description = (
                "Set or change a tenant's per-node limits; a tier not given keeps its "
                "value. 0 removes a limit (unlimited); `kvctl quota clear` goes back to "
                "the agents' configured limits. Agents apply it from their etcd watch."
            )
        _common(q)
        q.set_defaults(func=cmd_quota, kvctl_command=f"quota {action}")


_VIEW_DESCRIPTIONS = {
    "status": "Cluster health at a glance: etcd, the kill switch, agents and routers "
    "(each asked directly), namespaces, quotas, and why health is degraded. Exit 4 when "
    "a member is unreachable or missing or no router is registered; 0 with health "
    "degraded when only a tier reports a problem (listed).",
    "stats": "Per tenant: request- and token-weighted hit rates, bytes held against "
    "quotas, evictions by reason; without --tenant also the agents' node-wide counters "
    "(lease fence, kill switch, NVMe). Summed over the agents that answered (PARTIAL "
    "says which did not).",
}


def _register_views(sub) -> None:

    for name, fn, helptext in (
        ("status", cmd_status, "cluster health at a glance"),
        ("nodes", cmd_nodes, "capacity and occupancy per node and tier"),
        (
            "stats",
            cmd_stats,
            "hit rates per tenant (request- and token-weighted), evictions by reason",
        ),
    ):
        p = sub.add_parser(name, help=helptext, description=_VIEW_DESCRIPTIONS.get(name))
        if name == "stats":
            p.add_argument("--tenant", type=tenant_arg, help="only this tenant")
        if name == "nodes":
            p.description = (
                "Every agent and router: address, device, occupancy, state; agents and "
                "routers seen recently but not registered now are listed as MISSING "
                "(exit 4), or as stopped when they stopped cleanly (exit 0). "
                "`kvctl nodes forget ID` deletes the record of a member decommissioned "
                "for good (a live one is refused)."
            )
            p.add_argument("action", nargs="?", choices=["forget"], help="forget ID")
            p.add_argument("member", nargs="?", metavar="ID", help="agent or router id")
        _common(p, nodes=True)
        p.set_defaults(func=fn, kvctl_command=name)

    p = sub.add_parser(
        "namespaces",
        help="namespaces registered in etcd, counted per tenant",
        description="Count the namespace records of each tenant (the agents "
        "refuse a tenant's namespace beyond max_namespaces_per_tenant); with "
        "--tenant, list that tenant's namespaces and their generations.",
    )
    p.add_argument("--tenant", type=tenant_arg, help="list this tenant's namespaces")
    _common(p)
    p.set_defaults(func=cmd_namespaces, kvctl_command="namespaces")

    p = sub.add_parser(
        "audit",
        help="admin actions recorded in etcd (who, what, when, result)",
        description="Every admin action (flush, killswitch, quota, nodes forget) is "
        "recorded in etcd in the transaction that makes it, then rewritten with its "
        "outcome: ok NO with 'acknowledgements unconfirmed' is a change in force whose "
        "acknowledgements kvctl did not see. Oldest first.",
    )
    p.add_argument(
        "--limit", type=count, default=50, help="the newest N records (default 50; 0: all)"
    )
    _common(p)
    p.set_defaults(func=cmd_audit, kvctl_command="audit")
