"""Multi-tenant multi-turn OpenAI chat through the gateway, or straight to the engines by
round robin / consistent hashing, with per-request engine, cached tokens and TTFT. Shared
by the demo (`make run`) and loadtest/bench_gateway.py.

Each tenant's sessions share its system prompt; a session's next prompt is the whole
conversation so far. A turn's requests (one per session) run concurrently. The direct
modes use their own cache_salt per tenant ("rr-<tenant>", ...), so no mode reuses the KV
another mode left in the engines or agents.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import time
from dataclasses import dataclass

import httpx

MODES = ("gateway", "rr", "chash")


@dataclass(frozen=True, slots=True)
class Turn:
    tenant: str
    session: int
    turn: int
    engine: str
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    priced: str = ""  # the gateway's x-kvstore-route: where the router priced the blocks
    prompt_ids: tuple[int, ...] = ()  # with a codec: the prompt's token ids (the ceiling)


@dataclass(frozen=True, slots=True)
class Workload:
    tenants: tuple[str, ...]
    sessions: int
    turns: int
    system_words: int = 600
    user_words: int = 60
    max_tokens: int = 4
    seed: int = 1

    def system(self, tenant: str) -> str:
        rng = random.Random(f"{self.seed}-{tenant}")
        return " ".join(f"w{rng.randrange(5, 1000)}" for _ in range(self.system_words))

    def user(self, tenant: str, session: int, turn: int) -> str:
        rng = random.Random(f"{self.seed}-{tenant}-{session}-{turn}")
        return " ".join(f"w{rng.randrange(5, 1000)}" for _ in range(self.user_words))


def _pick(mode: str, engines: list[str], rr: itertools.count, tenant: str, session: int) -> str:
    if mode == "rr":
        return engines[next(rr) % len(engines)]
    key = f"{tenant}/{session}".encode()  # rendezvous hashing of the session
    return max(engines, key=lambda e: hashlib.blake2b(key + e.encode(), digest_size=8).digest())


async def _ask(
    c: httpx.AsyncClient, url: str, headers: dict, body: dict
) -> tuple[dict, float, str, str, str]:
    """Stream one chat answer: (usage, TTFT ms, text, the gateway's engine and route
    headers)."""
    t0 = time.perf_counter()
    ttft, text = 0.0, []
    usage: dict = {}
    async with c.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft or (time.perf_counter() - t0) * 1000
                    text.append(piece)
            usage = ev.get("usage") or usage
        engine = r.headers.get("x-kvstore-engine", "")
        priced = r.headers.get("x-kvstore-route", "")
    return usage, ttft, "".join(text).strip(), engine, priced


async def run(
    w: Workload, mode: str, gateway: str, keys: dict[str, str], engines: dict[str, str],
    model: str = "tiny", on_turn=None, codec=None,
) -> list[Turn]:  # fmt: skip
    """`keys`: tenant -> API key (gateway mode); `engines`: engine id -> URL (direct);
    `codec`: the model's PromptCodec, to keep each prompt's token ids (`ceiling`)."""
    history = {
        (t, s): [{"role": "system", "content": w.system(t)}]
        for t in w.tenants
        for s in range(w.sessions)
    }
    rr, ids, out = itertools.count(), sorted(engines), []
    async with httpx.AsyncClient(timeout=300) as c:

        async def one(tenant: str, session: int, turn: int) -> Turn:
            msgs = history[(tenant, session)]
            msgs.append({"role": "user", "content": w.user(tenant, session, turn)})
            body = {"model": model, "messages": msgs, "max_tokens": w.max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            if mode == "gateway":
                url, headers = (
                    gateway + "/v1/chat/completions",
                    {"authorization": f"Bearer {keys[tenant]}"},
                )
                engine = ""
            else:
                engine = _pick(mode, ids, rr, tenant, session)
                url, headers = engines[engine] + "/v1/chat/completions", {}
                body["cache_salt"] = f"{mode}-{tenant}"
            usage, ttft, text, via, priced = await _ask(c, url, headers, body)
            prompt_ids = tuple(codec.chat_ids(msgs)) if codec is not None else ()
            msgs.append({"role": "assistant", "content": text})
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            t = Turn(tenant, session, turn, via or engine, int(usage.get("prompt_tokens", 0)),
                     cached, ttft, priced, prompt_ids)  # fmt: skip
            if on_turn is not None:
                on_turn(mode, t)
            return t

        for turn in range(w.turns):
            batch = [(t, s) for t in w.tenants for s in range(w.sessions)]
            random.Random(f"{w.seed}-{turn}").shuffle(batch)
            out += await asyncio.gather(*(one(t, s, turn) for t, s in batch))
            await asyncio.sleep(0.5)  # the connector's saves reach the agents and the index
    return out


def ceiling(turns: list[Turn], block: int) -> float:
    """The cached-token share of one unbounded cache over the same prompts, in the order
    they were sent (turn by turn; a round's requests in their sending order): a prompt's
    leading full blocks already seen, by chain (token prefix), per tenant (salts keep
    tenants apart), leaving one token to compute. Needs `prompt_ids` (run with a codec);
    without them, the previous turn of the session only (a lower figure: the tenant's
    shared system prompt is not counted)."""
    prompt = sum(t.prompt_tokens for t in turns)
    if not prompt:
        return 0.0
    if all(t.prompt_ids for t in turns):
        seen: dict[str, set[bytes]] = {}
        cached = 0
        for t in turns:
            have = seen.setdefault(t.tenant, set())
            ids, h = [], hashlib.blake2b(digest_size=16)
            for i in range(len(t.prompt_ids) // block):
                h.update(json.dumps(t.prompt_ids[i * block : (i + 1) * block]).encode())
                ids.append(h.copy().digest())
            usable = (len(t.prompt_ids) - 1) // block
            n = next((i for i, b in enumerate(ids[:usable]) if b not in have), usable)
            cached += n * block
            have.update(ids)
        return cached / prompt
    by_session = {(t.tenant, t.session, t.turn): t for t in turns}
    cached = 0
    for t in turns:
        prev = by_session.get((t.tenant, t.session, t.turn - 1))
        reuse = (prev.prompt_tokens // block) * block if prev else 0
        cached += min(reuse, ((t.prompt_tokens - 1) // block) * block)
    return cached / prompt
