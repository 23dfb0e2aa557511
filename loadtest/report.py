"""Metrics and the report of a trace replay (loadtest/replay.py): per policy and per
tenant, token- and request-weighted hit rates against the trace's ceiling, TTFT
percentiles with and without the cache, saved prefill per GB-hour of device pool, and
requests per node; written as Markdown with PNG plots.

Token-weighted (cached tokens / prompt tokens) and request-weighted (requests with a
hit / requests) rates are kept apart everywhere, as the design brief asks.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

GB = 1e9  # saved prefill per GB-hour uses decimal GB, as capacity planning does
PERCENTILES = (50, 95, 99)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One node as the router priced it for a request (RouteResponse.candidates), so a
    report can show why a request went where it did. Costs in blocks recomputed."""

    node: str
    local_blocks: int
    peer_blocks: int
    in_flight: int
    queued_blocks: float
    cost: float
    recompute: float
    peer: float
    space: float
    load: float
    utilization: float


@dataclass(frozen=True, slots=True)
class Outcome:
    """One replayed request under one policy. Times are simulated seconds, except
    `transfer_s` and its phases, measured wall time: transfer_s = route_s + prefetch_s +
    get_s; put_s (after prefill, so not part of TTFT) is kept for the breakdown."""

    index: int
    tenant: str
    arrival: float
    node: str
    prompt_tokens: int
    cached_tokens: int
    ceiling_tokens: int  # what an unbounded single cache would have served
    hbm_blocks: int  # of the cached blocks, found in the device pool (lookup's view)
    nvme_blocks: int  # ... found only on NVMe
    peer_blocks: int  # blocks the router expected to pull from a peer (ours only)
    index_best_blocks: int  # longest prefix any node held per the router (-1: no router)
    chosen_blocks: int  # local + peer blocks the router promised on its choice (-1: none)
    transfer_s: float
    prefill_s: float  # of the uncached suffix, from the calibrated cost model
    full_prefill_s: float  # of the whole prompt: what the cache saved is the difference
    wait_s: float
    ttft_s: float
    nocache_ttft_s: float
    errors: tuple[str, ...] = ()  # calls that failed or fell short; the rest was recomputed
    route_s: float = 0.0  # prompt hashing + the router's Route call (router policies)
    prefetch_s: float = 0.0  # Peer.Prefetch of the router's peer blocks
    get_s: float = 0.0  # Get of the cached prefix
    put_s: float = 0.0  # Put of the new blocks (after prefill: not in TTFT)
    route_rpc_s: float = 0.0  # the harness's Route call (ours; in route_s only with rpc)
    candidates: tuple[Candidate, ...] = ()  # the router's, cheapest first (ours only)


