"""What a serving engine (vLLM with our connector) publishes about itself in etcd.

Key ``engines/<engine_id>`` under the cluster prefix, written under the registrar's lease
(kvstore/integrations/vllm_serve.py), so an engine that dies drops out within the TTL. The
gateway (router/gateway/) routes OpenAI requests to these; the KV-events subscriber reads
`kv_events_endpoint` / `kv_events_replay_endpoint`. JSON fields, agreed between both::

    {"engine_id", "url", "models": [...], "node_id", "namespace", "block_size",
     "kv_events_endpoint", "kv_events_replay_endpoint", "device"}

`namespace` is the connector's namespace spec (kvstore.namespace.Namespace.to_dict(),
before any `cache_salt`): with it the gateway computes the same chain ids as the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.coord.records import record_from_json

__all__ = ["ENGINES", "EngineRecord"]

ENGINES = "engines/"


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

    def to_json(self) -> bytes:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["models"] = list(self.models)
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "EngineRecord":
        # Newer registrars may add fields: ignored.
        return record_from_json(cls, raw, "engine record")
