"""The simulated side of a trace replay (loadtest/replay.py), no cluster I/O: the trace
and its per-request ceiling, the prefill cost model (measured on the tiny Llama, or a
given speed), the time scale that sets the offered load, the no-cache TTFT baseline, and
the consistent-hash ring of the baseline policy."""

from __future__ import annotations

import functools
import math
from bisect import bisect_right
from dataclasses import dataclass
from hashlib import blake2b
from typing import TYPE_CHECKING, Union

from kvstore.cli.analyze import Request, cached_blocks, iter_requests, keyspace_root
from kvstore.hashing import hash_chain
from kvstore.namespace import Namespace
from loadtest.tracegen import TraceConfig, generate, variant_config

if TYPE_CHECKING:  # importing it pulls in transformers: only calibration needs that
    from loadtest.model import PrefillCalibration

BLOCK = 16  # tokens per block (the replay's KV layout)
LAYOUT = dict(
    model_name="tiny-llama",
    model_revision="seed0",
    adapter_id="none",
    adapter_revision="none",
    tokenizer_id="synthetic",
    tokenizer_revision="v1",
    rope_type="default",
    rope_theta=10000.0,
    rope_scaling="none",
    attention_impl="sdpa",
    kv_dtype="float16",
    prompt_template_version="v1",
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    tp_rank=0,
    tp_size=1,
    block_size=BLOCK,
)
# Owner of the trace's public namespaces: every tenant opens that owner's namespace (a
# tenant may open another's public namespace), so all of them share its blocks.
PUBLIC_TENANT = "public"


def replay_spec(tenant: str, trace_ns: str, public: bool, run: str) -> Namespace:
    """The namespace a replay opens for a trace namespace; `run` names the run and
    policy ("<nonce>-<policy>"), so each policy starts empty. Raises InvalidArgument
    (a ValueError) for what the store would refuse."""
    owner = PUBLIC_TENANT if public else tenant
    return Namespace(tenant=owner, name=f"replay-{run}-{trace_ns}", public=public, **LAYOUT)


def check_trace(reqs: list[Request]) -> None:
    """Everything the replay will ask of the store, checked before a cluster starts:
    each namespace as the agents will validate it (kvstore.namespace: no '/', text that
    encodes), and a namespace public on every line or on none. ValueError names the
    line."""
    seen: dict[tuple[str, str], int] = {}
    public: dict[str, tuple[bool, int]] = {}
    for r in reqs:
        was = public.setdefault(r.namespace, (r.public, r.line))
        if was[0] != r.public:
            raise ValueError(
                f"line {r.line}: namespace {r.namespace!r} is "
                f"{'public' if r.public else 'private'} here but "
                f"{'public' if was[0] else 'private'} on line {was[1]}"
            )
        key = r.keyspace
        if key in seen:
            continue
        seen[key] = r.line
        try:
            # namespace_id encodes every field: text that cannot be UTF-8 fails here too
            _ = replay_spec(r.tenant, r.namespace, r.public, "0-ours").namespace_id
            if r.public:  # the tenant itself must be valid too, though it owns nothing
                _ = replay_spec(r.tenant, r.namespace, False, "0-ours").namespace_id
        except ValueError as exc:  # InvalidArgument, UnicodeEncodeError
            raise ValueError(
                f"line {r.line}: tenant {r.tenant!r}, namespace {r.namespace!r}: {exc}"
            ) from None


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    t: float  # simulated arrival, seconds (trace time x time scale)
    tenant: str
    namespace: str
    tokens: list[int]
    ceiling_tokens: int
    output_tokens: int = 0  # generated after the prompt: the request decodes this long
    public: bool = False  # its namespace is public: shared by every tenant


def load_trace(
    trace: str | None, requests: int | None, seed: int, variant: str = "reference"
) -> tuple[list[Request], object]:
    """Validated requests in arrival order (a file, else the trace `variant` of
    loadtest.tracegen), and the same requests again as a source for kvctl's analyze()."""
    if trace:
        source: object = trace
    else:
        n = requests or TraceConfig().requests
        source = list(generate(variant_config(variant, requests=n, seed=seed)))
    reqs = list(iter_requests(source))
    if trace and requests:
        reqs = reqs[:requests]
        source = [
            {
                "t": r.t,
                "tenant": r.tenant,
                "namespace": r.namespace,
                "tokens": r.tokens,
                "public": r.public,
            }
            for r in reqs
        ]
    if not reqs:
        raise ValueError("the trace holds no requests")
    return reqs, source


def ceiling_per_request(reqs: list[Request]) -> list[int]:
    """Cached tokens of each request under one unbounded cache, the way
    kvstore.cli.analyze counts them (one keyspace per tenant and namespace)."""
    seen: set[bytes] = set()
    roots: dict[tuple[str, str], bytes] = {}
    out = []
    for r in reqs:
        key = r.keyspace
        root = roots.get(key) or roots.setdefault(key, keyspace_root(*key))
        ids = hash_chain(root, r.tokens, BLOCK)
        out.append(cached_blocks(ids, seen) * BLOCK)
        seen.update(ids)
    return out


@dataclass(frozen=True, slots=True)
class LinearPrefill:
    """Prefill at a fixed speed: the pricing part of loadtest.model.PrefillCalibration's
    interface, without importing transformers (seconds of start-up)."""

    tokens_per_s: float

    def prefill_seconds(self, length: int) -> float:
        return max(0, length) / self.tokens_per_s

    def suffix_seconds(self, cached: int, total: int) -> float:
        return max(0, total - cached) / self.tokens_per_s

    def to_dict(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s}


