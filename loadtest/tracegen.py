"""Reproducible multi-tenant prompt traces shaped like real inference traffic.

Four kinds of sessions, each a small state machine that yields prompts:

* ``agent`` — a long system prompt and tool schemas (shared by every session of the
  same agent app), a task, then one request per step whose prompt grows by the
  previous tool call (the model's output) and its tool result.
* ``chat`` — multi-turn chat: each turn's prompt is the previous prompt plus the
  assistant's answer (the previous output) plus a new user message.
* ``rag`` — a system prompt, 1-3 documents drawn with Zipf-like popularity from the
  tenant's corpus, and a question; a session asks 1-3 questions over its documents.
* ``oneoff`` — a unique prompt with nothing shared.

Sessions start as a Poisson process and their steps are spaced by exponential think
times, so sessions of all tenants interleave. Everything is derived from the seed:
static content (system prompts, tools, documents) from keyed ``random.Random``
instances, so it is the same whichever session first uses it; each session has its
own generator, so its content does not depend on how sessions interleave.

Namespaces named in ``public_namespaces`` (``--public-namespaces``) are public: their
lines say ``"public": true`` and their static content is one set shared by every tenant
(public documents, a common system prompt), so tenants share prefixes there.

Variants (``--variant``) break prefixes the way real deployments do; the default,
``reference``, is the trace above:

* ``broken-tools`` — an agent app's tools are separate schemas that each session lists
  in its own order, so sessions of one app share only the system prompt.
* ``trimmed-chat`` — chats keep a context window (``CHAT_WINDOW`` tokens): once the
  history outgrows it, the oldest turns after the system prompt are dropped, so each
  trimmed turn shares only the system prompt with the previous one.
* ``timestamp-first`` — every prompt starts with the current minute (a few tokens), so
  requests share prefixes only within a minute.
* ``oneoff`` — mostly one-off prompts (60% of requests), the rest as in the reference.

Usage: ``python -m loadtest.tracegen --requests 2000 --seed 7 --out trace.jsonl``.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

KINDS = ("agent", "chat", "rag", "oneoff")
VARIANTS = ("reference", "broken-tools", "trimmed-chat", "timestamp-first", "oneoff")
CHAT_WINDOW = 2048  # tokens a trimmed chat keeps (system prompt included)
_TOOLS_PER_APP = (3, 8)  # broken-tools: separate tool schemas per agent app
_ONEOFF_MIX = {"agent": 0.15, "chat": 0.15, "rag": 0.1, "oneoff": 0.6}

# Nominal requests per session by kind, used to turn the per-request mix into
# per-session odds and the request rate into a session start rate.
_MEAN_STEPS = {"agent": 9.0, "chat": 6.0, "rag": 2.0, "oneoff": 1.0}
# Mean seconds between two requests of one session (tool runtime, human think time).
_MEAN_GAP_S = {"agent": 2.0, "chat": 10.0, "rag": 8.0, "oneoff": 1.0}
_AGENT_APPS = 2  # agent configurations (system prompt + tools) per tenant
_CHAT_PERSONAS = 2  # chat system prompts per tenant


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """What to generate. The mix is the intended share of *requests* per kind."""

    requests: int = 2000
    seed: int = 7
    vocab_size: int = 32000
    tenant_weights: tuple[float, ...] = (0.4, 0.3, 0.2, 0.1)
    agent: float = 0.35
    chat: float = 0.30
    rag: float = 0.25
    oneoff: float = 0.10
    max_prompt_tokens: int = 8192
    max_output_tokens: int = 1024
    rate: float = 10.0  # mean requests per second over the whole trace
    namespaces: tuple[str, ...] = ("llama-3-8b", "llama-3-70b")
    namespace_weights: tuple[float, ...] = (0.8, 0.2)
    # Of `namespaces`, those that are public (shared by every tenant): their records say
    # "public": true, and a replay opens one namespace of that name for all tenants.
    public_namespaces: tuple[str, ...] = ()
    docs_per_tenant: int = 200
    zipf_s: float = 1.1
    variant: str = "reference"  # one of VARIANTS: how prefixes break

    def __post_init__(self) -> None:
        _require(
            self.variant in VARIANTS,
            f"unknown variant {self.variant!r}; choose from {', '.join(VARIANTS)}",
        )
        _require(self.requests >= 0, f"requests must be >= 0, got {self.requests}")
        _require(self.vocab_size >= 16, f"vocab_size must be >= 16, got {self.vocab_size}")
        _require(
            len(self.tenant_weights) >= 1 and all(w > 0 for w in self.tenant_weights),
            f"tenant_weights must be positive, got {self.tenant_weights}",
        )
        _require(
            all(self.share(k) >= 0 for k in KINDS) and sum(map(self.share, KINDS)) > 0,
            "mix shares must be >= 0 and not all zero",
        )
        _require(
            self.max_prompt_tokens >= 16,
            f"max_prompt_tokens must be >= 16, got {self.max_prompt_tokens}",
        )
        _require(
            self.max_output_tokens >= 1,
            f"max_output_tokens must be >= 1, got {self.max_output_tokens}",
        )
        _require(math.isfinite(self.rate) and self.rate > 0, f"rate must be > 0, got {self.rate}")
        _require(len(self.namespaces) >= 1 and all(self.namespaces), "namespaces must be named")
        _require(
            len(self.namespace_weights) == len(self.namespaces)
            and all(w > 0 for w in self.namespace_weights),
            "namespace_weights must be positive, one per namespace",
        )
        unknown = sorted(set(self.public_namespaces) - set(self.namespaces))
        _require(
            not unknown,
            f"public namespaces {unknown} are not among the namespaces {list(self.namespaces)}",
        )
        _require(
            self.docs_per_tenant >= 3, f"docs_per_tenant must be >= 3, got {self.docs_per_tenant}"
        )
        _require(self.zipf_s >= 0, f"zipf_s must be >= 0, got {self.zipf_s}")

    def share(self, kind: str) -> float:
        """The configured request share of ``kind``."""
        return getattr(self, kind)

    @property
    def tenants(self) -> tuple[str, ...]:
        width = len(str(len(self.tenant_weights) - 1))
        return tuple(f"tenant-{i:0{width}d}" for i in range(len(self.tenant_weights)))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def linear_weights(n: int) -> tuple[float, ...]:
    """Tenant sizes n, n-1, ..., 1 normalized: 4 tenants -> 0.4/0.3/0.2/0.1."""
    _require(n >= 1, f"need at least one tenant, got {n}")
    total = n * (n + 1) / 2
    return tuple((n - i) / total for i in range(n))


def _loguniform(rng: random.Random, low: int, high: int) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))


def _tokens(rng: random.Random, vocab: range, n: int) -> list[int]:
    return rng.choices(vocab, k=n)


class _Tenant:
    """A tenant's static content, generated on first use from keyed generators."""

    def __init__(self, name: str, cfg: TraceConfig) -> None:
        self.name = name
        self.cfg = cfg
        self.vocab = range(cfg.vocab_size)
        self._segments: dict[str, list[int]] = {}
        popularity = [1.0 / (rank + 1) ** cfg.zipf_s for rank in range(cfg.docs_per_tenant)]
        self.doc_cum_weights = list(itertools.accumulate(popularity))

    def segment(self, key: str, low: int, high: int) -> list[int]:
        """Fixed tokens for ``key`` (a system prompt, tool schemas, a document)."""
        tokens = self._segments.get(key)
        if tokens is None:
            rng = random.Random(f"tracegen/{self.cfg.seed}/{self.name}/{key}")
            tokens = _tokens(rng, self.vocab, rng.randint(low, high))
            self._segments[key] = tokens
        return tokens

    def document(self, rank: int) -> list[int]:
        return self.segment(f"doc/{rank}", 200, 1500)


