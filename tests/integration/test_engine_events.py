"""vLLM's KV events into the router's engine index, end to end: a real vLLM CPU engine
(loadtest/vllm_run.py, in .venv-vllm, a subprocess) publishes KV events over ZMQ to the
router's EngineFeed (bound on 127.0.0.1: vLLM connects its publisher there), which learns
the engine from a real etcd (engines/). The engine's cache is small, so distinct prompts
evict the first one; a second engine on the same endpoint is a restart.

The router side runs in this process on its own event loop thread; every read and route
is run on that loop (the board is not thread-safe)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvstore.coord.engines import ENGINES, EngineRecord
from kvstore.coord.etcd import EtcdClient
from kvstore.hashing import BlockId, hash_chain_packed
from kvstore.namespace import Namespace
from router.engine_feed import CATCH_UP_S, EngineFeed
from router.routing import RouterCore
from router.scoring import Weights
from tests.support.common import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK = 32
SECRET = "events-test-secret"

pytestmark = [pytest.mark.timeout(900)]
needs_vllm = pytest.mark.skipif(
    not VLLM_PY.exists(), reason="no .venv-vllm: run `make vllm-env` (make test depends on it)"
)


class RouterLoop:
    """A RouterCore and its EngineFeed on an event loop in a thread."""

    def __init__(self, etcd_endpoint: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.core = RouterCore(Weights(), tenant_secrets={"acme": SECRET})
        self.etcd: EtcdClient = self.call(lambda: EtcdClient(etcd_endpoint))
        self.feed: EngineFeed = self.call(lambda: EngineFeed(self.core.engines, self.etcd))
        self.call(self.feed.start)

    def call(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def wait(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.wait(self.feed.stop())
        self.wait(self.etcd.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(16)
    out = {"A": [rng.randrange(1, 1000) for _ in range(200)]}  # 6 full blocks
    for i in range(8):
        out[f"X{i}"] = [rng.randrange(1, 1000) for _ in range(200)]
    out["C"] = [rng.randrange(1, 1000) for _ in range(100)]
    out["W"] = [rng.randrange(1, 1000) for _ in range(40)]
    return out


@needs_vllm
def test_engine_cache_events_index_evictions_and_restart(tmp_path, etcd):
    p = _prompts()
    pub, replay = free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub}",  # vLLM connects: the router binds it
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",  # vLLM binds its ROUTER there
    }
    extra = {"agent": "127.0.0.1:1", "tenant": "acme", "tenant_secret": SECRET}

    def req(name: str) -> dict:
        return {"prompt": p[name], "max_tokens": 2}

    engine = {"kv_events": events, "prefix_caching": True, "num_blocks": 24}
    plan = {
        "model": str(tmp_path / "tiny-llama"),
        "tiny": {"seed": 1},
        "block_size": BLOCK,
        "max_len": 256,  # with 24 blocks of 32 tokens: vLLM wants room for one full request
        "engines": [
            {
                **engine,
                "namespace": extra,
                "batches": [
                    {"wait": "registered"},
                    [req("W")],
                    [req("A")],
                    {"wait": "held"},
                    *[[req(f"X{i}")] for i in range(8)],
                    {"wait": "evicted"},
                ],
            },
            {**engine, "batches": [[req("C")], {"wait": "restarted"}]},
        ],
    }
    router = RouterLoop(etcd.endpoint)
    spec: dict = {}
    seen: list[str] = []

    def ids(name: str) -> bytes:
        ns = Namespace.from_dict(spec)
        return hash_chain_packed(BlockId(ns.root(0, SECRET)), p[name], BLOCK)

    def held(name: str) -> int:
        return router.call(
            lambda: router.core.engines.index.prefix_lengths(ids(name)).get("vllm-0", 0)
        )

    def route(name: str, dry_run: bool = True):
        return router.call(
            lambda: router.core.route_engines(
                Namespace.from_dict(spec).namespace_id, ids(name), "tiny", dry_run=dry_run
            )
        )

    def on_wait(name: str, ev: dict) -> None:
        seen.append(name)
        if name == "registered":
            for engine_id, events_ep in (("vllm-0", events["endpoint"]), ("vllm-1", None)):
                rec = EngineRecord(
                    engine_id,
                    "http://127.0.0.1:1",
                    ("tiny",),
                    "agent-0",
                    spec,
                    BLOCK,
                    events_ep,
                    events["replay_endpoint"] if events_ep else None,
                )
                router.wait(router.etcd.put(ENGINES + engine_id, rec.to_json()))
            sub = wait_for(lambda: router.call(lambda: router.feed.subscribers.get("vllm-0")))
            # vLLM's PUB drops what it sends before it is connected; the warm-up prompt
            # after this point makes any later loss a gap, which the replay socket fills.
            wait_for(lambda: router.call(sub.connected.is_set), timeout=30, what="publisher")
        elif name == "held":
            # Every full block but the last prompt token's is cached by vLLM and named by
            # the connector's chain ids; its cache wins though it is the busier engine.
            wait_for(lambda: held("A") == 6, timeout=60, what="A in the engine index")
            first = route("A", dry_run=False)
            assert first.chosen.engine_id == "vllm-0"
            d = route("A")
            assert (d.chosen.engine_id, d.chosen.engine_blocks) == ("vllm-0", 6)
            assert d.chosen.in_flight == 1
        elif name == "evicted":
            wait_for(lambda: held("A") == 0, timeout=60, what="A evicted (BlockRemoved)")
            # X7's BlockStored can come in a later batch than the one that removed A's
            # last blocks: on a loaded host it was still on its way (make test at 11b6e7e
            # read 0 here).
            wait_for(lambda: held("X7") == 6, timeout=30, what="X7 in the engine index")
            d = route("A")
            assert d.chosen.engine_id == "vllm-1"  # the eviction changed the choice
        elif name == "restarted":
            wait_for(lambda: held("C") == 3, timeout=60, what="C from the restarted engine")
            assert held("X7") == 0  # the old engine's entries went with the restart
            stream = router.call(lambda: router.core.engines.engines["vllm-0"].stream)
            assert stream.resyncs >= 1

    try:
        _run_plan(tmp_path, plan, spec, on_wait)
    finally:
        router.close()
    assert seen == ["registered", "held", "evicted", "restarted"]


def _run_plan(tmp_path: Path, plan: dict, spec: dict, on_wait) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    log_path = tmp_path / "vllm.log"
    proc = subprocess.Popen(
        [str(VLLM_PY), "-m", "loadtest.vllm_run", str(plan_file)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(log_path, "w"),
        text=True,
    )
    done, out = False, []
    assert proc.stdout is not None and proc.stdin is not None
    try:
        for line in proc.stdout:
            if not line.startswith('{"event"'):
                out.append(line)
                continue
            ev = json.loads(line)
            if ev["event"] == "namespace":
                spec.update(ev["spec"])
            elif ev["event"] == "wait":
                on_wait(ev["name"], ev)
                proc.stdin.write("\n")
                proc.stdin.flush()
            elif ev["event"] == "done":
                done = True
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(out) + log_path.read_text()
    log_path.write_text(log)
    assert done and proc.returncode == 0, f"vLLM run failed (rc {proc.returncode}):\n" + log[-6000:]


class _Publisher:
    """vLLM's publisher protocol over real ZMQ sockets, driven by the test: an XPUB (a
    PUB that also hears subscriptions) connected to the router's bound SUB, and the
    ROUTER replay socket, answered by hand as vLLM's ZmqEventPublisher._service_replay
    does. The router side (an EngineFeed with no etcd: the record is handed in) runs on
    its own loop thread."""

    def __init__(self, catch_up_s: float | None) -> None:
        import zmq

        from tests.support.common import make_namespace

        self.spec = make_namespace(tenant="acme", block_size=4)
        self.tokens = list(range(40, 60))  # 5 blocks of 4
        self.hashes = [bytes([i]) * 32 for i in range(5)]
        pub_port, replay_port = free_port(), free_port()
        router = RouterLoop.__new__(RouterLoop)
        router.loop = asyncio.new_event_loop()
        router.thread = threading.Thread(target=router.loop.run_forever, daemon=True)
        router.thread.start()
        router.core = RouterCore(Weights(), tenant_secrets={"acme": SECRET})
        router.feed = router.call(lambda: EngineFeed(router.core.engines, None, catch_up_s))
        self.router = router
        self.rec = EngineRecord(
            "e0",
            "http://127.0.0.1:1",
            ("tiny",),
            "n0",
            self.spec.to_dict(),
            4,
            f"tcp://127.0.0.1:{pub_port}",
            f"tcp://127.0.0.1:{replay_port}",
        )
        self.ctx = zmq.Context()
        self.pub, self.rep = self.ctx.socket(zmq.XPUB), self.ctx.socket(zmq.ROUTER)
        self.rep.bind(self.rec.kv_events_replay_endpoint or "")
        self.clients: list[bytes] = []  # the identity each replay request came from

    def frames(self) -> list[bytes]:
        import msgpack

        stored = {
            "type": "BlockStored",
            "block_hashes": self.hashes,
            "parent_block_hash": None,
            "token_ids": self.tokens,
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        return [
            msgpack.packb([1.0, [stored], 0]),
            msgpack.packb([2.0, [{"type": "BlockRemoved", "block_hashes": self.hashes[3:]}], 0]),
            msgpack.packb([3.0, [{"type": "BlockRemoved", "block_hashes": self.hashes[2:3]}], 0]),
        ]

    def connect(self) -> None:
        """As vLLM's publisher does at start: it connects, bound or not yet."""
        self.pub.connect(self.rec.kv_events_endpoint or "")

    def subscribe(self, connected: bool = False):
        """The router's subscriber for this engine, connected and subscribed: from here
        on a batch sent live is delivered (once: one connection)."""
        self.router.call(lambda: self.router.feed.upsert(self.rec))
        sub = self.router.feed.subscribers["e0"]
        if not connected:
            self.connect()
        wait_for(lambda: self.router.call(sub.connected.is_set), what="publisher connected")
        assert self.pub.poll(20_000), "no subscription arrived"
        assert self.pub.recv() == b"\x01"
        return sub

    def send(self, seq: int, frame: bytes) -> None:
        self.pub.send_multipart((b"", seq.to_bytes(8, "big"), frame))

    def answer_replay(self, frames: dict[int, bytes]) -> int:
        """Answer one replay request with the batches from its start on; its start."""
        assert self.rep.poll(20_000), "the subscriber asked for no replay"
        client, empty, start_b = self.rep.recv_multipart()
        assert empty == b""
        self.clients.append(client)
        start = int.from_bytes(start_b, "big")
        for seq in sorted(s for s in frames if s >= start):
            self.rep.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), frames[seq]))
        self.rep.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))
        return start

    def held(self) -> dict[str, int]:
        root = BlockId(self.spec.root(0, SECRET))
        chain = hash_chain_packed(root, self.tokens, 4)
        return self.router.call(lambda: self.router.core.engines.index.prefix_lengths(chain))

    def close(self) -> None:
        self.pub.close(0)
        self.rep.close(0)
        self.ctx.term()
        self.router.wait(self.router.feed.stop())
        self.router.loop.call_soon_threadsafe(self.router.loop.stop)
        self.router.thread.join(10)


