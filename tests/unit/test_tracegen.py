"""Tests for loadtest.tracegen: determinism, request structure and the resulting ceiling."""

from __future__ import annotations

import io
import json
import os
import time
from collections import Counter, defaultdict

import pytest

from kvstore.cli.analyze import analyze
from loadtest.tracegen import KINDS, TraceConfig, generate, linear_weights, main, write_trace

KEYS = ["id", "t", "tenant", "namespace", "session", "kind", "tokens", "output_tokens"]


@pytest.fixture(scope="module")
def default_trace():
    """The default trace (2000 requests, seed 7), generated once, with its timing."""
    start = time.perf_counter()
    buf = io.StringIO()
    count = write_trace(TraceConfig(), buf)
    elapsed = time.perf_counter() - start
    text = buf.getvalue()
    return count, text, [json.loads(line) for line in text.splitlines()], elapsed


def _text(cfg: TraceConfig) -> str:
    buf = io.StringIO()
    write_trace(cfg, buf)
    return buf.getvalue()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_same_seed_same_bytes_different_seed_differs(default_trace):
    _, text, _, _ = default_trace
    assert _text(TraceConfig()) == text
    assert _text(TraceConfig(seed=8)) != text
    small = TraceConfig(requests=100, seed=3)
    assert _text(small) == _text(small)


