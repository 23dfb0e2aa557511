"""The etcd endpoints: parsing them, and the gRPC target and options of one channel."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence

from kvstore.units import host_problem, split_port

log = logging.getLogger("kvstore.etcd")

# Reconnect quickly after an etcd restart; grpc's default backoff grows to two minutes.
_CHANNEL_OPTIONS = [
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 3_000),
    ("grpc.keepalive_permit_without_calls", True),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """'host:port[,host:port]' (an http:// scheme is accepted and dropped)."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for item in items:
        item = item.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme) :]
        item = item.rstrip("/")
        if item:
            parts = split_port(item)
            if parts is None:
                raise ValueError(f"etcd endpoint {item!r} is not host:port")
            host, port = parts
            if not 0 < port < 65536:
                raise ValueError(f"etcd endpoint {item!r}: the port must be in 1..65535")
            if problem := host_problem(host):
                raise ValueError(f"etcd endpoint {item!r}: {problem}")
            out.append(f"127.0.0.1:{port}" if host == "localhost" else item)
    if not out:
        raise ValueError("no etcd endpoints given")
    return out


def _ip_family(host: str) -> int | None:
    """4 or 6 for an IP address literal ([bracketed] for IPv6), None for a name."""
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).version
    except ValueError:
        return None


def channel_target(endpoints: list[str]) -> str:
    """The gRPC target of one channel over `endpoints` (parse_endpoints). IP addresses of
    one family: all of them (gRPC spreads calls and fails over among them). One name:
    `dns:///name:port`, which gRPC resolves, and re-resolves when connections fail, to
    every address it has (a name for every member, e.g. a headless Service, fails over
    the same way). Several names, or IPv4 beside IPv6, cannot share one channel: the
    first endpoint only, with a warning saying what to give instead."""
    families = {_ip_family(e.rsplit(":", 1)[0]) for e in endpoints}
    if families == {4}:
        return "ipv4:" + ",".join(endpoints)
    if families == {6}:
        return "ipv6:" + ",".join(endpoints)
    if len(endpoints) > 1:
        log.warning(
            "etcd endpoints %s: one connection balances over IP addresses of one family or "
            "over the addresses of one name, not over several names; using %s only. For "
            "failover give IP addresses, or one name that resolves to every member (e.g. "
            "etcd's headless Service)",
            ",".join(endpoints),
            endpoints[0],
        )
    first = endpoints[0]
    return first if _ip_family(first.rsplit(":", 1)[0]) else f"dns:///{first}"
