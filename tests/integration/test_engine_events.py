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

import pytest

from kvstore.coord.engines import ENGINES, EngineRecord
from kvstore.coord.etcd import EtcdClient
from kvstore.hashing import hash_chain_packed
from kvstore.namespace import Namespace
from router.engine_feed import EngineFeed
from router.routing import RouterCore
from router.scoring import Weights
from tests.support.common import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK = 32
SECRET = "events-test-secret"

pytestmark = [
    pytest.mark.skipif(
        not VLLM_PY.exists(), reason="no .venv-vllm: run `make vllm-env` (make test depends on it)"
    ),
    pytest.mark.timeout(900),
]


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
        return hash_chain_packed(ns.root(0, SECRET), p[name], BLOCK)

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
            assert held("X7") == 6
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
