"""Certificates for the mTLS tests, from trustme: a cluster CA with the pair every
process presents (valid for 127.0.0.1 and localhost) and a client pair, and a second,
unrelated CA whose client pair every port must refuse."""

from __future__ import annotations

import ssl
import socket
from dataclasses import dataclass
from pathlib import Path

import trustme

from kvstore.config import TLSConfig


@dataclass(frozen=True, slots=True)
class Pki:
    directory: Path
    ca: trustme.CA
    server: TLSConfig  # agents, routers, etcd
    client: TLSConfig  # kvctl, clients
    stranger: TLSConfig  # a client pair of another CA (trusting the cluster's CA)
    stranger_own_ca: str  # that other CA's certificate

    def section(self, tls: TLSConfig | None = None) -> dict:
        """An AgentConfig/RouterConfig `tls` section."""
        t = tls or self.server
        return {"tls": {"ca_file": t.ca_file, "cert_file": t.cert_file, "key_file": t.key_file}}


def write_pair(ca: trustme.CA, directory: Path, name: str, *identities: str) -> TLSConfig:
    """A certificate of `ca` for `identities` in directory/name.crt and .key, and
    ca.crt next to them (written in place: the rotation test rewrites them)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert = ca.issue_cert(*identities)
    cert.private_key_pem.write_to_path(str(directory / f"{name}.key"))
    cert.cert_chain_pems[0].write_to_path(str(directory / f"{name}.crt"))
    ca.cert_pem.write_to_path(str(directory / "ca.crt"))
    return TLSConfig(
        str(directory / "ca.crt"), str(directory / f"{name}.crt"), str(directory / f"{name}.key")
    )


def make_pki(directory: Path) -> Pki:
    ca, other = trustme.CA(), trustme.CA()
    server = write_pair(ca, directory / "cluster", "server", "127.0.0.1", "localhost")
    client = write_pair(ca, directory / "cluster", "client", "kvstore-client")
    # Valid for 127.0.0.1 too: an agent may present it (a server of the wrong cluster).
    stranger = write_pair(other, directory / "stranger", "client", "127.0.0.1", "localhost")
    own = str(directory / "stranger" / "own-ca.crt")
    other.cert_pem.write_to_path(own)
    # The stranger trusts the cluster's CA: only its own certificate is wrong.
    ca.cert_pem.write_to_path(stranger.ca_file)
    return Pki(directory, ca, server, client, stranger, own)


def handshake_error(address: str, tls: TLSConfig | None, ca_file: str) -> str:
    """Open one TLS connection to `address` presenting `tls`'s pair (None: none) and send
    a byte; '' when the server accepted it, else what went wrong. TLS 1.3 servers refuse
    a missing or unknown client certificate after the client's handshake completes, so
    the refusal shows on the first read."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=ca_file)
    ctx.set_alpn_protocols(["h2"])
    if tls is not None:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname=host) as s:
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                s.settimeout(5)
                data = s.recv(1)
                return "" if data else "closed by the server"
    except (ssl.SSLError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
