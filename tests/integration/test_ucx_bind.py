"""The UCX peer listener answers only on the agent's configured address (issue 18:
"listeners bind only where configured"). ucxx 0.52 binds its listener to every
interface and cannot be told otherwise (node_agent/peer/ucx/bind.py says why), so the
agent refuses each connection that arrived on another interface before the peer
protocol starts: a peer dialling the host's other address gets no answer, one dialling
the configured 127.0.0.1 does, and the refusal is counted."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

import pytest
from support.common import free_port, ucx_dial

from kvstore.client import KVClient
from node_agent.peer.ucx import direct


def other_address() -> str:
    """A non-loopback IPv4 address of this host ('' when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                req = struct.pack("256s", name.encode()[:15])
                ip = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
            except OSError:
                continue  # no IPv4 address on it
            if not ip.startswith("127."):
                return ip
    return ""


def dial(host: str, port: int, linger: float = 0.0) -> dict:
    return ucx_dial(host, str(port), str(linger))


def counter(address: str, name: str) -> int:
    with KVClient(address, use_shm=False) as c:
        return int(dict(c.stats().counters).get(name, 0))


def test_ucx_listener_serves_only_the_configured_interface(spawn_agent):
    there = other_address()
    if not there:
        pytest.skip("this host has no non-loopback IPv4 address to dial")
    port = free_port()
    # UCX on every device, as on an agent told a wildcard or a routable address: the
    # interface check alone stops the other address (with "auto" UCX's own connection
    # setup fails first: the next test).
    agent = spawn_agent(listen="127.0.0.1:0", peer_port=port, peer={"ucx_net_devices": "all"})
    assert f"UCX peer listener on 127.0.0.1:{port}" in agent.log

    # Dialled where the agent was told to listen: the request is answered (a refusal of
    # the unknown namespace, from the peer protocol).
    here = dial("127.0.0.1", port)
    assert "answer" in here, here
    assert counter(agent.address, "peer_ucx_wrong_interface") == 0

    # Dialled on the host's other address: dropped before the protocol starts.
    away = dial(there, port)
    assert "closed" in away, away
    assert counter(agent.address, "peer_ucx_wrong_interface") == 1


def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) pairs process `pid` listens on over TCP (IPv4 and IPv6)."""
    mine = direct._sockets(str(pid))  # its socket inodes
    out = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path(f"/proc/{pid}/net/{table}")
        rows = path.read_text().splitlines()[1:] if path.exists() else []
        for row in rows:
            f = row.split()
            if f[3] == "0A" and f[9] in mine:  # TCP_LISTEN, one of its sockets
                ip_hex, port_hex = f[1].split(":")
                raw = b"".join(  # /proc prints each 32-bit word in host order
                    struct.pack("<I", int(ip_hex[i : i + 8], 16)) for i in range(0, len(ip_hex), 8)
                )
                ip = ipaddress.ip_address(socket.inet_ntop(family, raw))
                if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                    ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 listens on 127.0.0.1
                out.add((str(ip), int(port_hex, 16)))
    return out


def test_ucx_transports_of_a_loopback_agent_listen_on_loopback_only(spawn_agent):
    """UCX's TCP transport listens on a port of every network device it uses, besides
    the peer listener, and takes what arrives there with no handshake: a probe wrote into
    an agent's pool (and crashed one) through such a port on the host's other address,
    without a token (2026-12-07). An agent told to listen on 127.0.0.1 now keeps UCX to
    the loopback device (peer.ucx_net_devices "auto"): it listens nowhere else but on the
    peer listener's wildcard port, which the interface check guards (above). With "all"
    (UCX's default; the positive control) its transport listens on the other address."""
    there = other_address()
    if not there:
        pytest.skip("this host has no non-loopback IPv4 address")
    port = free_port()
    agent = spawn_agent(listen="127.0.0.1:0", peer_port=port)
    assert "UCX transports on lo" in agent.log, agent.log[-2000:]
    socks = listening(agent.proc.pid)
    assert ("0.0.0.0", port) in socks, socks
    grpc_port = int(agent.address.rsplit(":", 1)[1])
    transports = {s for s in socks if s[1] not in (port, grpc_port)}
    assert transports, socks  # UCX's TCP transport listens, on loopback
    assert {ip for ip, _ in socks - {("0.0.0.0", port)}} == {"127.0.0.1"}, socks
    assert dial("127.0.0.1", port).get("answer"), "UCX still serves its peers"
    assert "closed" in dial(there, port)  # and none that dialled the other address

    wide = spawn_agent(listen="127.0.0.1:0", peer={"ucx_net_devices": "all"})
    assert "UCX transports on every network device" in wide.log
    assert there in {ip for ip, _ in listening(wide.proc.pid)}


def test_a_refused_request_ends_its_connection(spawn_agent):
    """A request without a valid token (or for a namespace it may not read) is answered
    with the refusal, and the connection ends there, even when the caller acknowledges
    the answer as a fetcher does before its next request: a stranger keeps no connection,
    nor the memory of its request, on an agent (a refused request used to count as
    served, and the connection then waited idle_endpoint_s for the next one)."""
    port = free_port()
    spawn_agent(
        peer_port=port,
        allow_unauthenticated=False,
        peer={"io_timeout_s": 2, "idle_endpoint_s": 600},
    )
    got = dial("127.0.0.1", port, linger=30)
    assert "authorization" in got["answer"], got
    assert "closed_after_s" in got, got  # before: still open 30 s on (for 600)
