"""The gateway's prompt ids (router/gateway/prompt.py) are the tokenizer's own: the fast
path it takes (no character offsets) gives what `Tokenizer.encode` gives, special tokens
and all, for a byte-level BPE tokenizer with a BOS post-processor like real models'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from router.gateway.prompt import BadPrompt, PromptCodec

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Ünïcödé, emoji 🙂, tabs\tand\nnewlines.",
    "def f(x):\n    return x * 2  # code, too",
    "KV caches keep attention keys and values of a prompt's tokens.",
] * 20


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> PromptCodec:
    d: Path = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=special))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return PromptCodec.load(str(d))


PIECES = list("abcdefKV xyz\t\n.,🙂Ü") + ["<|end|>", "<s>", "quick ", "return "]
TEXT = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=TEXT)
def test_completion_ids_are_encodes_ids_with_special_tokens(codec: PromptCodec, text: str):
    assert codec.completion_ids(text) == codec.tokenizer.encode(text, add_special_tokens=True).ids


@settings(max_examples=100, deadline=None)
@given(turns=st.lists(st.tuples(st.sampled_from(["user", "system"]), TEXT), min_size=1))
def test_chat_ids_are_the_rendered_templates_ids_without_added_specials(
    codec: PromptCodec, turns: list[tuple[str, str]]
):
    messages = [{"role": r, "content": c} for r, c in turns]
    text = codec.template.render(messages=messages, add_generation_prompt=True)
    want = codec.tokenizer.encode(text, add_special_tokens=False).ids
    assert codec.chat_ids(messages) == want
    assert want[-1] == codec.tokenizer.token_to_id("<|assistant|>")


def test_message_content_is_text_or_content_parts_and_null_only_for_an_assistant(
    codec: PromptCodec,
):
    """Before the fix any content went into the template (an int, null, an object), and
    on to the engine; OpenAI's shapes still pass."""
    for content in ("abc", [{"type": "text", "text": "abc"}], []):
        assert codec.chat_ids([{"role": "user", "content": content}])
    tools = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}
    assert codec.chat_ids([{"role": "user", "content": "abc"}, tools, {"role": "assistant"}])
    for message, said in (
        ({"role": "user", "content": 5}, "must be a string or a list of content parts, not int"),
        ({"role": "user", "content": None}, "list of content parts, not null"),
        ({"role": "user"}, "list of content parts, not null"),
        ({"role": "tool", "content": {"text": "abc"}}, "content parts, not dict"),
        ({"role": "user", "content": ["abc"]}, "content[0] must be a content part"),
        ({"role": "user", "content": [{"text": "abc"}]}, "content[0] must be a content part"),
    ):
        with pytest.raises(BadPrompt, match=r"messages\[1\]\.content") as exc:
            codec.chat_ids([{"role": "user", "content": "abc"}, message])
        assert said in str(exc.value)


def test_a_completion_prompt_is_unwrapped_once_at_most(codec: PromptCodec):
    """A prompt in single-element lists was unwrapped recursively (a Python frame a
    level, up to the recursion limit); OpenAI's shapes are a string, ids, or a list of
    either."""
    assert codec.completion_ids(["abc"]) == codec.completion_ids("abc")
    assert codec.completion_ids([[5, 6]]) == [5, 6]
    for prompt in ([["abc"]], [[[5, 6]]], [[["abc"]]], [[5, "x"]]):
        with pytest.raises(BadPrompt, match="prompt must be one string"):
            codec.completion_ids(prompt)
