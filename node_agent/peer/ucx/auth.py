"""Authenticating a UCX peer connection with the agents' mTLS certificates.

UCX has no TLS. With `tls` configured, each new UCX connection starts with a mutual
challenge-response before any FetchRequest (1.5 round trips, once per connection; the
fetcher keeps connections for its next requests):

1. listener -> fetcher: a fresh 32-byte nonce Ns.
2. fetcher -> listener: its own nonce Nf, its certificate, and its signature (the key of
   its TLS pair) over ("fetcher", Ns, Nf, the UCX address it dialled).
3. listener -> fetcher: its certificate and signature over ("listener", Ns, Nf, address).

Each side checks that the other's certificate was issued by the CA of tls.ca_file, is
within its validity and allows client authentication, then the signature. A proof is
bound to the listener's nonce (no replay) and to the address the fetcher meant to reach
(a hostile listener cannot relay an agent's proof to another agent: the address differs).

What this does not do: the payload and the control messages after the handshake are NOT
encrypted and not integrity-protected by the handshake (every block is still verified
against its checksum before it is stored). The bearer token in a FetchRequest travels in
clear over UCX; run UCX on a trusted network (a cluster's own fabric), or turn it off
(ucx_enabled: false) to keep everything on gRPC over mTLS. See docs/tls.md.
"""

from __future__ import annotations

import datetime
import os
import struct
import threading
import time

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from kvstore.config import TLSConfig
from kvstore.tls import files_stamp, read_files
from node_agent.peer.errors import PeerTransportError, within
from node_agent.peer.ucx.wire import control_buffer, post_control, recv_control

CONTEXT = b"kvstore-ucx-auth-v1"
NONCE_BYTES = 32
MAX_CERT_BYTES = 64 << 10


class UcxAuthError(PeerTransportError):
    """The other side of a UCX connection did not prove it holds a cluster certificate."""


def _sign(key, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PSS(padding.MGF1(hashes.SHA256()), 32), hashes.SHA256())
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    raise UcxAuthError(f"unsupported private key type {type(key).__name__}")


def _verify(public, signature: bytes, data: bytes) -> None:
    if isinstance(public, ec.EllipticCurvePublicKey):
        public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    elif isinstance(public, rsa.RSAPublicKey):
        public.verify(
            signature, data, padding.PSS(padding.MGF1(hashes.SHA256()), 32), hashes.SHA256()
        )
    elif isinstance(public, ed25519.Ed25519PublicKey):
        public.verify(signature, data)
    else:
        raise UcxAuthError(f"unsupported certificate key type {type(public).__name__}")


def _transcript(role: bytes, ns: bytes, nf: bytes, address: str) -> bytes:
    return b"|".join((CONTEXT, role, ns, nf, address.encode()))


class UcxAuth:
    """This agent's certificate and key, and the CA it trusts, re-read when the files
    change (the same rotation as the gRPC port: kvstore/tls.py)."""

    def __init__(self, tls: TLSConfig) -> None:
        self._tls = tls
        self._lock = threading.Lock()
        self._stamp: tuple = ()
        self._load()

    def _load(self) -> None:
        with self._lock:
            stamp = files_stamp(self._tls)
            if stamp == self._stamp:
                return
            files = read_files(self._tls)
            self._cas = x509.load_pem_x509_certificates(files.ca)
            self._cert_pem = x509.load_pem_x509_certificates(files.cert)[0].public_bytes(
                serialization.Encoding.PEM
            )
            self._key = serialization.load_pem_private_key(files.key, password=None)
            self._stamp = stamp

    @staticmethod
    def nonce() -> bytes:
        return os.urandom(NONCE_BYTES)

    def prove(self, role: bytes, ns: bytes, nf: bytes, address: str) -> bytes:
        """Our certificate and signature over the transcript, framed for check()."""
        self._load()
        sig = _sign(self._key, _transcript(role, ns, nf, address))
        return struct.pack("<I", len(self._cert_pem)) + self._cert_pem + sig

    def check(self, role: bytes, ns: bytes, nf: bytes, address: str, proof: bytes) -> None:
        """Raise UcxAuthError unless `proof` is a signature of a certificate of our CA."""
        self._load()
        if len(proof) < 4:
            raise UcxAuthError("UCX peer sent no certificate")
        (n,) = struct.unpack_from("<I", proof)
        if not 0 < n <= min(MAX_CERT_BYTES, len(proof) - 4):
            raise UcxAuthError(f"UCX peer sent a malformed proof ({n}-byte certificate)")
        try:
            cert = x509.load_pem_x509_certificate(proof[4 : 4 + n])
        except ValueError as exc:
            raise UcxAuthError(f"UCX peer sent an unreadable certificate: {exc}") from None
        self._check_cert(cert)
        try:
            _verify(cert.public_key(), proof[4 + n :], _transcript(role, ns, nf, address))
        except InvalidSignature:
            raise UcxAuthError("UCX peer's signature does not verify") from None

    def _check_cert(self, cert: x509.Certificate) -> None:
        now = datetime.datetime.now(datetime.timezone.utc)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise UcxAuthError("UCX peer's certificate is expired or not yet valid")
        try:
            eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            eku = None
        if eku is not None and ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
            raise UcxAuthError("UCX peer's certificate does not allow client authentication")
        for ca in self._cas:
            try:
                cert.verify_directly_issued_by(ca)
                return
            except (ValueError, TypeError, InvalidSignature):
                continue
        raise UcxAuthError("UCX peer's certificate is not issued by this cluster's CA")


async def accept_handshake(ep, auth: UcxAuth, address: str, control, timeout: float) -> None:
    """The listener's side of the handshake on a new connection `ep` (control: a
    control_buffer); raises UcxAuthError or PeerTransportError (the caller aborts)."""
    far = time.monotonic() + 1e9
    ns = auth.nonce()
    await within(post_control(ep, ns), far, timeout, "UCX auth challenge")
    raw = await within(recv_control(ep, control), far, timeout, "UCX auth proof")
    nf, proof = raw[:NONCE_BYTES], raw[NONCE_BYTES:]
    if len(nf) != NONCE_BYTES:
        raise UcxAuthError("UCX peer sent no nonce: not an authenticating kvstore agent")
    auth.check(b"fetcher", ns, nf, address, proof)
    await within(
        post_control(ep, auth.prove(b"listener", ns, nf, address)), far, timeout, "UCX auth reply"
    )


async def connect_handshake(ep, auth: UcxAuth, address: str, deadline: float, io: float) -> None:
    """The fetcher's side on a new connection to the listener at `address`."""
    control = control_buffer()
    ns = await within(recv_control(ep, control), deadline, io, "UCX auth challenge")
    if len(ns) != NONCE_BYTES:
        raise UcxAuthError(f"UCX peer {address} sent no challenge: does it run with tls?")
    nf = auth.nonce()
    await within(
        post_control(ep, nf + auth.prove(b"fetcher", ns, nf, address)),
        deadline,
        io,
        "UCX auth proof",
    )
    proof = await within(recv_control(ep, control), deadline, io, "UCX auth reply")
    auth.check(b"listener", ns, nf, address, proof)
