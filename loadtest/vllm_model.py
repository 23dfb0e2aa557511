"""A tiny random-weight Llama on disk, in the form vLLM loads (config, weights, tokenizer).

Nothing is downloaded: the weights come from `loadtest.model.build_tiny_llama` (seeded), the
tokenizer is a word-level one built with the `tokenizers` library ("w0 w1 ..." are the ids
0, 1, ...). Shared by tests/integration/test_vllm.py and loadtest/bench_vllm.py; runs in the
vLLM venv (.venv-vllm, `make vllm-env`), which has transformers and tokenizers.

    python -m loadtest.vllm_model /tmp/tiny-llama --layers 2 --hidden 128
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "write_tiny_llama", "write_word_tokenizer"]

# Roles as words of the vocabulary (w1 user, w2 assistant, w3 system), so a rendered chat
# is plain "w..." words: the gateway (tokenizers + Jinja2) and vLLM (transformers)
# tokenize it alike, and an answer sent back as the next turn's content re-tokenizes to
# the same ids.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ {'user': 'w1', 'assistant': 'w2', 'system': 'w3'}.get(m['role'], 'w4') }} "
    "{{ m['content'] }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}w2{% endif %}"
)


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_word_tokenizer(directory: str | Path, vocab: int = 1000) -> Path:
    """The tiny model's tokenizer and chat template alone, with `tokenizers` only (no
    transformers): what the gateway needs in front of stand-in workers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return d


def write_tiny_llama(
    path: str | Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1000,
    max_positions: int = 4096,
    dtype: str = "float32",
) -> Path:
    """Write the model to `path` (idempotent: an existing complete one is kept) and return
    it. Same arguments, same weights."""
    import torch

    from loadtest.model import build_tiny_llama

    path = Path(path)
    marker = path / "kvstore-tiny.json"
    args = {
        "seed": seed,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "vocab": vocab,
        "max_positions": max_positions,
        "dtype": dtype,
        "chat_template": CHAT_TEMPLATE,
    }
    if marker.exists() and json.loads(marker.read_text()) == args:
        return path
    model = build_tiny_llama(
        seed,
        dtype=getattr(torch, dtype),
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        max_positions=max_positions,
    )
    model.config.architectures = ["LlamaForCausalLM"]
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    _tokenizer(vocab).save_pretrained(path)
    marker.write_text(json.dumps(args))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--max-positions", type=int, default=4096)
    a = ap.parse_args()
    print(
        write_tiny_llama(
            a.path, seed=a.seed, layers=a.layers, hidden=a.hidden, max_positions=a.max_positions
        )
    )


if __name__ == "__main__":
    main()
