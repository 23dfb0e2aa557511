"""kvctl's committing commands: flush and killswitch. Each writes its change and its
audit record in one etcd transaction, then waits for every live member's
acknowledgement (exit 5 when one is missing, etcd went away or Ctrl-C came after the
commit: kvstore/cli/control_run.py)."""

from __future__ import annotations

import sys
from dataclasses import asdict

from kvstore import errors
from kvstore.cli.control_run import (
    FAILED,
    MAX_TENANT_CHARS,
    NOT_ACKED,
    OK,
    USAGE,
    Usage,
    add_common,
    committed_hook,
    print_json,
    progress_printer,
    run,
    seconds,
    table,
    unconfirmed,
)
from kvstore.coord.admin import ControlPlane
from kvstore.coord.admin_records import ROUTER_MEMBER, FlushReport, SwitchReport
from kvstore.errors import clip, shown

MAX_REASON_CHARS = 1024  # the kill switch's reason: etcd and every audit listing hold it


def cmd_flush(args) -> int:
    args.commits = True  # Ctrl-C before its commit: "nothing changed" (control_run)
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
        try:
            rep = await cp.flush(
                tenant,
                name,
                args.timeout,
                progress_printer("flush"),
                committed_hook(args, _flush_committed),
            )
        except errors.Unavailable as exc:
            return unconfirmed(args, "flush", exc)
        _show_flush(rep, args)
        return _flush_exit(rep, args)

    return run(args, body)


def _flush_committed(flushed, revision: int) -> None:
    gens = (
        ", ".join(f"{f.ns_hex[:12]} {f.old_generation}->{f.new_generation}" for f in flushed)
        or "no namespace record in etcd: the name only, for unregistered copies"
    )
    print(
        f"flush: committed at etcd revision {revision} ({gens}); waiting for acknowledgements",
        file=sys.stderr,
        flush=True,
    )


def _show_flush(rep: FlushReport, args) -> None:
    p = rep.progress
    for m in p.left:
        print(
            f"flush: {m} left (its lease expired or was revoked) without acknowledging: "
            + (
                "it routes by load only until it re-announced itself and re-read the generations"
                if m.startswith(ROUTER_MEMBER)
                else "it fences itself and re-reads generations before serving again"
            ),
            file=sys.stderr,
            flush=True,
        )
    if args.output == "json":
        print_json(
            {
                "ok": rep.ok,
                "tenant": rep.tenant,
                "name": rep.name,
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
        return
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
        print(f"flushed on agents before their etcd registration: {p.unregistered} namespaces")
    print(f"time taken: {rep.elapsed_s:.2f}s")


def _flush_exit(rep: FlushReport, args) -> int:
    if rep.ok:
        return OK
    print(
        f"kvctl flush: generation committed at etcd revision {rep.revision}, but "
        f"{', '.join(rep.progress.missing)} did not acknowledge within {args.timeout:g}s; "
        "they cannot serve the old generation once they catch up. Check them with "
        "`kvctl nodes`.",
        file=sys.stderr,
    )
    return NOT_ACKED


def cmd_killswitch(args) -> int:
    args.commits = args.state != "status"  # see cmd_flush

    async def body(etcd) -> int:
        cp = ControlPlane(etcd)
        if args.state == "status":
            return await _killswitch_status(cp, args)
        _check_reason(args)
        try:
            rep = await cp.set_killswitch(
                args.state == "on",
                args.reason,
                args.timeout,
                progress_printer(f"kill switch {args.state}"),
                committed_hook(
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
            return unconfirmed(args, "killswitch", exc)
        _show_switch(rep, args)
        return _switch_exit(rep, args)

    return run(args, body)


async def _killswitch_status(cp: ControlPlane, args) -> int:
    if args.reason:
        raise Usage("--reason goes with `killswitch on` only, not status")
    on, info = await cp.killswitch()
    if args.output == "json":
        print_json({"enabled": on, **({"info": info} if info else {})})
    else:
        extra = f" (reason: {info.get('reason') or '-'}, by {info.get('by', '?')})" if on else ""
        print(f"kill switch: {'ON' if on else 'off'}{shown(extra)}")
    return OK


def _check_reason(args) -> None:
    """--reason: required with on, refused with off, at most MAX_REASON_CHARS."""
    on = args.state == "on"
    if args.reason and not on:
        raise Usage(f"--reason goes with `killswitch on` only, not {args.state}")
    if len(args.reason) > MAX_REASON_CHARS:
        raise Usage(
            f"--reason is {len(args.reason)} characters; at most {MAX_REASON_CHARS} "
            "(it is stored with the switch and in the audit log)"
        )
    if not args.reason.isprintable():
        raise Usage(
            f"--reason {clip(args.reason)} has control characters (newline, tab, escape "
            "sequences): give it on one line of plain text"
        )
    if on and not args.reason.strip():
        raise Usage(
            'killswitch on needs --reason "…" (recorded with the switch and in the '
            "audit log: who reads it next needs to know why)"
        )


def _show_switch(rep: SwitchReport, args) -> None:
    p, on = rep.progress, rep.enabled
    if rep.was_on is not None:
        w = rep.was_on
        print(
            f"kill switch on: it was ON already (reason: {w.get('reason') or '-'}, by "
            f"{w.get('by', '?')}); its reason is now yours",
            file=sys.stderr,
        )
    if args.output == "json":
        print_json(
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
        return
    print(
        "kill switch ON: every lookup misses, writes are refused"
        if on
        else "kill switch off: caching resumes"
        if rep.changed
        else "kill switch already off: nothing changed"
    )
    print(f"nodes acknowledged: {len(p.acked)}/{len(p.members)}; time taken: {rep.elapsed_s:.2f}s")


def _switch_exit(rep: SwitchReport, args) -> int:
    missing = ", ".join(rep.progress.missing)
    if rep.ok:
        return OK
    if not rep.changed:
        print(
            f"kvctl killswitch: the kill switch is off in etcd, but the last "
            f"acknowledgement of {missing} still says on, and none came "
            f"within {args.timeout:g}s. Check them with `kvctl nodes`.",
            file=sys.stderr,
        )
        return NOT_ACKED
    print(
        f"kvctl killswitch: set in etcd, but {missing} did not "
        f"acknowledge within {args.timeout:g}s",
        file=sys.stderr,
    )
    return NOT_ACKED


# ------------------------------------------------------------------------- parsers
def register(sub) -> None:
    """Add flush and killswitch to kvctl's subparsers."""
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
    add_common(p)
    p.set_defaults(func=cmd_flush, kvctl_command="flush")
    _register_killswitch(sub)


def _register_killswitch(sub) -> None:
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
    add_common(p)
    p.set_defaults(func=cmd_killswitch, kvctl_command="killswitch")
