"""gRPC credentials from a TLSConfig (kvstore/config.py): what every server port and every
channel of the agent, the router, the client library and kvctl use, so that one set of
PEM files turns mTLS on for every hop.

Rotation: a server's certificate configuration is fetched by gRPC at each new handshake
(grpc.dynamic_ssl_server_credentials); the fetcher re-reads the files when one of them
changed on disk (size or mtime; a Kubernetes Secret volume swaps them atomically), so
new connections get the new certificate and CA without a restart, while established
ones keep the session they negotiated. Channels read the files when they are created.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvstore.config import TLSConfig

log = logging.getLogger("kvstore.tls")

ChannelOptions = Sequence[tuple[str, object]]


class TLSFilesError(ValueError):
    """A configured certificate, key or CA file cannot be read (the message names it)."""


@dataclass(frozen=True, slots=True)
class PemFiles:
    """The bytes of one TLSConfig's files, read together."""

    ca: bytes
    cert: bytes
    key: bytes


def read_pem(path: str, what: str, who: str = "tls") -> bytes:
    """The PEM file at `path`, or a TLSFilesError naming `who`'s `what` and the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TLSFilesError(f"{who}: cannot read the {what} {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise TLSFilesError(f"{who}: the {what} {path} holds no PEM data")
    return data


def read_files(tls: TLSConfig) -> PemFiles:
    files = PemFiles(
        read_pem(tls.ca_file, "CA file (tls.ca_file)"),
        read_pem(tls.cert_file, "certificate (tls.cert_file)"),
        read_pem(tls.key_file, "private key (tls.key_file)"),
    )
    check_pair(files, tls)
    return files


def check_pair(files: PemFiles, tls: TLSConfig) -> None:
    """TLSFilesError unless the private key is the certificate's (its first, the leaf's):
    gRPC takes such a pair and fails every handshake, which a client reports as an
    unreachable server. Also met mid-rotation, one file replaced before the other: the
    caller keeps what it had (ReloadingServerCredentials)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(files.cert)
    except ValueError as exc:
        raise TLSFilesError(f"tls: the certificate {tls.cert_file} does not parse: {exc}") from None
    try:
        key = serialization.load_pem_private_key(files.key, password=None)
    except (ValueError, TypeError) as exc:  # TypeError: a key that needs a password
        raise TLSFilesError(f"tls: the private key {tls.key_file} does not load: {exc}") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise TLSFilesError(
            f"tls: the private key {tls.key_file} is not the key of the certificate {tls.cert_file}"
        )


def files_stamp(tls: TLSConfig) -> tuple:
    """What changes when any of the files is replaced (size, mtime, inode)."""
    out: list[tuple[int, int, int] | None] = []
    for path in (tls.ca_file, tls.cert_file, tls.key_file):
        try:
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


class ReloadingServerCredentials:
    """The fetcher behind grpc.dynamic_ssl_server_credentials: None (keep the current
    configuration) unless a file changed since the last read; a file that cannot be read
    mid-rotation keeps the current one too, and is tried again at the next handshake."""

    def __init__(self, tls: TLSConfig) -> None:
        self.tls = tls
        self._lock = threading.Lock()  # gRPC calls the fetcher from its own threads
        self._stamp = files_stamp(tls)
        self.files = read_files(tls)  # raises TLSFilesError before anything listens
        self.reloads = 0

    def configuration(self, files: PemFiles):
        return grpc.ssl_server_certificate_configuration(
            [(files.key, files.cert)], root_certificates=files.ca
        )

    def fetch(self):
        with self._lock:
            stamp = files_stamp(self.tls)
            if stamp == self._stamp:
                return None
            try:
                files = read_files(self.tls)
            except TLSFilesError as exc:
                log.warning("TLS files changed but cannot be read yet (%s); keeping the old", exc)
                return None
            self._stamp, self.files = stamp, files
            self.reloads += 1
        log.info("TLS files changed on disk: new connections use the new certificate")
        return self.configuration(files)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.configuration(self.files),
            self.fetch,
            require_client_authentication=self.tls.require_client_cert,
        )


def add_port(server, address: str, tls: TLSConfig) -> int:
    """server.add_secure_port with reloading mTLS credentials, or add_insecure_port when
    `tls` is off. Returns the bound port (0 when binding failed, as grpc does)."""
    if not tls.enabled:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, ReloadingServerCredentials(tls).credentials())


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    files = read_files(tls)
    return grpc.ssl_channel_credentials(files.ca, files.key, files.cert)


def _options(tls: TLSConfig, options: ChannelOptions) -> list[tuple[str, object]]:
    opts = list(options)
    if tls.server_name:  # see TLSConfig.server_name
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return opts


def channel(address: str, tls: TLSConfig | None, options: ChannelOptions = ()) -> grpc.Channel:
    """A blocking channel to `address`, over mTLS when `tls` is on."""
    if tls is None or not tls.enabled:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(tls), options=_options(tls, options))


def aio_channel(
    address: str, tls: TLSConfig | None, options: ChannelOptions = ()
) -> grpc.aio.Channel:
    """An asyncio channel to `address`, over mTLS when `tls` is on."""
    if tls is None or not tls.enabled:
        return grpc.aio.insecure_channel(address, options=list(options))
    creds = channel_credentials(tls)
    return grpc.aio.secure_channel(address, creds, options=_options(tls, options))


def client_tls(tls: TLSConfig | str | None) -> TLSConfig | None:
    """A client's `tls` argument: a TLSConfig, or a directory with files_in's files."""
    if isinstance(tls, str):
        tls = files_in(tls)
    if tls is not None and tls.enabled:
        read_files(tls)  # a missing file: a clear error now, not at the first call
        return tls
    return None


def files_in(directory: str) -> TLSConfig:
    """The client pair and CA `kvctl cluster up --tls` writes: <dir>/ca.crt,
    client.crt, client.key (what kvctl, tests and benchmarks present)."""
    return TLSConfig(
        os.path.join(directory, "ca.crt"),
        os.path.join(directory, "client.crt"),
        os.path.join(directory, "client.key"),
    )
