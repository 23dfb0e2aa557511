"""Attacks on the gateway's connections, by callers that need no API key: a client that
sends slowly or stalls (nothing, half a head, half a body, a chunked body that never
ends), more connections than max_connections (or max_connections_per_client), a head of
any size. Each is cut off at its limit (router/gateway/server.py, _OneSendProtocol) and
the gateway goes on serving. Real processes: etcd and the router serving the gateway,
and, where requests must be in flight, a stand-in engine that holds them
(standin_delay_s)."""

from __future__ import annotations

import contextlib

import json
import socket
import ssl
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


def _connect(address: str, timeout: float = 15, rcvbuf: int = 0) -> socket.socket:
    """A client connection; `rcvbuf`: its receive buffer, set small before connecting
    (so that a stream fills it soon)."""
    host, port = address.rsplit(":", 1)
    if not rcvbuf:
        return socket.create_connection((host, int(port)), timeout=timeout)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect((host, int(port)))
    return s


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


def _open(s: socket.socket) -> bool:
    """`s` is not closed by the gateway: nothing to read yet, and no end of stream (asked
    without waiting: a socket with a timeout would wait for something to read first)."""
    timeout = s.gettimeout()
    s.setblocking(False)
    try:
        s.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        s.settimeout(timeout)
    return False


def _metric(gw, line: str) -> float:
    """The value of the gateway's metric `line` (name and labels), 0 when absent."""
    for got in gw.metrics().splitlines():
        if got.startswith(line + " "):
            return float(got.rsplit(" ", 1)[1])
    return 0.0


def _held_request(body: dict) -> bytes:
    """A whole POST /v1/completions of key-acme with `body`."""
    data = json.dumps(body).encode()
    head = POST + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data)
    return head + data


def _503(got: bytes) -> dict:
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), got[:200]
    assert b"retry-after: 1\r\n" in head.lower() + b"\r\n", head
    error = json.loads(body)["error"]
    assert error["code"] == 503, error
    return error


SHED = 'kvstore_gateway_connections_shed_total{limit="%s",reason="%s"}'
REFUSED = 'kvstore_gateway_connections_refused_total{reason="%s"}'
OTHER = "127.0.0.2"  # another client address (the gateway listens on 127.0.0.1)


def test_at_max_connections_a_new_client_takes_the_longest_waiting_connections_place(
    start_gateway, tokenizer_dir
):
    """Before the fix, with max_connections connections open, every new client's request
    was 503, whatever those held: a stranger keeping that many silent or idle connections
    open (opening new ones as the header deadline cut them) kept every client out. Now
    the newcomer is served and the connection waiting longest with no request being
    served is closed: an idle keep-alive one or a silent one without a word, one whose
    head or body is still arriving with a 503. One per newcomer, the others untouched."""
    gw = start_gateway({MODEL: tokenizer_dir}, {"max_connections": 4})
    idle = _connect(gw.address)
    assert _get(idle).startswith(b"HTTP/1.1 200 ")  # then idle (keep-alive)
    silent = _connect(gw.address)
    half_head = _connect(gw.address)
    half_head.sendall(POST)
    half_body = _connect(gw.address)
    half_body.sendall(POST + b"content-length: 1000\r\n\r\n" + b'{"model"')
    waiting = [idle, silent, half_head, half_body]  # longest waiting first
    served: list[socket.socket] = []  # the newcomers, kept open (idle from their answers)
    try:
        for i, answer in enumerate((b"", b"", b"HTTP/1.1 503 ", b"HTTP/1.1 503 ")):
            served.append(_connect(gw.address))
            assert _get(served[-1]).startswith(b"HTTP/1.1 200 "), i
            got = _until_closed(waiting[i])
            assert got.startswith(answer) and (answer or not got), (i, got[:200])
            if answer:
                assert "connection limit" in _503(got)["message"]
            assert all(_open(s) for s in waiting[i + 1 :] + served), i
        assert _metric(gw, SHED % ("max_connections", "idle")) == 2
        assert _metric(gw, SHED % ("max_connections", "incomplete_request")) == 2
        assert _metric(gw, REFUSED % "max_connections") == 0
    finally:
        for s in waiting + served:
            s.close()