# Each session generator yields (prompt tokens, output tokens). A yielded prompt is
# never mutated afterwards: growth always builds a new list.
Step = tuple[list[int], int]


def _agent_tools(tenant: _Tenant, app: int, rng: random.Random) -> list[int]:
    """The app's tool schemas: one fixed segment, or (broken-tools) separate schemas in
    an order of this session's own."""
    if tenant.cfg.variant != "broken-tools":
        return tenant.segment(f"agent/{app}/tools", 600, 2500)
    keyed = random.Random(f"tracegen/{tenant.cfg.seed}/{tenant.name}/agent/{app}/tool-count")
    count = keyed.randint(*_TOOLS_PER_APP)
    tools = [tenant.segment(f"agent/{app}/tool/{i}", 100, 400) for i in range(count)]
    rng.shuffle(tools)
    return [t for tool in tools for t in tool]


def _agent_session(tenant: _Tenant, rng: random.Random) -> Iterator[Step]:
    app = rng.randrange(_AGENT_APPS)
    prompt = (
        tenant.segment(f"agent/{app}/system", 800, 2000)
        + _agent_tools(tenant, app, rng)
        + _tokens(rng, tenant.vocab, rng.randint(40, 300))
    )
    steps = rng.randint(3, 20)
    for step in range(1, steps + 1):
        if step == steps:
            yield prompt, rng.randint(50, 400)  # the final answer
            return
        call = _tokens(rng, tenant.vocab, rng.randint(20, 120))
        yield prompt, len(call)
        result = _tokens(rng, tenant.vocab, _loguniform(rng, 30, 1200))
        if len(prompt) + len(call) + len(result) > tenant.cfg.max_prompt_tokens:
            return  # the agent ran out of context
        prompt = prompt + call + result


