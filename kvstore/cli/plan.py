"""Capacity planning for a kvstore node: how many KV blocks fit in each tier.

Pure arithmetic, no I/O. The model is deliberately simple and stated here so an
operator can check it by hand:

* KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element.
* A block holds ``block_size`` tokens. The device pool is cut into slots of
  ``slot_bytes`` (the agents' setting, 2 MiB by default) and every block takes one
  whole slot, whatever its payload; a block bigger than a slot is refused (an agent
  refuses its namespace), so the plan is too. The NVMe tier stores payload bytes (the
  per-block header is a few dozen bytes and is ignored).
* The running requests (``concurrency`` sequences of ``context_len`` tokens) take
  their KV from the device pool first, a slot per block, a partial last block too;
  what is left of the pool holds cached prefixes.
* The cacheable working set defaults to the full-block prefixes of the running
  requests; pass ``working_set_tokens`` (e.g. the distinct tokens that
  ``kvctl analyze`` reports for a trace) to plan against a real trace. Tiers are
  exclusive: HBM holds what it can, NVMe the rest it can, the remainder is recomputed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace

from kvstore.config import DEFAULT_SLOT_BYTES
from kvstore.errors import clip
from kvstore.namespace import KV_DTYPE_BYTES, MAX_BLOCK_SIZE
from kvstore.units import parse_size  # noqa: F401 (kvctl plan's size parser, re-exported)

# Bits rather than bytes per element so that sub-byte dtypes stay integral:
# 2 x bits is always a multiple of 8 for bits >= 4.
DTYPE_BITS: dict[str, int] = {
    "fp32": 32,
    "fp16": 16,
    "bf16": 16,
    "fp8": 8,
    "int8": 8,
    "int4": 4,
    "fp4": 4,
    # the names a namespace's kv_dtype takes (kvstore.namespace.KV_DTYPE_BYTES)
    **{name: 8 * size for name, size in KV_DTYPE_BYTES.items()},
}
# Short names for dtypes a namespace accepts; int4 and fp4 it does not (yet).
_STORE_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}

_BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The KV layout of a model: what decides how many bytes one token's KV takes."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model {field} must be a positive integer, got {value!r}")


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("llama-3-8b", layers=32, kv_heads=8, head_dim=128),
        ModelShape("llama-3-70b", layers=80, kv_heads=8, head_dim=128),
        ModelShape("mistral-7b", layers=32, kv_heads=8, head_dim=128),
        ModelShape("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128),
    )
}


@dataclass(frozen=True, slots=True)
class TierMix:
    """Fraction of the cacheable working set each tier can hold.

    The three fractions sum to 1 (all are 0 for an empty working set).
    """

    working_set_blocks: int
    hbm_fraction: float
    nvme_fraction: float
    uncached_fraction: float


@dataclass(frozen=True, slots=True)
class PlanReport:
    """Result of :func:`plan`; all sizes in bytes, counts in blocks or tokens."""

    model: ModelShape
    kv_dtype: str
    block_size: int
    context_len: int
    concurrency: int
    bytes_per_token: int
    bytes_per_block: int
    slot_bytes: int  # the pool's slot: every block takes one, whatever its payload
    hbm_bytes: int
    nvme_bytes: int
    hbm_blocks: int
    nvme_blocks: int
    hbm_tokens: int
    nvme_tokens: int
    running_tokens: int
    running_bytes: int
    running_blocks: int
    cache_blocks: int
    shortfall_blocks: int
    tier_mix: TierMix
    gpu_mem_bytes: int | None
    weights_bytes: int | None
    gpu_headroom_bytes: int | None
    warnings: tuple[str, ...]


def format_size(num_bytes: int) -> str:
    """Format a byte count with binary units: ``2097152`` -> ``"2 MiB"``."""
    if num_bytes < 0:
        return "-" + format_size(-num_bytes)
    for unit, size in _BINARY_UNITS:
        if num_bytes >= size:
            text = f"{num_bytes / size:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{num_bytes} B"


def kv_bytes_per_token(model: ModelShape, kv_dtype: str) -> int:
    """2 x layers x KV heads x head dim x bytes per element."""
    bits = DTYPE_BITS.get(kv_dtype)
    if bits is None:
        raise ValueError(
            f"unknown kv dtype {clip(kv_dtype)}: accepted dtypes are {', '.join(DTYPE_BITS)}"
        )
    return 2 * model.layers * model.kv_heads * model.head_dim * bits // 8


def resolve_model(name: str) -> ModelShape:
    """Look up a preset model shape by name."""
    shape = PRESETS.get(name.lower())
    if shape is None:
        raise ValueError(f"unknown model preset {clip(name)}: presets are {', '.join(PRESETS)}")
    return shape


def _check_count(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value!r}")


def _validate(block_size: int, context_len: int, concurrency: int, sizes: dict) -> None:
    # a namespace refuses larger blocks: a plan for them could never be deployed
    _check_count("block_size", block_size, 1, MAX_BLOCK_SIZE)
    _check_count("context_len", context_len, 1)
    _check_count("concurrency", concurrency, 0)
    _check_count("slot_bytes", sizes.pop("slot_bytes"), 1)
    for name, value in sizes.items():
        if value is not None:
            _check_count(name, value, 0)


def _check_fits_slot(bytes_per_block: int, slot_bytes: int) -> None:
    # An agent refuses a namespace whose blocks are bigger than its slots (a block never
    # takes several): a plan for them could never be deployed either.
    if bytes_per_block > slot_bytes:
        raise ValueError(
            f"blocks of {format_size(bytes_per_block)} do not fit {format_size(slot_bytes)} "
            f"slots: agents refuse such a namespace; plan with --slot-bytes of at least "
            f"{format_size(bytes_per_block)} and set the agents' slot_bytes (the chart's "
            "agent.slotKiB) to it, or shrink the block size"
        )


def _tier_mix(working_set_blocks: int, cache_blocks: int, nvme_blocks: int) -> TierMix:
    if working_set_blocks == 0:
        return TierMix(0, 0.0, 0.0, 0.0)
    in_hbm = min(working_set_blocks, cache_blocks)
    in_nvme = min(working_set_blocks - in_hbm, nvme_blocks)
    rest = working_set_blocks - in_hbm - in_nvme
    return TierMix(
        working_set_blocks=working_set_blocks,
        hbm_fraction=in_hbm / working_set_blocks,
        nvme_fraction=in_nvme / working_set_blocks,
        uncached_fraction=rest / working_set_blocks,
    )


def _gpu_headroom(
    gpu_mem_bytes: int | None, weights_bytes: int | None, hbm_bytes: int
) -> int | None:
    if gpu_mem_bytes is None:
        if weights_bytes is not None:
            raise ValueError("weights_bytes needs gpu_mem_bytes to compare against")
        return None
    return gpu_mem_bytes - (weights_bytes or 0) - hbm_bytes


def _warnings(r: PlanReport) -> tuple[str, ...]:
    out: list[str] = []
    if r.hbm_blocks == 0:
        out.append(f"device pool is smaller than one slot ({format_size(r.slot_bytes)})")
    if 2 * r.bytes_per_block <= r.slot_bytes:
        fill = r.bytes_per_block / r.slot_bytes
        out.append(
            f"blocks of {format_size(r.bytes_per_block)} fill {fill:.0%} of a "
            f"{format_size(r.slot_bytes)} slot: the pool holds {r.hbm_blocks:,} of them, "
            f"slots of {format_size(r.bytes_per_block)} would hold "
            f"{r.hbm_bytes // r.bytes_per_block:,}"
        )
    if r.shortfall_blocks > 0:
        out.append(
            f"device pool cannot hold the running KV: short by {r.shortfall_blocks:,} blocks "
            f"({format_size(r.shortfall_blocks * r.slot_bytes)}); "
            "no room is left for cached prefixes"
        )
    if r.kv_dtype not in KV_DTYPE_BYTES and r.kv_dtype not in _STORE_DTYPE:
        out.append(
            f"kv dtype {r.kv_dtype}: agents store no such blocks yet (a namespace's kv_dtype "
            f"is one of {', '.join(KV_DTYPE_BYTES)})"
        )
    if r.gpu_headroom_bytes is not None and r.gpu_headroom_bytes < 0:
        out.append(
            f"weights + device pool exceed GPU memory by {format_size(-r.gpu_headroom_bytes)}"
        )
    return tuple(out)


def plan(
    model: ModelShape,
    kv_dtype: str,
    block_size: int,
    context_len: int,
    concurrency: int,
    hbm_bytes: int,
    nvme_bytes: int,
    gpu_mem_bytes: int | None = None,
    weights_bytes: int | None = None,
    working_set_tokens: int | None = None,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
) -> PlanReport:
    """Size the device pool (slots of ``slot_bytes``, one block each) and NVMe tier for
    ``model`` in blocks of ``block_size`` tokens."""
    _validate(
        block_size,
        context_len,
        concurrency,
        {
            "slot_bytes": slot_bytes,
            "hbm_bytes": hbm_bytes,
            "nvme_bytes": nvme_bytes,
            "gpu_mem_bytes": gpu_mem_bytes,
            "weights_bytes": weights_bytes,
            "working_set_tokens": working_set_tokens,
        },
    )
    bpt = kv_bytes_per_token(model, kv_dtype)
    bpb = bpt * block_size
    _check_fits_slot(bpb, slot_bytes)
    hbm_blocks, nvme_blocks = hbm_bytes // slot_bytes, nvme_bytes // bpb
    running_blocks = concurrency * -(-context_len // block_size)
    cache_blocks = max(0, hbm_blocks - running_blocks)
    if working_set_tokens is None:
        working_set_blocks = concurrency * (context_len // block_size)
    else:
        working_set_blocks = working_set_tokens // block_size
    report = PlanReport(
        model=model,
        kv_dtype=kv_dtype,
        block_size=block_size,
        context_len=context_len,
        concurrency=concurrency,
        bytes_per_token=bpt,
        bytes_per_block=bpb,
        slot_bytes=slot_bytes,
        hbm_bytes=hbm_bytes,
        nvme_bytes=nvme_bytes,
        hbm_blocks=hbm_blocks,
        nvme_blocks=nvme_blocks,
        hbm_tokens=hbm_blocks * block_size,
        nvme_tokens=nvme_blocks * block_size,
        running_tokens=concurrency * context_len,
        running_bytes=concurrency * context_len * bpt,
        running_blocks=running_blocks,
        cache_blocks=cache_blocks,
        shortfall_blocks=max(0, running_blocks - hbm_blocks),
        tier_mix=_tier_mix(working_set_blocks, cache_blocks, nvme_blocks),
        gpu_mem_bytes=gpu_mem_bytes,
        weights_bytes=weights_bytes,
        gpu_headroom_bytes=_gpu_headroom(gpu_mem_bytes, weights_bytes, hbm_bytes),
        warnings=(),
    )
    return replace(report, warnings=_warnings(report))


def _size_cell(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    if abs(num_bytes) < 1024:
        return format_size(num_bytes)
    return f"{format_size(num_bytes)} ({num_bytes:,} B)"


def _table_rows(r: PlanReport) -> list[tuple[str, str]]:
    m = r.model
    mix = r.tier_mix
    rows = [
        ("model", f"{m.name} ({m.layers} layers, {m.kv_heads} KV heads, head dim {m.head_dim})"),
        ("kv dtype", r.kv_dtype),
        ("block size", f"{r.block_size} tokens"),
        ("KV per token", _size_cell(r.bytes_per_token)),
        ("KV per block", _size_cell(r.bytes_per_block)),
        ("pool slot", f"{_size_cell(r.slot_bytes)}, one block each"),
        (
            "device pool",
            f"{_size_cell(r.hbm_bytes)} = {r.hbm_blocks:,} blocks (a slot each), "
            f"{r.hbm_tokens:,} tokens",
        ),
        (
            "NVMe tier",
            f"{_size_cell(r.nvme_bytes)} = {r.nvme_blocks:,} blocks, {r.nvme_tokens:,} tokens",
        ),
        (
            "running KV",
            f"{r.concurrency} x {r.context_len:,} tokens = "
            f"{format_size(r.running_bytes)}, {r.running_blocks:,} blocks "
            f"({format_size(r.running_blocks * r.slot_bytes)} of slots)",
        ),
        (
            "pool left for prefixes",
            f"{r.cache_blocks:,} blocks, {r.cache_blocks * r.block_size:,} tokens",
        ),
        ("pool shortfall", f"{r.shortfall_blocks:,} blocks"),
        ("working set", f"{mix.working_set_blocks:,} blocks"),
        (
            "tier mix",
            f"HBM {mix.hbm_fraction:.1%}, NVMe {mix.nvme_fraction:.1%}, "
            f"recompute {mix.uncached_fraction:.1%}",
        ),
    ]
    if r.gpu_mem_bytes is not None:
        rows.append(("GPU memory", _size_cell(r.gpu_mem_bytes)))
        rows.append(("weights", _size_cell(r.weights_bytes)))
        rows.append(("GPU headroom", _size_cell(r.gpu_headroom_bytes)))
    rows.extend(("warning", text) for text in r.warnings)
    return rows


def render_plan(report: PlanReport, output: str = "table") -> str:
    """Render a plan as an aligned text table or as JSON (bytes as integers)."""
    if output == "json":
        return json.dumps(asdict(report), indent=2)
    if output != "table":
        raise ValueError(f"unknown output format {output!r}: use 'table' or 'json'")
    rows = _table_rows(report)
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key.ljust(width)}  {value}" for key, value in rows)


def _size_arg(text: str) -> int:
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"a size cannot be negative, got {text!r}")
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvctl plan`` arguments to ``parser``."""
    parser.description = (
        "Capacity planning: KV bytes per token and per block, blocks per tier (a pool slot "
        "per block), the KV the running requests need and what is left of the device pool "
        "for cached prefixes."
    )
    shape = parser.add_argument_group("model shape (a preset, or explicit numbers)")
    shape.add_argument("--model", help=f"preset: {', '.join(PRESETS)}")
    shape.add_argument("--layers", type=int, help="number of transformer layers")
    shape.add_argument("--kv-heads", type=int, help="number of KV heads (after GQA)")
    shape.add_argument("--head-dim", type=int, help="attention head dimension")
    parser.add_argument(
        "--kv-dtype",
        default="fp16",
        help=f"KV element type: {', '.join(DTYPE_BITS)} (default fp16; fp16 is a "
        "namespace's float16, bf16 its bfloat16, fp8 its float8_e4m3fn; int4 and fp4 are "
        "planned for, not stored yet)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument(
        "--context-len", type=int, default=8192, help="tokens per running sequence (default 8192)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=1, help="running sequences per GPU (default 1)"
    )
    parser.add_argument(
        "--hbm", type=_size_arg, required=True, help="device-memory pool size, e.g. 40GiB"
    )
    parser.add_argument(
        "--nvme", type=_size_arg, default=0, help="NVMe tier size, e.g. 2TiB (default 0)"
    )
    parser.add_argument(
        "--slot-bytes",
        type=_size_arg,
        default=DEFAULT_SLOT_BYTES,
        help="the agents' pool slot size (slot_bytes; the chart's agent.slotKiB): every block "
        f"takes a whole slot (default {format_size(DEFAULT_SLOT_BYTES).replace(' ', '')})",
    )
    parser.add_argument(
        "--gpu-mem",
        type=_size_arg,
        default=None,
        help="total GPU memory, to check weights + pool fit, e.g. 80GiB",
    )
    parser.add_argument(
        "--weights",
        type=_size_arg,
        default=None,
        help="model weights resident on the GPU, e.g. 16GiB",
    )
    parser.add_argument(
        "--working-set-tokens",
        type=int,
        default=None,
        help="cacheable working set in tokens (e.g. distinct tokens from "
        "'kvctl analyze'); default: prefixes of the running requests",
    )
    parser.add_argument(
        "--output", choices=("table", "json"), default="table", help="output format (default table)"
    )


