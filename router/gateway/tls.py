"""HTTPS for the gateway, from the same PEM files as the router's gRPC TLS (kvstore/tls.py):
the listener's ssl.SSLContext, reloaded when the files change on disk, and the client
context for engines reached over https://.

Rotation: the listener's context carries an SNI callback, which OpenSSL runs at every
handshake (with or without a server name in the hello). It compares the files' stamp
(size, mtime, inode, as kvstore.tls does) with the last one read and, when it
changed, builds a fresh context from the files and hands it to the connection being set
up, so this handshake and every later one use the new certificate, key and CA without a
restart; established connections keep the session they negotiated. A file that cannot be
read mid-rotation keeps the current context and is tried again at the next handshake, as
on the gRPC side. The engine client reads its files when the gateway starts.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass, replace

from kvstore.config import TLSConfig
from kvstore.tls import TLSFilesError, read_pem
from router.gateway.config import GatewayConfig

__all__ = ["GatewayTLS", "ReloadingServerContext", "engine_client_context", "server_context"]

log = logging.getLogger("kvstore.gateway")


@dataclass(frozen=True, slots=True)
class GatewayTLS:
    """The files the gateway serves HTTPS with and trusts engines by."""

    cert_file: str
    key_file: str
    ca_file: str  # "": no client certificates, engines by the system's trust store
    require_client_cert: bool = False
    server_name: str = ""  # the name engines' certificates are checked against ("": host)

    @classmethod
    def resolve(cls, cfg: GatewayConfig, router_tls: TLSConfig) -> "GatewayTLS | None":
        """The gateway's own tls_* files when set, else the router's tls: section, unless
        `https` is off; None: plain HTTP."""
        if not cfg.https:
            return None
        if cfg.tls_cert_file:
            out = cls(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_ca_file)
        elif router_tls.enabled:
            out = cls(router_tls.cert_file, router_tls.key_file, router_tls.ca_file)
            out = replace(out, server_name=router_tls.server_name)
        else:
            return None
        if cfg.require_client_cert and not out.ca_file:
            raise ValueError("require_client_cert needs a CA (tls_ca_file or the router's tls)")
        return replace(out, require_client_cert=cfg.require_client_cert)

    def stamp(self) -> tuple:
        """What changes when any of the files is replaced (size, mtime, inode)."""
        out: list[tuple[int, int, int] | None] = []
        for path in (self.ca_file, self.cert_file, self.key_file):
            try:
                st = os.stat(path) if path else None
            except OSError:
                st = None
            out.append((st.st_mtime_ns, st.st_size, st.st_ino) if st else None)
        return tuple(out)


def server_context(tls: GatewayTLS) -> ssl.SSLContext:
    """The listener's context; every file readable PEM that OpenSSL takes, else a
    TLSFilesError (a ValueError) naming the file, before anything listens."""
    read_pem(tls.cert_file, "certificate", who="gateway tls")
    read_pem(tls.key_file, "private key", who="gateway tls")
    if tls.ca_file:
        read_pem(tls.ca_file, "CA file", who="gateway tls")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.ca_file:
            ctx.load_verify_locations(cafile=tls.ca_file)
    except (ssl.SSLError, OSError) as exc:
        raise TLSFilesError(f"gateway tls: {tls.cert_file} / {tls.key_file}: {exc}") from None
    ctx.verify_mode = ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE
    return ctx


class ReloadingServerContext:
    """The listener's context (`context`, what uvicorn serves with); see the module
    docstring for how rotation reaches new handshakes."""

    def __init__(self, tls: GatewayTLS) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._stamp = tls.stamp()
        self.context = server_context(tls)  # raises TLSFilesError before listening
        self.context.sni_callback = self._on_hello
        self._current = self.context
        self.reloads = 0

    def _on_hello(self, conn: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        with self._lock:
            stamp = self.tls.stamp()
            if stamp != self._stamp:
                try:
                    fresh = server_context(self.tls)
                except TLSFilesError as exc:
                    log.warning("gateway TLS files changed but cannot be read yet (%s)", exc)
                else:
                    self._stamp, self._current = stamp, fresh
                    self.reloads += 1
                    log.info("gateway TLS files changed on disk: new connections use them")
            current = self._current
        if current is not ctx:
            conn.context = current


def engine_client_context(tls: GatewayTLS | None) -> ssl.SSLContext | None:
    """What the gateway trusts engines served over https:// by: its CA, presenting its
    own pair (engines may require client certificates: vLLM --ssl-cert-reqs 2). None:
    the client's default (the system's trust store), for a gateway without a CA."""
    if tls is None or not tls.ca_file:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_file)
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    return ctx