def _chat_session(tenant: _Tenant, rng: random.Random) -> Iterator[Step]:
    persona = rng.randrange(_CHAT_PERSONAS)
    system = tenant.segment(f"chat/{persona}/system", 100, 600)
    turns = [_tokens(rng, tenant.vocab, rng.randint(10, 200))]  # user, answer + user, ...
    trim = tenant.cfg.variant == "trimmed-chat"
    for _ in range(rng.randint(2, 10)):
        prompt = system + [t for turn in turns for t in turn]
        answer = _tokens(rng, tenant.vocab, rng.randint(50, 600))
        yield prompt, len(answer)
        question = _tokens(rng, tenant.vocab, rng.randint(10, 200))
        if len(prompt) + len(answer) + len(question) > tenant.cfg.max_prompt_tokens:
            return
        turns.append(answer + question)
        # A trimmed chat drops its oldest turns (never the newest) to fit the window.
        while trim and len(turns) > 1 and len(system) + sum(map(len, turns)) > CHAT_WINDOW:
            turns.pop(0)


def _pick_documents(tenant: _Tenant, rng: random.Random, k: int) -> list[int]:
    ranks: list[int] = []
    population = range(tenant.cfg.docs_per_tenant)
    while len(ranks) < k:
        (rank,) = rng.choices(population, cum_weights=tenant.doc_cum_weights)
        if rank not in ranks:
            ranks.append(rank)
    return ranks


def _rag_session(tenant: _Tenant, rng: random.Random) -> Iterator[Step]:
    context = list(tenant.segment("rag/system", 80, 300))
    for rank in _pick_documents(tenant, rng, rng.randint(1, 3)):
        context += tenant.document(rank)
    for _ in range(rng.randint(1, 3)):
        yield context + _tokens(rng, tenant.vocab, rng.randint(10, 80)), rng.randint(50, 400)


def _oneoff_session(tenant: _Tenant, rng: random.Random) -> Iterator[Step]:
    yield _tokens(rng, tenant.vocab, _loguniform(rng, 30, 3000)), rng.randint(10, 500)


_SESSIONS = {
    "agent": _agent_session,
    "chat": _chat_session,
    "rag": _rag_session,
    "oneoff": _oneoff_session,
}


