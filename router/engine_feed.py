"""Feeds the router's EngineBoard: engines from etcd engines/ (list then watch), and one
ZMQ subscriber per engine that publishes KV events (router/engine_events.py applies them).

Which side binds: vLLM's publisher binds an endpoint with a wildcard (`tcp://*:5557`),
ipc or inproc, and CONNECTS to any other (`tcp://10.0.0.7:5557`). So for a
`tcp://HOST:PORT` endpoint the subscriber here binds HOST:PORT (it must be this router's
address: one router replica per such engine), and for `tcp://*:PORT` it connects to the
engine's host (from its URL), which lets every router replica subscribe. The replay socket
is always bound by vLLM (a ROUTER): we connect a DEALER, send the first missing sequence
number (8 bytes, big-endian) and read (topic, seq, payload) frames until seq -1.

Two things ask it. A gap (a live seq past the next expected) asks from the first missing
seq. And a live socket idle for `catch_up_s` asks from the next expected seq: a PUB drops
what it sends before the subscription reaches it, so an engine's first batches after a
(re)connect can be lost with no later batch to show the gap; the catch-up brings them
within about `catch_up_s` (an empty answer, seq -1 alone, when nothing was lost).

Where the subscriber binds, any process that can connect to that address can publish into
it (ZMQ has no authentication here, and vLLM's publisher no CURVE): messages over
MAX_FRAME_BYTES disconnect their sender (ZMQ_MAXMSGSIZE), and frames that are not
(topic, 8-byte seq, payload) are dropped and counted like the stream's other noise
(router/engine_events.py, "Noise"). Where the engine binds (wildcard or ipc endpoints) the
router connects out, and nothing else can write into its socket.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from kvstore.coord.engines import ENGINES, EngineRecord, EngineRecordReader
from kvstore.coord.etcd import EtcdClient, KeyValue, WatchEvent
from router.engines import EngineBoard
from router.engine_events import EngineStream

log = logging.getLogger("kvstore.router")

END_SEQ = -1
REPLAY_TIMEOUT_S = 2.0
CATCH_UP_S = 1.0  # a live socket idle this long asks the replay socket what it missed
# The most one ZMQ message (frame) may carry, live or replayed: a scheduler step's events,
# token ids included, are far below (a 128k-token prefill is ~1 MiB of msgpack).
MAX_FRAME_BYTES = 64 << 20
_RETRY_S = (0.2, 3.0)


def subscriber_binds(endpoint: str) -> bool:
    """True where vLLM's publisher connects (vllm ZmqEventPublisher._is_bind_endpoint)."""
    return not ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc:", "inproc:")))


def connectable(endpoint: str, engine_url: str) -> str:
    """A wildcard endpoint the engine bound, as an address to connect to."""
    if "*" in endpoint:
        return endpoint.replace("*", urlsplit(engine_url).hostname or "127.0.0.1", 1)
    return endpoint


