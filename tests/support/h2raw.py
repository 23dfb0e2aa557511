"""A bare HTTP/2 (cleartext) client for gRPC attacker tests: open calls with the headers
a gRPC client sends, then send a message in part, or none, or whole, as no gRPC library
would let a test do. It never reads a response: each stream's flow-control window stays
at the server's first 64 KiB. It answers the server's PINGs unless told not to.
Responses are not decoded (HPACK): what a test sees is whether the server sent a stream
DATA (a response message) and whether it ended it (trailers or RST_STREAM)."""

from __future__ import annotations

import asyncio
import struct

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 1, 4, 1


def _int(n: int, prefix_bits: int) -> bytes:
    """An HPACK integer with a `prefix_bits` prefix (RFC 7541 5.1)."""
    top = (1 << prefix_bits) - 1
    if n < top:
        return bytes([n])
    out = [top]
    n -= top
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def hpack(headers: list[tuple[str, str]]) -> bytes:
    """Literal header fields without indexing, no Huffman coding."""
    out = b""
    for k, v in headers:
        kb, vb = k.encode(), v.encode()
        out += b"\x00" + _int(len(kb), 7) + kb + _int(len(vb), 7) + vb
    return out


def grpc_frame(message: bytes, declared: int | None = None) -> bytes:
    """A gRPC length-prefixed message; `declared`: the length announced instead."""
    return b"\x00" + struct.pack(">I", len(message) if declared is None else declared) + message


class H2:
    """One connection; `closed`: the streams the server ended, `answered`: those it sent
    DATA on, `endings`: the payload of the frame that ended each (trailers are HPACK: a
    status message the server sends as a plain literal can be found in them)."""

    def __init__(
        self, host: str, port: int, local_host: str | None = None, answer_pings: bool = True
    ) -> None:
        self.host, self.port, self.local_host = host, port, local_host
        self.answer_pings = answer_pings  # False: as a client whose host or process is gone
        self.pings = 0  # PINGs the server sent
        self.next_id = 1
        self.conn_win = self.init_win = 65535
        self.win: dict[int, int] = {}
        self.closed: set[int] = set()
        self.answered: set[int] = set()
        self.endings: dict[int, bytes] = {}
        self.cond = asyncio.Condition()
        self.max_frame = 16384
        self.gone = False

    async def connect(self) -> "H2":
        local = (self.local_host, 0) if self.local_host else None
        self.r, self.w = await asyncio.open_connection(self.host, self.port, local_addr=local)
        self.w.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        self._frame(SETTINGS, 0, 0, b"")
        self._frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 30))
        await self.w.drain()
        self._task = asyncio.create_task(self._read())
        return self

    def _frame(self, typ: int, flags: int, sid: int, payload: bytes) -> None:
        head = struct.pack(">I", len(payload))[1:] + bytes([typ, flags])
        self.w.write(head + struct.pack(">I", sid) + payload)

    def _settings(self, payload: bytes) -> None:
        for i in range(0, len(payload), 6):
            k, v = struct.unpack(">HI", payload[i : i + 6])
            if k == 4:  # SETTINGS_INITIAL_WINDOW_SIZE
                for s in self.win:
                    self.win[s] += v - self.init_win
                self.init_win = v
            elif k == 5:  # SETTINGS_MAX_FRAME_SIZE
                self.max_frame = v
        self._frame(SETTINGS, ACK, 0, b"")

    def _on_frame(self, typ: int, flags: int, sid: int, payload: bytes) -> None:
        if typ == SETTINGS and not flags & ACK:
            self._settings(payload)
        elif typ == PING and not flags & ACK:
            self.pings += 1
            if self.answer_pings:
                self._frame(PING, ACK, 0, payload)
        elif typ == WINDOW_UPDATE:
            inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if sid == 0:
                self.conn_win += inc
            elif sid in self.win:
                self.win[sid] += inc
        elif typ == DATA and payload:
            self.answered.add(sid)
        if typ == RST_STREAM or (typ in (DATA, HEADERS) and flags & END_STREAM):
            self.closed.add(sid)
            self.endings.setdefault(sid, payload)
        elif typ == GOAWAY:
            self.gone = True

    async def _read(self) -> None:
        try:
            while True:
                head = await self.r.readexactly(9)
                sid = struct.unpack(">I", head[5:9])[0] & 0x7FFFFFFF
                payload = await self.r.readexactly(int.from_bytes(head[:3], "big"))
                async with self.cond:
                    self._on_frame(head[3], head[4], sid, payload)
                    self.cond.notify_all()
                await self.w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            async with self.cond:
                self.gone = True
                self.cond.notify_all()

    async def open(self, path: str, metadata: tuple = (), end: bool = False) -> int:
        """A new call of `path` (its headers only; `end`: and no request at all)."""
        sid, self.next_id = self.next_id, self.next_id + 2
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", f"{self.host}:{self.port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
        async with self.cond:
            self.win[sid] = self.init_win
            self._frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), sid, hpack(headers))
        await self.w.drain()
        return sid

    async def send(self, sid: int, data: bytes, end: bool = False) -> None:
        """`data` on stream `sid`, as flow control allows (waits for window updates);
        `end`: and half-close the stream after it."""
        sent = 0
        while True:
            left = len(data) - sent
            async with self.cond:
                await self.cond.wait_for(
                    lambda left=left: (
                        left == 0
                        or min(self.conn_win, self.win[sid]) > 0
                        or sid in self.closed
                        or self.gone
                    )
                )
                if sid in self.closed or self.gone:
                    return
                n = min(self.conn_win, self.win[sid], self.max_frame, left)
                last = end and n == left
                if n or last:
                    self._frame(DATA, END_STREAM if last else 0, sid, data[sent : sent + n])
                self.conn_win -= n
                self.win[sid] -= n
                sent += n
            await self.w.drain()
            if sent == len(data) and (last or not end):
                return

    async def ended(self, sids: list[int]) -> None:
        """Until the server has ended every stream of `sids` (or the connection)."""
        async with self.cond:
            await self.cond.wait_for(lambda: self.gone or self.closed.issuperset(sids))

    async def answered_or_ended(self, sid: int) -> bool:
        """Whether the server answered `sid` (DATA) before ending it."""
        async with self.cond:
            await self.cond.wait_for(
                lambda: sid in self.answered or sid in self.closed or self.gone
            )
        return sid in self.answered

    async def close(self) -> None:
        self._task.cancel()
        self.w.close()