def test_a_lost_batch_is_replayed_over_the_replay_socket():
    """A fault injected: the publisher never sends seq 1 live; the subscriber sees the
    gap and asks the replay socket for it. Ordering only, no timing: seq 0 is sent once
    the subscription is there, and the replay is awaited on its request (no idle
    catch-up here, so the gap's is the only request)."""
    p = _Publisher(catch_up_s=None)
    try:
        frames = p.frames()
        stream = p.subscribe().stream
        p.send(0, frames[0])
        p.send(2, frames[2])  # seq 1 lost
        assert p.answer_replay({1: frames[1], 2: frames[2]}) == 1
        wait_for(lambda: p.router.call(lambda: stream.seq.expected) == 3, what="replay applied")
        assert p.held() == {"e0": 2}  # both removals applied, in order, none resynced
        assert stream.resyncs == 0
    finally:
        p.close()


def test_batches_sent_before_the_subscription_are_caught_up_when_the_socket_is_idle():
    """What a PUB does to an engine's first batches: sent before the router's
    subscription reached it, they are dropped, and no later batch shows the gap. With
    the default idle catch-up the subscriber asks the replay socket from the next seq it
    expects (0) and applies what it missed; a later live copy of one is dropped."""
    p = _Publisher(catch_up_s=CATCH_UP_S)
    try:
        frames = p.frames()
        p.connect()  # nobody bound yet: what is sent now is not delivered
        p.send(0, frames[0])
        p.send(1, frames[1])
        stream = p.subscribe(connected=True).stream
        assert p.router.call(lambda: stream.seq.expected) is None  # nothing arrived live
        assert p.answer_replay({0: frames[0], 1: frames[1]}) == 0
        wait_for(lambda: p.router.call(lambda: stream.seq.expected) == 2, what="catch-up")
        assert p.held() == {"e0": 3}  # stored 5, the last 2 removed
        p.send(1, frames[1])  # a live duplicate of a caught-up batch
        p.send(2, frames[2])
        wait_for(lambda: p.router.call(lambda: stream.seq.expected) == 3, what="seq 2 applied")
        assert p.held() == {"e0": 2}
        assert (stream.resyncs, stream.catch_ups) == (0, 1)
        # Idle again: the next catch-up asks from seq 3, and nothing is missing. It asks
        # over the same connection: catch-ups do not open one per idle second.
        assert p.answer_replay({s: f for s, f in enumerate(frames)}) == 3
        assert p.clients[0] == p.clients[1]
    finally:
        p.close()