def _model_from_args(args: argparse.Namespace) -> ModelShape:
    explicit = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    if args.model:
        base = resolve_model(args.model)
        given = {k: v for k, v in explicit.items() if v is not None}
        if not given:
            return base
        return ModelShape(**{**asdict(base), **given, "name": f"{base.name} (modified)"})
    missing = [f"--{k.replace('_', '-')}" for k, v in explicit.items() if v is None]
    if missing:
        raise ValueError(
            f"give --model or all of --layers, --kv-heads, --head-dim "
            f"(missing {', '.join(missing)})"
        )
    return ModelShape("custom", **explicit)


def plan_command(args: argparse.Namespace) -> int:
    """Run ``kvctl plan``: print the report; 0 on success, 2 on bad input."""
    try:
        report = plan(
            _model_from_args(args),
            kv_dtype=args.kv_dtype,
            block_size=args.block_size,
            context_len=args.context_len,
            concurrency=args.concurrency,
            hbm_bytes=args.hbm,
            nvme_bytes=args.nvme,
            gpu_mem_bytes=args.gpu_mem,
            weights_bytes=args.weights,
            working_set_tokens=args.working_set_tokens,
            slot_bytes=args.slot_bytes,
        )
        text = render_plan(report, getattr(args, "output", "table"))
    except ValueError as exc:
        print(f"kvctl plan: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0
