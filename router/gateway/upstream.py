"""The gateway's HTTP client to the engines: one httpcore connection pool for the
process (HTTP/1.1 keep-alive, a pool of connections per engine, TCP_NODELAY), over TLS
to engines whose URL is https:// (the gateway's CA, its pair as the client certificate).

Why httpcore rather than httpx on top of it: the gateway forwards bytes it already
encoded and streams the engine's bytes back unchanged, so httpx's request and response
models, auth, redirect and cookie handling are work per request for nothing
(loadtest/bench_gateway.py measures the gateway's CPU per request). httpcore is httpx's
own transport, from the same maintainers.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpcore

__all__ = ["Upstream", "UpstreamError", "EngineAnswer"]

# What a forward can fail with before or while the engine answers (httpcore's own
# hierarchy has no common base): connect, read, write, timeouts, a broken protocol, TLS.
_FAILURES: tuple[type[BaseException], ...] = (
    httpcore.TimeoutException,
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
    ssl.SSLError,
    OSError,
)

_NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


class UpstreamError(Exception):
    """A forward failed at the transport level (the message is the failure's kind)."""


@dataclass(slots=True)
class EngineAnswer:
    """The engine's answer, its body not read yet: status, content type, then the bytes."""

    response: httpcore.Response

    @property
    def status_code(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str:
        for name, value in self.response.headers:
            if name.lower() == b"content-type":
                return value.decode("latin-1")
        return "application/json"

    async def aread(self) -> bytes:
        try:
            return await self.response.aread()
        except _FAILURES as exc:
            raise UpstreamError(type(exc).__name__) from None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.aiter_stream():
                yield chunk
        except _FAILURES as exc:
            raise UpstreamError(type(exc).__name__) from None

    async def aclose(self) -> None:
        """Closing before the end drops the connection, which aborts the engine's request."""
        await self.response.aclose()


class Upstream:
    def __init__(
        self,
        connect_timeout_s: float,
        request_timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str = "",
    ) -> None:
        """`server_name`: the name https:// engines' certificates are checked against
        instead of the host dialled (TLSConfig.server_name: engines dialled by IP)."""
        self._extensions: dict[str, object] = {
            "timeout": {
                "connect": connect_timeout_s,
                "read": request_timeout_s,
                "write": request_timeout_s,
                "pool": request_timeout_s,
            }
        }
        if server_name:
            self._extensions["sni_hostname"] = server_name
        self.pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=None,
            max_keepalive_connections=256,
            keepalive_expiry=30.0,
            http1=True,
            http2=False,
            retries=0,  # a failed forward is retried by the gateway, on the next engine
            socket_options=_NODELAY,
        )

    async def post(self, url: str, body: bytes) -> EngineAnswer:
        target = httpcore.URL(url)
        host = target.host if target.port is None else b"%b:%d" % (target.host, target.port)
        headers = [
            (b"host", host),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
        ]
        request = httpcore.Request(
            "POST", target, headers=headers, content=body, extensions=self._extensions
        )
        try:
            return EngineAnswer(await self.pool.handle_async_request(request))
        except _FAILURES as exc:
            raise UpstreamError(type(exc).__name__) from None

    async def aclose(self) -> None:
        await self.pool.aclose()