class _Session:
    """A running session: its generator and the next request it will send."""

    def __init__(
        self,
        sid: str,
        kind: str,
        tenant: _Tenant,
        namespace: str,
        rng: random.Random,
        content: _Tenant | None = None,
    ) -> None:
        """`content`: whose static content the prompts use (a public namespace's, shared
        by every tenant); the tenant's own by default."""
        self.sid = sid
        self.kind = kind
        self.tenant = tenant
        self.namespace = namespace
        self.rng = rng
        self.steps = _SESSIONS[kind](content or tenant, rng)
        self.pending: Step | None = next(self.steps, None)

    def advance(self) -> Step:
        """Return the pending step and fetch the next one."""
        step = self.pending
        assert step is not None  # only sessions with a pending step are scheduled
        self.pending = next(self.steps, None)
        return step

    def gap(self) -> float:
        return self.rng.expovariate(1.0 / _MEAN_GAP_S[self.kind])


def _session_odds(cfg: TraceConfig) -> tuple[list[float], float]:
    """Per-session kind odds that give the request mix, and sessions per second."""
    total = sum(cfg.share(k) for k in KINDS)
    per_session = [cfg.share(k) / total / _MEAN_STEPS[k] for k in KINDS]
    # sum(per_session) = 1 / (mean requests per session)
    return per_session, cfg.rate * sum(per_session)


def _start_session(
    cfg: TraceConfig,
    tenants: list[_Tenant],
    master: random.Random,
    n: int,
    public: dict[str, _Tenant],
) -> _Session:
    odds, _ = _session_odds(cfg)
    (kind,) = master.choices(KINDS, weights=odds)
    (tenant,) = master.choices(tenants, weights=cfg.tenant_weights)
    (namespace,) = master.choices(cfg.namespaces, weights=cfg.namespace_weights)
    rng = random.Random(f"tracegen/{cfg.seed}/session/{n}")
    return _Session(f"{tenant.name}/s{n:06d}", kind, tenant, namespace, rng, public.get(namespace))


def _timestamp(cfg: TraceConfig, t: float) -> list[int]:
    """timestamp-first: the minute of `t` as 8 tokens, the same for every prompt of it."""
    rng = random.Random(f"tracegen/{cfg.seed}/minute/{int(t // 60)}")
    return _tokens(rng, range(cfg.vocab_size), 8)


def _record(index: int, t: float, session: _Session, step: Step, cfg: TraceConfig) -> dict:
    tokens, output = step
    if cfg.variant == "timestamp-first":
        tokens = _timestamp(cfg, t) + tokens
    record = {
        "id": f"r{index:06d}",
        "t": round(t, 6),
        "tenant": session.tenant.name,
        "namespace": session.namespace,
        "session": session.sid,
        "kind": session.kind,
        "tokens": tokens[: cfg.max_prompt_tokens],
        "output_tokens": max(1, min(output, cfg.max_output_tokens)),
    }
    if session.namespace in cfg.public_namespaces:  # absent otherwise: same bytes as before
        record["public"] = True
    return record


def generate(cfg: TraceConfig) -> Iterator[dict]:
    """Yield ``cfg.requests`` request records in arrival order (non-decreasing ``t``)."""
    master = random.Random(f"tracegen/{cfg.seed}/arrivals")
    tenants = [_Tenant(name, cfg) for name in cfg.tenants]
    # A public namespace's system prompts, tools and documents are one set for every
    # tenant (public content), so its sessions share prefixes across tenants.
    public = {ns: _Tenant(f"public/{ns}", cfg) for ns in cfg.public_namespaces}
    _, session_rate = _session_odds(cfg)
    heap: list[tuple[float, int, _Session]] = []
    order = itertools.count()
    next_start = master.expovariate(session_rate)
    sessions = 0
    emitted = 0
    while emitted < cfg.requests:
        if not heap or next_start <= heap[0][0]:
            session = _start_session(cfg, tenants, master, sessions, public)
            sessions += 1
            if session.pending is not None:
                heapq.heappush(heap, (next_start, next(order), session))
            next_start += master.expovariate(session_rate)
            continue
        t, _, session = heapq.heappop(heap)
        yield _record(emitted, t, session, session.advance(), cfg)
        emitted += 1
        if session.pending is not None:
            heapq.heappush(heap, (t + session.gap(), next(order), session))


def write_trace(cfg: TraceConfig, out: TextIO) -> int:
    """Write the trace as JSON Lines to ``out``; return the number of requests."""
    count = 0
    for record in generate(cfg):
        out.write(json.dumps(record, separators=(",", ":")))
        out.write("\n")
        count += 1
    return count