@dataclass(frozen=True, slots=True)
class SliceStats:
    """Metrics of one policy over one slice of the trace (all requests, or one tenant)."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    requests_with_hit: int
    token_hit_rate: float
    request_hit_rate: float
    ceiling_token_hit_rate: float
    ceiling_request_hit_rate: float
    ttft_s: tuple[float, float, float]  # p50, p95, p99
    nocache_ttft_s: tuple[float, float, float]
    ttft_p50_ratio: float
    ttft_p99_ratio: float
    mean_wait_s: float
    mean_transfer_s: float
    mean_prefill_s: float
    saved_prefill_s: float
    saved_tokens_per_gb_hour: float
    per_node: tuple[tuple[str, int], ...]
    max_mean_load: float
    peer_blocks: int  # blocks the router had copied from a peer (duplicates in the pools)
    nvme_share: float  # of the cached blocks served, those found only on NVMe
    phases_p50_s: tuple[tuple[str, float], ...] = ()  # see PHASES
    prefetches: int = 0  # requests that pulled blocks from a peer


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def max_mean(per_node: dict[str, int], nodes: Sequence[str]) -> float:
    """Requests on the busiest node over the mean per node (every node counts, idle too)."""
    counts = [per_node.get(n, 0) for n in nodes]
    mean = sum(counts) / len(counts) if counts else 0.0
    return max(counts) / mean if mean else math.nan


# What a request's TTFT is made of (cached: route + prefetch + get measured, queue and
# suffix prefill simulated), put (measured, after prefill), and the no-cache TTFT of the
# same requests (queue + full prefill, simulated). Prefetch is over the requests that did
# one; the p50s of the parts need not add up to the p50 of the whole.
PHASES = (
    "route",
    "prefetch",
    "get",
    "transfer",
    "queue",
    "prefill",
    "ttft",
    "put",
    "nocache_queue",
    "nocache_prefill",
    "nocache_ttft",
    "route_rpc",
)


def phases_p50(rows: Sequence[Outcome]) -> tuple[tuple[str, float], ...]:
    cols = {
        "route": [r.route_s for r in rows],
        "prefetch": [r.prefetch_s for r in rows if r.prefetch_s > 0],
        "get": [r.get_s for r in rows],
        "transfer": [r.transfer_s for r in rows],
        "queue": [r.wait_s for r in rows],
        "prefill": [r.prefill_s for r in rows],
        "ttft": [r.ttft_s for r in rows],
        "put": [r.put_s for r in rows],
        "nocache_queue": [r.nocache_ttft_s - r.full_prefill_s for r in rows],
        "nocache_prefill": [r.full_prefill_s for r in rows],
        "nocache_ttft": [r.nocache_ttft_s for r in rows],
        "route_rpc": [r.route_rpc_s for r in rows],
    }
    return tuple((k, percentile(cols[k], 50)) for k in PHASES)


def slice_stats(
    rows: Sequence[Outcome], nodes: Sequence[str], pool_bytes: int, hours: float
) -> SliceStats:
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.cached_tokens for r in rows)
    hits = sum(r.cached_tokens > 0 for r in rows)
    ceiling = sum(r.ceiling_tokens for r in rows)
    ttft = [r.ttft_s for r in rows]
    base = [r.nocache_ttft_s for r in rows]
    q = tuple(percentile(ttft, p) for p in PERCENTILES)
    qb = tuple(percentile(base, p) for p in PERCENTILES)
    n = len(rows) or 1
    per_node = Counter(r.node for r in rows)
    gbh = pool_bytes / GB * hours
    return SliceStats(
        requests=len(rows),
        prompt_tokens=prompt,
        cached_tokens=cached,
        requests_with_hit=hits,
        token_hit_rate=_ratio(cached, prompt),
        request_hit_rate=_ratio(hits, len(rows)),
        ceiling_token_hit_rate=_ratio(ceiling, prompt),
        ceiling_request_hit_rate=_ratio(sum(r.ceiling_tokens > 0 for r in rows), len(rows)),
        ttft_s=q,
        nocache_ttft_s=qb,
        ttft_p50_ratio=_ratio(q[0], qb[0]),
        ttft_p99_ratio=_ratio(q[2], qb[2]),
        mean_wait_s=sum(r.wait_s for r in rows) / n,
        mean_transfer_s=sum(r.transfer_s for r in rows) / n,
        mean_prefill_s=sum(r.prefill_s for r in rows) / n,
        saved_prefill_s=sum(r.full_prefill_s - r.prefill_s for r in rows),
        saved_tokens_per_gb_hour=_ratio(cached, gbh),
        per_node=tuple(sorted(per_node.items())),
        max_mean_load=max_mean(per_node, nodes),
        peer_blocks=sum(r.peer_blocks for r in rows),
        nvme_share=_ratio(
            sum(r.nvme_blocks for r in rows), sum(r.hbm_blocks + r.nvme_blocks for r in rows)
        ),
        phases_p50_s=phases_p50(rows),
        prefetches=sum(r.prefetch_s > 0 for r in rows),
    )


def summarize(
    outcomes: dict[str, list[Outcome]], nodes: Sequence[str], pool_bytes: int, hours: float
) -> dict[str, dict[str, SliceStats]]:
    """policy -> slice ("all" or a tenant) -> stats."""
    out: dict[str, dict[str, SliceStats]] = {}
    for policy, rows in outcomes.items():
        tenants = sorted({r.tenant for r in rows})
        out[policy] = {"all": slice_stats(rows, nodes, pool_bytes, hours)}
        for t in tenants:
            out[policy][t] = slice_stats(
                [r for r in rows if r.tenant == t], nodes, pool_bytes, hours
            )
    return out


def shortfall(rows: Sequence[Outcome], block_size: int) -> dict[str, int]:
    """Where a router-driven policy lost tokens against the ceiling, in tokens:

    - capacity: the ceiling's prefix was on no node when routed (per the router's index:
      evicted, or its blocks not stored yet because the request that makes them was
      still in flight);
    - routing: some node held more than the chosen node could serve with a peer fetch
      (the load or utilization term outweighed those blocks). With peer fetch the chosen
      node reaches the longest holder, so routing costs land in `capacity` instead: the
      copies it makes evict other blocks (see peer copies);
    - serving: the chosen node served less than the router promised (index lag, a block
      evicted or a peer fetch cut short between the route and the get).
    Needs the router's view: rows without one (index_best_blocks < 0) are skipped."""
    out = {"capacity": 0, "routing": 0, "serving": 0}
    for r in rows:
        if r.index_best_blocks < 0:
            continue
        best = min(r.index_best_blocks * block_size, r.ceiling_tokens)
        chosen = min(r.chosen_blocks * block_size, best)
        out["capacity"] += r.ceiling_tokens - best
        out["routing"] += best - chosen
        out["serving"] += max(0, chosen - r.cached_tokens)
    return out


