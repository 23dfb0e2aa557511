"""TLSConfig (file, env, flags, validation), kvstore/tls.py's file handling and reload
decisions, the dev CA of kvctl cluster up --tls, and the UCX handshake's proofs
(node_agent/peer/ucx/auth.py) with real keys and certificates."""

from __future__ import annotations

import json
import os

import pytest
import trustme

from kvstore.config import AgentConfig, RouterConfig, TLSConfig, load_config, tls_fields
from kvstore.tls import ReloadingServerCredentials, TLSFilesError, files_in, read_files
from kvstore.tls_ca import make_dev_pki
from node_agent.peer.ucx.auth import NONCE_BYTES, UcxAuth, UcxAuthError


def pair(ca: trustme.CA, directory, name: str = "server") -> TLSConfig:
    directory.mkdir(parents=True, exist_ok=True)
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(directory / f"{name}.key"))
    cert.cert_chain_pems[0].write_to_path(str(directory / f"{name}.crt"))
    ca.cert_pem.write_to_path(str(directory / "ca.crt"))
    return TLSConfig(
        str(directory / "ca.crt"), str(directory / f"{name}.crt"), str(directory / f"{name}.key")
    )


def test_all_three_files_or_none():
    assert not TLSConfig().enabled
    with pytest.raises(ValueError, match="cert_file, key_file must be set with ca_file"):
        TLSConfig(ca_file="ca.crt")
    with pytest.raises(ValueError, match="etcd_ca_file need ca_file"):
        TLSConfig(etcd_ca_file="etcd-ca.crt")
    t = TLSConfig("ca", "c", "k", etcd_ca_file="eca")
    assert t.for_etcd() == TLSConfig("eca", "c", "k")
    assert not TLSConfig("ca", "c", "k", etcd=False).for_etcd().enabled


def test_tls_section_from_file_env_and_flags(tmp_path, monkeypatch):
    path = tmp_path / "agent.json"
    path.write_text(json.dumps({"tls": {"ca_file": "/f/ca", "cert_file": "/f/c"}}))
    monkeypatch.setenv("KVSTORE_TLS_KEY_FILE", "/env/k")
    flags = tls_fields(None, "/flag/c", None)
    cfg = load_config(AgentConfig, str(path), "KVSTORE_AGENT_", {"tls": flags})
    assert cfg.tls == TLSConfig("/f/ca", "/flag/c", "/env/k")
    assert load_config(RouterConfig, str(path), "KVSTORE_ROUTER_").tls.key_file == "/env/k"
    monkeypatch.setenv("KVSTORE_TLS_CA", "/typo")
    with pytest.raises(ValueError, match="unknown tls settings in the environment: KVSTORE_TLS_CA"):
        load_config(AgentConfig, None, "KVSTORE_AGENT_")
    monkeypatch.delenv("KVSTORE_TLS_CA")
    path.write_text(json.dumps({"tls": {"ca": "/f/ca"}}))
    with pytest.raises(ValueError, match="unknown tls fields: ca"):
        load_config(AgentConfig, str(path))
    assert tls_fields(None, None, None) is None


def test_unreadable_or_non_pem_files_are_named(tmp_path):
    t = pair(trustme.CA(), tmp_path)
    assert read_files(t).ca.startswith(b"-----BEGIN")
    missing = TLSConfig(str(tmp_path / "nope.crt"), t.cert_file, t.key_file)
    with pytest.raises(TLSFilesError, match=r"CA file \(tls.ca_file\) .*nope.crt"):
        read_files(missing)
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(TLSFilesError, match=r"private key \(tls.key_file\) .*holds no PEM"):
        read_files(TLSConfig(t.ca_file, t.cert_file, str(tmp_path / "junk.key")))


