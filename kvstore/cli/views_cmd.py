"""kvctl's views of the cluster: status (health at a glance), nodes (every agent and
router, and `nodes forget`), stats (hit rates, bytes against quotas, evictions, node
counters) and namespaces. They read etcd and ask each agent and router directly
(kvstore/cli/views.py gathers it); exit 4 names an unreachable or missing member."""

from __future__ import annotations

import difflib
import sys
from dataclasses import asdict

from kvstore.cli.control_run import (
    FAILED,
    NODE_DOWN,
    OK,
    TOKEN_ENV,
    Usage,
    add_common,
    cluster_token,
    pct,
    print_json,
    run,
    table,
    tenant_arg,
)
from kvstore.cli.views import EVICTION_REASONS, ClusterView, cluster_view, node_counter_meaning
from kvstore.coord.admin import ControlPlane
from kvstore.coord.seen import forget as forget_seen
from kvstore.errors import clip, shown
from kvstore.units import format_size


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
            print_json(
                {
                    "tenants": counts,
                    **({"namespaces": [asdict(r) for r in records]} if args.tenant else {}),
                }
            )
        elif args.tenant:
            if records:  # none: stderr said so, with the tenants it may mean
                print(
                    table(
                        ["namespace id", "name", "model", "generation"],
                        [[r.ns_hex, r.name, r.model_name, r.generation] for r in records],
                    )
                )
                print()
            print(
                f"{shown(args.tenant)}: {len(records)} namespaces (limit: the agents' "
                "max_namespaces_per_tenant, default 1024)"
            )
        else:
            print(
                table(["tenant", "namespaces"], sorted(counts.items()))
                if counts
                else "no namespaces in etcd"
            )
        return OK

    return run(args, body)


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
        _member_row(
            f"router:{r.get('router_id', '?')}",
            r.get("address"),
            "UNREACHABLE" if r.get("reachable") is False else "up",
        )
        for r in view.routers
    ]
    rows += [
        _member_row(_member_name(m), m.address, f"MISSING (last seen {m.ago()})")
        for m in view.missing
    ]
    rows += [_member_row(_member_name(m), m.address, f"stopped ({m.ago()})") for m in view.stopped]
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


def _member_name(m) -> str:
    return m.member_id if m.kind == "agent" else f"router:{m.member_id}"


def _member_row(name: str, address: str | None, state: str) -> list:
    """A row of the nodes table for a member with no tiers to show (a router, one
    missing or stopped)."""
    return [name, address or "-", "-", state, "-", "-", "-", "-", "-"]


async def _view(etcd, args, tenant: str | None = None) -> ClusterView:
    return await cluster_view(
        etcd,
        cluster_token(args),
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
        print_json({"forgotten": mid, "deleted": gone})
    else:
        print(f"forgot {mid}: kvctl status no longer expects it")
    return OK


def cmd_status(args) -> int:
    async def body(etcd) -> int:
        view = await _view(etcd, args)
        if args.output == "json":
            d = view.to_dict()
            d.pop("tenants")
            print_json(d)
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
            bad = view.quotas_unreadable
            print(
                f"quotas:      {len(view.quotas)} tenants"
                + (f", {len(bad)} unreadable records (kvctl quota list names them)" if bad else "")
            )
            for problem in view.members_down + view.degraded_tiers:
                print(f"  - {problem}")
            for m in view.stopped:  # informational: it left etcd itself
                print(f"  - {m.describe()}")
            if view.nodes or view.routers or view.missing or view.stopped:
                print()
                print(_nodes_table(view))
        return _unreachable_exit(view, args, routers=True)

    return run(args, body)


def cmd_nodes(args) -> int:
    async def body(etcd) -> int:
        if args.action == "forget":
            return await _forget(etcd, args)
        if args.action is not None or args.member is not None:
            raise Usage("usage: kvctl nodes [forget ID]")
        view = await _view(etcd, args)
        if args.output == "json":
            print_json(
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

    return run(args, body)


def cmd_stats(args) -> int:
    async def body(etcd) -> int:
        view = await _view(etcd, args, args.tenant)
        tenants = view.tenants(args.tenant)
        if args.tenant and not tenants and (unknown := await _no_such_tenant(etcd, args.tenant)):
            print(f"kvctl stats: {unknown}", file=sys.stderr)  # a note, as for namespaces
        if args.output == "json":
            print_json(_stats_json(view, tenants))
        else:
            _print_stats(view, tenants, args.tenant)
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

    return run(args, body)


def _stats_json(view: ClusterView, tenants) -> dict:
    return {
        "tenants": [t.to_dict() for t in tenants],
        "evictions": view.evictions(),
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


def _print_stats(view: ClusterView, tenants, tenant: str | None) -> None:
    print(_tenants_table(tenants) if tenants else "no tenant activity")
    if tenants:
        n = max(t.nodes for t in tenants)
        print(
            f"(used: summed over {n} node{'s' if n != 1 else ''}, the most on one "
            "node in brackets; quotas are per node)"
        )
    print()
    ev = view.evictions()
    whose = f" of tenant {tenant}" if tenant else ""
    print(
        table(
            ["eviction reason", "blocks", "meaning"],
            [[k, v, EVICTION_REASONS[k]] for k, v in ev.items()],
        )
        + (f"\n(evictions of {tenant}'s blocks only)" if tenant else "")
        if ev
        else f"no evictions{whose}"
    )
    if not tenant:
        print()
        print(_node_counters_table(view))


def _tenants_table(tenants) -> str:
    return table(
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
                pct(t.request_hit_rate),
                pct(t.token_hit_rate),
                f"{format_size(t.hbm_bytes)} ({format_size(t.hbm_node_max_bytes)})",
                f"{format_size(t.nvme_bytes)} ({format_size(t.nvme_node_max_bytes)})",
                format_size(t.hbm_limit_bytes) if t.hbm_limit_bytes else "-",
                format_size(t.nvme_limit_bytes) if t.nvme_limit_bytes else "-",
            ]
            for t in tenants
        ],
    )


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


# ------------------------------------------------------------------------- parsers
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


def register(sub) -> None:
    """Add status, nodes, stats and namespaces to kvctl's subparsers."""
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
        add_common(p, nodes=True)
        p.set_defaults(func=fn, kvctl_command=name)

    p = sub.add_parser(
        "namespaces",
        help="namespaces registered in etcd, counted per tenant",
        description="Count the namespace records of each tenant (the agents "
        "refuse a tenant's namespace beyond max_namespaces_per_tenant); with "
        "--tenant, list that tenant's namespaces and their generations.",
    )
    p.add_argument("--tenant", type=tenant_arg, help="list this tenant's namespaces")
    add_common(p)
    p.set_defaults(func=cmd_namespaces, kvctl_command="namespaces")
