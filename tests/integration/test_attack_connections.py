"""Connections that never finish a handshake, against real agent and router processes
(docs/security.md, "Connections that send nothing"). Anyone who reaches a gRPC port can
open TCP connections to it, no token needed. Before, each was held 30-60 s, without a
cap: 20,000 from one stranger took every file descriptor of an agent (gRPC stopped
accepting, RocksDB could not open its files, every client's call timed out). Now at most
max_connections are open at once, one over it closed as it arrives, and each has
handshake_timeout_s to finish its handshake; a client connected before keeps working."""

from __future__ import annotations

import os
import socket

import httpx
from support.common import wait_for

from kvstore.client import KVClient
from kvstore.devprocs import free_port
from kvstore.telemetry import METRICS_MAX_CONNECTIONS, METRICS_TIMEOUT_S

CAP = 32
SLACK = 8  # descriptors the server may open meanwhile for itself


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("Threads:")[1].split()[0])


def _silent(address: str, n: int) -> list[socket.socket]:
    """`n` connections to `address` that send nothing (each accepted by the kernel,
    whatever the server then does with it)."""
    host, port = address.rsplit(":", 1)
    return [socket.create_connection((host, int(port)), timeout=10) for _ in range(n)]


def _closed(s: socket.socket) -> bool:
    """The server closed `s` (end of stream, or a reset), asked without waiting; what it
    sent first (an HTTP/2 server sends its SETTINGS at once) is read past."""
    s.setblocking(False)
    try:
        while s.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.settimeout(10)


def test_an_agent_holds_at_most_max_connections_silent_ones(spawn_agent):
    """The cap (a handshake time longer than the test, so that only the cap closes them):
    those over it are closed as they arrive; a client connected before is served."""
    agent = spawn_agent(max_connections=CAP, handshake_timeout_s=60)
    assert agent.proc is not None
    pid = agent.proc.pid
    with KVClient(agent.address) as client:
        client.stats()  # connected before the flood
        base = _fds(pid)
        silent = _silent(agent.address, 4 * CAP)
        try:
            # before the fix: all 128 held (30-60 s each)
            wait_for(lambda: _fds(pid) - base <= CAP + SLACK, 10, 0.1, what="the cap held")
            wait_for(
                lambda: sum(_closed(s) for s in silent) >= 3 * CAP - SLACK,
                10,
                0.1,
                what="those over the cap closed",
            )
            assert client.stats().node_id == agent.config["node_id"]  # the old connection
        finally:
            for s in silent:
                s.close()
    assert "Traceback" not in agent.log


def test_a_router_closes_silent_connections_at_handshake_timeout_s(start_router):
    """The handshake time, with no cap: each connection that sends nothing is closed
    after handshake_timeout_s (2 s here; before the fix, 30-60 s), and a client is served
    after."""
    router = start_router(config={"max_connections": 0, "handshake_timeout_s": 2})
    assert router.proc is not None
    pid = router.proc.pid
    base = _fds(pid)
    silent = _silent(router.address, 4 * CAP)
    try:
        wait_for(lambda: all(_closed(s) for s in silent), 15, 0.2, what="all closed")
        wait_for(lambda: _fds(pid) <= base + SLACK, 15, 0.2, what="their descriptors")
    finally:
        for s in silent:
            s.close()
    assert router.nodes() == {}  # still served
    assert "Traceback" not in router.log


def test_the_metrics_port_holds_at_most_its_cap_and_a_scrape_still_gets_in(spawn_agent):
    """The metrics port (a thread per connection) held a silent connection for ever: 500
    took an agent from 16 to 517 threads, all still there a minute later. Now it holds
    METRICS_MAX_CONNECTIONS: one over takes the place of the one waiting longest for its
    request, so a scrape gets in, and each is closed after METRICS_TIMEOUT_S of silence."""
    port = free_port()
    agent = spawn_agent(metrics_port=port)
    assert agent.proc is not None
    pid = agent.proc.pid
    base = _threads(pid)
    cap = METRICS_MAX_CONNECTIONS
    silent = _silent(f"127.0.0.1:{port}", 2 * cap)
    try:
        # (a wait, not one look: a closed connection's thread takes a moment to end;
        # before the fix the 128 threads stayed)
        wait_for(lambda: _threads(pid) - base <= cap + SLACK, 10, 0.1, what="the cap held")
        wait_for(lambda: all(_closed(s) for s in silent[:cap]), 10, 0.1, what="the oldest shed")
        scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert scrape.status_code == 200 and "kvstore_" in scrape.text
        wait_for(lambda: _closed(silent[cap]), 10, 0.1, what="the scrape's place")
        wait_for(
            lambda: all(_closed(s) for s in silent),
            METRICS_TIMEOUT_S + 10,
            0.2,
            what="the rest closed after METRICS_TIMEOUT_S",
        )
    finally:
        for s in silent:
            s.close()
    assert "Traceback" not in agent.log
