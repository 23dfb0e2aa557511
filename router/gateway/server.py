"""The gateway inside the router process: uvicorn on the router's event loop, over the
router's RouterCore (one routing decision, one in-flight table), following engines/ in
etcd. Why in-process rather than a sibling: the cost function reads the index and the
load the router already holds, with no RPC per request and no second copy of the
index to keep in sync."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kvstore.config import TLSConfig
from kvstore.coord.engines import ENGINES
from kvstore.coord.etcd import EtcdClient
from kvstore.process import StartupError
from router.gateway.app import Gateway, error_body
from router.gateway.config import GatewayConfig, ReloadingApiKeys, read_secret
from router.gateway.engines import EngineSet
from router.gateway.plan import Planner
from router.gateway.prompt import PromptCodec
from router.gateway.tls import GatewayTLS, ReloadingServerContext, engine_client_context
from router.gateway.upstream import Upstream
from router.routing import RouterCore

__all__ = ["GatewayServer", "build_gateway"]

log = logging.getLogger("kvstore.gateway")


class _Embedded(uvicorn.Server):
    """uvicorn without its signal handlers: the router process owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _HeadWithBody(asyncio.Transport):
    """A connection's transport as one request's uvicorn cycle writes to it: the first
    write (the answer's head) waits for the next (its body) or for the end of this turn
    of the event loop, whichever comes first, so that a whole answer leaves in one send()
    rather than two (uvicorn writes the head at http.response.start). The bytes and
    their order are unchanged; a streamed answer's head goes out before its first chunk
    comes from the engine."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport
        self._held: bytes | None = None
        self._first = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._first:
            self._first = False
            self._held = bytes(data)
            asyncio.get_running_loop().call_soon(self._flush)
            return
        if self._held is not None:
            data, self._held = self._held + data, None
        self._transport.write(data)

    def _flush(self) -> None:
        if self._held is not None:
            data, self._held = self._held, None
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self._transport.get_extra_info(name, default)


class _OneSendProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, each request's cycle writing through _HeadWithBody.
    Measured with a bare proxy (uvicorn, plain ASGI, aiohttp) against one stand-in, 400
    sequential requests each way interleaved: 0.03-0.09 ms less added latency in 6 of 6
    pairs (load ~3.5), the client woken once per answer instead of twice.

    It also holds each connection to `limits` (uvicorn has no such limits, and the
    httptools parser buffers a header of any size): a request's head must arrive within
    header_timeout_s of the connection opening, or of its first byte on a keep-alive
    connection (idle, it is uvicorn's timeout_keep_alive's), and its body within
    body_timeout_s of the head, else 408; a head over max_header_bytes is 431, counted
    as it arrives. Either way the connection is closed; the application, if it was
    reading the body, sees the client gone. One timer at most per connection, and none
    for a request whose head and body come in one read."""

    # header_timeout_s, body_timeout_s, max_header_bytes: set by _protocol
    limits: ClassVar[GatewayConfig]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = True  # the parser is before or inside a request's head
        self._body_open = False  # between a request's head and its end
        self._begun = False  # bytes of the current request have arrived
        self._head_read = 0  # bytes received while the head is open
        self._head_size = 0  # its URL and headers, as parsed
        self._heads = 0  # requests whose head has been parsed, on this connection
        self._timer: asyncio.TimerHandle | None = None
        self._cut = False  # refused or timed out: the connection is closing

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s)  # from the connection opening

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._cut:
            return
        head_before, heads = self._head_open, self._heads
        super().data_received(data)
        if self._cut or self.transport.is_closing():
            return
        if self._head_open:
            if head_before and heads == self._heads:  # all of `data` is this head's
                self._head_read += len(data)
            if self._head_read > self.limits.max_header_bytes:
                self._refuse(431, "the request's headers are too large")
            elif self._timer is None and self._idle():  # a keep-alive request begun
                self._arm(self.limits.header_timeout_s)
        elif self._body_open and self._timer is None and not self.pipeline:
            self._arm(self.limits.body_timeout_s)  # (a pipelined one's starts when it does)

    # Parser callbacks (all from within data_received)
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._begun, self._head_size = True, 0

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._cut:
            self._head_size += len(name) + len(value) + 4  # ": " and CRLF
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open, self._head_read = False, 0
        self._heads += 1
        self._disarm()
        if self._cut:
            return
        if self._head_size > self.limits.max_header_bytes:  # it came in one read
            self._refuse(431, "the request's headers are too large")
            return
        self._body_open = True
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not None and self.cycle is not before:  # a request, not an upgrade
            self.cycle.transport = _HeadWithBody(self.transport)

    def on_body(self, body: bytes) -> None:
        if not self._cut:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._head_open, self._body_open, self._begun = True, False, False
        self._disarm()
        if not self._cut:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts a pipelined request, if any
        if self._timer is not None or self.transport.is_closing():
            return
        # The next request's head, or body, came in part while this one was served: the
        # deadline runs from now.
        if self._head_open and self._begun and self._idle():
            self._arm(self.limits.header_timeout_s)
        elif self._body_open and not self.pipeline:
            self._arm(self.limits.body_timeout_s)

    # Deadlines and refusals
    def _idle(self) -> bool:
        """No request is being answered (so a refusal can be this connection's answer)."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, delay: float) -> None:
        self._timer = self.loop.call_later(delay, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._cut or self.transport.is_closing():
            return
        if self._head_open and not self._begun:  # nothing sent: nobody to answer
            self._cut = True
            self.transport.close()
        elif self._head_open:
            self._refuse(408, f"the request's headers took over {self.limits.header_timeout_s} s")
        else:
            self._refuse(408, f"the request's body took over {self.limits.body_timeout_s} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` where it can be this connection's next answer, and close. The
        application, if it waits for the body, sees the client gone (as uvicorn tells it
        when one leaves)."""
        self._cut = True
        self._disarm()
        cycle = self.cycle
        if self._body_open:  # the answer to this request, unless the application began one
            if cycle.response_started or self.pipeline:
                self.transport.close()
                return
            cycle.disconnected = True  # its receive() says so from here on
            cycle.message_event.set()
        elif not self._idle():  # an earlier request's answer is on its way: not in its midst
            self.transport.close()
            return
        kind = "timeout_error" if status == 408 else "invalid_request_error"
        body = json.dumps(error_body(status, message, kind)).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
        self.transport.write(b"".join(head) + b"connection: close\r\n\r\n" + body)
        self.transport.close()


