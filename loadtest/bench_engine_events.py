"""KV events applied per second by the router's engine subscriber (router/engine_feed.py),
through a real ZMQ socket, in vLLM 0.32's wire format; one JSON line.

A PUB socket connects to the subscriber's bound endpoint, as vLLM's publisher does, and
sends `batches` batches (topic, seq, msgpack payload) of `per_batch` events each: chains
of BlockStored (4 blocks of 32 tokens, new prompts and continuations) and BlockRemoved of
older ones, the mix of a busy engine. Timed from the first send until the subscriber has
applied every event. The baseline, measured in the same run, is msgpack decoding of the
same payloads alone: `applied_vs_decode` is the share of that rate the whole path keeps.

    .venv/bin/python -m loadtest.bench_engine_events [--batches 4000] [--per-batch 8]

Goal: `events_per_s` >= `goal_events_per_s` (20,000: a vLLM engine emits a batch per
scheduler step, ~100 steps/s at most on a GPU, each with a few events).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import time

import msgpack
import zmq
import zmq.asyncio

from kvstore.coord.engines import EngineRecord
from kvstore.devprocs import free_port
from router.engines import EngineBoard

BS = 32
GOAL = 20_000


def _spec() -> dict:
    return dict(
        tenant="bench",
        name="vllm",
        model_name="tiny",
        model_revision="r1",
        adapter_id="none",
        adapter_revision="none",
        tokenizer_id="tiny",
        tokenizer_revision="r1",
        rope_type="default",
        rope_theta=10000.0,
        rope_scaling="none",
        attention_impl="vllm",
        kv_dtype="float32",
        prompt_template_version="token-ids",
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        tp_rank=0,
        tp_size=1,
        block_size=BS,
    )


def payloads(batches: int, per_batch: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    live: list[bytes] = []  # tails of chains stored so far
    out = []
    for _ in range(batches):
        events: list[dict[str, object]] = []
        for _ in range(per_batch):
            if live and rng.random() < 0.25:
                events.append(
                    {"type": "BlockRemoved", "block_hashes": [live.pop(0)], "medium": "GPU"}
                )
                continue
            parent = live.pop(rng.randrange(len(live))) if live and rng.random() < 0.5 else None
            hashes, h = [], parent
            for _ in range(4):
                h = hashlib.sha256((h or b"") + rng.randbytes(8)).digest()
                hashes.append(h)
            live.append(hashes[-1])
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": parent,
                    "token_ids": [rng.randrange(50000) for _ in range(4 * BS)],
                    "block_size": BS,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "group_idx": 0,
                }
            )
        out.append(msgpack.packb([time.time(), events, 0], use_bin_type=True))
    return out


def decode_rate(frames: list[bytes], per_batch: int) -> float:
    t0 = time.perf_counter()
    for f in frames:
        msgpack.unpackb(f, raw=False)
    return len(frames) * per_batch / (time.perf_counter() - t0)


async def subscriber_rate(frames: list[bytes], per_batch: int, port: int) -> tuple[float, int]:
    from router.engine_feed import EngineFeed

    board = EngineBoard({"bench": "secret"})
    feed = EngineFeed(board)
    rec = EngineRecord(
        "bench-0", "http://127.0.0.1:1", ("tiny",), "n0", _spec(), BS, f"tcp://127.0.0.1:{port}"
    )
    feed.upsert(rec)
    sub = feed.subscribers["bench-0"]
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.connect(rec.kv_events_endpoint or "")
    await asyncio.wait_for(sub.connected.wait(), 10)
    await asyncio.sleep(0.2)  # the subscription reaches the PUB (not part of the timing)
    stream = sub.stream
    total = len(frames) * per_batch
    t0 = time.perf_counter()
    for seq, f in enumerate(frames):
        await pub.send_multipart((b"", seq.to_bytes(8, "big"), f))
    while stream.applied_events < total:
        await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - t0
    pub.close(0)
    ctx.term()
    blocks = board.index.engine_blocks("bench-0")
    await feed.stop()
    return total / elapsed, blocks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=4000)
    ap.add_argument("--per-batch", type=int, default=8)
    args = ap.parse_args()
    frames = payloads(args.batches, args.per_batch)
    base = decode_rate(frames, args.per_batch)
    rate, blocks = asyncio.run(subscriber_rate(frames, args.per_batch, free_port()))
    print(
        json.dumps(
            {
                "events": args.batches * args.per_batch,
                "events_per_s": round(rate),
                "decode_only_events_per_s": round(base),
                "applied_vs_decode": round(rate / base, 3),
                "indexed_blocks": blocks,
                "goal_events_per_s": GOAL,
                "goal_met": rate >= GOAL,
            }
        )
    )


if __name__ == "__main__":
    main()
