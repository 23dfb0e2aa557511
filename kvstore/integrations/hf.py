"""Hugging Face `transformers` integration: prefill with the prompt prefix KV from kvstore.

    model = LlamaForCausalLM.from_pretrained(...)
    spec = namespace_for_model(model, "acme", "chat", model_name="meta-llama/...",
                               model_revision="abc123", tokenizer_id="meta-llama/...",
                               tokenizer_revision="abc123", prompt_template_version="v3")
    worker = CachedPrefillWorker(model, client, client.open_namespace(spec))
    result = worker.prefill(prompt_tokens)      # result.last_logits, result.usage

The worker fetches the longest cached prefix, loads it into a `DynamicCache`, runs the
model only on the rest of the prompt (positions continue after the prefix) and stores
the prompt's new full blocks. A hit saves prefill work and must never change output, so
the worker can recompute a sample of hits without the cache and compare logits.

Layouts: a transformers cache holds, per layer, K and V as (batch, kv_heads, seq,
head_dim); kvstore block tensors are (layers, 2 [K, V], block_size, kv_heads, head_dim).
`cache_to_kv` / `kv_to_cache` convert one sequence (batch 1) between the two.

Written against transformers 5.x (the `cache=` forward argument, `Cache.layers`); the
4.x spellings (`past_key_values=`, `key_cache`/`value_cache`, legacy tuples) are read too.
"""

from __future__ import annotations

import inspect
import json
import logging
import random
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from transformers import DynamicCache

from kvstore.client import Usage
from kvstore.client.convert import blocks_to_kv, kv_to_blocks, torch_dtype
from kvstore.namespace import KV_DTYPE_BYTES, Namespace

log = logging.getLogger("kvstore.integrations.hf")

__all__ = [
    "namespace_for_model",
    "model_layout",
    "cache_to_kv",
    "kv_to_cache",
    "reference_logits",
    "reference_greedy",
    "CachedPrefillWorker",
    "PrefillResult",
    "PrefixCacheClient",
]

# Namespace fields a caller supplies (what the model object cannot tell us).
_CALLER_FIELDS = (
    "model_name",
    "model_revision",
    "adapter_id",
    "adapter_revision",
    "tokenizer_id",
    "tokenizer_revision",
    "prompt_template_version",
    "tp_rank",
    "tp_size",
    "public",
)
# Namespace fields read from the model; a handle whose spec disagrees is refused.
LAYOUT_FIELDS = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "kv_dtype",
    "rope_type",
    "rope_theta",
    "rope_scaling",
    "attention_impl",
)
_DTYPE_NAMES = {torch_dtype(name): name for name in KV_DTYPE_BYTES}

# Default verification tolerances per KV dtype (atol, rtol). A poisoned prefix moved the
# tiny test model's logits by ~0.6; honest noise from running only the suffix on top of a
# loaded prefix measured <= 4e-7 in float32 on CPU (0 in 16-bit). 16-bit types get
# looser bounds because GPU attention kernels reorder reductions (not measured here).
VERIFY_TOLERANCE = {"float32": (1e-4, 1e-3), "float16": (1e-2, 1e-2), "bfloat16": (5e-2, 2e-2)}


class PrefixCacheClient(Protocol):
    """What the worker needs from a client: `KVClient` or a cluster client alike."""

    def fetch(self, ns: Any, tokens: Sequence[int], device: Any = "cpu") -> Any: ...

    def store(self, ns: Any, tokens: Sequence[int], kv: Any, cached_blocks: int = 0) -> Usage: ...


