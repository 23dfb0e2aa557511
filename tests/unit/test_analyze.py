"""Tests for kvstore.cli.analyze: the prefix ceiling of a prompt trace."""

from __future__ import annotations

import argparse
import json

import pytest

from kvstore.cli.analyze import (
    HIT_BUCKETS,
    add_analyze_arguments,
    analyze,
    analyze_command,
    keyspace_root,
    render_analysis,
)


def _req(t, tokens, tenant="a", namespace="m"):
    return {"t": t, "tenant": tenant, "namespace": namespace, "tokens": list(tokens)}


def _lines(*records):
    return [json.dumps(r) + "\n" for r in records]


def _write(tmp_path, lines, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("".join(lines), encoding="utf-8")
    return path


def test_exact_block_prefix_hits_rounded_down():
    base = list(range(10))  # block size 4: two full blocks + 2 tail tokens
    report = analyze(
        _lines(
            _req(0.0, base),
            _req(1.0, base[:8] + [99] * 8),  # shares two blocks -> 8 cached tokens
            _req(2.0, base),  # same prompt again: the tail is never cached
        ),
        block_size=4,
    )
    s = report.overall
    assert (s.requests, s.prompt_tokens, s.cached_tokens) == (3, 36, 16)
    assert s.requests_with_hit == 2
    assert s.token_hit_rate == pytest.approx(16 / 36)
    assert s.request_hit_rate == pytest.approx(2 / 3)
    # distinct blocks: 2 (first) + 2 new (99-blocks) + 0
    assert s.distinct_blocks == 4
    assert report.distinct_tokens == 16


def test_hit_needs_match_from_token_zero():
    first = [1, 2, 3, 4, 5, 6, 7, 8]
    moved = [9, 9, 9, 9, 5, 6, 7, 8]  # second block equal in content, different prefix
    report = analyze(_lines(_req(0, first), _req(1, moved)), block_size=4)
    assert report.overall.cached_tokens == 0
    assert report.overall.distinct_blocks == 4


def test_only_leading_blocks_count():
    a = list(range(12))
    b = a[:4] + [50, 51, 52, 53] + a[8:]  # block 0 shared, block 1 differs
    report = analyze(_lines(_req(0, a), _req(1, b)), block_size=4)
    assert report.overall.cached_tokens == 4


def test_keyspaces_are_separate_per_tenant_and_namespace():
    tokens = list(range(32))
    report = analyze(
        _lines(
            _req(0, tokens, tenant="a", namespace="m"),
            _req(1, tokens, tenant="b", namespace="m"),  # other tenant: miss
            _req(2, tokens, tenant="a", namespace="n"),  # other namespace: miss
            _req(3, tokens, tenant="a", namespace="m"),  # same keyspace: full hit
        ),
        block_size=16,
    )
    assert report.keyspaces == 3
    assert report.overall.cached_tokens == 32
    assert report.overall.distinct_blocks == 6
    tenants = dict(report.tenants)
    assert list(tenants) == ["a", "b"]
    assert (tenants["a"].requests, tenants["a"].cached_tokens) == (3, 32)
    assert tenants["a"].distinct_blocks == 4
    assert (tenants["b"].cached_tokens, tenants["b"].request_hit_rate) == (0, 0.0)
    assert keyspace_root("a", "m") != keyspace_root("b", "m") != keyspace_root("a", "n")
    # Canonical, length-prefixed encoding: shifting characters between fields changes the root.
    assert keyspace_root("ab", "c") != keyspace_root("a", "bc")
    assert len(keyspace_root("a", "m")) == 16


def test_token_and_request_weighted_rates_differ():
    # One long request fully cached, nine short unique ones: high token rate, low request rate.
    long = list(range(1000, 1000 + 1600))
    records = [_req(0, long), _req(1, long)]
    records += [_req(2 + i, [i] * 16 + [7000 + i] * 16) for i in range(9)]
    s = analyze(_lines(*records)).overall
    assert s.cached_tokens == 1600
    assert s.token_hit_rate == pytest.approx(1600 / (3200 + 9 * 32))
    assert s.request_hit_rate == pytest.approx(1 / 11)


def test_hit_length_histogram_buckets():
    shared = list(range(20000))
    records = [_req(0, shared)]
    for t, n in enumerate([0, 16, 240, 256, 1008, 1024, 4080, 4096, 16368, 16384, 17000], 1):
        records.append(_req(t, shared[:n] + [40000 + t] * 16))
    hist = dict(analyze(_lines(*records)).overall.histogram)
    assert [label for label, _ in HIT_BUCKETS] == list(hist)
    assert hist == {"0": 2, "1-255": 2, "256-1k": 2, "1k-4k": 2, "4k-16k": 2, "16k+": 2}


def test_reads_a_file_and_skips_blank_lines(tmp_path):
    lines = _lines(_req(0, range(32)), _req(1, range(32)))
    path = _write(tmp_path, [lines[0], "\n", "   \n", lines[1]])
    report = analyze(path)
    assert report.overall.requests == 2 and report.overall.cached_tokens == 32
    assert (report.first_t, report.last_t) == (0.0, 1.0)
    assert analyze(str(path)).overall == report.overall


def test_accepts_dicts_and_ignores_extra_keys():
    rec = {**_req(0.5, range(16)), "id": "x", "kind": "chat", "output_tokens": 3}
    report = analyze([rec, {**rec, "t": 0.6}])
    assert report.overall.cached_tokens == 16


def test_streams_lazily():
    consumed = []

    def source():
        for i, line in enumerate(_lines(_req(0, range(16)), _req(1, range(16)))):
            consumed.append(i)
            yield line
        yield "{broken\n"
        consumed.append("past the error")

    with pytest.raises(ValueError, match="line 3"):
        analyze(source())
    assert consumed == [0, 1]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "line 2: invalid JSON"),
        ("[1, 2]", "line 2: expected a JSON object, got an array"),
        ("null", "line 2: expected a JSON object, got null"),
        ('{"tenant": "a", "namespace": "m", "tokens": []}', "line 2: missing required key 't'"),
        ('{"t": 1, "tenant": "a", "namespace": "m"}', "missing required key 'tokens'"),
        ('{"t": "1", "tenant": "a", "namespace": "m", "tokens": []}', "'t' must be a finite"),
        ('{"t": true, "tenant": "a", "namespace": "m", "tokens": []}', "'t' must be a finite"),
        ('{"t": 1, "tenant": "", "namespace": "m", "tokens": []}', "'tenant' must be a non-empty"),
        ('{"t": 1, "tenant": "a", "namespace": 3, "tokens": []}', "'namespace' must be"),
        ('{"t": 1, "tenant": "a", "namespace": "m", "tokens": "abc"}', "'tokens' must be a list"),
        ('{"t": 1, "tenant": "a", "namespace": "m", "tokens": [1, -2]}', "tokens\\[1\\] = -2"),
        ('{"t": 1, "tenant": "a", "namespace": "m", "tokens": [1.5]}', "tokens\\[0\\] = 1.5"),
        ('{"t": 1, "tenant": "a", "namespace": "m", "tokens": [4294967296]}', "tokens\\[0\\]"),
        ('{"t": -1, "tenant": "a", "namespace": "m", "tokens": []}', "line 2: t=-1.0 is earlier"),
    ],
)
def test_bad_lines_name_line_and_problem(line, problem):
    good = json.dumps(_req(0, range(4)))
    with pytest.raises(ValueError, match=problem) as exc:
        analyze([good, line])
    assert str(exc.value).startswith("line 2:")


