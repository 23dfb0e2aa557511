"""kvctl quota (per-tenant byte limits per node and tier, applied live by the agents
from their etcd watch) and kvctl audit (the admin actions recorded in etcd)."""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import asdict

from kvstore.cli.control_run import (
    FAILED,
    OK,
    USAGE,
    Usage,
    add_common,
    count,
    print_json,
    run,
    table,
    tenant_arg,
)
from kvstore.coord.admin import ControlPlane
from kvstore.coord.admin_records import Quota
from kvstore.errors import clip, shown
from kvstore.units import format_size, parse_size


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
        if value is not None and _bare_number(value):
            # `--hbm 5` meant 5 bytes: under one block, every block of the tenant evicted
            print(
                f"kvctl quota set: {flag} {clip(value)} has no unit; give one, e.g. "
                f"{clip(value.strip(), bare=True)}GiB or {clip(value.strip(), bare=True)}GB "
                "(0: no limit)",
                file=sys.stderr,
            )
            return USAGE

    async def body(etcd) -> int:
        cp = ControlPlane(etcd)
        unreadable: dict[str, str] = {}
        if args.action == "set":
            quotas = await _quota_set(cp, etcd, args)
            if quotas is None:
                return FAILED
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
            quotas, unreadable = await cp.list_quotas()
            for why in unreadable.values():
                print(f"kvctl quota list: {shown(why)}", file=sys.stderr)
            if unreadable and not quotas and args.output != "json":
                print("no readable quotas")
                return FAILED
        if args.output == "json":
            print_json({t: json.loads(q.to_json()) for t, q in quotas.items()})
            return FAILED if unreadable else OK
        elif quotas:
            print(table(["tenant", "hbm per node", "nvme per node"], _quota_rows(quotas)))
        else:
            print("no quotas set" if args.action == "list" else f"quota of {args.tenant} removed")
        return FAILED if args.action == "list" and unreadable else OK

    return run(args, body)


def _bare_number(value: str) -> bool:
    """A size with no unit other than 0 (which needs none): a number of bytes."""
    return re.fullmatch(r"\s*[0-9]+(\.[0-9]*)?\s*", value) is not None and float(value) != 0


async def _quota_set(cp: ControlPlane, etcd, args) -> dict[str, Quota] | None:
    """`quota set`: the tenant's merged quota, or None when refused (--strict)."""
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
            return None
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
    return quotas


def cmd_audit(args) -> int:
    async def body(etcd) -> int:
        records, unreadable = await ControlPlane(etcd).audit_log(args.limit)
        for why in unreadable:
            print(f"kvctl audit: {shown(why)}", file=sys.stderr)
        if args.output == "json":
            print_json([asdict(r) for r in records])
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
        elif not unreadable:
            print("no admin actions recorded")
        return FAILED if unreadable else OK

    return run(args, body)


# ------------------------------------------------------------------------- parsers
def register_quota(sub) -> None:
    """Add quota (set, get, clear, list) to kvctl's subparsers."""
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
                help="device pool bytes per node, with a unit (10GiB, 10GB; 5B for bytes); "
                "0 removes the limit (unlimited, whatever the agents' config says)",
            )
            q.add_argument(
                "--nvme",
                metavar="SIZE",
                help="NVMe bytes per node, with a unit (200GiB); 0 removes the limit",
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
        add_common(q)
        q.set_defaults(func=cmd_quota, kvctl_command=f"quota {action}")


def register_audit(sub) -> None:
    """Add audit to kvctl's subparsers."""
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
    add_common(p)
    p.set_defaults(func=cmd_audit, kvctl_command="audit")
