"""Tests for kvstore.cli.plan: KV sizing arithmetic, size parsing, rendering and the CLI hooks."""

from __future__ import annotations

import argparse
import json

import pytest

from kvstore.cli.plan import (
    PRESETS,
    ModelShape,
    add_plan_arguments,
    format_size,
    kv_bytes_per_token,
    parse_size,
    plan,
    plan_command,
    render_plan,
)

LLAMA8B = PRESETS["llama-3-8b"]


def _plan(**overrides):
    kwargs = dict(
        model=LLAMA8B,
        kv_dtype="fp16",
        block_size=16,
        context_len=8192,
        concurrency=4,
        hbm_bytes=parse_size("10GiB"),
        nvme_bytes=parse_size("1TiB"),
    )
    kwargs.update(overrides)
    return plan(**kwargs)


def test_llama3_8b_fp16_block_is_exactly_2_mib():
    report = _plan()
    assert report.bytes_per_token == 131072
    assert report.bytes_per_block == 2 * 2**20
    assert format_size(report.bytes_per_block) == "2 MiB"


@pytest.mark.parametrize(
    ("dtype", "per_token"),
    [
        ("fp32", 262144),
        ("fp16", 131072),
        ("bf16", 131072),
        ("fp8", 65536),
        ("int8", 65536),
        ("int4", 32768),
        ("fp4", 32768),
        # a namespace's names for them: plan took fp16, the store only float16
        ("float32", 262144),
        ("float16", 131072),
        ("bfloat16", 131072),
        ("float8_e4m3fn", 65536),
        ("float8_e5m2", 65536),
    ],
)
def test_bytes_per_element_by_dtype(dtype, per_token):
    assert kv_bytes_per_token(LLAMA8B, dtype) == per_token


def test_presets_match_published_shapes():
    assert (PRESETS["llama-3-70b"].layers, PRESETS["llama-3-70b"].kv_heads) == (80, 8)
    assert kv_bytes_per_token(PRESETS["llama-3-70b"], "fp16") == 2 * 80 * 8 * 128 * 2
    assert kv_bytes_per_token(PRESETS["mistral-7b"], "bf16") == 131072
    # Qwen2.5-7B: 28 layers, 4 KV heads -> 56 KiB per token in fp16.
    assert kv_bytes_per_token(PRESETS["qwen2.5-7b"], "fp16") == 57344


def test_unknown_dtype_names_accepted_ones():
    with pytest.raises(ValueError, match="fp16.*bf16.*fp8.*int8.*int4.*fp4"):
        kv_bytes_per_token(LLAMA8B, "fp12")


def test_pool_and_nvme_block_counts():
    report = _plan()
    assert report.hbm_blocks == 5120  # 10 GiB / 2 MiB
    assert report.hbm_tokens == 5120 * 16
    assert report.nvme_blocks == 2**40 // (2 * 2**20)
    assert report.nvme_tokens == report.nvme_blocks * 16


def test_running_kv_and_what_is_left_for_prefixes():
    report = _plan(concurrency=4, context_len=8192)
    assert report.running_tokens == 4 * 8192
    assert report.running_bytes == 4 * 8192 * 131072  # 4 GiB
    assert report.running_blocks == 4 * 512
    assert report.cache_blocks == 5120 - 2048
    assert report.shortfall_blocks == 0
    assert report.warnings == ()


def test_partial_last_block_takes_a_whole_slot():
    report = _plan(concurrency=3, context_len=20)
    assert report.running_blocks == 3 * 2
    # ... but only full blocks are cacheable.
    assert report.tier_mix.working_set_blocks == 3


def test_shortfall_when_running_kv_exceeds_pool():
    report = _plan(hbm_bytes=parse_size("2GiB"), concurrency=4, context_len=8192)
    assert report.hbm_blocks == 1024
    assert report.cache_blocks == 0
    assert report.shortfall_blocks == 2048 - 1024
    assert any("short by 1,024 blocks" in w for w in report.warnings)


def test_tier_mix_spills_from_hbm_to_nvme_then_recompute():
    # 1000 free pool blocks, 500 NVMe blocks, 2000-block working set.
    report = _plan(
        hbm_bytes=1000 * 2 * 2**20,
        nvme_bytes=500 * 2 * 2**20,
        concurrency=0,
        working_set_tokens=2000 * 16,
    )
    mix = report.tier_mix
    assert mix.working_set_blocks == 2000
    assert mix.hbm_fraction == pytest.approx(0.5)
    assert mix.nvme_fraction == pytest.approx(0.25)
    assert mix.uncached_fraction == pytest.approx(0.25)