# ---------------------------------------------------------------------- progress
class Progress:
    """A progress bar on stderr: redrawn in place on a terminal (at most 5 times a
    second), one line per 10% otherwise (logs, CI)."""

    def __init__(self, total: int, label: str, stream=sys.stderr) -> None:
        self.total, self.label, self.stream = max(1, total), label, stream
        self.done = 0
        self.t0 = self._last = time.monotonic()
        self._tty = stream.isatty()
        self._decile = 0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self._tty and (now - self._last >= 0.2 or self.done >= self.total):
            self._last = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()
        elif not self._tty and self.done * 10 // self.total > self._decile:
            self._decile = self.done * 10 // self.total
            self.stream.write(self._line(now) + "\n")
            self.stream.flush()

    def _line(self, now: float) -> str:
        frac = self.done / self.total
        bar = "#" * int(frac * 30)
        rate = self.done / max(now - self.t0, 1e-9)
        return (
            f"{self.label:<16} [{bar:<30}] {self.done}/{self.total} "
            f"{rate:6.1f} req/s {now - self.t0:6.1f}s"
        )

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


# ------------------------------------------------------------------------ rendering
LABELS = {"ours": "router (ours)", "rr": "round robin", "chash": "consistent hash"}


def label(policy: str) -> str:
    return LABELS.get(policy, policy)