class EngineSubscriber:
    """One engine's event socket into its EngineStream, until cancelled."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        rec: EngineRecord,
        stream: EngineStream,
        catch_up_s: float | None = CATCH_UP_S,
    ) -> None:
        self.ctx = ctx
        self.rec = rec
        self.stream = stream
        # None: no idle catch-up (only gaps ask the replay socket), for tests of the gap.
        self.catch_up_s = catch_up_s if rec.kv_events_replay_endpoint else None
        # Set once a publisher is connected (a ZMQ socket monitor event): what a driver
        # waits for before the engine's first events, which a PUB drops until then.
        self.connected = asyncio.Event()
        # The DEALER to the replay socket, kept between asks (a catch-up every idle
        # second would otherwise open and close a TCP connection each time); dropped
        # after any ask that did not end cleanly, so a late answer is never read as the
        # next one's.
        self._dealer: zmq.asyncio.Socket | None = None
        self.task = asyncio.create_task(self._run(), name=f"kv-events-{rec.engine_id}")

    def cancel(self) -> None:
        self.task.cancel()

    async def _run(self) -> None:
        delay = _RETRY_S[0]
        while True:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            # Watched before binding, so an accept right at bind is not missed.
            mon = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED)
            monitor = asyncio.create_task(self._monitor(mon))
            ep = self.rec.kv_events_endpoint or ""
            try:
                if subscriber_binds(ep):
                    sock.bind(ep)
                else:
                    sock.connect(connectable(ep, self.rec.url))
                log.info("engine %s: following KV events at %s", self.rec.engine_id, ep)
                await self._follow(sock)
            except zmq.ZMQError as exc:
                log.warning("engine %s: KV event socket %s: %s", self.rec.engine_id, ep, exc)
            finally:
                monitor.cancel()
                mon.close(0)
                sock.close(0)
                self._drop_dealer()
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_S[1])

    async def _monitor(self, mon: zmq.asyncio.Socket) -> None:
        await mon.recv_multipart()
        self.connected.set()

    async def _follow(self, sock: zmq.asyncio.Socket) -> None:
        idle_ms = None if self.catch_up_s is None else int(self.catch_up_s * 1000)
        while True:
            if idle_ms is not None and not await sock.poll(idle_ms):
                await self._catch_up()
                continue
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stream.drop(-1, f"a {len(frames)}-part message, not (topic, seq, batch)")
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            start = self.stream.live(seq, frames[2])
            while start is not None:  # a gap, or a frame to check with the engine
                start = self.stream.replayed(start, await self._replay(start))

    async def _catch_up(self) -> None:
        start = self.stream.catch_up_from()
        # Failing every idle second while the engine is away (restarting): not a warning.
        got = await self._replay(start, logging.DEBUG)
        if got:
            log.info(
                "engine %s: caught up %d batch(es) the live socket lost, from %d",
                self.rec.engine_id,
                len(got),
                start,
            )
            self.stream.caught_up(start, got)

    async def _replay(
        self, start: int, failed_level: int = logging.WARNING
    ) -> list[tuple[int, bytes]] | None:
        """The replay socket's batches from `start` on, in order; None when there is no
        replay socket, its answer is malformed, or the ask failed (logged at
        `failed_level`)."""
        ep = self.rec.kv_events_replay_endpoint
        if not ep:
            return None
        if self._dealer is None:
            self._dealer = self.ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            self._dealer.connect(connectable(ep, self.rec.url))
        sock = self._dealer
        out: list[tuple[int, bytes]] = []
        clean = False
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                async with asyncio.timeout(REPLAY_TIMEOUT_S):
                    frames = await sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    return None
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    clean = True
                    return out
                out.append((seq, frames[3]))
        except (TimeoutError, zmq.ZMQError) as exc:
            log.log(
                failed_level,
                "engine %s: replay from %d at %s failed: %r",
                self.rec.engine_id,
                start,
                ep,
                exc,
            )
            return None
        finally:
            if not clean:
                self._drop_dealer()

    def _drop_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(0)
            self._dealer = None


class EngineFeed:
    """etcd engines/ into the board, a subscriber per engine with an events endpoint."""

    def __init__(
        self,
        board: EngineBoard,
        etcd: EtcdClient | None = None,
        catch_up_s: float | None = CATCH_UP_S,
        records: EngineRecordReader | None = None,
    ) -> None:
        self.board = board
        self.etcd = etcd
        # decodes and, with the engine record key, verifies: no subscriber connects to
        # (or binds for) the endpoints of a record that does not verify
        self.records = records or EngineRecordReader()
        self.catch_up_s = catch_up_s
        self.ctx = zmq.asyncio.Context()
        self.subscribers: dict[str, EngineSubscriber] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.etcd is not None:
            self._task = asyncio.create_task(
                self.etcd.follow(ENGINES, self._reset, self._apply), name="etcd-engines"
            )

    async def stop(self) -> None:
        tasks = [s.task for s in self.subscribers.values()]
        if self._task is not None:
            tasks.append(self._task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.subscribers.clear()
        self.ctx.destroy(0)  # closes what cancelled tasks have not closed yet

    def upsert(self, rec: EngineRecord) -> None:
        if not self.board.upsert(rec) and rec.engine_id in self.subscribers:
            return
        old = self.subscribers.pop(rec.engine_id, None)
        if old is not None:
            old.cancel()
        st = self.board.engines[rec.engine_id]
        log.info("engine %s registered at %s (node %s)", rec.engine_id, rec.url, rec.node_id)
        if st.stream is not None:
            self.subscribers[rec.engine_id] = EngineSubscriber(
                self.ctx, rec, st.stream, self.catch_up_s
            )

    def remove(self, engine_id: str) -> None:
        sub = self.subscribers.pop(engine_id, None)
        if sub is not None:
            sub.cancel()
        self.board.remove(engine_id)

    def _reset(self, items: list[KeyValue]) -> None:
        self.records.reset(items, self.board.engines, self.upsert, self.remove)

    def _apply(self, events: list[WatchEvent]) -> None:
        self.records.apply(events, self.upsert, self.remove)