# --------------------------------------------------------------------------- namespace
def _rope_fields(config) -> tuple[str, float, str]:
    """(rope_type, rope_theta, canonical scaling) from a 5.x `rope_parameters` dict or
    the 4.x `rope_theta` + `rope_scaling` attributes."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        p = dict(params)
    else:
        p = dict(getattr(config, "rope_scaling", None) or {})
        if getattr(config, "rope_theta", None) is not None:
            p.setdefault("rope_theta", config.rope_theta)
    if any(isinstance(v, dict) for v in p.values()):
        raise ValueError(
            "per-layer-type rope parameters are not supported: "
            f"{sorted(k for k, v in p.items() if isinstance(v, dict))}"
        )
    # "type" is the pre-4.45 spelling of "rope_type"; an absent type means plain RoPE,
    # the way transformers itself reads such a config.
    rope_type = p.pop("rope_type", None) or p.pop("type", None) or "default"
    p.pop("type", None)
    theta = p.pop("rope_theta", None)
    if theta is None:
        raise ValueError("model config has no rope_theta; cannot name its namespace")
    scaling = json.dumps(p, sort_keys=True, separators=(",", ":")) if p else "none"
    return str(rope_type), float(theta), scaling


def _check_full_attention(config) -> None:
    """A sliding-window layer keeps only the last W tokens, so a stored prefix would not
    be the state the model expects; such models are refused until supported."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"only full-attention models are supported, config has layer "
            f"types {sorted(set(layer_types))}"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError(
            f"sliding-window attention (window {config.sliding_window}) is not supported"
        )


def model_layout(model) -> dict:
    """The namespace fields that come from the model: KV layout, RoPE, attention, dtype."""
    config = model.config
    _check_full_attention(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope_type, rope_theta, rope_scaling = _rope_fields(config)
    attn = getattr(config, "_attn_implementation", None)
    if not attn:
        raise ValueError("model config has no attention implementation set")
    dtype = model.dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"model dtype {dtype} is not a KV dtype kvstore stores")
    return dict(
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        kv_dtype=_DTYPE_NAMES[dtype],
        rope_type=rope_type,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_impl=attn,
    )


def _derived_defaults(model) -> dict:
    """Caller fields the model object answers for itself; anything else must be given."""
    out: dict = {}
    name = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    if name:
        out["model_name"] = name
    # A model with no adapter attached runs the base weights: "none" is a fact here.
    if not getattr(model, "_hf_peft_config_loaded", False) and not getattr(
        model, "peft_config", None
    ):
        out["adapter_id"] = out["adapter_revision"] = "none"
    tp_size = getattr(model, "_tp_size", None) or getattr(model, "tp_size", None) or 1
    if tp_size == 1:
        out["tp_rank"], out["tp_size"] = 0, 1
    return out


def namespace_for_model(
    model, tenant: str, name: str, block_size: int = 16, **revisions
) -> Namespace:
    """A Namespace for `model`: layout, RoPE, attention implementation and KV dtype from
    the model; model/tokenizer/adapter revisions and prompt-template version from the
    caller (`revisions`). Missing revisions are refused by Namespace, never defaulted."""
    unknown = sorted(set(revisions) - set(_CALLER_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown namespace fields for namespace_for_model: {unknown}; "
            f"the caller supplies {list(_CALLER_FIELDS)}, the rest comes "
            "from the model"
        )
    fields: dict[str, Any] = {
        f: "" for f in _CALLER_FIELDS if f not in ("tp_rank", "tp_size", "public")
    }
    fields.update(tp_rank=0, tp_size=0, public=False)  # 0: refused unless derived/given
    fields.update(_derived_defaults(model))
    fields.update(revisions)
    return Namespace(
        tenant=tenant, name=name, block_size=block_size, **model_layout(model), **fields
    )


# ------------------------------------------------------------------------ conversions
def _cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):  # 4.36 .. 4.55
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v, *_ in cache]  # legacy tuple of (K, V) per layer


def cache_to_kv(past_key_values) -> torch.Tensor:
    """A transformers cache of one sequence -> (layers, 2, tokens, kv_heads, head_dim)."""
    layers = _cache_layers(past_key_values)
    if not layers or any(k is None or k.dim() != 4 for k, _ in layers):
        raise ValueError("cache has no initialized (batch, heads, seq, head_dim) layers")
    if layers[0][0].shape[0] != 1:
        raise ValueError(f"cache_to_kv takes one sequence, cache has batch {layers[0][0].shape[0]}")
    # (1, heads, seq, dim) -> (seq, heads, dim) for K and V, stacked per layer.
    return torch.stack(
        [torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)]) for k, v in layers]
    )


