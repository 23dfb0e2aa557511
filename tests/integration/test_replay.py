"""Trace replay (loadtest/replay.py) and its report (loadtest/report.py).

The end-to-end test runs `python -m loadtest.replay` for real: it starts its own local
cluster (etcd, 2 agents, router), replays 120 requests under the three policies and
writes the report. The trace is built so that cache-aware routing must beat round robin:
an odd number of multi-turn sessions interleaved turn by turn, so round robin over two
agents sends every turn to the node that did not serve the previous one, while the
router (with peer fetch) serves each turn's whole previous prompt from cache. The last
requests ask about public documents, each by both tenants: a public namespace is shared,
so the second tenant's request hits what the first one stored.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.devcluster import ClusterError, down
from kvstore.devprocs import alive
from loadtest import report
from loadtest.replay_sim import HashRing, LinearPrefill, TraceRequest, nocache_ttft

ROOT = Path(__file__).resolve().parents[2]
SESSIONS, TURNS, DOCS = 11, 10, 5  # 11 x 10 + 2 x 5 = 120 requests


def interleaved_chat_trace(path: Path, seed: int = 3) -> None:
    """Turn k of every session, then turn k+1: session s's turn k is request 11k + s
    (+ one-offs at the end), so with 2 agents round robin alternates each session's
    node from turn to turn. Sessions have their own system prompts, so a turn's only
    reusable prefix is the session's earlier prompts."""
    rng = random.Random(seed)
    text = lambda n: [rng.randrange(32000) for _ in range(n)]  # noqa: E731
    prompts = [text(320) for _ in range(SESSIONS)]
    lines, t = [], 0.0
    for _turn in range(TURNS):
        for s in range(SESSIONS):
            lines.append(
                {
                    "t": t,
                    "tenant": f"tenant-{s % 2}",
                    "namespace": "tiny",
                    "tokens": list(prompts[s]),
                }
            )
            prompts[s] = prompts[s] + text(128)  # the answer and the next user message
            t += 0.05
    for _ in range(DOCS):  # requests 110, 112, ... by tenant-0; the next, by tenant-1
        # 39 blocks: recomputing them (78 ms at 8000 tokens/s) outweighs the holder's
        # in-flight load, so the router sends the second ask to the holder. (At 12
        # blocks an idle node recomputing them beat a busy holder, and a pull's measured
        # fixed cost beat both: no hit, as priced.)
        doc = text(632)
        for tenant in ("tenant-0", "tenant-1"):
            lines.append(
                {"t": t, "tenant": tenant, "namespace": "docs", "public": True, "tokens": doc}
            )
            # Tenant-1 asks a second after tenant-0: its store must have landed first, or
            # on a loaded host both run at once and tenant-1 misses (seen once in make test).
            t += 1.0
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _leftover_clusters(tmp: Path) -> list[Path]:
    return [p for p in tmp.glob("kv-replay-*") if (p / "cluster.json").exists()]