def test_at_max_connections_all_serving_a_new_request_is_503_and_none_is_shed(
    start_gateway, start_standin, tokenizer_dir
):
    """Connections whose requests are in flight (with the engine) are never closed to
    make room: with max_connections of them, a new connection's request is refused, 503
    with Retry-After in the gateway's JSON error shape (before the fix: uvicorn's plain
    text, no Retry-After, and not counted), and is served once one of them is gone."""
    gw = start_gateway({MODEL: tokenizer_dir}, {"max_connections": 4})
    start_standin("w0", MODEL)
    wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the engine in the gateway")
    held = [_connect(gw.address) for _ in range(4)]
    try:
        hold = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 1, "standin_delay_s": 300}
        for s in held:
            s.sendall(_held_request(hold))
        wait_for(
            lambda: _metric(gw, "kvstore_gateway_inflight") == 4,
            30,
            0.05,
            what="four requests in flight",
        )
        with _connect(gw.address) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            error = _503(_until_closed(extra))
        assert "4 connections open, each with a request in flight" in error["message"]
        assert all(_open(s) for s in held)
        assert _metric(gw, REFUSED % "max_connections") == 1
        held.pop().close()  # its request is dropped; its place is free
        wait_for(
            lambda: httpx.get(gw.url + "/health", timeout=10).status_code == 200,
            10,
            0.1,
            what="a connection served once one closed",
        )
        assert all(_open(s) for s in held)
    finally:
        for s in held:
            s.close()


def test_tls_handshakes_count_against_max_connections(start_gateway, tokenizer_dir, pki):
    """Before the fix a TLS connection was counted only once its handshake was done: a
    stranger opening connections that send nothing, or a part of a ClientHello, faster
    than header_timeout_s closed them held as many as it liked, each ~315 KiB of the
    router's memory and a file descriptor. Now a handshake is a waiting connection from
    the moment it opens: over max_connections the one waiting longest is closed without
    a word, and a client that completes its handshake is served in the oldest's place."""
    tls = {"tls": {**pki.section()["tls"], "etcd": False}}
    # (a handshake deadline longer than the test: only the limit closes anything here)
    limits = {"max_connections": 4, "header_timeout_s": 60}
    gw = start_gateway({MODEL: tokenizer_dir}, limits, router=tls)
    ctx = ssl.create_default_context(cafile=pki.server.ca_file)
    strangers = [_connect(gw.address) for _ in range(6)]  # no handshake done
    # The first bytes of a TLS 1.2 ClientHello record (type, version, length), cut short.
    strangers[-1].sendall(bytes.fromhex("160301020001000200fc03"))
    try:
        for i in (0, 1):  # closed to make room for the 5th and the 6th
            assert _until_closed(strangers[i]) == b"", i
        assert all(_open(s) for s in strangers[2:])
        assert _metric(gw, SHED % ("max_connections", "tls_handshake")) == 2
        with httpx.Client(verify=ctx) as client:
            assert client.get(gw.url + "/health", timeout=10).status_code == 200
        assert _until_closed(strangers[2]) == b""
        assert all(_open(s) for s in strangers[3:])
        assert _metric(gw, SHED % ("max_connections", "tls_handshake")) == 3
        assert _metric(gw, SHED % ("max_connections", "idle")) == 0
    finally:
        for s in strangers:
            s.close()
    assert "Traceback" not in gw.log, gw.log[-2000:]


