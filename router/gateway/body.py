"""A request body as the gateway reads it (HTTP 400 on BadBody, before any work): JSON
that the gateway can re-send as standard JSON, and the fields it passes to the engine that
an engine must not get wrong (counts and sampling numbers).

Each of these was a 500 with a traceback, or reached the engine as sent: a lone UTF-16
surrogate ("\\ud800") fails the tokenizer; nesting near Python's recursion limit fails the
decoder, or later the encoder that re-sends the body a few frames deeper; NaN, Infinity
and 1e999 come back out of json.dumps as NaN/Infinity, which is not JSON.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

__all__ = ["BadBody", "MAX_DEPTH", "MAX_TOKENS", "read_json", "check_fields"]

# The deepest nesting a body may have. OpenAI's own shapes go a few levels deep, a tool's
# JSON schema a few more; Python's decoder and encoder fail at ~1000 (less the stack's
# depth where they run), a limit a body would otherwise find in the middle of a forward.
MAX_DEPTH = 64
# max_tokens and max_completion_tokens above this are refused: the gateway does not know
# the model's length, and no model's reaches it (vLLM keeps token counts in int32).
MAX_TOKENS = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's bounds on `priority`
_SURROGATE = re.compile("[\ud800-\udfff]")
_NESTED = frozenset((str, dict, list))  # what json.loads makes that can hold a string
_COUNTS = ("max_tokens", "max_completion_tokens")
_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


class BadBody(ValueError):
    """The request's body cannot be served as it is (HTTP 400)."""


class _NotFinite(ValueError):
    pass


def _constant(name: str) -> float:
    raise _NotFinite("NaN and Infinity are not JSON")


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _NotFinite(f"too large a number: {text[:20]}")
    return value


# One decoder: json.loads with hooks builds one per call (~2 us a request on this host).
_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_float)


def read_json(raw: bytes) -> dict[str, Any]:
    """The body's JSON object; BadBody says what is wrong with it."""
    try:  # json.loads(raw), with the hooks
        body = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except _NotFinite as exc:
        raise BadBody(f"body is not JSON: {exc}") from None
    except UnicodeDecodeError:
        raise BadBody("body is not JSON: not UTF-8") from None
    except json.JSONDecodeError:
        raise BadBody("body is not JSON") from None
    except ValueError:  # int(): Python's limit on digits (sys.set_int_max_str_digits)
        digits = sys.get_int_max_str_digits()
        raise BadBody(
            f"body is not JSON the gateway reads: a number over {digits} digits"
        ) from None
    except RecursionError:
        raise BadBody(f"body nested deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise BadBody("body must be a JSON object")
    deep = raw.count(b"[") + raw.count(b"{") > MAX_DEPTH  # else it cannot be as deep
    if deep or _may_hold_surrogates(raw):
        _walk(body)
    return body


def _may_hold_surrogates(raw: bytes) -> bool:
    """False when json.loads(raw) cannot have made a lone surrogate: UTF-8 (what it reads
    unless a BOM or NUL bytes say UTF-16 or 32) with no "\\uD..." escape and no 0xED byte
    (the lead byte of U+D000-U+DFFF, Hangul included, which the walk then clears)."""
    return (
        b"\\ud" in raw
        or b"\\uD" in raw
        or b"\xed" in raw
        or b"\x00" in raw[:4]
        or raw[:2] in (b"\xff\xfe", b"\xfe\xff")
    )


def _walk(body: dict[str, Any]) -> None:
    """BadBody for nesting over MAX_DEPTH or a string (a key too) with a lone surrogate.
    The path of the field is put together only for the message, on the way out."""
    try:
        _visit(body, 0)
    except _Bad as bad:
        path = tuple(reversed(bad.path))
        if bad.why == "deep":
            raise BadBody(f"body nested deeper than {MAX_DEPTH} levels") from None
        where = (
            _name(path) if bad.why == "value" else (f"a key in {_name(path)}" if path else "a key")
        )
        raise BadBody(f"{where} is not valid Unicode (a lone UTF-16 surrogate)") from None


class _Bad(Exception):
    def __init__(self, why: str) -> None:
        self.why = why
        self.path: list[str | int] = []  # innermost first


def _visit(value: Any, depth: int) -> None:
    """`value` at `depth` (its path's length). Only strings, objects and arrays are
    looked into: a long array of numbers costs one pass in a comprehension. A member is
    visited only while its depth is under MAX_DEPTH (checked by its container)."""
    if value.__class__ is str:
        if _SURROGATE.search(value):
            raise _Bad("value")
        return
    if value.__class__ is dict:
        for key in value:
            if _SURROGATE.search(key):
                raise _Bad("key")
        items = [(k, v) for k, v in value.items() if v.__class__ in _NESTED]
    elif value.__class__ is list:
        items = [(i, v) for i, v in enumerate(value) if v.__class__ in _NESTED]
    else:
        return
    if value and depth + 1 >= MAX_DEPTH:  # its members lie deeper than the limit
        raise _Bad("deep")
    for where, child in items:
        try:
            _visit(child, depth + 1)
        except _Bad as bad:
            bad.path.append(where)
            raise


def _name(path: tuple[str | int, ...]) -> str:
    """A field's path as the message names it: messages[0].content ("body" for the whole)."""
    out = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    return out.removeprefix(".") or "body"


def check_fields(body: dict[str, Any], max_choices: int, caller_priority: bool = False) -> None:
    """BadBody for a field passed to the engine with a type or value it must not get, or
    a `priority` other than 0 where callers may not set it (`caller_priority`)."""
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadBody("stream must be true or false")
    if "priority" in body:  # null too: vLLM's priority is a number, never null
        priority = body["priority"]
        if not _whole(priority) or not INT64_MIN <= priority <= INT64_MAX:
            raise BadBody("priority must be a whole number (64-bit)")
        if priority and not caller_priority:
            raise BadBody(
                "priority is not taken from callers here: the engines are shared, and a "
                "request's priority would move it ahead of other callers' (the gateway's "
                "caller_priority is off)"
            )
    choices = f"{max_choices} (the gateway's max_choices)"
    for names, least, most, over in (
        (("n", "best_of"), 1, max_choices, choices),
        (_COUNTS, 0, MAX_TOKENS, str(MAX_TOKENS)),
    ):
        for name in names:
            value = body.get(name)
            if value is None:
                continue
            if not _whole(value) or value < least:
                raise BadBody(f"{name} must be a whole number >= {least}")
            if value > most:
                raise BadBody(f"{name} over {over}")
    for name in _NUMBERS:  # finite already (read_json)
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise BadBody(f"{name} must be a number")


def choices(body: dict[str, Any]) -> int:
    """The sequences a request (checked by check_fields) has the engine generate at once:
    `n`, or `best_of` where larger (vLLM generates best_of and returns the best n)."""
    return max(body.get("n") or 1, body.get("best_of") or 1)


def counted(sequences: int, cap: int) -> int:
    """What a request of `sequences` choices counts against an in-flight cap (an engine's,
    a tenant's): that many, at most the whole cap, so that it runs once nothing else
    holds it (0: no cap)."""
    return max(1, min(sequences, cap) if cap else sequences)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
