"""A tiny Llama-architecture model with seeded random weights, and prefill calibration.

Nothing is downloaded: the model is built from a `LlamaConfig`, so tests and replays get
a real transformer (RoPE, GQA, SDPA attention, a real KV cache) that runs on a CPU in
milliseconds. `measure_prefill` times cache-free prefill at several prompt lengths; the
resulting `PrefillCalibration` prices recomputation for trace replay (how much prefill
time a hit of `cached` tokens saves on a prompt of `total` tokens).

    python -m loadtest.model --lengths 16,64,256,512 --layers 2 --hidden 128
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = [
    "tiny_llama_config",
    "build_tiny_llama",
    "PrefillCalibration",
    "measure_prefill",
    "measure_decode",
]


def tiny_llama_config(
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1000,
    intermediate: int | None = None,
    max_positions: int = 4096,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    initializer_range: float = 0.02,
    attn_implementation: str = "sdpa",
) -> LlamaConfig:
    """Llama config for a small model; `rope_scaling` adds e.g. {"rope_type": "linear",
    "factor": 2.0} to the RoPE parameters."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"hidden {hidden} must divide by heads {heads}, and heads by kv_heads {kv_heads}"
        )
    rope = {"rope_type": "default", "rope_theta": float(rope_theta), **(rope_scaling or {})}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rope_parameters=rope,
        initializer_range=initializer_range,
        attn_implementation=attn_implementation,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_tiny_llama(
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **config_kwargs,
) -> LlamaForCausalLM:
    """A seeded random-weight Llama in eval mode; same seed and config, same weights.
    The global torch RNG is left as it was."""
    config = tiny_llama_config(**config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


@dataclass(frozen=True, slots=True)
class PrefillCalibration:
    """Measured cache-free prefill time per prompt length (median of repeats).

    Between points time is interpolated linearly (through (0, 0) below the first);
    beyond the last point it extends with the last segment's slope, which
    underestimates the quadratic attention term on very long prompts."""

    lengths: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.lengths or len(self.lengths) != len(self.seconds):
            raise ValueError("calibration needs matching, non-empty lengths and seconds")
        if list(self.lengths) != sorted(set(self.lengths)) or self.lengths[0] <= 0:
            raise ValueError(
                f"lengths must be positive and strictly increasing, got {self.lengths}"
            )

    def prefill_seconds(self, length: int) -> float:
        if length <= 0:
            return 0.0
        xs = (0, *self.lengths)
        ys = (0.0, *self.seconds)
        i = min(max(bisect.bisect_left(xs, length), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (length - x0) / (x1 - x0))

    def tokens_per_s(self, length: int) -> float:
        """Prefill throughput of a whole prompt of `length` tokens."""
        s = self.prefill_seconds(length)
        return length / s if s > 0 else float("inf")

    def suffix_seconds(self, cached: int, total: int) -> float:
        """Prefill time of tokens cached..total given the first `cached` from a cache:
        for causal attention, the cost of the whole prompt minus that of the prefix."""
        if not 0 <= cached <= total:
            raise ValueError(f"need 0 <= cached ({cached}) <= total ({total})")
        return max(0.0, self.prefill_seconds(total) - self.prefill_seconds(cached))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PrefillCalibration":
        return cls(tuple(int(x) for x in d["lengths"]), tuple(float(x) for x in d["seconds"]))


def measure_prefill(
    model,
    lengths: Sequence[int],
    *,
    repeats: int = 3,
    warmup: int = 1,
    seed: int = 0,
    max_seconds: float = 60.0,
) -> PrefillCalibration:
    """Time cache-free prefill of random prompts at each length (bounded by
    `max_seconds` overall: once spent, remaining lengths get their warmup and one
    timed run each)."""
    lengths = sorted(set(int(n) for n in lengths))
    limit = getattr(model.config, "max_position_embeddings", None)
    if not lengths or lengths[0] <= 0 or (limit and lengths[-1] > limit):
        raise ValueError(f"lengths must be in [1, {limit}], got {lengths}")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    gen = torch.Generator().manual_seed(seed)
    deadline = time.monotonic() + max_seconds
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device)
            times = []
            for i in range(warmup + repeats):
                if times and time.monotonic() > deadline:
                    break
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            # Prefill cost never falls with length; a dip is noise from a shared host,
            # and pricing must not say a longer prompt is cheaper.
            out.append(max(statistics.median(times), out[-1] if out else 0.0))
    return PrefillCalibration(tuple(lengths), tuple(out))


def measure_decode(model, context: int = 512, steps: int = 16, *, seed: int = 0) -> float:
    """Seconds per generated token: single-token forward passes on top of a KV cache of
    `context` tokens (median of `steps`, after one warm-up step)."""
    if context < 1 or steps < 1:
        raise ValueError("context and steps must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(device)
    times = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(steps + 1):
            nxt = out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, cache=out["cache"], use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="16,64,256,512")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    model = build_tiny_llama(
        a.seed,
        dtype=getattr(torch, a.dtype),
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        kv_heads=a.kv_heads,
    )
    cal = measure_prefill(model, [int(x) for x in a.lengths.split(",")], repeats=a.repeats)
    rows = [
        {"length": n, "seconds": s, "tokens_per_s": cal.tokens_per_s(n)}
        for n, s in zip(cal.lengths, cal.seconds)
    ]
    print(json.dumps({"calibration": cal.to_dict(), "points": rows}, indent=1))


if __name__ == "__main__":
    main()
