"""Attacks on the gateway's connections, by callers that need no API key: a client that
sends slowly or stalls (nothing, half a head, half a body, a chunked body that never
ends), more connections than max_connections, a head of any size. Each is cut off at
its limit (router/gateway/server.py, _OneSendProtocol) and the gateway goes on serving.
Real processes: etcd and the router serving the gateway (no engine: every request here
is refused or answered before one is needed)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from support.common import wait_for
from support.gateway import write_word_tokenizer

MODEL = "tiny"
POST = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-acme\r\n"


@pytest.fixture
def tokenizer_dir(tmp_path):
    return str(write_word_tokenizer(tmp_path / "tok"))


def _connect(address: str, timeout: float = 15) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def _until_closed(s: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection (a socket timeout, as
    before the fix, when it never does)."""
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def _get(s: socket.socket, path: str = "/health") -> bytes:
    """One keep-alive GET on `s`, its whole answer (a JSON body, its length declared)."""
    s.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += s.recv(65536)
    return head


def test_slow_or_stalled_clients_are_cut_off_at_their_deadlines(start_gateway, tokenizer_dir):
    """Before the fix every one of these stayed open (480 s in the operator's probe): now a
    connection that sends nothing is closed after header_timeout_s, one whose head or body
    is late gets 408 and is closed, and a keep-alive connection's next head has
    header_timeout_s from its first byte, however slowly it trickles in."""
    gw = start_gateway({MODEL: tokenizer_dir}, {"header_timeout_s": 1, "body_timeout_s": 1.5})
    cases = [
        (b"", b""),  # nothing: closed without a word
        (POST + b"content-type: application/json\r\n", b"HTTP/1.1 408 "),  # half a head
        (POST + b"content-length: 1000\r\n\r\n" + b'{"model"', b"HTTP/1.1 408 "),
        (POST + b'transfer-encoding: chunked\r\n\r\n8\r\n{"model"\r\n', b"HTTP/1.1 408 "),
    ]
    for sent, answer in cases:
        with _connect(gw.address) as s:  # closed by the gateway, not the client's timeout
            s.sendall(sent)
            got = _until_closed(s)
        assert got.startswith(answer) and (answer or not got), (sent[-40:], got[:200])
        if answer:
            error = json.loads(got.partition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == 408 and error["type"] == "timeout_error", error
    with _connect(gw.address) as s:  # keep-alive: served, idle, then a head trickling in
        assert _get(s).startswith(b"HTTP/1.1 200 ")
        time.sleep(1.5)  # idle longer than header_timeout_s: that is keep-alive's to close
        with pytest.raises(OSError):  # cut off mid-trickle: a reset, or a broken pipe
            for byte in b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 100:
                s.sendall(bytes([byte]))
                time.sleep(0.1)
            pytest.fail(f"a trickling head was let through ({_until_closed(s)[:80]!r})")
    assert httpx.get(gw.url + "/health", timeout=10).status_code == 200


def test_connections_beyond_max_connections_get_503(start_gateway, tokenizer_dir):
    """Before the fix there was no cap on connections."""
    gw = start_gateway({MODEL: tokenizer_dir}, {"max_connections": 3})
    held = [_connect(gw.address) for _ in range(3)]
    try:
        for s in held:  # served, then kept open (keep-alive)
            assert _get(s).startswith(b"HTTP/1.1 200 ")
        with _connect(gw.address) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert _until_closed(extra).startswith(b"HTTP/1.1 503 ")
        held.pop().close()
        wait_for(
            lambda: httpx.get(gw.url + "/health", timeout=10).status_code == 200,
            10,
            0.1,
            what="a connection served once one closed",
        )
    finally:
        for s in held:
            s.close()


def test_oversize_request_headers_are_431_before_they_are_buffered(start_gateway, tokenizer_dir):
    """Before the fix a 100 MB header was read whole and answered 200 (the router's memory
    peaked at 272 MB). Now a head over max_header_bytes is 431, whether it comes in one
    read or streams in (refused as it arrives: the router's peak memory does not grow by
    the 64 MiB sent), and the gateway goes on serving."""
    gw = start_gateway({MODEL: tokenizer_dir}, {"max_header_bytes": "16KiB"})
    ok = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 15000 + b"\r\n\r\n"
    with _connect(gw.address) as s:
        assert _get(s, "/health").startswith(b"HTTP/1.1 200 ")  # the control
        s.sendall(ok)
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
    with _connect(gw.address) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000 + b"\r\n\r\n")
        got = _until_closed(s)
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]
    assert json.loads(got.partition(b"\r\n\r\n")[2])["error"]["code"] == 431

    def peak_kib() -> int:
        status = open(f"/proc/{gw.proc.pid}/status").read()
        return int(status.split("VmHWM:")[1].split()[0])

    before = peak_kib()
    answer = b""
    with _connect(gw.address) as s:
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
            for _ in range(1024):
                s.sendall(b"a" * (64 << 10))
            s.sendall(b"\r\n\r\n")
            answer = _until_closed(s)
        except OSError:  # refused mid-way: a reset, or a broken pipe
            pass
    assert not answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert peak_kib() - before < 16 << 10, (before, peak_kib())
    assert httpx.get(gw.url + "/health", timeout=10).status_code == 200