CostModel = Union["PrefillCalibration", LinearPrefill]


def calibrate(tokens_per_s: float | None, max_len: int, say) -> CostModel:
    """A given throughput (linear cost), or a measurement of the tiny Llama's prefill."""
    if tokens_per_s:
        return LinearPrefill(tokens_per_s)
    from loadtest.model import PrefillCalibration, measure_prefill

    model = _tiny_llama(max(4096, max_len))
    lengths = [n for n in (16, 128, 512, 2048) if n < max_len] + [max_len]
    say(f"calibrating prefill of the tiny Llama at {lengths} tokens ...")
    # Two passes, the faster of the two per length: on a shared host one stall (or the
    # first forward pass) would otherwise price every later length, since prefill cost
    # is kept non-decreasing in length.
    passes = [
        measure_prefill(model, lengths, repeats=3, seed=i, max_seconds=20.0) for i in range(2)
    ]
    best: list[float] = []
    for times in zip(*(c.seconds for c in passes)):
        best.append(max(min(times), best[-1] if best else 0.0))
    cal = PrefillCalibration(passes[0].lengths, tuple(best))
    say("  " + ", ".join(f"{n}: {s * 1e3:.0f} ms" for n, s in zip(cal.lengths, cal.seconds)))
    return cal


@functools.cache
def _tiny_llama(max_positions: int):
    """The seeded tiny Llama both calibrations time (built once per run)."""
    from loadtest.model import build_tiny_llama

    return build_tiny_llama(0, max_positions=max_positions)


def marginal_tokens_per_s(cal: CostModel, reqs: list[Request]) -> float:
    """What the router should price a recomputed block at (its prefill_tokens_per_s):
    the measured cost of the prompt's second half at the trace's median prompt length,
    i.e. what one more cached block saves there (the first tokens also pay the model's
    per-call overhead, which a cache hit does not save)."""
    lengths = sorted(len(r.tokens) for r in reqs)
    m = max(2 * BLOCK, lengths[len(lengths) // 2])
    s = cal.prefill_seconds(m) - cal.prefill_seconds(m // 2)
    if s <= 0:  # a flat calibration: price at the whole prompt's throughput
        s = cal.prefill_seconds(m) * (m - m // 2) / m
    return (m - m // 2) / s if s > 0 else 1e9


def decode_seconds_per_token(ms_per_token: float | None, say, max_len: int = 0) -> float:
    """A given decode speed, or the tiny Llama's measured decode step (at 512 tokens of
    context: each output token is one forward pass over the KV cache)."""
    if ms_per_token is not None:
        return ms_per_token / 1e3
    from loadtest.model import measure_decode

    model = _tiny_llama(max(4096, max_len))
    # The faster of two passes, as for prefill: one stall must not price every token.
    s = min(measure_decode(model, 512, 16, seed=i) for i in range(2))
    say(f"  decode: {s * 1e3:.1f} ms per output token")
    return s


def time_scale(
    reqs: list[Request], cal: CostModel, agents: int, offered_load: float
) -> tuple[float, float]:
    """(scale, native load): stretch or squeeze arrivals so full prefill (no cache)
    would keep the agents `offered_load` busy; scale 1 when offered_load is 0."""
    span = reqs[-1].t - reqs[0].t
    work = sum(cal.prefill_seconds(len(r.tokens)) for r in reqs)
    native = work / (agents * span) if span > 0 else math.inf
    if offered_load <= 0 or not math.isfinite(native):
        return 1.0, native
    return native / offered_load, native


def nocache_ttft(reqs: list[TraceRequest], cal: CostModel, nodes: list[str]) -> list[float]:
    """Full prefill, each request on the node that frees up first."""
    busy = {n: 0.0 for n in nodes}
    out = []
    for r in reqs:
        node = min(nodes, key=lambda n: (busy[n], n))
        start = max(r.t, busy[node])
        busy[node] = start + cal.prefill_seconds(len(r.tokens))
        out.append(busy[node] - r.t)
    return out


def simulated_requests(raw: list[Request], scale: float) -> list[TraceRequest]:
    """Trace requests with arrivals from 0, scaled, and their ceilings."""
    ceil = ceiling_per_request(raw)
    return [
        TraceRequest(
            i,
            (r.t - raw[0].t) * scale,
            r.tenant,
            r.namespace,
            list(r.tokens),
            c,
            r.output_tokens,
            r.public,
        )
        for i, (r, c) in enumerate(zip(raw, ceil))
    ]


class HashRing:
    """Consistent hashing with virtual nodes: a key goes to the first point at or after
    its hash, so adding a node moves only ~1/n of the keys."""

    def __init__(self, nodes: list[str], vnodes: int = 64) -> None:
        points = sorted((self._h(f"{n}#{i}".encode()), n) for n in nodes for i in range(vnodes))
        self._keys = [k for k, _ in points]
        self._nodes = [n for _, n in points]

    @staticmethod
    def _h(data: bytes) -> int:
        return int.from_bytes(blake2b(data, digest_size=8).digest(), "little")

    def node(self, key: bytes) -> str:
        i = bisect_right(self._keys, self._h(key))
        return self._nodes[i % len(self._nodes)]
