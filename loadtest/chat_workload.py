"""Multi-tenant multi-turn OpenAI chat through the gateway, or straight to the engines by
round robin / consistent hashing, with per-request engine, cached tokens and TTFT. Shared
by the demo (`make run`) and loadtest/bench_gateway.py.

Each tenant's sessions share its system prompt; a session's next prompt is the whole
conversation so far. A turn's requests (one per session) run concurrently. The direct
modes use their own cache_salt per tenant ("rr-<tenant>", ...), so no mode reuses the KV
another mode left in the engines or agents. `run` sends one mode's whole workload;
`run_interleaved` sends several modes' turns in turn, for a comparison on shared engines.
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
    round: int = 0  # which of run_interleaved's workloads


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


class Chat:
    """One mode's sessions: their conversations so far, sent a turn at a time (`turn`),
    so that a benchmark can interleave the modes' turns on the same engines."""

    def __init__(
        self, w: Workload, mode: str, gateway: str, keys: dict[str, str],
        engines: dict[str, str], model: str = "tiny", on_turn=None, codec=None,
        round_: int = 0,
    ) -> None:  # fmt: skip
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.w, self.mode, self.gateway, self.keys = w, mode, gateway, keys
        self.engines, self.model, self.on_turn, self.codec = engines, model, on_turn, codec
        self.round = round_
        self.history = {
            (t, s): [{"role": "system", "content": w.system(t)}]
            for t in w.tenants
            for s in range(w.sessions)
        }
        self._rr, self._ids = itertools.count(), sorted(engines)

    async def _one(self, c: httpx.AsyncClient, tenant: str, session: int, turn: int) -> Turn:
        w, msgs = self.w, self.history[(tenant, session)]
        msgs.append({"role": "user", "content": w.user(tenant, session, turn)})
        body = {"model": self.model, "messages": msgs, "max_tokens": w.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        if self.mode == "gateway":
            url = self.gateway + "/v1/chat/completions"
            headers, engine = {"authorization": f"Bearer {self.keys[tenant]}"}, ""
        else:
            engine = _pick(self.mode, self._ids, self._rr, tenant, session)
            url, headers = self.engines[engine] + "/v1/chat/completions", {}
            body["cache_salt"] = f"{self.mode}-{tenant}"
        usage, ttft, text, via, priced = await _ask(c, url, headers, body)
        prompt_ids = tuple(self.codec.chat_ids(msgs)) if self.codec is not None else ()
        msgs.append({"role": "assistant", "content": text})
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        t = Turn(tenant, session, turn, via or engine, int(usage.get("prompt_tokens", 0)),
                 cached, ttft, priced, prompt_ids, self.round)  # fmt: skip
        if self.on_turn is not None:
            self.on_turn(self.mode, t)
        return t

    async def turn(self, turn: int) -> list[Turn]:
        """Every session's next turn, concurrently (sent in a seeded shuffled order), then
        a pause so the connector's saves reach the agents and the router's index. Each
        turn connects afresh: a connection kept from the last turn may have idled past
        the server's keep-alive timeout (uvicorn's 5 s) while other modes ran, and one
        closed just as it is reused fails the request (httpx.ReadError)."""
        w = self.w
        batch = [(t, s) for t in w.tenants for s in range(w.sessions)]
        random.Random(f"{w.seed}-{turn}").shuffle(batch)
        async with httpx.AsyncClient(timeout=300) as c:
            out = await asyncio.gather(*(self._one(c, t, s, turn) for t, s in batch))
        await asyncio.sleep(0.5)
        return list(out)


async def run(
    w: Workload, mode: str, gateway: str, keys: dict[str, str], engines: dict[str, str],
    model: str = "tiny", on_turn=None, codec=None,
) -> list[Turn]:  # fmt: skip
    """One mode's whole workload, turn by turn. `keys`: tenant -> API key (gateway
    mode); `engines`: engine id -> URL (direct); `codec`: the model's PromptCodec, to keep
    each prompt's token ids (`ceiling`)."""
    chat, out = Chat(w, mode, gateway, keys, engines, model, on_turn, codec), []
    for turn in range(w.turns):
        out += await chat.turn(turn)
    return out


def rotated(modes: tuple[str, ...], turn: int) -> tuple[str, ...]:
    """The order the modes send turn `turn` in: rotated by one each turn, so no mode
    always goes first (after the pause) or last (behind the others' saves)."""
    k = turn % len(modes)
    return modes[k:] + modes[:k]


async def run_interleaved(
    rounds: list[Workload], modes: tuple[str, ...], gateway: str, keys: dict[str, str],
    engines: dict[str, str], model: str = "tiny", codec=None,
) -> dict[str, list[Turn]]:  # fmt: skip
    """Every mode's workloads on the same engines, interleaved in time: turn t of every
    mode (one mode's batch at a time, in `rotated` order, the rotation running on across
    the rounds) before turn t + 1 of any, so host load drifting during the run and the
    engines warming up fall on every mode alike, where running the modes one after
    another gave them all to the first. `rounds`: workloads run one after another (give
    each its own seed: new conversations), for more requests per figure."""
    out: dict[str, list[Turn]] = {m: [] for m in modes}
    k = 0
    for r, w in enumerate(rounds):
        chats = {m: Chat(w, m, gateway, keys, engines, model, codec=codec, round_=r) for m in modes}
        for turn in range(w.turns):
            for m in rotated(modes, k):
                out[m] += await chats[m].turn(turn)
            k += 1
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