def test_the_routers_memory_goes_back_down_after_a_burst_of_connections(
    start_gateway, tokenizer_dir, pki
):
    """Before the fix the router's resident memory stayed at its peak after a burst:
    3,000 TLS connections sending part of a ClientHello, then closed, left it ~180 MiB
    up for good (glibc kept the freed memory for reuse). Now the process gives what the
    allocator holds free back to the kernel (kvstore/heap.py, looked at every 10 s):
    resident memory falls back most of the way."""
    tls = {"tls": {**pki.section()["tls"], "etcd": False}}
    gw = start_gateway({MODEL: tokenizer_dir}, {"header_timeout_s": 60}, router=tls)
    pid = gw.proc.pid

    def resident_kib() -> int:
        status = open(f"/proc/{pid}/status").read()
        return int(status.split("VmRSS:")[1].split()[0])

    before = resident_kib()
    burst = []
    try:
        for _ in range(2000):
            burst.append(_connect(gw.address))
            burst[-1].sendall(bytes.fromhex("160301020001000200fc03"))
        wait_for(lambda: _metric(gw, SHED % ("max_connections", "tls_handshake")) == 976, 30)
        peak = resident_kib()
    finally:
        for s in burst:
            s.close()
    assert peak - before > 64 << 10, (before, peak)  # the burst's memory: 100s of MiB
    wait_for(
        lambda: resident_kib() - before < (peak - before) / 2,
        45,
        0.5,
        what=f"the router's memory back down (before {before} KiB, peak {peak} KiB)",
    )
    assert "freed memory back to the system" in gw.log


def test_max_connections_per_client_sheds_that_clients_own_or_refuses_it_alone(
    start_gateway, start_standin, tokenizer_dir
):
    """max_connections_per_client (before the fix no such cap: one address could hold
    every place): over it, a client's new connection takes the place of that client's own
    longest waiting one; with all of its connections serving, its new request is 503,
    while another address is served."""
    gw = start_gateway({MODEL: tokenizer_dir}, {"max_connections_per_client": 2})
    start_standin("w0", MODEL)
    host, port = gw.address.rsplit(":", 1)
    with httpx.Client(transport=httpx.HTTPTransport(local_address=OTHER)) as elsewhere:
        wait_for(  # from another address: none of 127.0.0.1's connections
            lambda: elsewhere.get(gw.url + "/health", timeout=5).json()["engines"] == 1,
            30,
            0.1,
            what="the engine in the gateway",
        )
    first, second = _connect(gw.address), _connect(gw.address)  # silent, from 127.0.0.1
    held = [first, second]
    try:
        assert httpx.get(gw.url + "/health", timeout=10).status_code == 200
        assert _until_closed(first) == b"" and _open(second)
        assert _metric(gw, SHED % ("max_connections_per_client", "idle")) == 1
        # Two requests in flight from 127.0.0.1: its third connection is refused.
        hold = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 1, "standin_delay_s": 300}
        second.sendall(_held_request(hold))
        wait_for(lambda: _metric(gw, "kvstore_gateway_inflight") == 1, 30, 0.05, what="one")
        held.append(_connect(gw.address))
        held[-1].sendall(_held_request(hold))
        wait_for(lambda: _metric(gw, "kvstore_gateway_inflight") == 2, 30, 0.05, what="two")
        with _connect(gw.address) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            error = _503(_until_closed(extra))
        assert "this client has 2 connections open" in error["message"], error
        assert _open(second) and _open(held[-1])
        assert _metric(gw, REFUSED % "max_connections_per_client") == 1
        other = socket.create_connection((host, int(port)), 15, source_address=(OTHER, 0))
        with other:
            assert _get(other).startswith(b"HTTP/1.1 200 ")
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


STALLED = "kvstore_gateway_clients_stalled_total"


def _streamed_request(chunks: int) -> bytes:
    """A whole streamed POST /v1/completions of key-acme, `chunks` SSE events long."""
    return _held_request(
        {
            "model": MODEL,
            "prompt": "w1 w2",
            "max_tokens": 1,
            "stream": True,
            "standin_chunks": chunks,
        }
    )