def stats_dict(stats: dict[str, dict[str, SliceStats]]) -> dict:
    """JSON-ready: NaN becomes null."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return {
        p: {s: {k: clean(v) for k, v in asdict(st).items()} for s, st in slices.items()}
        for p, slices in stats.items()
    }


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.1%}"


def _ms(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x * 1e3:,.0f}"


def _num(x: float, fmt: str = "{:.2f}") -> str:
    return "-" if not math.isfinite(x) else fmt.format(x)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
    ]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _policy_rows(stats: dict[str, dict[str, SliceStats]], key: str) -> list[list[str]]:
    rows = []
    for policy, slices in stats.items():
        s = slices.get(key)
        if s is None:
            continue
        rows.append(
            [
                label(policy),
                _pct(s.token_hit_rate),
                _pct(s.ceiling_token_hit_rate),
                _pct(s.request_hit_rate),
                _pct(s.ceiling_request_hit_rate),
                " / ".join(_ms(x) for x in s.ttft_s),
                " / ".join(_ms(x) for x in s.nocache_ttft_s),
                _num(s.ttft_p50_ratio),
                _num(s.ttft_p99_ratio),
                _num(s.saved_tokens_per_gb_hour, "{:,.3g}"),
                _num(s.max_mean_load),
            ]
        )
    return rows


_HEADERS = (
    "policy",
    "token hit",
    "ceiling",
    "request hit",
    "ceiling",
    "TTFT p50/p95/p99 ms",
    "no cache p50/p95/p99 ms",
    "p50 ratio",
    "p99 ratio",
    "saved tok / GB·h",
    "max/mean load",
)


def _time_rows(stats: dict[str, dict[str, SliceStats]]) -> list[list[str]]:
    rows = []
    for policy, slices in stats.items():
        s = slices["all"]
        rows.append(
            [
                label(policy),
                _ms(s.mean_wait_s),
                _ms(s.mean_transfer_s),
                _ms(s.mean_prefill_s),
                f"{s.saved_prefill_s:,.1f}",
                _pct(s.nvme_share),
                f"{s.peer_blocks:,}",
                ", ".join(f"{n}: {c}" for n, c in s.per_node),
            ]
        )
    return rows


def _phase_rows(stats: dict[str, dict[str, SliceStats]]) -> list[list[str]]:
    rows = []
    for policy, slices in stats.items():
        s = slices["all"]
        p = dict(s.phases_p50_s)
        fine = lambda x: "-" if not math.isfinite(x) else f"{x * 1e3:,.2f}"  # noqa: E731
        rows.append(
            [
                label(policy),
                fine(p["route"]),
                fine(p["route_rpc"]) if p["route_rpc"] > 0 else "-",
                f"{fine(p['prefetch'])} ({s.prefetches:,})",
                fine(p["get"]),
                fine(p["transfer"]),
                _ms(p["queue"]),
                _ms(p["prefill"]),
                _ms(p["ttft"]),
                fine(p["put"]),
                _ms(p["nocache_queue"]),
                _ms(p["nocache_prefill"]),
                _ms(p["nocache_ttft"]),
            ]
        )
    return rows


def render_markdown(
    meta: dict,
    stats: dict[str, dict[str, SliceStats]],
    goals: Sequence[tuple[str, str, str, bool]],
    shortfalls: dict[str, dict[str, int]],
    notes: Sequence[str],
) -> str:
    lines = [f"# Trace replay: {meta.get('title', 'report')}", ""]
    lines += _table(("setting", "value"), [[k, str(v)] for k, v in meta.items() if k != "title"])
    lines += ["", "## Goals", ""]
    lines += _table(
        ("goal", "measured", "target", "met"),
        [[g, v, t, "yes" if ok else "**no**"] for g, v, t, ok in goals],
    )
    lines += ["", "## All tenants", ""]
    lines += _table(_HEADERS, _policy_rows(stats, "all"))
    lines += [
        "",
        "Mean per request in ms (queue wait and prefill simulated, "
        "route+prefetch+get measured wall time), prefill seconds saved, share of "
        "served blocks found only on NVMe, blocks copied from peers, requests per node:",
        "",
    ]
    lines += _table(
        (
            "policy",
            "queue wait",
            "route+prefetch+get",
            "suffix prefill",
            "prefill s saved",
            "from NVMe",
            "peer copies",
            "requests per node",
        ),
        _time_rows(stats),
    )
    lines += [
        "",
        "Per-request phases, p50 in ms: measured route (hashing, plus the router's "
        "decision time or, with --route-charge rpc, the whole Route call), the Route "
        "call's wall time from the harness (not in TTFT unless --route-charge rpc), peer "
        "prefetch (requests that did one), get and their sum; simulated queue wait, "
        "suffix prefill and TTFT; measured put (after prefill, not in TTFT); and the "
        "no-cache TTFT of the same requests (simulated queue + full prefill):",
        "",
    ]
    lines += _table(
        (
            "policy",
            "route",
            "Route call",
            "prefetch (n)",
            "get",
            "route+prefetch+get",
            "queue",
            "prefill",
            "TTFT",
            "put",
            "no cache: queue",
            "prefill",
            "TTFT",
        ),
        _phase_rows(stats),
    )
    tenants = sorted({t for slices in stats.values() for t in slices if t != "all"})
    for t in tenants:
        lines += ["", f"## Tenant {t}", ""]
        lines += _table(_HEADERS, _policy_rows(stats, t))
    if shortfalls:
        lines += ["", "## Tokens lost against the ceiling (router-driven policies)", ""]
        lines += _table(
            ("policy", "capacity", "routing", "serving"),
            [[label(p), *(f"{v:,}" for v in d.values())] for p, d in shortfalls.items()],
        )
    lines += [
        "",
        "## Plots",
        "",
        "![hit rate by policy and tenant](hit_rate.png)",
        "",
        "![TTFT CDF, cached vs no cache](ttft_cdf.png)",
        "",
        "![requests per node](load_per_node.png)",
        "",
    ]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def plot_hit_rates(path: Path, stats: dict[str, dict[str, SliceStats]]) -> None:
    plt = _pyplot()
    policies = list(stats)
    slices = ["all"] + sorted({t for s in stats.values() for t in s if t != "all"})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    width = 0.8 / (len(policies) + 1)
    for ax, attr, ceil_attr, title in (
        (axes[0], "token_hit_rate", "ceiling_token_hit_rate", "token-weighted"),
        (axes[1], "request_hit_rate", "ceiling_request_hit_rate", "request-weighted"),
    ):
        for i, p in enumerate(policies):
            ys = [getattr(stats[p][s], attr) if s in stats[p] else 0 for s in slices]
            ax.bar([x + i * width for x in range(len(slices))], ys, width, label=label(p))
        first = stats[policies[0]]
        ys = [getattr(first[s], ceil_attr) if s in first else 0 for s in slices]
        ax.bar(
            [x + len(policies) * width for x in range(len(slices))],
            ys,
            width,
            label="ceiling",
            color="lightgray",
            edgecolor="gray",
        )
        ax.set_xticks([x + width * len(policies) / 2 for x in range(len(slices))], slices)
        ax.set_title(f"{title} hit rate")
        ax.set_ylim(0, 1)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=len(names), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_ttft_cdf(path: Path, outcomes: dict[str, list[Outcome]]) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for policy, rows in outcomes.items():
        xs = sorted(r.ttft_s * 1e3 for r in rows)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label(policy))
    any_rows = next(iter(outcomes.values()), [])
    xs = sorted(r.nocache_ttft_s * 1e3 for r in any_rows)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], "k--", label="no cache")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (simulated ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF: cached vs no cache")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_load(path: Path, stats: dict[str, dict[str, SliceStats]], nodes: Sequence[str]) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    policies = list(stats)
    width = 0.8 / max(1, len(policies))
    for i, p in enumerate(policies):
        counts = dict(stats[p]["all"].per_node)
        ax.bar(
            [x + i * width for x in range(len(nodes))],
            [counts.get(n, 0) for n in nodes],
            width,
            label=f"{label(p)} (max/mean {stats[p]['all'].max_mean_load:.2f})",
        )
    ax.set_xticks([x + width * (len(policies) - 1) / 2 for x in range(len(nodes))], nodes)
    ax.set_ylabel("requests")
    ax.set_title("requests per node")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(
    out_dir: Path,
    meta: dict,
    outcomes: dict[str, list[Outcome]],
    stats: dict[str, dict[str, SliceStats]],
    nodes: Sequence[str],
    goals: Sequence[tuple[str, str, str, bool]],
    shortfalls: dict[str, dict[str, int]],
    notes: Sequence[str],
    headline: dict,
    extra: dict | None = None,
) -> Path:
    """report.md, hit_rate.png, ttft_cdf.png, load_per_node.png, summary.json and
    requests.jsonl (every Outcome) in `out_dir`. Returns the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_hit_rates(out_dir / "hit_rate.png", stats)
    plot_ttft_cdf(out_dir / "ttft_cdf.png", outcomes)
    plot_load(out_dir / "load_per_node.png", stats, nodes)
    md = out_dir / "report.md"
    md.write_text(render_markdown(meta, stats, goals, shortfalls, notes))
    summary = {
        "headline": headline,
        "meta": meta,
        "stats": stats_dict(stats),
        "shortfall_tokens": shortfalls,
        "notes": list(notes),
        **(extra or {}),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    with open(out_dir / "requests.jsonl", "w") as f:
        for policy, rows in outcomes.items():
            for r in rows:
                f.write(json.dumps({"policy": policy, **asdict(r)}) + "\n")
    return md


# ------------------------------------------------------------- headline and goals
def _r(x: float | None, nd: int = 4):
    return None if x is None or not math.isfinite(x) else round(x, nd)


def headline(
    stats: dict[str, dict[str, SliceStats]],
    ceiling_token: float,
    ceiling_request: float,
    extra: dict,
) -> dict:
    """The one-line JSON summary: ours, plus the hit rates and balance of the others."""
    out: dict = {"ceiling": _r(ceiling_token), "ceiling_request": _r(ceiling_request)}
    ours = stats.get("ours", {}).get("all")
    for key in (
        "token_hit_rate",
        "request_hit_rate",
        "ttft_p50_ratio",
        "ttft_p99_ratio",
        "max_mean_load",
    ):
        out[key] = _r(getattr(ours, key)) if ours else None
    if ours:
        out["phases_p50_ms"] = {k: _r(v * 1e3, 3) for k, v in ours.phases_p50_s}
    for policy, slices in stats.items():
        if policy == "ours":
            continue
        s = slices["all"]
        out[f"{policy}_token_hit_rate"] = _r(s.token_hit_rate)
        out[f"{policy}_request_hit_rate"] = _r(s.request_hit_rate)
        out[f"{policy}_ttft_p50_ratio"] = _r(s.ttft_p50_ratio)
        out[f"{policy}_ttft_p99_ratio"] = _r(s.ttft_p99_ratio)
        out[f"{policy}_max_mean_load"] = _r(s.max_mean_load)
    out.update(extra)
    return out


def goals(
    stats: dict[str, dict[str, SliceStats]], ceiling_token: float, targets: dict[str, float]
) -> list[tuple[str, str, str, bool]]:
    ours = stats.get("ours", {}).get("all")
    if ours is None:
        return []
    want_hit = targets["hit_vs_ceiling"] * ceiling_token
    return [
        (
            "token hit rate vs ceiling",
            f"{ours.token_hit_rate:.1%} "
            f"({_num(ours.token_hit_rate / ceiling_token if ceiling_token else math.nan)} x)",
            f">= {targets['hit_vs_ceiling']} x {ceiling_token:.1%} = {want_hit:.1%}",
            ours.token_hit_rate >= want_hit,
        ),
        (
            "TTFT p50 cached / no cache",
            _num(ours.ttft_p50_ratio),
            f"<= {targets['ttft_p50_ratio']}",
            ours.ttft_p50_ratio <= targets["ttft_p50_ratio"],
        ),
        (
            "max / mean requests per node",
            _num(ours.max_mean_load),
            f"<= {targets['max_mean_load']}",
            ours.max_mean_load <= targets["max_mean_load"],
        ),
    ]


def error_counts(outcomes: dict[str, list[Outcome]]) -> dict[str, dict[str, int]]:
    """policy -> failed gRPC call ("lookup: UNKNOWN") -> count."""
    return {p: dict(Counter(e for r in rows for e in r.errors)) for p, rows in outcomes.items()}


def notes(
    stats: dict[str, dict[str, SliceStats]],
    shortfalls: dict[str, dict[str, int]],
    counters: dict[str, dict[str, int]],
    errors: dict[str, dict[str, int]],
) -> list[str]:
    """Plain-language observations: failed calls, which term dominates what was lost,
    what TTFT is made of, what the agents did."""
    out = []
    for policy, errs in errors.items():
        if errs:
            out.append(
                f"**{label(policy)}: {sum(errs.values()):,} calls failed or fell "
                "short**; what they could not load was recomputed: "
                + ", ".join(f"{k} x{v}" for k, v in sorted(errs.items()))
            )
    for policy, parts in shortfalls.items():
        lost = sum(parts.values())
        if lost:
            top = max(parts, key=parts.get)
            share = ", ".join(f"{k} {v / lost:.0%}" for k, v in parts.items())
            out.append(
                f"{label(policy)}: {lost:,} tokens short of the ceiling; the "
                f"dominant term is **{top}** ({share})."
            )
    for policy, slices in stats.items():
        s = slices["all"]
        terms = {
            "queue wait": s.mean_wait_s,
            "route+prefetch+get": s.mean_transfer_s,
            "suffix prefill": s.mean_prefill_s,
        }
        top = max(terms, key=terms.get)
        out.append(
            f"{label(policy)}: mean TTFT is dominated by {top} "
            f"({', '.join(f'{k} {_ms(v)} ms' for k, v in terms.items())})."
        )
    keys = ("put_blocks", "get_blocks", "promotions", "peer_fetch_ucx", "peer_fetch_grpc")
    for policy, c in counters.items():
        shown = {
            k: v
            for k, v in sorted(c.items())
            if k in keys or "evict" in k or "demot" in k or "drop" in k
        }
        if shown:
            out.append(
                f"{label(policy)} agent counters (all agents, this run): "
                + ", ".join(f"{k} {v:,}" for k, v in shown.items())
            )
    return out
