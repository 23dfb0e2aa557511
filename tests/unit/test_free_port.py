"""free_port (kvstore.devprocs): ports for servers the tests, benchmarks and `kvctl cluster
up` start, from below the kernel's ephemeral range (where every outgoing connection takes
its own port) and, under pytest-xdist, from a slice of their own per worker."""

from __future__ import annotations

import socket

import pytest

from kvstore import devprocs


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_free_ports_lie_below_the_ephemeral_range():
    if _ephemeral_low() < devprocs.FREE_PORTS.stop:  # e.g. 1024-65535: no range is apart
        pytest.skip(f"this host's ephemeral ports start at {_ephemeral_low()}")
    assert devprocs.FREE_PORTS.stop <= _ephemeral_low()


@pytest.mark.parametrize("count", [2, 3, 8])
def test_each_worker_has_a_slice_of_its_own(monkeypatch, count):
    shares = []
    for i in range(count):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{i}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
        shares.append(set(devprocs._share_of_free_ports()))
    assert all(len(s) >= len(devprocs.FREE_PORTS) // count for s in shares)
    assert len(set().union(*shares)) == sum(map(len, shares))  # no port in two slices
    assert set().union(*shares) <= set(devprocs.FREE_PORTS)


def test_outside_xdist_the_whole_range(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert devprocs._share_of_free_ports() == devprocs.FREE_PORTS


def test_ports_come_in_turn_and_a_held_one_is_skipped(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    ports = devprocs._FreePorts()
    first = ports.take()
    share = devprocs._share_of_free_ports()
    assert first in share
    following = share[(share.index(first) + 1) % len(share)]
    with socket.socket() as held:  # a server already on the next one
        held.bind(("127.0.0.1", following))
        held.listen()
        second = ports.take()
    assert second not in (first, following) and second in share
    many = [ports.take() for _ in range(200)]
    assert len(set(many)) == len(many) and first not in many


def test_free_port_can_be_bound():
    port = devprocs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
