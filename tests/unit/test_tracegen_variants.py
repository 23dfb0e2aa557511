"""loadtest.tracegen's variants: traces whose prefixes break (tools reordered, chats
trimmed at the front, a timestamp first, one-off prompts), and the reference unchanged."""

from __future__ import annotations

import hashlib
import io
import json
from collections import Counter, defaultdict

import pytest

from loadtest.tracegen import (
    CHAT_WINDOW,
    VARIANTS,
    TraceConfig,
    generate,
    main,
    variant_config,
    write_trace,
)
from loadtest.replay_sim import load_trace

# sha256 of the default trace (2000 requests, seed 7) as main wrote it before variants
# existed: the reference replay's figures stay comparable across versions.
REFERENCE_SHA256 = "d287f3525380ccb5d9f0204101816013cdad5e9e25cb45a04ddb12cf0e2ce528"


def _records(variant: str, n: int = 600) -> list[dict]:
    return list(generate(variant_config(variant, requests=n, seed=7)))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _by_session(records: list[dict], kind: str) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = defaultdict(list)
    for r in records:
        if r["kind"] == kind:
            out[r["session"]].append(r["tokens"])
    return out


def test_reference_trace_is_byte_identical_to_before_variants():
    buf = io.StringIO()
    write_trace(TraceConfig(), buf)
    assert hashlib.sha256(buf.getvalue().encode()).hexdigest() == REFERENCE_SHA256
    buf2 = io.StringIO()
    write_trace(variant_config("reference"), buf2)
    assert buf2.getvalue() == buf.getvalue()


def test_broken_tools_share_the_system_prompt_but_not_the_tool_order():
    """Reference: sessions of one app share system prompt + tools (>= 1400 tokens);
    broken-tools: only the system prompt (800-2000 tokens), then they part."""

    def first_prompts(variant: str) -> dict[tuple[str, int], list[list[int]]]:
        groups: dict[tuple[str, int], list[list[int]]] = defaultdict(list)
        for r in _records(variant, 800):
            if r["kind"] == "agent" and r["tenant"] == "tenant-0":
                groups[(r["namespace"], r["tokens"][0])].append(r["tokens"])
        return groups

    ref = [_common_prefix(ps[0], p) for ps in first_prompts("reference").values() for p in ps[1:]]
    broken = [
        _common_prefix(ps[0], p) for ps in first_prompts("broken-tools").values() for p in ps[1:]
    ]
    assert ref and broken
    # Some pairs still list the same tool first; most do not.
    assert sorted(broken)[len(broken) // 2] < sorted(ref)[len(ref) // 2]
    assert min(broken) >= 800  # the system prompt stays shared


def test_trimmed_chats_drop_their_oldest_turns_to_fit_the_window():
    sessions = _by_session(_records("trimmed-chat", 1200), "chat")
    trimmed = 0
    for prompts in sessions.values():
        for prev, cur in zip(prompts, prompts[1:]):
            if _common_prefix(prev, cur) < len(prev):  # the history was cut at the front
                trimmed += 1
                assert _common_prefix(prev, cur) <= 600  # the system prompt, at most
            assert len(cur) <= CHAT_WINDOW
    assert trimmed > 0
    # The reference never trims: each turn extends the previous prompt.
    for prompts in _by_session(_records("reference", 1200), "chat").values():
        for prev, cur in zip(prompts, prompts[1:]):
            assert cur[: len(prev)] == prev


def test_timestamp_first_shares_prefixes_only_within_a_minute():
    records = _records("timestamp-first", 1200)
    heads: dict[int, set[tuple[int, ...]]] = defaultdict(set)
    for r in records:
        heads[int(r["t"] // 60)].add(tuple(r["tokens"][:8]))
    assert len(heads) >= 2
    assert all(len(h) == 1 for h in heads.values())  # one timestamp per minute
    assert len({next(iter(h)) for h in heads.values()}) == len(heads)  # all different
    ref = {r["id"]: r["tokens"] for r in _records("reference", 1200)}
    assert all(r["tokens"][8:] == ref[r["id"]][: len(r["tokens"]) - 8] for r in records)


def test_oneoff_variant_is_mostly_one_off_prompts():
    kinds = Counter(r["kind"] for r in _records("oneoff", 2000))
    assert 0.5 < kinds["oneoff"] / 2000 < 0.7, kinds


def test_variants_are_deterministic_and_named_in_the_cli(tmp_path, capsys):
    for v in VARIANTS:
        assert _records(v, 50) == _records(v, 50)
    out = tmp_path / "t.jsonl"
    assert main(["--variant", "broken-tools", "--requests", "30", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == _records("broken-tools", 30)
    with pytest.raises(SystemExit) as exc:
        main(["--variant", "nonsense"])
    assert exc.value.code == 2
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown variant 'x'; choose from reference"):
        TraceConfig(variant="x")


def test_replay_loads_a_variant():
    reqs, _ = load_trace(None, 40, 7, "timestamp-first")
    ref, _ = load_trace(None, 40, 7)
    assert len(reqs) == len(ref) == 40
    for a, b in zip(reqs, ref):
        assert list(a.tokens[8:]) == list(b.tokens[: len(a.tokens) - 8])
