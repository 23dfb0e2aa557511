"""Prefix-ceiling analysis of a prompt trace.

The ceiling is the hit rate an unbounded single cache would reach over the same
prompts: requests are replayed in arrival order, each (tenant, namespace) is its own
keyspace, and a request's cached tokens are ``block_size`` x the number of leading
full blocks whose chain id some earlier request of that keyspace already produced.
Routing and capacity decide how close a real cluster gets to it.

Input is JSON Lines, one request per line::

    {"t": 12.5, "tenant": "acme", "namespace": "llama-3-8b", "tokens": [1, 2, ...]}

An optional ``"public": true`` marks the namespace public: shared by every tenant (one
keyspace for all of them), as public namespaces are in the store. Extra keys are ignored;
blank lines are skipped; the file is streamed, and it must be
sorted by ``t`` (a line that goes back in time is an error, because replaying it out of
order would overstate or understate the ceiling).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvstore.hashing import hash_chain

# (label, lowest cached-token count in the bucket); the last bucket is open-ended.
HIT_BUCKETS: tuple[tuple[str, int], ...] = (
    ("0", 0),
    ("1-255", 1),
    ("256-1k", 256),
    ("1k-4k", 1024),
    ("4k-16k", 4096),
    ("16k+", 16384),
)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Request:
    """One validated trace line: what the analysis needs of it."""

    line: int
    t: float
    tenant: str
    namespace: str
    tokens: tuple[int, ...] | list[int]
    output_tokens: int = 0  # tokens generated after the prompt (optional in a trace)
    public: bool = False  # a public namespace: every tenant shares its keyspace

    @property
    def keyspace(self) -> tuple[str, str]:
        """(tenant, namespace); a public namespace is one keyspace whoever asks ("" is
        no tenant's name: tenants are non-empty)."""
        return ("" if self.public else self.tenant, self.namespace)


@dataclass(frozen=True, slots=True)
class HitStats:
    """Ceiling counters for one slice of the trace (everything, or one tenant)."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    requests_with_hit: int
    distinct_blocks: int
    histogram: tuple[tuple[str, int], ...]

    @property
    def token_hit_rate(self) -> float:
        """Cached tokens / prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        """Fraction of requests with at least one cached block."""
        return self.requests_with_hit / self.requests if self.requests else 0.0


@dataclass(frozen=True, slots=True)
class AnalysisReport:
    """Result of :func:`analyze`."""

    block_size: int
    overall: HitStats
    tenants: tuple[tuple[str, HitStats], ...]
    keyspaces: int
    first_t: float | None
    last_t: float | None

    @property
    def distinct_tokens(self) -> int:
        """Size of the unbounded cache in tokens (distinct blocks x block size)."""
        return self.overall.distinct_blocks * self.block_size


@dataclass(slots=True)
class _Tally:
    """Mutable accumulator behind a :class:`HitStats`."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests_with_hit: int = 0
    distinct_blocks: int = 0
    histogram: list[int] = field(default_factory=lambda: [0] * len(HIT_BUCKETS))

    def add(self, prompt: int, cached: int, new_blocks: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.requests_with_hit += cached > 0
        self.distinct_blocks += new_blocks
        self.histogram[_bucket(cached)] += 1

    def freeze(self) -> HitStats:
        labels = (label for label, _ in HIT_BUCKETS)
        return HitStats(
            requests=self.requests,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            requests_with_hit=self.requests_with_hit,
            distinct_blocks=self.distinct_blocks,
            histogram=tuple(zip(labels, self.histogram)),
        )


def _bucket(cached: int) -> int:
    index = 0
    for i, (_, low) in enumerate(HIT_BUCKETS):
        if cached >= low:
            index = i
    return index


def keyspace_root(tenant: str, namespace: str) -> bytes:
    """A 16-byte chain root per (tenant, namespace).

    Only separates keyspaces for the analysis; it is not the production root (which
    is keyed with a tenant secret). Length-prefixed UTF-8 keeps the encoding canonical.
    """
    h = hashlib.blake2b(digest_size=16, person=b"kvctl-analyze")
    for part in (tenant, namespace):
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return h.digest()


def _fail(line: int, problem: str) -> ValueError:
    return ValueError(f"line {line}: {problem}")


def _check_tokens(line: int, tokens: object) -> list[int]:
    if not isinstance(tokens, list):
        raise _fail(line, f"'tokens' must be a list of integers, got {type(tokens).__name__}")
    for i, tok in enumerate(tokens):
        if type(tok) is not int or not 0 <= tok <= _INT32_MAX:
            raise _fail(line, f"tokens[{i}] = {tok!r} is not a token id (0..2^31-1)")
    return tokens


def _check_text(line: int, record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value:
        raise _fail(line, f"'{key}' must be a non-empty string, got {value!r}")
    return value


def _json_kind(value: object) -> str:
    """What a decoded JSON value is, in JSON's words."""
    if value is None:
        return "null"
    names = {bool: "true/false", int: "a number", float: "a number", str: "a string"}
    return names.get(type(value), "an array" if isinstance(value, list) else type(value).__name__)


def parse_record(line: int, record: object) -> Request:
    """Validate one decoded trace record; errors name the line and the problem."""
    if not isinstance(record, dict):
        raise _fail(line, f"expected a JSON object, got {_json_kind(record)}")
    for key in ("t", "tenant", "namespace", "tokens"):
        if key not in record:
            raise _fail(line, f"missing required key '{key}'")
    t = record["t"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise _fail(line, f"'t' must be a finite number of seconds, got {t!r}")
    out = record.get("output_tokens", 0)
    if type(out) is not int or not 0 <= out <= _INT32_MAX:
        raise _fail(line, f"'output_tokens' must be an integer >= 0, got {out!r}")
    public = record.get("public", False)
    if not isinstance(public, bool):
        raise _fail(line, f"'public' must be true or false, got {public!r}")
    return Request(
        line=line,
        t=float(t),
        tenant=_check_text(line, record, "tenant"),
        namespace=_check_text(line, record, "namespace"),
        tokens=_check_tokens(line, record["tokens"]),
        output_tokens=out,
        public=public,
    )


_BLANK = object()  # a blank line: skipped (a `null` line is a record, and refused)


def _decode(line: int, raw: str | bytes | dict) -> object:
    if isinstance(raw, dict):
        return raw
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    if not text.strip():
        return _BLANK
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(line, f"invalid JSON: {exc.msg} at column {exc.colno}") from None


def _lines(source: str | os.PathLike | Iterable) -> Iterator[str | bytes | dict]:
    if isinstance(source, (str, os.PathLike)):
        if os.fspath(source) == "-":
            yield from sys.stdin
            return
        with open(source, encoding="utf-8") as f:
            yield from f
    else:
        yield from source


def iter_requests(source: str | os.PathLike | Iterable) -> Iterator[Request]:
    """Stream validated requests from a path, ``"-"`` (stdin), or an iterable of lines/dicts."""
    last_t = -math.inf
    for line, raw in enumerate(_lines(source), start=1):
        record = _decode(line, raw)
        if record is _BLANK:
            continue
        request = parse_record(line, record)
        if request.t < last_t:
            raise _fail(
                line,
                f"t={request.t} is earlier than the previous request "
                f"(t={last_t}); sort the trace by arrival time",
            )
        last_t = request.t
        yield request


def cached_blocks(ids: list[bytes], seen: set[bytes]) -> int:
    """How many leading blocks of `ids` an unbounded cache holding `seen` would serve."""
    count = 0
    for block_id in ids:
        if block_id not in seen:
            break
        count += 1
    return count


def analyze(source: str | os.PathLike | Iterable, block_size: int = 16) -> AnalysisReport:
    """Replay a trace through an unbounded per-keyspace cache and count the hits."""
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    roots: dict[tuple[str, str], bytes] = {}
    seen: set[bytes] = set()  # roots differ per keyspace, so one set serves them all
    overall = _Tally()
    tenants: dict[str, _Tally] = {}
    first_t = last_t = None
    for req in iter_requests(source):
        key = req.keyspace
        root = roots.get(key)
        if root is None:
            root = roots[key] = keyspace_root(*key)
        ids = hash_chain(root, req.tokens, block_size)
        hit = cached_blocks(ids, seen)
        before = len(seen)
        seen.update(ids)
        new_blocks = len(seen) - before
        for tally in (overall, tenants.setdefault(req.tenant, _Tally())):
            tally.add(len(req.tokens), hit * block_size, new_blocks)
        first_t = req.t if first_t is None else first_t
        last_t = req.t
    return AnalysisReport(
        block_size=block_size,
        overall=overall.freeze(),
        tenants=tuple((name, tenants[name].freeze()) for name in sorted(tenants)),
        keyspaces=len(roots),
        first_t=first_t,
        last_t=last_t,
    )


def _stats_dict(stats: HitStats) -> dict:
    return {
        "requests": stats.requests,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
        "token_hit_rate": stats.token_hit_rate,
        "requests_with_hit": stats.requests_with_hit,
        "request_hit_rate": stats.request_hit_rate,
        "distinct_blocks": stats.distinct_blocks,
        "hit_length_histogram": dict(stats.histogram),
    }


def report_dict(report: AnalysisReport) -> dict:
    """A JSON-ready view of the report, rates included."""
    return {
        "block_size": report.block_size,
        "keyspaces": report.keyspaces,
        "first_t": report.first_t,
        "last_t": report.last_t,
        "distinct_tokens": report.distinct_tokens,
        "overall": _stats_dict(report.overall),
        "tenants": {name: _stats_dict(stats) for name, stats in report.tenants},
    }


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    fmt = lambda r: "  ".join(  # noqa: E731 - local one-liner
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
    )
    return [fmt(headers), *(fmt(r) for r in rows)]


def _render_table(report: AnalysisReport) -> str:
    rows = [("all", report.overall), *report.tenants]
    span = "-" if report.first_t is None else f"{report.first_t:.3f}s .. {report.last_t:.3f}s"
    lines = [
        f"prefix ceiling (unbounded cache), block size {report.block_size}, "
        f"{report.keyspaces} keyspaces, trace span {span}",
        "",
        *_table(
            [
                "tenant",
                "requests",
                "prompt tok",
                "cached tok",
                "token hit",
                "req w/ hit",
                "request hit",
                "distinct blocks",
            ],
            [
                [
                    name,
                    f"{s.requests:,}",
                    f"{s.prompt_tokens:,}",
                    f"{s.cached_tokens:,}",
                    f"{s.token_hit_rate:.1%}",
                    f"{s.requests_with_hit:,}",
                    f"{s.request_hit_rate:.1%}",
                    f"{s.distinct_blocks:,}",
                ]
                for name, s in rows
            ],
        ),
        "",
        "hit length (cached tokens per request):",
        *_table(
            ["tenant", *(label for label, _ in HIT_BUCKETS)],
            [[name, *(f"{n:,}" for _, n in s.histogram)] for name, s in rows],
        ),
    ]
    return "\n".join(lines)


def render_analysis(report: AnalysisReport, output: str = "table") -> str:
    """Render an analysis as a text table or as JSON."""
    if output == "json":
        return json.dumps(report_dict(report), indent=2)
    if output != "table":
        raise ValueError(f"unknown output format {output!r}: use 'table' or 'json'")
    return _render_table(report)


def add_analyze_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvctl analyze`` arguments to ``parser``."""
    parser.description = (
        "Prefix-ceiling analysis of a prompt trace: the token- and request-weighted hit "
        "rate of an unbounded single cache over the same prompts, per tenant, with the "
        "hit-length distribution and the number of distinct blocks."
    )
    parser.add_argument(
        "trace",
        help="JSON Lines trace, one request per line with t, tenant, namespace, tokens "
        "(sorted by t); '-' reads stdin",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument(
        "--output", choices=("table", "json"), default="table", help="output format (default table)"
    )


def analyze_command(args: argparse.Namespace) -> int:
    """Run ``kvctl analyze``: print the report; 0 on success, 2 on a bad option, 1 when
    the trace cannot be read or is malformed (kvctl's exit codes: 1 failure, 2 usage)."""
    if type(args.block_size) is not int or args.block_size < 1:
        print(f"kvctl analyze: --block-size must be >= 1, got {args.block_size}", file=sys.stderr)
        return 2
    try:
        report = analyze(args.trace, block_size=args.block_size)
        text = render_analysis(report, getattr(args, "output", "table"))
    except (ValueError, OSError) as exc:
        print(f"kvctl analyze: {args.trace}: {exc}", file=sys.stderr)
        return 1
    if not report.overall.requests:  # an all-zero table would read as "no hits at all"
        print(f"kvctl analyze: {args.trace}: the trace holds no requests", file=sys.stderr)
        return 1
    print(text)
    return 0