@pytest.fixture
def replay_tmp(tmp_path):
    """TMPDIR for the replay, where it creates its cluster's state directory: whatever
    cluster is still recorded there at teardown (the replay failed hard) is stopped."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    yield tmp
    for state_dir in _leftover_clusters(tmp):
        try:
            down(state_dir, grace_s=5.0)
        except ClusterError:
            pass


def test_short_replay_end_to_end(tmp_path, replay_tmp):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out"
    interleaved_chat_trace(trace)
    env = dict(os.environ, TMPDIR=str(replay_tmp), PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "loadtest.replay",
        "--trace",
        str(trace),
        "--agents",
        "2",
        "--workers",
        "4",
        "--pool-fraction",
        "2",
        "--prefill-tokens-per-s",
        "8000",
        # Dispatched at the trace's own times: a document's second ask leaves a second
        # after the first (unpaced, both of every pair could run at once and all miss:
        # seen once in make test).
        "--offered-load",
        "0",
        "--speed",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # stdout is the JSON line, nothing else
    head = json.loads(lines[0])
    assert head["requests"] == 120 and head["agents"] == 2
    for key in (
        "ceiling",
        "token_hit_rate",
        "request_hit_rate",
        "ttft_p50_ratio",
        "ttft_p99_ratio",
        "max_mean_load",
        "rr_token_hit_rate",
        "rr_ttft_p99_ratio",
        "chash_ttft_p99_ratio",
        "pool_fraction",
    ):
        assert isinstance(head[key], float), key
    # The router told its prices (a block recomputed at the given 8000 tokens/s: 2 ms),
    # and ours was charged its decision time, never more than the Route call it made.
    assert head["router_prices_ms"]["recompute_block"] == pytest.approx(2.0)
    assert head["route_charge"] == "decision"
    phases = head["phases_p50_ms"]
    assert 0 < phases["route"] <= phases["route_rpc"]
    for policy in ("", "rr_", "chash_"):
        assert 0.0 <= head[f"{policy}token_hit_rate"] <= head["ceiling"] + 1e-9
        assert 0.0 <= head[f"{policy}request_hit_rate"] <= head["ceiling_request"] + 1e-9
    assert head["token_hit_rate"] >= head["rr_token_hit_rate"]
    assert head["ttft_p50_ratio"] > 0 and head["max_mean_load"] >= 1.0
    for name in ("report.md", "summary.json", "requests.jsonl"):
        assert (out / name).stat().st_size > 0, name
    for name in ("hit_rate.png", "ttft_cdf.png", "load_per_node.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    md = (out / "report.md").read_text()
    assert "round robin" in md and "consistent hash" in md and "tenant-1" in md
    summary = json.loads((out / "summary.json").read_text())
    assert summary["headline"] == head
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 120
    # Ours carries the router's candidates and their cost terms (why it went where it
    # did), cheapest first; the baselines never asked the router.
    terms = ("recompute", "peer", "space", "load", "utilization")
    for r in rows:
        if r["policy"] != "ours":
            assert r["candidates"] == []
            continue
        top = r["candidates"][0]
        assert top["node"] == r["node"] and len(r["candidates"]) == 2
        assert top["cost"] == pytest.approx(sum(top[k] for k in terms), abs=0.05)
        assert top["cost"] <= r["candidates"][1]["cost"]
    # The public documents: one keyspace for both tenants, so tenant-1's asks are hits
    # in the ceiling, and our router serves them from what tenant-0's stored.
    second = [r for r in rows if r["index"] >= SESSIONS * TURNS and r["index"] % 2]
    assert {r["tenant"] for r in second} == {"tenant-1"}
    assert all(r["ceiling_tokens"] == 624 for r in second)
    # Each tenant asks each document once, so any hit on a document request is the
    # other tenant's store: the workers run the pair concurrently (the trace's 1 s gap
    # does not pace them), so either ask of a pair may be the one that hits.
    docs = [r for r in rows if r["index"] >= SESSIONS * TURNS and r["policy"] == "ours"]
    assert sum(r["cached_tokens"] for r in docs) > 0
    # The replay stopped the cluster it started and removed its state directory.
    assert not _leftover_clusters(replay_tmp)
    for pid, kind in summary["cluster_pids"]:
        assert not alive(pid, kind), (pid, kind)


def test_interleaved_trace_ceiling_beats_alternating_nodes(tmp_path):
    """The premise of the end-to-end ordering assertion, checked without a cluster:
    a cache holding only what a node saw under round robin gets less than the ceiling."""
    from kvstore.cli.analyze import analyze, iter_requests
    from loadtest.replay_sim import ceiling_per_request

    trace = tmp_path / "trace.jsonl"
    interleaved_chat_trace(trace)
    reqs = list(iter_requests(trace))
    ceil = ceiling_per_request(reqs)
    assert sum(ceil) == analyze(trace).overall.cached_tokens
    seen: list[set] = [set(), set()]
    rr = 0
    for i, r in enumerate(reqs):
        prefixes = {tuple(r.tokens[:n]) for n in range(16, len(r.tokens) + 1, 16)}
        node = seen[i % 2]
        rr += max((len(p) for p in prefixes & node), default=0)
        node.update(prefixes)
    assert rr < 0.9 * sum(ceil)


# ------------------------------------------------------------------- pure parts
def test_hash_ring_is_stable_and_moves_few_keys():
    keys = [random.Random(i).randbytes(16) for i in range(2000)]
    three = HashRing(["a", "b", "c"])
    assert [three.node(k) for k in keys] == [HashRing(["c", "a", "b"]).node(k) for k in keys]
    counts = {n: sum(three.node(k) == n for k in keys) for n in "abc"}
    assert min(counts.values()) > 2000 / 3 * 0.5  # 64 virtual nodes spread keys
    four = HashRing(["a", "b", "c", "d"])
    moved = [k for k in keys if three.node(k) != four.node(k)]
    assert all(four.node(k) == "d" for k in moved)  # keys only move to the new node
    assert len(moved) < 2000 * 0.45


def test_nocache_baseline_queues_on_the_first_free_node():
    cal = LinearPrefill(100.0)  # 10 ms per token
    reqs = [TraceRequest(i, 0.0, "t", "n", [0] * 100, 0) for i in range(3)]
    # two nodes: two requests start at once, the third waits for the first to finish
    assert nocache_ttft(reqs, cal, ["a", "b"]) == pytest.approx([1.0, 1.0, 2.0])


def test_percentile_and_balance():
    assert report.percentile([3, 1, 2, 4], 50) == pytest.approx(2.5)
    assert report.percentile([5], 99) == 5
    assert report.max_mean({"a": 3, "b": 1}, ["a", "b", "c"]) == pytest.approx(3 / (4 / 3))


def test_shortfall_splits_lost_tokens():
    def row(ceiling, best, chosen, cached):
        return report.Outcome(
            0,
            "t",
            0.0,
            "a",
            1000,
            cached,
            ceiling,
            0,
            0,
            0,
            best,
            chosen,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
        )

    parts = report.shortfall([row(640, 30, 20, 160), row(320, -1, -1, 0)], block_size=16)
    # ceiling 640: index had 480 anywhere (160 lost to capacity), chosen node 320 (160
    # lost to routing), served 160 (160 lost serving); the router-less row is skipped
    assert parts == {"capacity": 160, "routing": 160, "serving": 160}


def test_weight_overrides_parse_and_refuse_bad_input():
    from loadtest.replay import parse_weights

    w = parse_weights("load=2,recompute=1.5")
    assert (w.load, w.recompute, w.peer_fetch) == (2.0, 1.5, 0.0)
    assert parse_weights(None) is None
    for bad in ("load", "speed=1", "load=0", "load=nan"):
        with pytest.raises(ValueError):
            parse_weights(bad)


def test_cli_refuses_bad_arguments(capsys):
    from loadtest.replay import main

    assert main(["--policies", "ours,random"]) == 2
    assert "unknown policies" in capsys.readouterr().err
    assert main(["--decode-ms-per-token", "-1"]) == 2
    assert "--decode-ms-per-token" in capsys.readouterr().err
    assert main(["--requests", "0"]) == 2


def test_bad_traces_are_refused_before_anything_starts(tmp_path, capsys, replay_tmp, monkeypatch):
    from loadtest.replay import main

    monkeypatch.setenv("TMPDIR", str(replay_tmp))  # where a started cluster would live
    good = {"t": 0.0, "tenant": "acme", "namespace": "tiny", "tokens": list(range(40))}
    cases = [
        ([good, {**good, "t": 1.0, "namespace": "team/a"}], "line 2", "'/'"),
        ([{**good, "tenant": "a/b"}], "line 1", "'/'"),
        ([{**good, "public": "yes"}], "line 1", "'public' must be true or false"),
        ([good, {**good, "t": 1.0, "public": True}], "line 2", "public here but private on line 1"),
        ([{**good, "namespace": "\ud800"}], "line 1", "surrogates not allowed"),
    ]
    trace = tmp_path / "bad.jsonl"
    for i, (lines, where, what) in enumerate(cases):
        trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
        fast = ["--prefill-tokens-per-s", "8000", "--decode-ms-per-token", "0"] if i else []
        assert main(["--trace", str(trace), "--agents", "1", *fast]) == 2, what
        err = capsys.readouterr().err
        assert where in err and what in err and "Traceback" not in err, err
        # Refused before calibrating the model or starting a cluster.
        assert "calibrating" not in err and "starting a local cluster" not in err, err
    assert not _leftover_clusters(replay_tmp) and not list(replay_tmp.iterdir())


def test_public_namespaces_are_one_keyspace_for_every_tenant():
    from kvstore.cli.analyze import analyze
    from loadtest.replay_sim import PUBLIC_TENANT, replay_spec

    doc = list(range(64))
    lines = [
        {"t": 0, "tenant": "a", "namespace": "docs", "public": True, "tokens": doc},
        {"t": 1, "tenant": "b", "namespace": "docs", "public": True, "tokens": doc},
        {"t": 2, "tenant": "b", "namespace": "mine", "tokens": doc},
        {"t": 3, "tenant": "a", "namespace": "mine", "tokens": doc},
    ]
    assert analyze(lines).overall.cached_tokens == 64  # b's ask of the public doc only
    a, b = (replay_spec(t, "docs", True, "n-ours") for t in ("a", "b"))
    assert a == b and a.public and a.tenant == PUBLIC_TENANT
    assert a.root(0, None) == b.root(0, None)  # unkeyed: any tenant's client computes it
    mine = {replay_spec(t, "mine", False, "n-ours").namespace_id for t in ("a", "b")}
    assert len(mine) == 2


def test_decode_speed_given_or_measured_on_the_tiny_llama():
    from loadtest.replay_sim import decode_seconds_per_token

    said = []
    assert decode_seconds_per_token(2.5, said.append) == pytest.approx(0.0025)
    assert decode_seconds_per_token(0, said.append) == 0 and not said
    measured = decode_seconds_per_token(None, said.append)
    assert 0 < measured < 5 and "ms per output token" in said[-1]
