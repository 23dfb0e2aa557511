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
`engine_record_key_file`) take only records that verify (EngineRecordReader), or, with
`engine_record_unsigned: accept` (while registrars are being given the key), also those
that carry no signature at all; a signature that does not verify is refused either way.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from kvstore.coord.records import (
    json_object,
    record_from_dict,
    record_from_json,
    record_hmac,
    record_key,
    signature_matches,
)

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


# Printable ASCII, no '/': the chart's `<node name>-gpu<i>` fits (node names: 253).
_ENGINE_ID = re.compile(r"[\x21-\x2e\x30-\x7e]{1,512}")


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
        if not isinstance(self.engine_id, str) or not _ENGINE_ID.fullmatch(self.engine_id):
            # It names the engine in the gateway's answers (a header), metrics and logs: a
            # CR/LF or a non-ASCII character there would split or break an answer.
            raise ValueError(
                "engine_id must be 1-512 printable ASCII characters without '/' or spaces, "
                f"got {str(self.engine_id)[:80]!r}"
            )
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


class _Put(Protocol):  # kvstore.coord.etcd.KeyValue (that module imports this one)
    @property
    def key(self) -> str: ...
    @property
    def value(self) -> bytes: ...


class _Change(_Put, Protocol):  # kvstore.coord.etcd.WatchEvent
    @property
    def deleted(self) -> bool: ...


def engine_record_key(secret: str) -> bytes:
    """The HMAC key of engine records: SHA-256(context + the key file's text)."""
    return record_key(RECORD_CONTEXT, secret)


def record_signature(key: bytes, data: dict[str, Any]) -> str:
    """HMAC-SHA256 (hex) over the context and every field of `data` but `signature`, as
    canonical JSON (kvstore/coord/records.py). ValueError for what JSON cannot carry
    (NaN), as a forger may write."""
    return record_hmac(key, RECORD_CONTEXT, {k: v for k, v in data.items() if k != SIGNATURE})


def _verifies(key: bytes, data: dict[str, Any]) -> bool:
    try:
        expected = record_signature(key, data)
    except ValueError:
        return False
    return signature_matches(data.get(SIGNATURE), expected)  # constant time


def read_engine_record(raw: bytes, key: bytes = b"", accept_unsigned: bool = False) -> EngineRecord:
    """The record in `raw`; with `key`, only when its signature verifies, or, with
    `accept_unsigned`, when it carries no signature at all (RecordNotSigned otherwise: a
    signature that does not verify is refused in every mode). ValueError for a value
    that is no engine record."""
    return _read(raw, key, accept_unsigned)[0]


def _read(raw: bytes, key: bytes, accept_unsigned: bool) -> tuple[EngineRecord, bool]:
    """The record and whether it was taken without a signature under `key`."""
    data = json_object(raw, "engine record")
    unsigned = bool(key) and accept_unsigned and SIGNATURE not in data
    if key and not unsigned and not _verifies(key, data):
        raise RecordNotSigned("not signed with the engine record key")
    return record_from_dict(EngineRecord, data, "engine record"), unsigned


