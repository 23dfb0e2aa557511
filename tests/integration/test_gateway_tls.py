"""The gateway over HTTPS (issue 18, "mTLS on every hop ... the gateway"): it serves the
router's own tls: files, optionally requires client certificates (API keys still name
the tenant), picks up rewritten files without a restart, and talks to engines over
HTTPS with the CA and its pair. Real router process, real etcd, stand-in workers; the
refusals of plaintext and foreign clients are in test_attack_gateway.py."""

from __future__ import annotations

import re
import socket

import httpx
import pytest
import trustme
from support.common import wait_for
from support.gateway import https_standin, register_engine, stop_proc, write_word_tokenizer
from support.tls import write_pair

from kvstore.coord.engines import EngineRecord

MODEL = "tiny"
ACME = {"authorization": "Bearer key-acme"}


@pytest.fixture
def tokenizer_dir(tmp_path):
    return str(write_word_tokenizer(tmp_path / "tok"))


def tls_router(pki) -> dict:
    """A router config whose gRPC and gateway use pki.server (etcd stays plaintext)."""
    return {"tls": {**pki.section()["tls"], "etcd": False}}


# The stand-ins serve plain HTTP on loopback: a gateway serving HTTPS leaves them out
# unless told otherwise (test_plaintext_engines_are_left_out_when_the_gateway_serves_tls).
PLAIN_OK = {"allow_plaintext_engines": True}


def _chat(text: str = "w5 w6 w7") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}]}


def _post(gw, verify: str, cert=None, headers=ACME) -> httpx.Response:
    with httpx.Client(verify=_ctx(verify, cert)) as c:
        return c.post(gw.url + "/v1/chat/completions", json=_chat(), headers=headers)


def _ctx(ca: str, cert=None):
    import ssl

    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def test_https_from_the_routers_files(start_gateway, start_standin, tokenizer_dir, pki):
    gw = start_gateway({MODEL: tokenizer_dir}, PLAIN_OK, router=tls_router(pki))
    gw.http = {"verify": _ctx(pki.server.ca_file)}
    w = start_standin("w0", MODEL)
    wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the engine in the gateway")
    assert gw.url.startswith("https://")
    r = _post(gw, pki.server.ca_file)  # no client certificate: not required by default
    assert r.status_code == 200, r.text
    assert r.headers["x-kvstore-engine"] == "w0"
    assert len(w.seen()) == 1
    assert _post(gw, pki.server.ca_file, headers={}).status_code == 401  # keys still count


def test_client_certificates_required_with_the_switch(
    start_gateway, start_standin, tokenizer_dir, pki
):
    gw = start_gateway(
        {MODEL: tokenizer_dir}, {"require_client_cert": True, **PLAIN_OK}, router=tls_router(pki)
    )
    client = (pki.client.cert_file, pki.client.key_file)
    gw.http = {"verify": _ctx(pki.server.ca_file, client)}
    start_standin("w0", MODEL)
    wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the engine in the gateway")
    assert _post(gw, pki.server.ca_file, client).status_code == 200
    # The certificate authenticates the connection; the API key still names the tenant.
    assert _post(gw, pki.server.ca_file, client, headers={}).status_code == 401


def test_rewritten_files_apply_to_new_connections(
    start_gateway, start_standin, tokenizer_dir, pki, tmp_path
):
    gw = start_gateway(
        {MODEL: tokenizer_dir}, {"require_client_cert": True, **PLAIN_OK}, router=tls_router(pki)
    )
    old_client = (pki.client.cert_file, pki.client.key_file)
    gw.http = {"verify": _ctx(pki.server.ca_file, old_client)}
    start_standin("w0", MODEL)
    wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the engine in the gateway")
    old_ca = str(tmp_path / "old-ca.crt")
    pki.ca.cert_pem.write_to_path(old_ca)
    assert _post(gw, old_ca, old_client).status_code == 200
    # Rotate to a new CA: the server's pair and ca.crt rewritten where the router reads them.
    new = trustme.CA()
    write_pair(new, tmp_path / "pki" / "cluster", "server", "127.0.0.1", "localhost")
    new_client = write_pair(new, tmp_path / "new-client", "client", "kvstore-client")
    pair = (new_client.cert_file, new_client.key_file)
    wait_for(lambda: _ok(gw, new_client.ca_file, pair), 20, 0.2, what="the new certificate served")
    with pytest.raises(httpx.HTTPError):  # the old CA no longer names the server
        _post(gw, old_ca, old_client)
    with pytest.raises(httpx.HTTPError):  # nor does a client pair of the old CA pass
        _post(gw, new_client.ca_file, old_client)