def _protocol(cfg: GatewayConfig) -> type[_OneSendProtocol]:
    """_OneSendProtocol held to `cfg`'s connection limits (uvicorn makes one per
    connection, from a class)."""
    return type("_LimitedProtocol", (_OneSendProtocol,), {"limits": cfg})


def build_gateway(
    cfg: GatewayConfig,
    core: RouterCore,
    generation: Callable[[bytes], int | None] = lambda ns_id: None,
    router_tls: TLSConfig | None = None,
) -> Gateway:
    """Everything read and checked before serving: a bad file is a ValueError here.
    `router_tls`: the router's tls: section, what the gateway serves HTTPS with unless its
    own tls_* files are set."""
    tls = GatewayTLS.resolve(cfg, router_tls or TLSConfig())
    if tls is not None:
        ReloadingServerContext(tls)  # unreadable or unusable files: refused here
    codecs = {model: PromptCodec.load(path) for model, path in cfg.tokenizers.items()}
    keys = ReloadingApiKeys(cfg.api_keys_file)
    kv_secrets = {t: read_secret(p, f"kv_secret_files.{t}") for t, p in cfg.kv_secret_files.items()}
    if cfg.salt_key_file:
        salt_key = read_secret(cfg.salt_key_file, "salt_key_file").encode()
    elif kv_secrets:
        salt_key = next(iter(sorted(kv_secrets.items())))[1].encode()
    else:
        raise ValueError("salt_key_file or kv_secret_files is required (it keys cache_salt)")
    engines = EngineSet(cfg.max_inflight_per_engine, cfg.engine_suspend_s)
    planner = Planner(core, kv_secrets, salt_key, generation)
    upstream = Upstream(
        cfg.connect_timeout_s,
        cfg.request_timeout_s,
        engine_client_context(tls),
        tls.server_name if tls is not None else "",
    )
    return Gateway(cfg, planner, engines, codecs, keys, upstream=upstream)


class GatewayServer:
    def __init__(
        self,
        cfg: GatewayConfig,
        gateway: Gateway,
        etcd: EtcdClient | None,
        router_tls: TLSConfig | None = None,
    ) -> None:
        self.cfg, self.gateway, self.etcd = cfg, gateway, etcd
        tls = GatewayTLS.resolve(cfg, router_tls or TLSConfig())
        self.tls = ReloadingServerContext(tls) if tls is not None else None
        self.port = 0
        self._server: _Embedded | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def address(self) -> str:
        return f"{self.cfg.listen.rsplit(':', 1)[0]}:{self.port}"

    def _uvicorn_config(self) -> uvicorn.Config:
        tls: dict = {}
        if self.tls is not None:  # our context, so rotated files reach new handshakes
            ctx = self.tls.context
            tls = {"ssl_context_factory": lambda config, default: ctx}
        # No access log: a URL is harmless, but nothing per request is logged by default.
        return uvicorn.Config(
            self.gateway,
            http=_protocol(self.cfg),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
            # uvicorn counts the connection asking among them: max_connections are served.
            limit_concurrency=self.cfg.max_connections + 1,
            **tls,
        )

    def _bind(self) -> socket.socket:
        host, _, port = self.cfg.listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only
        # for sockets that say they are TCP; without it every keep-alive answer waits
        # ~40 ms for a delayed ACK (Nagle).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port)))
        except (OSError, ValueError) as exc:
            sock.close()
            raise StartupError(f"gateway cannot listen on {self.cfg.listen}: {exc}") from None
        sock.set_inheritable(True)
        return sock

    async def start(self) -> None:
        sock = self._bind()  # ours, so a taken port is a StartupError, not uvicorn's exit
        self.port = sock.getsockname()[1]
        if self.etcd is not None:
            e = self.gateway.engines
            self._tasks.append(asyncio.create_task(self.etcd.follow(ENGINES, e.reset, e.apply)))
        self._server = _Embedded(self._uvicorn_config())
        task = asyncio.create_task(self._server.serve(sockets=[sock]))
        self._tasks.append(task)
        while not self._server.started:
            if task.done():
                raise StartupError(f"gateway on {self.cfg.listen} did not start")
            await asyncio.sleep(0.02)
        scheme = "https" if self.tls is not None else "http"
        log.info("gateway serving OpenAI API on %s://%s", scheme, self.address)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        for t in self._tasks[:1] if self.etcd is not None else []:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.gateway.close()