class EngineRecordReader:
    """engines/<id> values as one follower (the gateway's, the KV-event subscriber's)
    takes them: a record that does not decode, or sits under another engine's key, or
    (with a key) does not verify, is None. Refusals of unsigned or forged records are
    counted (`refused`, a metric) and logged once per key until the key is deleted or
    holds a record that verifies; neither the key nor a signature is ever logged.

    `accept_unsigned` (the router's `engine_record_unsigned: accept`, while registrars
    are being given the key): a record with no `signature` field is taken, logged once
    per key and counted (`unsigned`: the etcd keys holding one now, a metric); one whose
    signature does not verify is still refused, and so is an unsigned record under a key
    that held a verified one since this reader was made (a registrar that signs never
    goes back to unsigned: that is someone replacing its record), counted as refused and
    logged once. Without a key every record is taken as it stands, and the first one
    read logs that records are not authenticated (unless `said_unauthenticated`: the
    router said so at start)."""

    def __init__(
        self, key: bytes = b"", accept_unsigned: bool = False, said_unauthenticated: bool = False
    ) -> None:
        self.key = key
        self.accept_unsigned = accept_unsigned
        self.refused = 0
        self._said: set[str] = set()
        self._unsigned: set[str] = set()  # etcd keys whose record was taken unsigned
        # etcd keys that held a record that verified, deleted since or not: never unsigned
        self._verified: set[str] = set()
        self._said_unauthenticated = said_unauthenticated

    @property
    def unsigned(self) -> int:
        """How many engines/ keys hold a record taken without a signature now."""
        return len(self._unsigned)

    def read(self, etcd_key: str, value: bytes) -> EngineRecord | None:
        was_unsigned = etcd_key in self._unsigned
        self._unsigned.discard(etcd_key)
        try:
            rec, unsigned = _read(value, self.key, self.accept_unsigned)
            if unsigned and etcd_key in self._verified:
                raise RecordNotSigned("unsigned, where a signed record was")
        except RecordNotSigned as exc:
            self._refuse(etcd_key, str(exc))
            return None
        except (ValueError, TypeError) as exc:
            log.warning("ignoring engine record %s: %s", etcd_key, exc)
            return None
        if etcd_key != ENGINES + rec.engine_id:
            log.warning("ignoring engine record %s: it names engine %r", etcd_key, rec.engine_id)
            return None
        self._said.discard(etcd_key)
        if self.key and not unsigned:
            self._verified.add(etcd_key)
        if unsigned:
            self._unsigned.add(etcd_key)
            if not was_unsigned:
                log.warning(
                    "engine record %s is unsigned and taken (engine_record_unsigned: accept): "
                    "give its registrar the engine record key (--record-key-file) before "
                    "the routers refuse unsigned records",
                    etcd_key,
                )
        elif not self.key and not self._said_unauthenticated:
            self._said_unauthenticated = True
            log.warning(
                "engine records are not authenticated (no engine_record_key_file): whoever "
                "can write etcd can point the gateway's requests and the KV-event subscriber "
                "at a server of theirs (docs/security.md, Engine records)"
            )
        return rec

    def _refuse(self, etcd_key: str, why: str) -> None:
        """Count a refused record; log it once per key (until deleted or verified)."""
        self.refused += 1
        if etcd_key not in self._said:
            self._said.add(etcd_key)
            log.warning(
                "ignoring engine record %s: %s (engine_record_key_file); no request goes "
                "to the url it names",
                etcd_key,
                why,
            )

    def forget(self, etcd_key: str) -> None:
        """The key was deleted: a later refusal under it is logged again."""
        self._said.discard(etcd_key)
        self._unsigned.discard(etcd_key)

    # ------------------------------------------------------------ following engines/
    # The gateway's EngineSet and the router's EngineFeed follow engines/ the same way:
    # what they add or drop for each record is theirs (`upsert`, `remove`).

    def reset(
        self,
        items: Iterable[_Put],
        known: Iterable[str],
        upsert: Callable[[EngineRecord], None],
        remove: Callable[[str], None],
    ) -> None:
        """A listing of engines/: upsert what it holds that reads, then remove the engine
        ids of `known` (read after, a live view) that it does not."""
        items = list(items)
        listed = {kv.key for kv in items}
        for etcd_key in (self._said | self._unsigned) - listed:  # deleted while away
            self.forget(etcd_key)
        seen = set()
        for kv in items:
            rec = self.read(kv.key, kv.value)
            if rec is not None:
                seen.add(rec.engine_id)
                upsert(rec)
        for engine_id in [e for e in known if e not in seen]:
            remove(engine_id)

    def apply(
        self,
        events: Iterable[_Change],
        upsert: Callable[[EngineRecord], None],
        remove: Callable[[str], None],
    ) -> None:
        """Watch events on engines/: a record that reads is upserted; a deleted key, or
        one now holding no engine to take, removes its engine."""
        for ev in events:
            rec = None if ev.deleted else self.read(ev.key, ev.value)
            if ev.deleted:
                self.forget(ev.key)
            if rec is not None:
                upsert(rec)
            else:
                remove(ev.key[len(ENGINES) :])