def test_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        analyze([], block_size=0)


def test_empty_trace():
    report = analyze([])
    assert report.overall.requests == 0
    assert report.overall.token_hit_rate == 0.0 and report.overall.request_hit_rate == 0.0
    assert report.tenants == () and report.first_t is None
    assert "prefix ceiling" in render_analysis(report, "table")


def test_render_json_and_table():
    report = analyze(
        _lines(
            _req(0, range(64), tenant="acme"),
            _req(1, range(64), tenant="acme"),
            _req(2, range(64), tenant="zeta"),
        )
    )
    data = json.loads(render_analysis(report, "json"))
    assert data["overall"]["token_hit_rate"] == pytest.approx(64 / 192)
    assert data["overall"]["request_hit_rate"] == pytest.approx(1 / 3)
    assert data["tenants"]["acme"]["cached_tokens"] == 64
    assert data["overall"]["hit_length_histogram"] == {
        "0": 2,
        "1-255": 1,
        "256-1k": 0,
        "1k-4k": 0,
        "4k-16k": 0,
        "16k+": 0,
    }
    assert data["overall"]["distinct_blocks"] == 8
    table = render_analysis(report, "table")
    assert "acme" in table and "zeta" in table and "33.3%" in table
    with pytest.raises(ValueError, match="json"):
        render_analysis(report, "csv")


def _parser():
    parser = argparse.ArgumentParser(prog="kvctl analyze")
    add_analyze_arguments(parser)
    return parser


def test_analyze_command_success_and_bad_input(tmp_path, capsys):
    good = _write(tmp_path, _lines(_req(0, range(32)), _req(1, range(32))))
    assert analyze_command(_parser().parse_args([str(good), "--output", "json"])) == 0
    assert json.loads(capsys.readouterr().out)["overall"]["cached_tokens"] == 32

    bad = _write(tmp_path, _lines(_req(0, range(32))) + ['{"t": 1}\n'], name="bad.jsonl")
    assert analyze_command(_parser().parse_args([str(bad)])) == 1  # a failure, not usage
    err = capsys.readouterr().err
    assert "line 2: missing required key 'tenant'" in err and "bad.jsonl" in err

    missing = tmp_path / "nope.jsonl"
    assert analyze_command(_parser().parse_args([str(missing)])) == 1
    assert "No such file" in capsys.readouterr().err

    bs = _parser().parse_args([str(good), "--block-size", "0"])
    assert analyze_command(bs) == 2
    assert "block-size" in capsys.readouterr().err


def test_output_tokens_are_optional_and_checked():
    from kvstore.cli.analyze import iter_requests

    reqs = list(iter_requests([_req(0, range(16)), {**_req(1, range(16)), "output_tokens": 7}]))
    assert [r.output_tokens for r in reqs] == [0, 7]
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="output_tokens"):
            list(iter_requests([{**_req(0, range(16)), "output_tokens": bad}]))
