"""The etcd the tests start (tests/support/common.EtcdProc): its ports come from
free_port(), which another process can take before etcd binds it."""

from __future__ import annotations

import socket

import pytest

from support.common import EtcdProc


def _listening(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past etcd's TIME_WAITs
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_first_start_whose_port_was_taken_moves_to_fresh_ports(tmp_path):
    with _listening() as taken:
        port = taken.getsockname()[1]
        e = EtcdProc(tmp_path / "etcd-data")
        e.client_port = port
        e.start()
        try:
            assert e.client_port != port
            assert e._healthy()
            assert "address already in use" in e.log.read_text()
        finally:
            e.stop()


def test_a_restart_keeps_its_ports_and_says_why_it_could_not_start(tmp_path):
    e = EtcdProc(tmp_path / "etcd-data")
    e.start()
    endpoint = e.endpoint
    e.stop()
    with _listening(e.client_port):  # someone took the client port during the outage
        with pytest.raises(RuntimeError, match="address already in use"):
            e.start()
        assert e.endpoint == endpoint
    e.stop()
    e.start()  # the port is free again: the same data, the same endpoint
    try:
        assert e.endpoint == endpoint and e._healthy()
    finally:
        e.stop()