def test_cli_writes_identical_files_for_a_seed(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.jsonl", "b.jsonl", "c.jsonl"))
    assert main(["--requests", "150", "--seed", "7", "--out", str(a)]) == 0
    assert main(["--requests", "150", "--seed", "7", "--out", str(b)]) == 0
    assert main(["--requests", "150", "--seed", "9", "--out", str(c)]) == 0
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert len(a.read_bytes().splitlines()) == 150
    # The CLI defaults are the library defaults.
    assert a.read_text() == _text(TraceConfig(requests=150, seed=7))


def test_records_are_well_formed(default_trace):
    count, _, records, _ = default_trace
    assert count == len(records) == 2000
    assert len({r["id"] for r in records}) == 2000
    for r in records:
        assert list(r) == KEYS
        assert r["kind"] in KINDS
        assert 1 <= len(r["tokens"]) <= 8192
        assert all(0 <= tok < 32000 for tok in r["tokens"])
        assert 1 <= r["output_tokens"] <= 1024
    times = [r["t"] for r in records]
    assert times == sorted(times) and times[0] >= 0


def test_tenants_namespaces_and_kinds_present(default_trace):
    _, _, records, _ = default_trace
    tenants = Counter(r["tenant"] for r in records)
    assert len(tenants) == 4
    assert tenants["tenant-0"] > tenants["tenant-2"] > tenants["tenant-3"]
    assert len({r["namespace"] for r in records}) == 2
    kinds = Counter(r["kind"] for r in records)
    intended = {"agent": 0.35, "chat": 0.30, "rag": 0.25, "oneoff": 0.10}
    for kind, share in intended.items():
        assert abs(kinds[kind] / 2000 - share) < 0.12, kinds


def test_sessions_interleave(default_trace):
    _, _, records, _ = default_trace
    last_seen: dict[str, int] = {}
    interleaved = 0
    for i, r in enumerate(records):
        if r["session"] in last_seen and last_seen[r["session"]] != i - 1:
            interleaved += 1
        last_seen[r["session"]] = i
    assert interleaved > 100
    for r in records:  # a session belongs to one tenant, namespace and kind
        assert r["session"].startswith(r["tenant"] + "/")
    by_session = defaultdict(set)
    for r in records:
        by_session[r["session"]].add((r["tenant"], r["namespace"], r["kind"]))
    assert all(len(v) == 1 for v in by_session.values())


def _sessions(records, kind):
    out = defaultdict(list)
    for r in records:
        if r["kind"] == kind:
            out[r["session"]].append(r)
    return out


@pytest.mark.parametrize("kind", ["chat", "agent"])
def test_turns_extend_the_previous_prompt(default_trace, kind):
    _, _, records, _ = default_trace
    multi = [s for s in _sessions(records, kind).values() if len(s) >= 3]
    assert len(multi) >= 10
    for steps in multi:
        for prev, cur in zip(steps, steps[1:]):
            assert len(cur["tokens"]) > len(prev["tokens"])
            assert cur["tokens"][: len(prev["tokens"])] == prev["tokens"]
            # The previous answer is in the new prompt, right after the old prompt.
            assert len(cur["tokens"]) >= len(prev["tokens"]) + prev["output_tokens"]


def test_agent_sessions_share_system_prompt_and_tools(default_trace):
    _, _, records, _ = default_trace
    firsts = defaultdict(list)  # tenant -> first prompt of each agent session
    for steps in _sessions(records, "agent").values():
        firsts[steps[0]["tenant"]].append(steps[0]["tokens"])
    for tenant, prompts in firsts.items():
        # Sessions of one agent app share its system prompt and tool schemas (>= 1400
        # tokens) and then diverge at the task.
        shared = [_common_prefix(prompts[0], p) for p in prompts[1:]]
        assert any(n >= 1400 for n in shared), tenant
        assert all(n < len(p) for n, p in zip(shared, prompts[1:]))
    t0, t1 = firsts["tenant-0"][0], firsts["tenant-1"][0]
    assert _common_prefix(t0, t1) < 4  # tenants never share content (beyond chance)


def test_rag_requests_share_documents_across_sessions(default_trace):
    _, _, records, _ = default_trace
    for tenant in ("tenant-0", "tenant-1"):
        rag = [r for r in records if r["kind"] == "rag" and r["tenant"] == tenant]
        assert len(rag) >= 20
        # Every RAG prompt of a tenant starts with the same system prompt ...
        system_len = min(_common_prefix(rag[0]["tokens"], r["tokens"]) for r in rag[1:])
        assert system_len >= 80
        # ... and popular documents make prompts of different sessions share much more.
        doc_sharing = {
            (a["session"], b["session"])
            for i, a in enumerate(rag)
            for b in rag[i + 1 :]
            if a["session"] != b["session"]
            and _common_prefix(a["tokens"], b["tokens"]) >= system_len + 200
        }
        assert len(doc_sharing) >= 5


def test_oneoff_prompts_share_nothing():
    records = list(generate(TraceConfig(requests=300, seed=1, agent=0, chat=0, rag=0, oneoff=1)))
    assert {r["kind"] for r in records} == {"oneoff"}
    report = analyze(records)
    assert report.overall.cached_tokens == 0


def test_default_trace_ceiling_is_between_zero_and_one(default_trace):
    _, text, _, _ = default_trace
    report = analyze(io.StringIO(text))
    overall = report.overall
    assert overall.requests == 2000
    assert 0.4 < overall.token_hit_rate < 0.98
    assert 0.4 < overall.request_hit_rate < 0.99
    assert overall.token_hit_rate != overall.request_hit_rate
    assert len(report.tenants) == 4
    assert all(0 < s.token_hit_rate < 1 for _, s in report.tenants)


def test_prompt_cap_respected():
    records = list(generate(TraceConfig(requests=300, seed=2, max_prompt_tokens=512)))
    assert max(len(r["tokens"]) for r in records) <= 512
    assert Counter(r["kind"] for r in records)["agent"] > 0


def test_vocab_and_tenant_count_configurable():
    cfg = TraceConfig(requests=400, seed=4, vocab_size=100, tenant_weights=linear_weights(6))
    records = list(generate(cfg))
    assert max(tok for r in records for tok in r["tokens"]) < 100
    assert len({r["tenant"] for r in records}) == 6
    assert linear_weights(4) == pytest.approx((0.4, 0.3, 0.2, 0.1))


def test_generate_is_lazy_and_exact():
    gen = generate(TraceConfig(requests=5, seed=1))
    assert next(gen)["id"] == "r000000"
    assert len(list(gen)) == 4
    assert list(generate(TraceConfig(requests=0))) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(requests=-1),
        dict(vocab_size=1),
        dict(tenant_weights=()),
        dict(tenant_weights=(1.0, 0.0)),
        dict(agent=-0.1),
        dict(agent=0, chat=0, rag=0, oneoff=0),
        dict(max_prompt_tokens=8),
        dict(rate=0.0),
        dict(namespace_weights=(1.0,)),
        dict(docs_per_tenant=2),
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        TraceConfig(**kwargs)


def test_cli_bad_arguments(tmp_path, capsys):
    out = tmp_path / "x.jsonl"
    assert main(["--mix", "agent=1,video=2", "--out", str(out)]) == 2
    assert "bad --mix entry 'video=2'" in capsys.readouterr().err
    assert main(["--tenants", "0", "--out", str(out)]) == 2
    assert "tenant" in capsys.readouterr().err
    assert main(["--requests", "-5", "--out", str(out)]) == 2
    assert not out.exists()


def test_cli_mix(tmp_path):
    out = tmp_path / "chat.jsonl"
    assert main(["--requests", "100", "--mix", "chat=1", "--out", str(out)]) == 0
    kinds = {json.loads(line)["kind"] for line in out.read_text().splitlines()}
    assert kinds == {"chat"}


def test_default_trace_generates_quickly(default_trace):
    *_, elapsed = default_trace
    budget = float(os.environ.get("TRACEGEN_TIME_BUDGET_S", "20"))
    assert elapsed < budget


def test_public_namespaces_are_marked_and_shared_by_tenants():
    cfg = TraceConfig(requests=600, public_namespaces=("llama-3-8b",))
    records = list(generate(cfg))
    for r in records:  # marked on every line of the public namespace, absent elsewhere
        assert r.get("public", False) is (r["namespace"] == "llama-3-8b"), r["id"]
    # Its content (system prompts, tools, documents) is the same for every tenant, so
    # tenants share prefixes there and the ceiling, one keyspace for all, is higher.
    agents = defaultdict(list)  # tenant -> prompts of its agent sessions there
    for r in records:
        if r.get("public") and r["kind"] == "agent":
            agents[r["tenant"]].append(r["tokens"])
    shared = max(_common_prefix(a, b) for a in agents["tenant-0"] for b in agents["tenant-1"])
    assert shared >= 800  # an agent app's system prompt, at least
    private, public = analyze(list(generate(TraceConfig(requests=600)))), analyze(records)
    assert public.keyspaces < private.keyspaces  # 4 tenants x 2 namespaces -> 4 + 1
    assert public.overall.token_hit_rate > private.overall.token_hit_rate
    with pytest.raises(ValueError, match="not among the namespaces"):
        TraceConfig(public_namespaces=("nope",))