def _dechunk(answer: bytes) -> bytes:
    """The body of an HTTP/1.1 answer sent with chunked transfer coding."""
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if not n:
            return body
        body, rest = body + rest[:n], rest[n + 2 :]


def test_an_unread_answer_on_a_closing_connection_is_cut_off_too(
    start_gateway, start_standin, tokenizer_dir
):
    """A whole answer (not streamed) goes into the connection's buffers at once, and the
    request is done with; when the connection is then closed by the gateway (uvicorn's
    keep-alive timeout, or shed to make room, as here) before send_timeout_s has passed,
    the transport waited to drain for ever: a probe piled up 90 MiB of such answers per
    16 connections, outside every cap (2026-12-07). Now a closing connection whose client
    took none of its answer for send_timeout_s is cut off like an open one."""
    gw = start_gateway({MODEL: tokenizer_dir}, {"send_timeout_s": 3, "max_connections": 2})
    start_standin("w0", MODEL)
    wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the engine in the gateway")
    body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 1, "standin_chunks": 1_000_000}
    unread = _connect(gw.address, 30, rcvbuf=4096)  # ~8 MB of answer: more than buffers
    others: list[socket.socket] = []
    try:
        unread.sendall(_held_request(body))
        assert unread.recv(12).startswith(b"HTTP/1.1 200"), "the answer began"
        others = [_connect(gw.address) for _ in range(2)]  # the unread one is shed
        wait_for(lambda: _metric(gw, STALLED) == 1, 60, 0.1, what="the unread answer cut off")
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := unread.recv(1 << 16):
                received += chunk
        assert len(received) < 4 << 20, len(received)  # not the whole answer
    finally:
        for s in [unread, *others]:
            s.close()


def test_a_client_that_reads_none_of_its_stream_is_cut_off_and_its_request_released(
    start_gateway, start_standin, tokenizer_dir
):
    """Before the fix a client that asked for a stream and read none of it kept its
    request in flight, with its engine's and its tenant's slots, for as long as it kept
    the connection open (the gateway waited for it to make room, with no deadline). Now,
    once the gateway has had more to send for send_timeout_s and the client took none of
    it, the connection is closed, counted, and the request released: the tenant's next
    request is served although max_inflight_per_tenant is 1. A client that reads the
    same stream slowly, but never stops for send_timeout_s, gets all of it."""
    gw = start_gateway({MODEL: tokenizer_dir}, {"send_timeout_s": 2, "max_inflight_per_tenant": 1})
    start_standin("w0", MODEL)
    wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the engine in the gateway")
    chunks = 40_000  # ~3 MB of events: more than the buffers between engine and client
    with _connect(gw.address, 30, rcvbuf=4096) as slow:  # the control: reads, with pauses
        slow.sendall(_streamed_request(chunks))
        got = b""
        while not got.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked body
            chunk = slow.recv(1 << 16)
            assert chunk, got[-300:]  # closed before the end
            got += chunk
            time.sleep(0.02)
        events = _dechunk(got).split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""], events[-3:]
        assert len(events) == chunks + 2, len(events)
    assert _metric(gw, STALLED) == 0
    stalled = _connect(gw.address, 30, rcvbuf=4096)
    try:
        stalled.sendall(_streamed_request(chunks))
        wait_for(lambda: _metric(gw, STALLED) == 1, 60, 0.1, what="the stalled client cut off")
        wait_for(
            lambda: _metric(gw, "kvstore_gateway_inflight") == 0,
            30,
            0.05,
            what="its request released",
        )
        received = b""
        try:  # what the buffers held (a reset may discard it), and no more
            while chunk := stalled.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            pass
        assert b"data: [DONE]" not in received, received[-200:]
    finally:
        stalled.close()
    answer = httpx.post(
        gw.url + "/v1/completions",
        json={"model": MODEL, "prompt": "w1 w2", "max_tokens": 1},
        headers={"authorization": "Bearer key-acme"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
