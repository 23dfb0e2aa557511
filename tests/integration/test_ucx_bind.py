"""The UCX peer listener answers only on the agent's configured address (issue 18:
"listeners bind only where configured"). ucxx 0.52 binds its listener to every
interface and cannot be told otherwise (node_agent/peer/ucx/bind.py says why), so the
agent refuses each connection that arrived on another interface before the peer
protocol starts: a peer dialling the host's other address gets no answer, one dialling
the configured 127.0.0.1 does, and the refusal is counted."""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import subprocess

import pytest
from support.common import PY, ROOT, free_port

from kvstore.client import KVClient

DIAL = ROOT / "tests" / "support" / "ucx_dial.py"


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
    r = subprocess.run(
        [PY, str(DIAL), host, str(port), str(linger)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines, (r.returncode, r.stdout, r.stderr[-3000:])
    return json.loads(lines[-1])


def counter(address: str, name: str) -> int:
    with KVClient(address, use_shm=False) as c:
        return int(dict(c.stats().counters).get(name, 0))


def test_ucx_listener_serves_only_the_configured_interface(spawn_agent):
    there = other_address()
    if not there:
        pytest.skip("this host has no non-loopback IPv4 address to dial")
    port = free_port()
    agent = spawn_agent(listen="127.0.0.1:0", peer_port=port)
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
