"""The gateway inside the router process: uvicorn on the router's event loop, over the
router's RouterCore (one routing decision, one in-flight table), following engines/ in
etcd. Why in-process rather than a sibling: the cost function reads the index and the
load the router already holds, with no RPC per request and no second copy of the
index to keep in sync."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import socket
import struct
import sys
import termios
from asyncio import sslproto
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kvstore.config import TLSConfig
from kvstore.coord.engines import ENGINES, EngineRecordReader
from kvstore.coord.etcd import EtcdClient
from kvstore.process import StartupError
from router.gateway.app import Gateway, error_body
from router.gateway.config import GatewayConfig, ReloadingApiKeys, read_secret
from router.gateway.engines import EngineSet
from router.gateway.metrics import GatewayMetrics
from router.gateway.plan import Planner
from router.gateway.prompt import PromptCodec
from router.gateway.tls import GatewayTLS, ReloadingServerContext, engine_client_context
from router.gateway.upstream import Upstream
from router.routing import RouterCore

__all__ = ["GatewayServer", "build_gateway"]

log = logging.getLogger("kvstore.gateway")


class _Embedded(uvicorn.Server):
    """uvicorn without its signal handlers: the router process owns SIGTERM.

    With TLS, uvicorn's listener accepts plain TCP and each connection's handshake is
    _TLSHandshake's: counted in the connection limits (`book`) from the moment it opens,
    and held to `handshake_timeout_s` (the gateway's header_timeout_s: the headers' clock
    starts once it is done). uvicorn hands ssl to create_server, whose handshakes the
    limits never saw and which had asyncio's default timeout, 60 s: a probe held 6,000
    connections that sent nothing, or a part of a ClientHello, for a minute each, at
    ~315 KiB of the router's memory apiece (Python's TLS buffers) and one file
    descriptor; with the timeout alone, a client opening connections faster than it let
    them go still held as many as it liked."""

    def __init__(
        self, config: uvicorn.Config, handshake_timeout_s: float, book: _Connections
    ) -> None:
        super().__init__(config)
        self.handshake_timeout_s = handshake_timeout_s
        self.book = book

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        if self.config.ssl is None:
            await super().startup(sockets)
            return
        own = type(loop).create_server
        timeout, book = self.handshake_timeout_s, self.book

        async def create_server(factory: Any, *args: Any, **kwargs: Any) -> asyncio.Server:
            # uvicorn's TLS listener only: a call of anyone else's in the meantime (no
            # ssl, or a timeout of its own) goes through unchanged
            ctx = kwargs.get("ssl")
            if ctx is not None and kwargs.get("ssl_handshake_timeout") is None:
                kwargs["ssl"] = None
                accept = lambda: _TLSHandshake(factory, ctx, timeout, book)  # noqa: E731
                return await own(loop, accept, *args, **kwargs)
            return await own(loop, factory, *args, **kwargs)

        loop.create_server = create_server  # type: ignore[method-assign,assignment]
        try:
            await super().startup(sockets)
        finally:
            if loop.__dict__.get("create_server") is create_server:
                del loop.create_server  # the loop's own method again

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for conn in list(self.book.open):  # uvicorn knows connections once their handshake is done
            if isinstance(conn, _TLSHandshake):
                conn.transport.abort()
        await super().shutdown(sockets)


class _SSLProtocol(sslproto.SSLProtocol):
    """asyncio's TLS protocol, reading 32 KiB at a time instead of 256: each connection
    holds a read buffer of that size from the moment it opens (a zero-filled bytearray:
    256 KiB resident per connection, most of the ~315 KiB a silent one cost). A TLS record
    is at most 16 KiB; a large request body takes more, cheaper reads."""

    max_size = 32 * 1024


class _TLSHandshake(asyncio.Protocol):
    """A TLS connection until its handshake is done, counted in the connection limits
    (_Connections) from the moment it opens as a `waiting` connection (nothing of a
    request received): over max_connections or max_connections_per_client, the one
    waiting longest is closed, a handshake among them, so connections that never finish
    a handshake, however fast a stranger opens them, hold no more than the limits allow.
    The handshake is asyncio's own (SSLProtocol, as create_server(ssl=) runs it, with
    `timeout_s`); once done, uvicorn's protocol takes the connection over, counted from
    then on as itself. A handshake that fails or times out closes the connection."""

    def __init__(
        self,
        app_factory: Callable[[], Any],
        ctx: Any,
        timeout_s: float,
        book: _Connections,
    ) -> None:
        self.app_factory, self.ctx, self.timeout_s, self.book = app_factory, ctx, timeout_s, book
        self.peer = ""
        self.transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        # Not read here: the handshake reads from the first byte (as in start_tls).
        transport.pause_reading()
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if peer else ""  # uvicorn's client[0]
        self.book.add(self)
        self.book.admit(self)  # over a limit still (all serving): its request will be 503
        app = self.app_factory()
        app.handshake = self  # out of the book as it takes over (_OneSendProtocol)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        tls = _SSLProtocol(
            loop,
            app,
            self.ctx,
            done,
            server_side=True,
            ssl_handshake_timeout=self.timeout_s,  # type: ignore[arg-type]  # (a float)
        )
        transport.set_protocol(tls)
        tls.connection_made(transport)
        transport.resume_reading()
        done.add_done_callback(self._done)

    def _done(self, done: asyncio.Future) -> None:
        self.book.drop(self)
        if done.cancelled() or done.exception() is not None:
            self.transport.abort()

    def _shed(self) -> str:
        """Closed to make room for another (_Connections._shed): nobody to answer."""
        self.transport.abort()
        return "tls_handshake"


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


class _Counted(Protocol):
    """A connection _Connections counts: _OneSendProtocol, or _TLSHandshake before it."""

    peer: str

    @property
    def transport(self) -> asyncio.BaseTransport: ...
    def _shed(self) -> str: ...


class _Connections:
    """A gateway's open client connections, held to max_connections and
    max_connections_per_client (one per server, shared by its connections).

    A connection over a limit does not wait for a free place: it takes the place of a
    connection that is `waiting` (no request being served: nothing received since it
    opened, idle between keep-alive requests, or a request's head or body still arriving),
    the one waiting longest, which is closed (`_shed`: _OneSendProtocol's, or
    _TLSHandshake's for a TLS connection whose handshake is not done). Only when every
    other connection counted against the limit is serving a request (received whole, its
    answer not yet complete: with an engine, or streaming) does the newcomer stay over the
    limit, and its request is refused with 503. So silent or idle connections, however
    many a stranger opens, cannot keep a client out, nor can one client's own idle pool."""

    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.cap, self.per_client = cfg.max_connections, cfg.max_connections_per_client
        self.metrics = metrics
        self.open: dict[_Counted, None] = {}  # not closed by us
        self.waiting: dict[_Counted, None] = {}  # longest waiting first
        self.clients: Counter[str] = Counter()  # client address -> its open connections

    def add(self, conn: _Counted) -> None:
        self.open[conn] = self.waiting[conn] = None
        self.clients[conn.peer] += 1

    def drop(self, conn: _Counted) -> None:
        """`conn` is closing or closed (idempotent)."""
        self.waiting.pop(conn, None)
        if self.open.pop(conn, 0) is None:
            self.clients[conn.peer] -= 1
            if not self.clients[conn.peer]:
                del self.clients[conn.peer]

    def wait(self, conn: _Counted) -> None:
        """`conn` serves no request from now (last among the waiting)."""
        if conn in self.open:
            self.waiting.pop(conn, None)
            self.waiting[conn] = None

    def serve(self, conn: _Counted) -> None:
        self.waiting.pop(conn, None)

    def admit(self, conn: _Counted) -> str | None:
        """Make room for `conn` (counted already) within both limits by shedding waiting
        connections; the limit it stays over, if any."""
        if self.per_client and self.clients[conn.peer] > self.per_client:
            self._prune()
            if self.clients[conn.peer] > self.per_client and not self._shed(
                conn, "max_connections_per_client", conn.peer
            ):
                return "max_connections_per_client"
        if len(self.open) > self.cap:
            self._prune()
            if len(self.open) > self.cap and not self._shed(conn, "max_connections"):
                return "max_connections"
        return None

    def _prune(self) -> None:
        """Forget connections closed other than by us (uvicorn's keep-alive timeout, an
        answer with connection: close) whose connection_lost is still to come: a TLS
        connection's closing handshake can take a while."""
        for conn in [c for c in self.open if c.transport.is_closing()]:
            self.drop(conn)

    def _shed(self, asking: _Counted, limit: str, peer: str | None = None) -> bool:
        for conn in self.waiting:
            if conn is not asking and (peer is None or conn.peer == peer):
                break
        else:
            return False
        self.drop(conn)
        self.metrics.connections_shed.labels(limit, conn._shed()).inc()
        return True


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
    for a request whose head and body come in one read.

    And it keeps the server to max_connections and max_connections_per_client (_Connections):
    a connection over either is admitted by closing a waiting one, or its requests are
    503 while it stays over. A connection closed to make room that had nothing of a
    request is closed without a word (an idle keep-alive connection's close is ordinary
    HTTP: clients retry on a new one); one whose request's head or body was arriving is
    answered 503 with Retry-After, and the application, if it was reading the body, sees
    the client gone. 503 rather than 408: the request was not late by its deadline, the
    gateway is full and the client may retry.

    And it cuts off a client that reads nothing of an answer for send_timeout_s while the
    gateway has more to send (the transport paused writing: the kernel's buffers and the
    transport's are full): the connection is dropped, and the application sees the client
    gone, which releases its request. Without it a client that never reads kept its
    request's engine and tenant slots for as long as the engine streamed, or for ever once
    the stream ended in the buffers. Like nginx's send_timeout: the clock runs between two
    writes the client lets through (the transport's buffer going down), so a slow reader
    that keeps reading stays."""

    # header_timeout_s, body_timeout_s, max_header_bytes, the connection limits and
    # retry_after_s: set by _protocol, as is `book`, the server's open connections
    limits: ClassVar[GatewayConfig]
    book: ClassVar[_Connections]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = True  # the parser is before or inside a request's head
        self._body_open = False  # between a request's head and its end
        self._begun = False  # bytes of the current request have arrived
        self._head_read = 0  # bytes received while the head is open
        self._head_size = 0  # its URL and headers, as parsed
        self._heads = 0  # requests whose head has been parsed, on this connection
        self._timer: asyncio.TimerHandle | None = None
        self._cut = False  # refused, timed out or shed: the connection is closing
        self.peer = ""  # the client's address (host), for max_connections_per_client
        self._admitted = False  # within the connection limits (once, for good)
        self._served: list[Any] = []  # cycles of requests received whole, answers unfinished
        self._stall: asyncio.TimerHandle | None = None  # writing paused: send_timeout_s
        self._stall_at = 0  # bytes waiting in the transport when that clock started
        self._aborted = False  # cut off by _stalled
        self.handshake: _TLSHandshake | None = None  # that counted this TLS connection before

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else ""
        if self.handshake is not None:  # done: this protocol is counted in its place
            self.book.drop(self.handshake)
        self.book.add(self)
        self._admitted = self.book.admit(self) is None
        self._arm(self.limits.header_timeout_s)  # from the connection opening

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unstall()
        self.book.drop(self)
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
        if self._over_limit():
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
            if self.cycle is not None and not self.cycle.response_complete:
                self._served.append(self.cycle)  # received whole: in flight, not shed
                self.book.serve(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts a pipelined request, if any
        self._served = [c for c in self._served if not c.response_complete]
        if not self._served and not self.transport.is_closing():
            self.book.wait(self)
        if self.transport.is_closing():  # connection: close
            self._closing_with_unsent()
            return
        if self._timer is not None:
            return
        # The next request's head, or body, came in part while this one was served: the
        # deadline runs from now.
        if self._head_open and self._begun and self._idle():
            self._arm(self.limits.header_timeout_s)
        elif self._body_open and not self.pipeline:
            self._arm(self.limits.body_timeout_s)

    # Connection limits, deadlines and refusals
    def _over_limit(self) -> bool:
        """At a request's head: refuse it (503) if this connection is over a connection
        limit still (every other connection serving a request), or if the server has
        max_connections requests running (as uvicorn's limit_concurrency did: requests
        whose clients have left and whose application has not finished yet)."""
        if not self._idle():  # pipelined behind a request in flight: admitted already
            return False
        reason = None
        if not self._admitted:
            reason = self.book.admit(self)
            self._admitted = reason is None
        if reason is None and len(self.tasks) > self.limits.max_connections:
            reason = "max_connections"
        if reason is None:
            return False
        self.book.metrics.connections_refused.labels(reason).inc()
        if reason == "max_connections_per_client":
            why = f"this client has {self.limits.max_connections_per_client} connections"
        else:
            why = f"the gateway has {self.limits.max_connections} connections"
        self._refuse(503, f"{why} open, each with a request in flight; retry later")
        return True

    def _shed(self) -> str:
        """Close this waiting connection to make room for another (_Connections._shed):
        why, for the metrics."""
        if self._head_open and not self._begun:  # nothing of a request: nobody to answer
            self._cut_off()
            self.transport.close()
            self._closing_with_unsent()  # an earlier answer's end, still unread
            return "idle"
        self._refuse(503, "the gateway is at its connection limit; this request was the slowest")
        return "incomplete_request"

    def _idle(self) -> bool:
        """No request is being answered (so a refusal can be this connection's answer)."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, delay: float) -> None:
        self._timer = self.loop.call_later(delay, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cut_off(self) -> None:
        """This connection is closing: no timer left, and out of the server's open
        connections (idempotent)."""
        self._cut = True
        self._disarm()
        self.book.drop(self)

    def _expired(self) -> None:
        self._timer = None
        if self._cut or self.transport.is_closing():
            return
        if self._head_open and not self._begun:  # nothing sent: nobody to answer
            self._cut_off()
            self.transport.close()
        elif self._head_open:
            self._refuse(408, f"the request's headers took over {self.limits.header_timeout_s} s")
        else:
            self._refuse(408, f"the request's body took over {self.limits.body_timeout_s} s")

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        self._closing_with_unsent()

    # Writing to a client that does not read
    def _closing_with_unsent(self) -> None:
        """The gateway closed this connection with some of an answer not yet taken (less
        than the buffer's high-water mark, so writing never paused): the same clock as a
        paused writer's, so that a client that reads nothing cannot keep the rest, nor
        the connection's file descriptor, for ever."""
        if self._stall is None and not self._aborted and self.transport.is_closing():
            unsent = self._unsent()
            if unsent:
                self._watch_stall(unsent)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._watch_stall(self._unsent())

    def _watch_stall(self, unsent: int) -> None:
        """Check in send_timeout_s whether the client took any of the `unsent` bytes."""
        self._stall_at = unsent
        self._stall = self.loop.call_later(self.limits.send_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def _unstall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _unsent(self) -> int:
        """Bytes of answers the client has not taken: in the transport's buffer and in
        the kernel's send queue (not yet acknowledged; the transport's buffer alone goes
        down only when that queue has drained to half, seconds apart for a slow reader
        behind megabytes of socket buffer)."""
        n = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                n += int.from_bytes(queued, sys.byteorder, signed=True)
            except OSError:  # a socket whose send queue the kernel does not report
                pass
        return n

    def _stalled(self) -> None:
        """A closing transport is held to the same clock: closed with an answer still
        unsent (uvicorn's keep-alive timeout after a whole answer was written, a shed), it
        would wait for a client that reads nothing for ever, holding the answer (a probe
        piled up 90 MiB per 16 such connections, outside every cap)."""
        self._stall = None
        if self._aborted:
            return
        left = self._unsent()
        if left < self._stall_at:  # the client took some (not yet down to resume_writing)
            self._watch_stall(left)
            return
        self._cut_off()
        self._aborted = True
        self.book.metrics.clients_stalled.inc()
        log.warning(
            "closed a connection from %s: it read nothing of its answer for %g s (send_timeout_s)",
            self.peer or "?",
            self.limits.send_timeout_s,
        )
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset: the kernel drops the send queue with the socket
            with contextlib.suppress(OSError):  # (else an orphaned socket kept sending
                # the megabytes queued for minutes, held in kernel memory meanwhile)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()  # close() would wait for the buffers to drain

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` where it can be this connection's next answer, and close. The
        application, if it waits for the body, sees the client gone (as uvicorn tells it
        when one leaves)."""
        self._cut_off()
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
        kind = {408: "timeout_error", 503: "api_error"}.get(status, "invalid_request_error")
        body = json.dumps(error_body(status, message, kind)).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        if status == 503:
            head.append(b"retry-after: %d\r\n" % self.limits.retry_after_s)
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
        self.transport.write(b"".join(head) + b"connection: close\r\n\r\n" + body)
        self.transport.close()


def _protocol(cfg: GatewayConfig, metrics: GatewayMetrics) -> type[_OneSendProtocol]:
    """_OneSendProtocol held to `cfg`'s connection limits (uvicorn makes one per
    connection, from a class), all sharing one _Connections."""
    book = _Connections(cfg, metrics)
    return type("_LimitedProtocol", (_OneSendProtocol,), {"limits": cfg, "book": book})


def build_gateway(
    cfg: GatewayConfig,
    core: RouterCore,
    generation: Callable[[bytes], int | None] = lambda ns_id: None,
    router_tls: TLSConfig | None = None,
    records: EngineRecordReader | None = None,
) -> Gateway:
    """Everything read and checked before serving: a bad file is a ValueError here.
    `router_tls`: the router's tls: section, what the gateway serves HTTPS with unless its
    own tls_* files are set; `records`: how engines/ records are read (with the router's
    engine record key: only those that verify get requests)."""
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
    metrics = GatewayMetrics()
    engines = EngineSet(
        cfg.max_inflight_per_engine,
        cfg.engine_suspend_s,
        records=records or EngineRecordReader(),
        refuse_plaintext=tls is not None and not cfg.allow_plaintext_engines,
        on_refused=metrics.engines_refused.labels("plaintext").inc,
    )
    planner = Planner(core, kv_secrets, salt_key, generation)
    upstream = Upstream(
        cfg.connect_timeout_s,
        cfg.request_timeout_s,
        engine_client_context(tls),
        tls.server_name if tls is not None else "",
    )
    return Gateway(cfg, planner, engines, codecs, keys, metrics, upstream=upstream)


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
            # max_connections and max_connections_per_client are _OneSendProtocol's (not
            # uvicorn's limit_concurrency, which would refuse while idle ones are open).
            http=_protocol(self.cfg, self.gateway.metrics),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
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
        config = self._uvicorn_config()
        book = config.http.book  # type: ignore[union-attr]  # (_protocol's class)
        self._server = _Embedded(config, self.cfg.header_timeout_s, book)
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
