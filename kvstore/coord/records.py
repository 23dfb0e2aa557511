"""JSON records kept in etcd (nodes/, engines/): decoded one way, with newer writers'
extra fields ignored so an older reader keeps working during a rolling upgrade."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def json_object(raw: bytes, what: str) -> dict[str, Any]:
    """The JSON object `raw`; ValueError naming `what` when it is not one."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{what} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object")
    return data


def record_from_json(cls: type[T], raw: bytes, what: str) -> T:
    """`cls` built from the JSON object `raw`; ValueError naming `what` when it is not
    one, or misses a required field."""
    return record_from_dict(cls, json_object(raw, what), what)


def record_from_dict(cls: type[T], data: dict[str, Any], what: str) -> T:
    """`cls` built from the decoded object `data` (fields it does not know ignored)."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]  # cls is a dataclass
    kept: dict[str, Any] = {k: v for k, v in data.items() if k in known}
    try:
        return cls(**kept)
    except TypeError as exc:  # a required field missing
        raise ValueError(f"{what}: {exc}") from None