def test_tier_mix_default_working_set_is_running_prefixes():
    report = _plan(concurrency=4, context_len=8192)
    mix = report.tier_mix
    assert mix.working_set_blocks == 2048
    assert mix.hbm_fraction == 1.0 and mix.nvme_fraction == 0.0
    assert mix.hbm_fraction + mix.nvme_fraction + mix.uncached_fraction == pytest.approx(1.0)


def test_gpu_headroom_and_overcommit_warning():
    ok = _plan(gpu_mem_bytes=parse_size("80GiB"), weights_bytes=parse_size("16GiB"))
    assert ok.gpu_headroom_bytes == parse_size("54GiB")
    over = _plan(
        hbm_bytes=parse_size("70GiB"),
        gpu_mem_bytes=parse_size("80GiB"),
        weights_bytes=parse_size("16GiB"),
    )
    assert over.gpu_headroom_bytes == -parse_size("6GiB")
    assert any("exceed GPU memory by 6 GiB" in w for w in over.warnings)
    with pytest.raises(ValueError, match="gpu_mem_bytes"):
        _plan(weights_bytes=parse_size("16GiB"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 0),
        ("context_len", -1),
        ("concurrency", -2),
        ("hbm_bytes", -1),
        ("block_size", 1.5),
        ("block_size", 4097),  # more than a namespace takes
        ("concurrency", True),
    ],
)
def test_rejects_bad_numbers(field, value):
    with pytest.raises(ValueError, match=field):
        _plan(**{field: value})


