"""What a serving engine (vLLM with our connector) publishes about itself in etcd.

Key ``engines/<engine_id>`` under the cluster prefix, written under the registrar's lease
(kvstore/integrations/vllm_serve.py), so an engine that dies drops out within the TTL. The
gateway (router/gateway/) routes OpenAI requests to these; the KV-events subscriber reads
`kv_events_endpoint` / `kv_events_replay_endpoint`. JSON fields, agreed between both::

    {"engine_id", "url", "models": [...], "node_id", "namespace", "block_size",
     "kv_events_endpoint", "kv_events_replay_endpoint", "device"}

`namespace` is the connector's namespace spec (kvstore.namespace.Namespace.to_dict(),
before any `cache_salt`): with it the gateway computes the same chain ids as the engine.

Signed records (docs/security.md, Engine records): anyone who can write etcd could put
`engines/evil` naming a server of theirs, and the gateway would forward every tenant's
prompts to it. So a registrar holding the engine record key (`--record-key-file`) adds
`signature`: HMAC-SHA256, keyed by SHA-256("kvstore engine record v1" + the key file's
text), over every other field of the record as written (canonical JSON: sorted keys, no
spaces, ASCII), so no field that directs traffic (url, engine_id, node_id, models,
namespace, KV-event endpoints, device, block_size) nor one added later can be changed
or added without the key. Readers configured with the key (the router's
`engine_record_key_file`) take only records that verify (EngineRecordReader).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.coord.records import json_object, record_from_dict, record_from_json

__all__ = [
    "ENGINES",
    "EngineRecord",
    "EngineRecordReader",
    "RecordNotSigned",
    "engine_record_key",
    "read_engine_record",
    "record_signature",
]

ENGINES = "engines/"
SIGNATURE = "signature"
# Domain separation: the key signs engine records only, whatever else the same secret
# is used for (a node record's context is "kvstore node record v1").
RECORD_CONTEXT = "kvstore engine record v1"

log = logging.getLogger("kvstore.engines")


@dataclass(frozen=True, slots=True)
class EngineRecord:
    engine_id: str
    url: str  # HTTP base of the engine's OpenAI server, e.g. http://10.0.0.5:8000
    models: tuple[str, ...]  # served model names
    node_id: str  # the agent the engine's connector uses
    namespace: dict[str, Any] = field(default_factory=dict)
    block_size: int = 0
    kv_events_endpoint: str | None = None  # vLLM's ZMQ KV-event publisher, when enabled
    kv_events_replay_endpoint: str | None = None
    # The compute the engine runs on (e.g. "cuda:GPU-<uuid>", "cpu:<host>"): engines naming
    # the same device share it, so the router adds up their queues. "": a device of its own.
    device: str = ""

    def __post_init__(self) -> None:
        if not self.engine_id or "/" in self.engine_id:
            raise ValueError(f"engine_id must be non-empty without '/', got {self.engine_id!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine {self.engine_id}: url must be http(s)://, got {self.url!r}")
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise ValueError(f"engine {self.engine_id}: models must name at least one model")
        if not isinstance(self.block_size, int) or self.block_size < 0:
            raise ValueError(f"engine {self.engine_id}: block_size must be an int >= 0")
        if not isinstance(self.namespace, dict):
            raise ValueError(f"engine {self.engine_id}: namespace must be a JSON object")
        if not isinstance(self.device, str) or len(self.device) > 256:
            raise ValueError(f"engine {self.engine_id}: device must be a string of <= 256 chars")
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "url", self.url.rstrip("/"))

    def to_json(self, key: bytes = b"") -> bytes:
        """The record as etcd holds it; with `key` (engine_record_key), signed."""
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        data["models"] = list(self.models)
        if key:  # signed as the reader will decode it (tuples are lists there)
            data[SIGNATURE] = record_signature(key, json.loads(json.dumps(data)))
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "EngineRecord":
        """Unverified (kvctl's listing); the gateway and the router read through
        EngineRecordReader. Newer registrars may add fields: ignored."""
        return record_from_json(cls, raw, "engine record")


class RecordNotSigned(ValueError):
    """An engine record without a signature that verifies under the reader's key."""


def engine_record_key(secret: str) -> bytes:
    """The HMAC key of engine records: SHA-256(context + the key file's text)."""
    return hashlib.sha256(RECORD_CONTEXT.encode() + secret.encode()).digest()


def record_signature(key: bytes, data: dict[str, Any]) -> str:
    """HMAC-SHA256 (hex) over the context and every field of `data` but `signature`, as
    canonical JSON (one encoding per record: no field can run into the next). ValueError
    for what JSON cannot carry (NaN), as a forger may write."""
    body = {k: v for k, v in data.items() if k != SIGNATURE}
    signed = json.dumps(
        [RECORD_CONTEXT, body],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=False,
    ).encode()
    return hmac.new(key, signed, hashlib.sha256).hexdigest()


def _verifies(key: bytes, data: dict[str, Any]) -> bool:
    sig = data.get(SIGNATURE)
    if not isinstance(sig, str) or not sig:
        return False
    try:
        expected = record_signature(key, data)
    except ValueError:
        return False
    return hmac.compare_digest(sig.encode(), expected.encode())  # constant time


def read_engine_record(raw: bytes, key: bytes = b"") -> EngineRecord:
    """The record in `raw`; with `key`, only when its signature verifies (RecordNotSigned
    otherwise). ValueError for a value that is no engine record."""
    data = json_object(raw, "engine record")
    if key and not _verifies(key, data):
        raise RecordNotSigned("not signed with the engine record key")
    return record_from_dict(EngineRecord, data, "engine record")


class EngineRecordReader:
    """engines/<id> values as one follower (the gateway's, the KV-event subscriber's)
    takes them: a record that does not decode, or sits under another engine's key, or
    (with a key) does not verify, is None. Refusals of unsigned or forged records are
    counted (`refused`, a metric) and logged once per key until the key is deleted or
    holds a record that verifies; neither the key nor a signature is ever logged."""

    def __init__(self, key: bytes = b"") -> None:
        self.key = key
        self.refused = 0
        self._said: set[str] = set()

    def read(self, etcd_key: str, value: bytes) -> EngineRecord | None:
        try:
            rec = read_engine_record(value, self.key)
        except RecordNotSigned:
            self.refused += 1
            if etcd_key not in self._said:
                self._said.add(etcd_key)
                log.warning(
                    "ignoring engine record %s: not signed with the engine record key "
                    "(engine_record_key_file); no request goes to the url it names",
                    etcd_key,
                )
            return None
        except (ValueError, TypeError) as exc:
            log.warning("ignoring engine record %s: %s", etcd_key, exc)
            return None
        if etcd_key != ENGINES + rec.engine_id:
            log.warning("ignoring engine record %s: it names engine %r", etcd_key, rec.engine_id)
            return None
        self._said.discard(etcd_key)
        return rec

    def forget(self, etcd_key: str) -> None:
        """The key was deleted: a later refusal under it is logged again."""
        self._said.discard(etcd_key)