def test_a_catch_up_left_unanswered_asks_again_over_a_fresh_connection():
    """An ask that timed out drops its DEALER: the answer, were it to come late, would
    otherwise be read as the next ask's."""
    p = _Publisher(catch_up_s=CATCH_UP_S)
    try:
        p.subscribe()
        assert p.rep.poll(20_000), "no catch-up asked"
        first, _, _ = p.rep.recv_multipart()  # left unanswered past REPLAY_TIMEOUT_S
        assert p.answer_replay({}) == 0  # the next catch-up, from 0 still
        assert p.clients == [p.clients[0]] and p.clients[0] != first
    finally:
        p.close()


def test_frames_from_another_local_process_are_dropped_not_a_reason_to_clear():
    """The tester's attack: in the layout where the router binds the event socket (vLLM
    given tcp://127.0.0.1:PORT connects to it), a second PUB that connects there sends
    garbage with seq 2**62, and well-formed batches that clear (AllBlocksCleared) with a
    seq far ahead and one going back. Garbage is dropped at once; the others are checked
    against the engine's replay socket (which vLLM binds: only the engine answers it)
    and dropped; the engine's own next batch is applied. Before, one garbage frame
    cleared the engine's entries, and each one after it again."""
    import zmq

    p = _Publisher(catch_up_s=None)
    attacker = p.ctx.socket(zmq.PUB)
    try:
        frames = p.frames()
        stream = p.subscribe().stream
        p.send(0, frames[0])
        wait_for(lambda: p.held() == {"e0": 5}, what="the engine's batch applied")
        attacker.connect(p.rec.kv_events_endpoint or "")

        def forge(seq: int, payload: bytes) -> None:
            attacker.send_multipart((b"", seq.to_bytes(8, "big", signed=True), payload))

        # The garbage below is sent again until one copy arrives, and copies sent before
        # that one was handled may still be on their way: count only the other drops.
        garbage_why = "sequence number out of range"

        def dropped() -> int:
            return p.router.call(lambda: stream.dropped - stream.drops.get(garbage_why, 0))

        def handled() -> int:  # dropped, or (before) a resync
            return p.router.call(lambda: getattr(stream, "dropped", 0) + stream.resyncs)

        # Until the attacker's PUB has the router's subscription, what it sends is lost.
        wait_for(lambda: forge(2**62, b"garbage") or handled() > 0, what="garbage arrived")
        assert p.router.call(lambda: stream.drops) == {garbage_why: stream.dropped}
        assert p.held() == {"e0": 5}
        n = dropped()
        forge(1, b"\xc1not msgpack")
        attacker.send_multipart((b"", b"\x00" * 4, b"short seq"))
        attacker.send_multipart((b"just one part",))
        wait_for(lambda: dropped() == n + 3, what="three more dropped")
        assert p.held() == {"e0": 5}
        clear = msgpack.packb([9.0, [{"type": "AllBlocksCleared"}], 0])
        forge(1000, clear)  # ahead: the engine's replay (from 1) has nothing past 0
        assert p.answer_replay({0: frames[0]}) == 1
        wait_for(lambda: dropped() == n + 4, what="the batch from the future dropped")
        forge(0, clear)  # going back: the engine's replay still has seq 0 as applied
        assert p.answer_replay({0: frames[0]}) == 0
        wait_for(lambda: dropped() == n + 5, what="the 'restart' dropped")
        assert p.held() == {"e0": 5}
        p.send(1, frames[1])  # the engine goes on
        wait_for(lambda: p.held() == {"e0": 3}, what="the engine's next batch applied")
        assert p.router.call(lambda: (stream.resyncs, stream.seq.expected)) == (0, 2)
    finally:
        attacker.close(0)
        p.close()