def test_model_shape_validated():
    with pytest.raises(ValueError, match="kv_heads"):
        ModelShape("x", layers=2, kv_heads=0, head_dim=64)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10GiB", 10 * 2**30),
        ("10 GiB", 10 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("512", 512),
        ("512B", 512),
        ("2KB", 2000),
        ("3MB", 3_000_000),
        ("4GB", 4 * 10**9),
        ("1KiB", 1024),
        ("5MiB", 5 * 2**20),
        ("2TiB", 2 * 2**40),
        ("1gib", 2**30),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "10 PiB", "ten GiB", "-1GiB", "1.5.2GiB", "0.5B", "10 GiB extra"]
)
def test_parse_size_rejects_junk(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_size_error_names_units():
    with pytest.raises(ValueError, match="KiB.*MiB.*GiB.*TiB"):
        parse_size("10 XB")


@pytest.mark.parametrize(
    ("num", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (2 * 2**20, "2 MiB"),
        (10 * 2**30, "10 GiB"),
        (3 * 2**40, "3 TiB"),
    ],
)
def test_format_size(num, text):
    assert format_size(num) == text
    assert parse_size(text) == num


def test_render_json_round_trips_the_numbers():
    report = _plan()
    data = json.loads(render_plan(report, "json"))
    assert data["bytes_per_block"] == 2097152
    assert data["model"]["name"] == "llama-3-8b"
    assert data["cache_blocks"] == report.cache_blocks
    assert data["tier_mix"]["hbm_fraction"] == 1.0


def test_render_table_shows_key_lines():
    text = render_plan(_plan(), "table")
    assert "KV per block" in text and "2 MiB" in text
    assert "5,120 blocks" in text
    with pytest.raises(ValueError, match="table"):
        render_plan(_plan(), "yaml")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvctl plan")
    add_plan_arguments(parser)
    return parser


def test_plan_command_prints_json(capsys):
    args = _parser().parse_args(
        [
            "--model",
            "llama-3-8b",
            "--hbm",
            "10GiB",
            "--nvme",
            "1TiB",
            "--concurrency",
            "4",
            "--output",
            "json",
        ]
    )
    assert plan_command(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hbm_blocks"] == 5120 and data["nvme_blocks"] == 524288


def test_plan_command_explicit_shape_and_bad_input(capsys):
    args = _parser().parse_args(
        ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--hbm", "1GiB"]
    )
    assert plan_command(args) == 0
    assert "custom" in capsys.readouterr().out
    bad = _parser().parse_args(["--model", "gpt-9", "--hbm", "1GiB"])
    assert plan_command(bad) == 2
    assert "unknown model preset 'gpt-9'" in capsys.readouterr().err
    missing = _parser().parse_args(["--layers", "32", "--hbm", "1GiB"])
    assert plan_command(missing) == 2
    assert "--kv-heads" in capsys.readouterr().err
    dtype = _parser().parse_args(["--model", "mistral-7b", "--hbm", "1GiB", "--kv-dtype", "x"])
    assert plan_command(dtype) == 2
    assert "accepted dtypes" in capsys.readouterr().err


def test_plan_command_override_on_preset(capsys):
    args = _parser().parse_args(
        ["--model", "llama-3-8b", "--layers", "16", "--hbm", "1GiB", "--output", "json"]
    )
    assert plan_command(args) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 65536


def test_bad_size_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--model", "llama-3-8b", "--hbm", "lots"])
    assert exc.value.code == 2
    assert "invalid size 'lots'" in capsys.readouterr().err


# ------------------------------------------------- the pool counts slots, not payload
def test_small_blocks_take_a_whole_slot_each():
    """The pool is cut into slots (2 MiB by default, the agents' slot_bytes) and every
    block takes one, whatever its payload: 512 KiB blocks (int4) do not fit 4 x as many."""
    report = _plan(kv_dtype="int4", concurrency=4, context_len=8192)
    assert report.bytes_per_block == 512 * 2**10
    assert report.slot_bytes == 2 * 2**20
    assert report.hbm_blocks == 5120  # 10 GiB / 2 MiB slots, not 10 GiB / 512 KiB
    assert report.hbm_tokens == 5120 * 16
    assert report.cache_blocks == 5120 - 4 * 512  # the running blocks take a slot each too
    assert report.nvme_blocks == 2**40 // (512 * 2**10)  # NVMe stores payload bytes
    assert any("fill 25% of a 2 MiB slot" in w for w in report.warnings)


def test_slots_sized_for_the_blocks_hold_more_of_them():
    report = _plan(kv_dtype="fp8", slot_bytes=2**20)
    assert report.hbm_blocks == 10240
    assert report.warnings == ()
    # Qwen2.5-7B fp16: 896 KiB blocks, 2 in a 2 MiB slot's room but 1 per slot.
    qwen = _plan(model=PRESETS["qwen2.5-7b"], concurrency=0)
    assert qwen.bytes_per_block == 896 * 2**10
    assert qwen.hbm_blocks == 5120


def test_shortfall_counts_slots():
    report = _plan(kv_dtype="int4", hbm_bytes=parse_size("2GiB"), concurrency=4)
    assert report.hbm_blocks == 1024
    assert report.shortfall_blocks == 2048 - 1024
    assert any("short by 1,024 blocks (2 GiB)" in w for w in report.warnings)
    assert "2,048 blocks (4 GiB of slots)" in render_plan(report)
    tiny = _plan(kv_dtype="int4", hbm_bytes=2**20)  # room for two blocks, not one slot
    assert tiny.hbm_blocks == 0
    assert any("smaller than one slot (2 MiB)" in w for w in tiny.warnings)


def test_block_bigger_than_a_slot_is_refused():
    """An agent refuses a namespace whose blocks do not fit its slots (they never take
    several), so a plan for them names the slot size to set."""
    big = PRESETS["llama-3-70b"]  # 5 MiB blocks in fp16
    with pytest.raises(ValueError, match="5 MiB.*2 MiB slots"):
        _plan(model=big)
    assert _plan(model=big, slot_bytes=5 * 2**20).hbm_blocks == 2048
    with pytest.raises(ValueError, match="slot_bytes"):
        _plan(slot_bytes=0)


def test_plan_command_slot_bytes(capsys):
    args = ["--model", "llama-3-8b", "--kv-dtype", "int4", "--hbm", "10GiB", "--output", "json"]
    assert plan_command(_parser().parse_args(args)) == 0
    assert json.loads(capsys.readouterr().out)["hbm_blocks"] == 5120
    assert plan_command(_parser().parse_args([*args, "--slot-bytes", "512KiB"])) == 0
    assert json.loads(capsys.readouterr().out)["hbm_blocks"] == 20480
    big = _parser().parse_args(["--model", "llama-3-70b", "--hbm", "10GiB"])
    assert plan_command(big) == 2
    assert "--slot-bytes" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["int4", "fp4"])
def test_a_dtype_no_agent_stores_is_planned_with_a_warning(dtype):
    assert any("agents store no such blocks yet" in w for w in _plan(kv_dtype=dtype).warnings)
    assert not any("no such blocks" in w for w in _plan(kv_dtype="float16").warnings)