def _parse_mix(text: str) -> dict[str, float]:
    mix = {k: 0.0 for k in KINDS}
    for part in text.split(","):
        kind, sep, value = part.partition("=")
        kind = kind.strip()
        if not sep or kind not in mix:
            raise ValueError(
                f"bad --mix entry {part!r}: use kind=share with kinds "
                f"{', '.join(KINDS)}, e.g. agent=0.35,chat=0.3,rag=0.25,oneoff=0.1"
            )
        try:
            mix[kind] = float(value)
        except ValueError:
            raise ValueError(f"bad --mix share {value!r} for {kind}") from None
    return mix


def variant_mix(variant: str) -> dict[str, float]:
    """The request mix a variant implies ({}: TraceConfig's defaults)."""
    return dict(_ONEOFF_MIX) if variant == "oneoff" else {}


def variant_config(variant: str, **kw) -> TraceConfig:
    """TraceConfig of a named variant (ValueError naming the choices for another)."""
    return TraceConfig(variant=variant, **{**variant_mix(variant), **kw})


def _build_parser() -> argparse.ArgumentParser:
    defaults = TraceConfig()
    p = argparse.ArgumentParser(
        prog="python -m loadtest.tracegen",
        description="Generate a reproducible multi-tenant prompt trace (JSON Lines): agent "
        "loops, multi-turn chat, RAG over shared documents and one-off prompts.",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=defaults.requests,
        help=f"number of requests (default {defaults.requests})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help=f"random seed; same seed, same bytes (default {defaults.seed})",
    )
    p.add_argument("--out", default="-", help="output file (default '-' = stdout)")
    p.add_argument(
        "--tenants",
        type=int,
        default=len(defaults.tenant_weights),
        help="number of tenants, sized n, n-1, ..., 1 (default 4: 0.4/0.3/0.2/0.1)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=defaults.vocab_size,
        help=f"token ids are drawn from [0, vocab) (default {defaults.vocab_size})",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=defaults.max_prompt_tokens,
        help=f"prompt length cap (default {defaults.max_prompt_tokens})",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=defaults.rate,
        help=f"mean requests per second (default {defaults.rate})",
    )
    p.add_argument(
        "--public-namespaces",
        default="",
        help="comma-separated namespaces (of "
        f"{', '.join(defaults.namespaces)}) that are public: shared by "
        "every tenant (default none)",
    )
    p.add_argument(
        "--variant",
        choices=VARIANTS,
        default="reference",
        help="how prefixes break: reference (default), broken-tools (tools in a per-session "
        "order), trimmed-chat (chats trimmed at the front), timestamp-first (the minute "
        "first), oneoff (60%% one-off prompts)",
    )
    p.add_argument(
        "--mix",
        default=None,
        help="request shares per kind, e.g. agent=0.35,chat=0.3,rag=0.25,oneoff=0.1 "
        "(kinds left out get 0)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; 0 on success, 2 on bad arguments."""
    args = _build_parser().parse_args(argv)
    try:
        mix = _parse_mix(args.mix) if args.mix is not None else variant_mix(args.variant)
        cfg = TraceConfig(
            requests=args.requests,
            seed=args.seed,
            tenant_weights=linear_weights(args.tenants),
            vocab_size=args.vocab_size,
            max_prompt_tokens=args.max_prompt_tokens,
            rate=args.rate,
            public_namespaces=tuple(
                n.strip() for n in args.public_namespaces.split(",") if n.strip()
            ),
            variant=args.variant,
            **mix,
        )
    except ValueError as exc:
        print(f"tracegen: {exc}", file=sys.stderr)
        return 2
    if args.out == "-":
        try:
            write_trace(cfg, sys.stdout)
            sys.stdout.flush()
        except BrokenPipeError:  # e.g. piped into `head`: the reader has what it wanted
            sys.stdout = open(os.devnull, "w", encoding="utf-8")
        return 0
    with open(args.out, "w", encoding="utf-8", newline="\n") as out:
        write_trace(cfg, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
