"""Which process a direct read may read (node_agent/peer/ucx/direct.serves_connection):
only the one at the far end of this process's own TCP connection to the peer address.
Two listeners on one port at two addresses of the host: the one this process is not
connected to must not pass (a caller could otherwise name its own listener on an agent's
port and have the reader copy that agent's memory)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvstore.devprocs import free_port
from node_agent.peer.ucx.direct import serves_connection

LISTEN = (
    "import socket, sys\n"
    "s = socket.socket()\n"
    "s.bind((sys.argv[1], int(sys.argv[2])))\n"
    "s.listen()\n"
    "print('ready', flush=True)\n"
    "c, _ = s.accept()\n"
    "print('accepted', flush=True)\n"
    "sys.stdin.read()\n"
)


def _listener(ip: str, port: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", LISTEN, ip, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_only_the_far_end_of_our_own_connection_passes():
    port = free_port()
    try:
        agent = _listener("127.0.0.1", port)  # the process a liar would name
        liar = _listener("127.0.0.2", port)  # what the connection really reached
    except AssertionError:
        pytest.skip("127.0.0.2 is not usable on this host")
    conn = socket.create_connection(("127.0.0.2", port), timeout=10)
    try:
        assert liar.stdout is not None
        # accepted: the connection's far end is in its fds now, not in the accept queue
        assert liar.stdout.readline().strip() == "accepted"
        assert serves_connection(liar.pid, ["127.0.0.2"], port)
        assert not serves_connection(agent.pid, ["127.0.0.2"], port)  # same port, not ours
        assert not serves_connection(agent.pid, ["127.0.0.1"], port)  # not connected to it
    finally:
        conn.close()
        for p in (agent, liar):
            p.kill()
            p.wait(10)