def test_a_key_that_is_not_the_certificates_is_named_before_any_handshake(tmp_path):
    """gRPC takes such a pair and fails every handshake ('Invalid private key'), which
    kvctl reported as an unreachable etcd."""
    ca = trustme.CA()
    t, other = pair(ca, tmp_path / "a"), pair(ca, tmp_path / "b")
    mixed = TLSConfig(t.ca_file, t.cert_file, other.key_file)
    with pytest.raises(TLSFilesError, match="is not the key of the certificate") as ei:
        read_files(mixed)
    assert other.key_file in str(ei.value) and t.cert_file in str(ei.value)
    (tmp_path / "bad.crt").write_text(
        "-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n"
    )
    with pytest.raises(TLSFilesError, match="does not parse"):
        read_files(TLSConfig(t.ca_file, str(tmp_path / "bad.crt"), t.key_file))
    assert read_files(t).key.startswith(b"-----BEGIN")  # a pair: read as before
    # Mid-rotation (the certificate replaced, the key not yet): the server keeps its pair.
    creds = ReloadingServerCredentials(t)
    pair(ca, tmp_path / "c")
    os.replace(tmp_path / "c" / "server.crt", t.cert_file)
    assert creds.fetch() is None and creds.reloads == 0


def test_server_credentials_reload_only_when_a_file_changed(tmp_path):
    t = pair(trustme.CA(), tmp_path)
    creds = ReloadingServerCredentials(t)
    assert creds.fetch() is None and creds.reloads == 0  # unchanged: keep the current
    old = creds.files.cert
    pair(trustme.CA(), tmp_path)  # a rotation rewrites all three
    assert creds.fetch() is not None and creds.reloads == 1
    assert creds.files.cert != old
    assert creds.fetch() is None
    os.unlink(t.key_file)  # mid-rotation: keep serving the current pair
    assert creds.fetch() is None and creds.reloads == 1


def test_dev_pki_files_and_modes(tmp_path):
    pki = make_dev_pki(str(tmp_path / "tls"))
    assert pki.client == files_in(str(tmp_path / "tls"))
    for t in (pki.server, pki.client):
        read_files(t)
        assert os.stat(t.key_file).st_mode & 0o077 == 0  # keys are private
    # The server pair also authenticates as a client (agents dial peers and etcd).
    UcxAuth(pki.server).check(
        b"r",
        b"n" * 32,
        b"f" * 32,
        "a:1",
        UcxAuth(pki.server).prove(b"r", b"n" * 32, b"f" * 32, "a:1"),
    )


def test_ucx_proofs_bind_the_nonces_and_the_address_and_need_the_ca(tmp_path):
    ca = trustme.CA()
    listener = UcxAuth(pair(ca, tmp_path / "l"))
    fetcher = UcxAuth(pair(ca, tmp_path / "f"))
    stranger = UcxAuth(pair(trustme.CA(), tmp_path / "s"))
    ns, nf = listener.nonce(), fetcher.nonce()
    assert len(ns) == NONCE_BYTES and ns != listener.nonce()
    proof = fetcher.prove(b"fetcher", ns, nf, "10.0.0.2:7000")
    listener.check(b"fetcher", ns, nf, "10.0.0.2:7000", proof)  # accepted
    for role, n_s, addr, msg in (
        (b"fetcher", listener.nonce(), "10.0.0.2:7000", "signature does not verify"),
        (b"fetcher", ns, "10.0.0.9:7000", "signature does not verify"),  # relayed
        (b"listener", ns, "10.0.0.2:7000", "signature does not verify"),
    ):
        with pytest.raises(UcxAuthError, match=msg):
            listener.check(role, n_s, nf, addr, proof)
    with pytest.raises(UcxAuthError, match="not issued by this cluster's CA"):
        listener.check(b"fetcher", ns, nf, "a:1", stranger.prove(b"fetcher", ns, nf, "a:1"))
    with pytest.raises(UcxAuthError, match="malformed proof"):
        listener.check(b"fetcher", ns, nf, "a:1", b"\xff\xff\xff\x7fjunk")
    with pytest.raises(UcxAuthError, match="no certificate"):
        listener.check(b"fetcher", ns, nf, "a:1", b"")
