"""JSON records kept in etcd (nodes/, engines/): decoded one way, with newer writers'
extra fields ignored so an older reader keeps working during a rolling upgrade, and
signed one way (record_hmac)."""

from __future__ import annotations

import hashlib
import hmac
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


# Signed records (engines/ and nodes/; docs/security.md): HMAC-SHA256 keyed by
# SHA-256(context + a secret the writers and readers share), over the context and the
# fields that decide trust as one canonical JSON array. One construction for both kinds;
# the context keeps a signature of one kind from verifying as the other.


def record_key(context: str, secret: str) -> bytes:
    """The HMAC key of records of `context`: SHA-256(context + secret)."""
    return hashlib.sha256(context.encode() + secret.encode()).digest()


def record_hmac(key: bytes, context: str, *signed: Any) -> str:
    """HMAC-SHA256 (hex) over [context, *signed] as canonical JSON (sorted keys, no spaces,
    ASCII: one encoding per record, and no field can run into the next). ValueError for
    what JSON cannot carry (NaN), as a forger may write."""
    body = json.dumps(
        [context, *signed],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=False,
    ).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def signature_matches(signature: object, expected: str) -> bool:
    """Whether `signature`, as a record holds it, is `expected`, compared in constant time
    as bytes: a signature that is no string, is empty, or is not ASCII (as a forger may
    write) does not match, and raises nothing."""
    if not isinstance(signature, str) or not signature:
        return False
    return hmac.compare_digest(signature.encode(), expected.encode())