def kv_to_cache(kv: torch.Tensor) -> DynamicCache:
    """(layers, 2, tokens, kv_heads, head_dim) -> a DynamicCache of one sequence."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be (layers, 2, tokens, heads, head_dim), got {tuple(kv.shape)}")
    cache = DynamicCache()
    for i in range(kv.shape[0]):
        k = kv[i, 0].transpose(0, 1).unsqueeze(0).contiguous()
        v = kv[i, 1].transpose(0, 1).unsqueeze(0).contiguous()
        cache.update(k, v, i)
    return cache


# -------------------------------------------------------------------------- forward
def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _forward(model, kwarg: str, tokens: Sequence[int], start: int, cache):
    """Run `tokens` at positions start.. on top of `cache` (None: a fresh one)."""
    device = model.device
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    pos = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)
    out = model(
        input_ids=ids,
        position_ids=pos,
        use_cache=True,
        **{kwarg: cache if cache is not None else DynamicCache()},
    )
    new_cache = out.get("cache")
    if new_cache is None:
        new_cache = out.get("past_key_values")
    return out.logits[0], new_cache


def reference_logits(model, tokens: Sequence[int]) -> torch.Tensor:
    """Logits of every position of a plain, cache-free prefill: (tokens, vocab)."""
    with torch.no_grad():
        return _forward(model, _cache_kwarg(model), tokens, 0, None)[0]


def reference_greedy(model, tokens: Sequence[int], n: int) -> list[int]:
    """Greedy continuation without kvstore (the model's own cache only)."""
    kwarg = _cache_kwarg(model)
    with torch.no_grad():
        logits, cache = _forward(model, kwarg, tokens, 0, None)
        return _greedy_loop(model, kwarg, logits[-1], cache, len(tokens), n)


def _greedy_loop(model, kwarg, last_logits, cache, pos: int, n: int) -> list[int]:
    out: list[int] = []
    for step in range(n):
        tok = int(torch.argmax(last_logits))
        out.append(tok)
        if step + 1 < n:
            logits, cache = _forward(model, kwarg, [tok], pos + step, cache)
            last_logits = logits[-1]
    return out


# --------------------------------------------------------------------------- worker
@dataclass(frozen=True, slots=True)
class PrefillResult:
    logits: torch.Tensor  # (computed_tokens, vocab): positions prefix_tokens..end
    cache: Any  # DynamicCache over the whole prompt, ready for decoding
    usage: Usage
    prefix_tokens: int  # tokens whose KV came from kvstore
    computed_tokens: int  # tokens the model ran on
    verified: bool | None  # None: not sampled; False: mismatch (recomputed result served)

    @property
    def last_logits(self) -> torch.Tensor:
        return self.logits[-1]


class CachedPrefillWorker:
    """Prefill with kvstore for one model and namespace.

    `client` is anything with KVClient's `fetch(ns, tokens, device=)` and
    `store(ns, tokens, kv, cached_blocks=)` (a single-node or a cluster client).
    With `verify_prob` > 0, each hit is recomputed without the cache with that
    probability (seeded by `verify_seed`); a mismatch beyond tolerance is counted in
    `verify_mismatches`, logged, and the recomputed result is served and stored.
    """

    def __init__(
        self,
        model,
        client: PrefixCacheClient,
        ns,
        *,
        verify_prob: float = 0.0,
        verify_seed: int = 0,
        verify_atol: float | None = None,
        verify_rtol: float | None = None,
    ) -> None:
        if not 0.0 <= verify_prob <= 1.0:
            raise ValueError(f"verify_prob must be in [0, 1], got {verify_prob}")
        layout = model_layout(model)
        bad = [
            f"{f}: namespace {getattr(ns.spec, f)!r}, model {layout[f]!r}"
            for f in LAYOUT_FIELDS
            if getattr(ns.spec, f) != layout[f]
        ]
        if bad:
            raise ValueError("namespace does not match the model: " + "; ".join(bad))
        self.model = model.eval()
        self.client = client
        self.ns = ns
        self.block_size = ns.spec.block_size
        self.verify_prob = verify_prob
        atol, rtol = VERIFY_TOLERANCE.get(layout["kv_dtype"], (1e-2, 1e-2))
        self.verify_atol = atol if verify_atol is None else verify_atol
        self.verify_rtol = rtol if verify_rtol is None else verify_rtol
        self.verify_checks = 0
        self.verify_mismatches = 0
        self.verify_max_abs_diff = 0.0  # largest logits difference seen by verification
        self._rng = random.Random(verify_seed)
        self._kwarg = _cache_kwarg(model)
        self._vocab = model.config.vocab_size

    def _check_tokens(self, tokens) -> list[int]:
        toks = [int(t) for t in tokens]
        if not toks:
            raise ValueError("prefill needs at least one token")
        bad = [t for t in toks if not 0 <= t < self._vocab]
        if bad:
            raise ValueError(f"{len(bad)} token ids outside [0, {self._vocab}), first {bad[0]}")
        return toks

    def prefill(self, tokens: Sequence[int]) -> PrefillResult:
        toks = self._check_tokens(tokens)
        hit = self.client.fetch(self.ns, toks, device=self.model.device)
        # At least one token must run so the last position has logits: when every
        # token is in cached full blocks, reuse all but the last token's KV.
        prefix = min(hit.cached_tokens, len(toks) - 1)
        with torch.no_grad():
            cache = kv_to_cache(blocks_to_kv(hit.blocks)[:, :, :prefix]) if prefix else None
            logits, cache = _forward(self.model, self._kwarg, toks[prefix:], prefix, cache)
            verified = None
            if prefix and self.verify_prob and self._rng.random() < self.verify_prob:
                verified, logits, cache = self._verify(toks, prefix, logits, cache)
        # Blocks already cached are passed through untouched; store writes only the rest.
        new_blocks = []
        if len(toks) // self.block_size > hit.cached_blocks:
            kv = cache_to_kv(cache)[:, :, hit.cached_tokens :]
            new_blocks = kv_to_blocks(kv, self.block_size)
        blocks = list(hit.blocks) + new_blocks
        written = self.client.store(self.ns, toks, blocks, cached_blocks=hit.cached_blocks)
        n = len(toks)
        usage = Usage(n, prefix, written.cache_write_tokens, n - prefix)
        return PrefillResult(logits, cache, usage, prefix, n - prefix, verified)

    def _verify(self, toks, prefix, logits, cache):
        ref_logits, ref_cache = _forward(self.model, self._kwarg, toks, 0, None)
        ref = ref_logits[prefix:]
        diff = float((logits.float() - ref.float()).abs().max())
        self.verify_checks += 1
        self.verify_max_abs_diff = max(self.verify_max_abs_diff, diff)
        if torch.allclose(
            logits.float(), ref.float(), atol=self.verify_atol, rtol=self.verify_rtol
        ):
            return True, logits, cache
        self.verify_mismatches += 1
        log.warning(
            "kv verification mismatch: namespace %s, %d cached tokens, max abs "
            "logits diff %.3g; serving the recomputed result",
            self.ns.spec.key,
            prefix,
            diff,
        )
        return False, ref, ref_cache

    def generate_greedy(self, tokens: Sequence[int], n: int) -> tuple[list[int], Usage]:
        """Prefill through kvstore, then `n` greedy tokens decoded on the local cache."""
        if n < 1:
            raise ValueError(f"generate_greedy needs n >= 1, got {n}")
        res = self.prefill(tokens)
        with torch.no_grad():
            out = _greedy_loop(
                self.model,
                self._kwarg,
                res.last_logits,
                res.cache,
                res.prefix_tokens + res.computed_tokens,
                n,
            )
        return out, res.usage
