"""Byte sizes for people: parse "10GiB" / "512MB" / "4096", format back."""

from __future__ import annotations

import ipaddress
import re
from decimal import Decimal

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_ACCEPTED = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes from 4096, "512MiB", "1.5 GB"...: exact (decimal arithmetic), whole bytes."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"size must be a string like '10GiB', got {value!r}")
    match = _RE.match(value)
    if match is None:
        raise ValueError(f"invalid size {value!r}: expected a number and a unit ({_ACCEPTED})")
    number, unit = match.groups()
    multiplier = _UNITS.get(unit.lower() or "b")
    if multiplier is None:
        raise ValueError(f"invalid size unit {unit!r} in {value!r}: accepted units are {_ACCEPTED}")
    exact = Decimal(number) * multiplier
    if exact != exact.to_integral_value():
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return int(exact)


def format_size(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?\.?")  # FQDN dot


def host_problem(host: str) -> str:
    """Why `host` (of split_port) is not a host name, IPv4 address or [bracketed] IPv6
    address ("" when it is one): a bare "2001:db8::5:2379" splits as host "2001:db8::5"
    (is that port 2379, or is "2001:db8::5:2379" an address with no port?), and
    "grpc://x:1" or "a b:2379" are no hosts at all."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host[:80]!r} is not an IPv6 address"
        return ""
    if ":" in host:
        return f"{host[:80]!r} is not a host name (an IPv6 address goes in brackets: [addr]:port)"
    if not _HOSTNAME.fullmatch(host):
        return f"{host[:80]!r} is not a host name or IPv4 address"
    return ""


def split_port(address: str) -> tuple[str, int] | None:
    """(host, port) of "host:port" (the port in ASCII digits, the host non-empty); None
    for anything else. Ranges are the callers': agents and routers may listen on port 0."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()):
        return None
    return host, int(port)