def _ok(gw, ca: str, cert) -> bool:
    try:
        return _post(gw, ca, cert).status_code == 200
    except httpx.HTTPError:
        return False


def test_engines_over_https_with_the_ca_and_the_pair(
    start_gateway, etcd, tokenizer_dir, pki, tmp_path
):
    gw = start_gateway({MODEL: tokenizer_dir}, router=tls_router(pki))
    gw.http = {"verify": _ctx(pki.server.ca_file)}
    s = pki.server
    proc, url = https_standin(tmp_path / "ws", "ws", s.cert_file, s.key_file, s.ca_file)
    try:
        register_engine(etcd.endpoint, EngineRecord("ws", url, (MODEL,), "node-ws"))
        wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the https engine in the gateway")
        r = _post(gw, pki.server.ca_file)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvstore-engine"] == "ws"
        # The engine requires client certificates: only the gateway's pair got through.
        client = (pki.client.cert_file, pki.client.key_file)
        with httpx.Client(verify=_ctx(s.ca_file, client)) as c:
            seen = c.get(url + "/seen").json()
        assert [x["model"] for x in seen] == [MODEL]
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/seen", verify=_ctx(s.ca_file))
    finally:
        stop_proc(proc)


def test_plaintext_engines_are_left_out_when_the_gateway_serves_tls(
    start_gateway, start_standin, etcd, tokenizer_dir, pki, tmp_path
):
    """A gateway serving HTTPS used to forward prompts to http:// engine records in
    plaintext; now it forwards only to https:// ones unless allow_plaintext_engines."""
    gw = start_gateway({MODEL: tokenizer_dir}, router=tls_router(pki))
    gw.http = {"verify": _ctx(pki.server.ca_file)}
    plain = start_standin("w0", MODEL)  # registers http://127.0.0.1:PORT
    # The counter's line is there from the start (at 0): wait for the refusal itself.
    refused = re.compile(
        r'^kvstore_gateway_engines_refused_total\{reason="plaintext"\} (\S+)$', re.M
    )
    wait_for(
        lambda: (m := refused.search(gw.metrics())) is not None and float(m.group(1)) >= 1,
        30,
        0.1,
        what="the http:// engine refused",
    )
    assert gw.engines() == 0
    assert _post(gw, pki.server.ca_file).status_code == 503  # no engine serves the model
    s = pki.server
    proc, url = https_standin(tmp_path / "ws", "ws", s.cert_file, s.key_file, s.ca_file)
    try:
        register_engine(etcd.endpoint, EngineRecord("ws", url, (MODEL,), "node-ws"))
        wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the https engine in the gateway")
        for _ in range(4):
            r = _post(gw, pki.server.ca_file)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvstore-engine"] == "ws"
    finally:
        stop_proc(proc)
    assert plain.seen() == []  # no prompt reached the plaintext engine
    assert gw.log.count("engine w0 left out: its URL http://") == 1  # logged once


def test_a_tls_handshake_that_does_not_finish_is_closed_at_header_timeout_s(
    start_gateway, start_standin, tokenizer_dir, pki
):
    """Connections that open and send nothing, or a part of a ClientHello, used to be held
    for asyncio's default 60 s (uvicorn passes no handshake timeout), each with ~315 KiB
    of the router's memory and a file descriptor, before the connection limits count
    them: a probe held 6,000 (2026-12-07). The handshake now has header_timeout_s (1 s
    here); a client that completes it is served as before."""
    gw = start_gateway(
        {MODEL: tokenizer_dir}, {"header_timeout_s": 1, **PLAIN_OK}, router=tls_router(pki)
    )
    gw.http = {"verify": _ctx(pki.server.ca_file)}
    start_standin("w0", MODEL)
    wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the engine in the gateway")
    host, port = gw.address.rsplit(":", 1)
    # The first bytes of a TLS 1.2 ClientHello record (type, version, length), cut short.
    for sent in (b"", bytes.fromhex("160301020001000200fc03")):
        s = socket.create_connection((host, int(port)), timeout=20)
        try:
            s.sendall(sent)
            try:
                assert s.recv(1) == b"", sent  # closed by the gateway
            except ConnectionResetError:
                pass
        finally:
            s.close()
    assert _post(gw, pki.server.ca_file).status_code == 200
