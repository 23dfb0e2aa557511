"""Prompt token ids as the engine computes them: the model's own tokenizer (`tokenizers`,
tokenizer.json) and chat template (Jinja2, rendered the way transformers'
`apply_chat_template` does), loaded from a local directory, offline.

Why not transformers: the router's venv would carry torch-sized dependencies and pins that
vLLM's venv contradicts; `tokenizers` and Jinja2 are what AutoTokenizer uses underneath.
A prompt the gateway tokenizes differently from the engine only routes worse (its chain
ids miss); the engine still computes the right answer from the request it receives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = ["PromptCodec", "BadPrompt"]


class BadPrompt(ValueError):
    """The request's prompt or messages cannot be turned into tokens (HTTP 400)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


# Roles whose content may be null or left out: an assistant's turn that only calls tools,
# and the deprecated function role's result (OpenAI's schema).
_NO_CONTENT_ROLES = frozenset(("assistant", "function"))


def _ids_only(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _check_content(i: int, message: dict[str, Any]) -> None:
    """A message's content as OpenAI takes it: text, or a list of content parts (objects
    with a string type); null or absent for an assistant's (function's) turn only."""
    content = message.get("content")
    if isinstance(content, str) or (content is None and message["role"] in _NO_CONTENT_ROLES):
        return
    if not isinstance(content, list):
        raise BadPrompt(
            f"messages[{i}].content must be a string or a list of content parts, "
            f"not {type(content).__name__ if content is not None else 'null'}"
        )
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise BadPrompt(f"messages[{i}].content[{j}] must be a content part (an object "
                            "with a string type)")  # fmt: skip


@dataclass(slots=True)
class PromptCodec:
    tokenizer: Tokenizer
    template: Any | None  # a compiled jinja2 Template, or None: no chat template
    special: dict[str, str]  # bos_token, eos_token, ... for the template

    @classmethod
    def load(cls, directory: str) -> "PromptCodec":
        d = Path(directory)
        try:
            tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise ValueError(f"tokenizer {directory}: cannot load tokenizer.json: {exc}") from None
        cfg: dict = {}
        if (d / "tokenizer_config.json").exists():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        source = cfg.get("chat_template")
        if (d / "chat_template.jinja").exists():  # transformers 5 writes it apart
            source = (d / "chat_template.jinja").read_text()
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        special = {
            k: v if isinstance(v, str) else (v or {}).get("content", "")
            for k, v in cfg.items()
            if k.endswith("_token") and isinstance(v, (str, dict))
        }
        template = None
        if source:
            # transformers' settings: its templates are written for them.
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent)
            template = env.from_string(source)
        return cls(tok, template, special)

    def completion_ids(self, prompt: Any) -> list[int]:
        """`prompt` of /v1/completions: a string, or token ids (used as they are)."""
        if isinstance(prompt, str):
            return self._ids(prompt, True)
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            # Checked here, before any work: an id the tokenizer cannot have made would
            # otherwise reach hashing (int32) or the engine as garbage.
            vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
            if prompt and not 0 <= min(prompt) <= max(prompt) < vocab:
                raise BadPrompt(f"token ids must be between 0 and {vocab - 1}")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], list):
            return self.completion_ids(prompt[0])  # ["text"]
        if isinstance(prompt, list) and len(prompt) == 1 and _ids_only(prompt[0]):
            return self.completion_ids(prompt[0])  # [[ids]]; no deeper: OpenAI's shapes
        raise BadPrompt("prompt must be one string or one list of token ids")

    def chat_ids(self, messages: Any, add_generation_prompt: bool = True) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadPrompt("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadPrompt("each message needs a string role")
            _check_content(i, m)
        if self.template is None:
            raise BadPrompt("this model has no chat template; use /v1/completions")
        try:
            text = self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
        except TemplateError as exc:
            raise BadPrompt(f"chat template refused the messages: {exc}") from None
        # The template writes the special tokens itself (vLLM: add_special_tokens=False).
        return self._ids(text, False)

    def _ids(self, text: str, special: bool) -> list[int]:
        # The ids of encode(), without the character offsets it also computes: the
        # gateway needs ids only (about 40 % less time per prompt here).
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=special)[0].ids
