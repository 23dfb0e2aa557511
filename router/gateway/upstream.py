"""The gateway's HTTP client to the engines: one aiohttp connection pool for the process
(HTTP/1.1 keep-alive, connections per engine, TCP_NODELAY), over TLS to engines whose URL
is https:// (the gateway's CA, its pair as the client certificate).

Why aiohttp: the gateway forwards bytes it already encoded and streams the engine's bytes
back unchanged, so the client's cost per request is most of what the gateway adds.
aiohttp's client parses HTTP in C; measured here against httpcore's pool (what httpx runs
on) over the same keep-alive connection to a stand-in worker, 1000 sequential POSTs, two
rounds: 0.61/0.62 ms of CPU per request against 1.49/1.63 (loadtest/bench_gateway.py
measures the whole gateway). Bodies are neither compressed nor decompressed on the way.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

__all__ = ["Upstream", "UpstreamError", "EngineAnswer"]

# What a forward can fail with before or while the engine answers: connect, read, write,
# timeouts, a broken protocol, TLS.
_FAILURES: tuple[type[BaseException], ...] = (
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ssl.SSLError,
    OSError,
)

_HEADERS = {"content-type": "application/json"}
# Idle connections are dropped before the engine drops them: vLLM's server (uvicorn) closes
# an idle keep-alive connection after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and a request
# written as it closes fails as if the engine had, which suspends the engine.
KEEPALIVE_S = 4.0
# aiohttp adds these by itself; the engine gets what a client calling it directly sends,
# and its bytes come back as they left it (no gzip negotiated for us to undo).
_SKIP = ("User-Agent", "Accept-Encoding")


class UpstreamError(Exception):
    """A forward failed at the transport level (the message is the failure's kind).
    `read_timeout`: the engine took the request and sent nothing for request_timeout_s
    (a slow answer, not a broken engine)."""

    def __init__(self, kind: str, read_timeout: bool = False) -> None:
        super().__init__(kind)
        self.read_timeout = read_timeout


def _failed(exc: BaseException) -> UpstreamError:
    return UpstreamError(type(exc).__name__, isinstance(exc, aiohttp.SocketTimeoutError))


@dataclass(slots=True)
class EngineAnswer:
    """The engine's answer, its body not read yet: status, content type, then the bytes."""

    response: aiohttp.ClientResponse

    @property
    def status_code(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str:
        return self.response.headers.get("content-type", "application/json")

    async def aread(self) -> bytes:
        try:
            return await self.response.read()
        except _FAILURES as exc:
            raise _failed(exc) from None

    async def first_chunk(self) -> bytes:
        """The body's first bytes as they arrive (b"": it ended empty); aiter_raw then
        goes on from there."""
        try:
            return await self.response.content.readany()
        except _FAILURES as exc:
            raise _failed(exc) from None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.content.iter_any():
                yield chunk
        except _FAILURES as exc:
            raise _failed(exc) from None

    async def aclose(self) -> None:
        """Closing before the end drops the connection, which aborts the engine's request;
        an answer read to its end gives the connection back to the pool."""
        if self.response.content.at_eof():
            self.response.release()
        else:
            self.response.close()


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
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._server_name = server_name or None
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=request_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use: an aiohttp session belongs to the running event loop.
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, keepalive_timeout=KEEPALIVE_S, ssl=self._ssl, enable_cleanup_closed=False
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                skip_auto_headers=_SKIP,
                auto_decompress=False,
            )
        return self._session

    async def post(self, url: str, body: bytes) -> EngineAnswer:
        try:
            # No redirects: an engine's Location would take the tenant's prompt to any
            # address, http:// included (past allow_plaintext_engines); a 3xx is the
            # engine failing (app.py).
            response = await self._client().post(
                url,
                data=body,
                headers=_HEADERS,
                server_hostname=self._server_name,
                allow_redirects=False,
            )
        except _FAILURES as exc:
            raise _failed(exc) from None
        return EngineAnswer(response)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
