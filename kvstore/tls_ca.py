"""A throwaway certificate authority for development clusters (`kvctl cluster up --tls`):
a CA, one server pair every process of the cluster presents (etcd, agents, routers; valid
for 127.0.0.1 and localhost, and for client authentication, since agents and routers are
clients of each other and of etcd) and a client pair for kvctl, tests and benchmarks.

Not for production: the CA key stays next to the certificates. Production certificates
come from the operator's PKI or cert-manager (deploy/helm/kvstore, `tls.*`)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvstore.config import TLSConfig

VALID_DAYS = 30


@dataclass(frozen=True, slots=True)
class DevPki:
    """Where make_dev_pki wrote the files."""

    directory: str
    server: TLSConfig  # what the cluster's processes present (and trust)
    client: TLSConfig  # what kvctl, tests and benchmarks present (ca.crt, client.*)


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvstore dev cluster"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def _write(path: str, data: bytes, private: bool) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # a reader (a reloading server) never sees half a file


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def issue(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    cn: str,
    server: bool,
    days: int = VALID_DAYS,
) -> tuple[bytes, bytes]:
    """A leaf certificate and its key (PEM) signed by the CA; `server`: also valid as a
    TLS server for 127.0.0.1 and localhost."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def make_dev_pki(directory: str, days: int = VALID_DAYS) -> DevPki:
    """Write ca.crt (+ ca.key), server.crt/.key and client.crt/.key into `directory`."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kvstore dev CA"))
        .issuer_name(_name("kvstore dev CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    path = lambda name: os.path.join(directory, name)  # noqa: E731
    _write(path("ca.crt"), ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(path("ca.key"), _key_pem(ca_key), private=True)
    for cn, server in (("server", True), ("client", False)):
        cert, key = issue(ca_cert, ca_key, f"kvstore {cn}", server, days)
        _write(path(f"{cn}.crt"), cert, private=False)
        _write(path(f"{cn}.key"), key, private=True)
    return DevPki(
        directory,
        TLSConfig(path("ca.crt"), path("server.crt"), path("server.key")),
        TLSConfig(path("ca.crt"), path("client.crt"), path("client.key")),
    )
