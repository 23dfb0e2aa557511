"""Typed configuration: one frozen dataclass per component, loadable from a YAML/JSON
file, then environment variables (KVSTORE_AGENT_<FIELD>, KVSTORE_ROUTER_<FIELD>), then
command-line overrides, in that order. Validation raises ValueError with the field name.
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvstore.policy import NamespacePolicy
from kvstore.units import parse_size

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class TenantConfig:
    token_sha256: str = ""  # hex SHA-256 of the tenant's bearer token
    hbm_limit_bytes: int = 0  # 0: no limit
    nvme_limit_bytes: int = 0


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Node agent. Sizes accept "2MiB"-style strings in files and env."""

    node_id: str = "agent-0"
    listen: str = "127.0.0.1:50051"  # gRPC listen address (port 0: pick a free one)
    advertise: str = ""  # address others dial; default: the bound listen address
    device: str = "auto"  # cuda:N, cpu, or auto
    pool_bytes: int = 256 * MiB  # device pool size (slots = pool_bytes // slot_bytes)
    slot_bytes: int = 2 * MiB  # largest block payload this node accepts
    data_dir: str = "./kvstore-data/agent-0"  # RocksDB directory (NVMe)
    nvme_bytes: int = 4096 * MiB  # NVMe tier capacity
    eviction: str = "value"  # value | lru
    default_policy: NamespacePolicy = field(default_factory=NamespacePolicy)
    policies: dict[str, NamespacePolicy] = field(default_factory=dict)  # "tenant/name"
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    allow_unauthenticated: bool = False  # dev only: accept requests without a token
    max_message_bytes: int = 64 * MiB
    max_blocks_per_request: int = 8192
    expire_interval_s: float = 5.0
    etcd_endpoints: str = ""  # host:port[,host:port]; empty: run without etcd
    lease_ttl_s: int = 5
    metrics_port: int = 0  # 0: no Prometheus endpoint
    peer_port: int = 0  # UCX peer-transfer listener port (0: pick a free one)
    ucx_enabled: bool = True  # False: peers move blocks over the gRPC fallback only
    metrics_host: str = ""  # Prometheus endpoint host; "": the host of `listen`
    otlp_endpoint: str = ""  # OTLP/gRPC traces; "": $OTEL_EXPORTER_OTLP_ENDPOINT, else off
    copy_threads: int = 0  # threads for bulk copies of a batch; 0: min(4, CPUs)
    local_lane: bool = True  # same-host clients call Lookup/Get/Put over a Unix socket

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {self.slot_bytes}")
        if self.pool_bytes < self.slot_bytes:
            raise ValueError(f"pool_bytes ({self.pool_bytes}) must hold at least one slot of "
                             f"slot_bytes ({self.slot_bytes})")
        if self.eviction not in ("value", "lru"):
            raise ValueError(f"eviction must be 'value' or 'lru', got {self.eviction!r}")
        if not self.node_id or "/" in self.node_id:
            raise ValueError("node_id must be non-empty and contain no '/'")
        # Zero or negative here would mean a busy maintenance loop, a lease that expires at
        # once, or a server that refuses every message.
        for name in ("max_blocks_per_request", "max_message_bytes", "expire_interval_s",
                     "lease_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.nvme_bytes < 0 or self.metrics_port < 0:
            raise ValueError("nvme_bytes and metrics_port must be >= 0")

    @property
    def pool_slots(self) -> int:
        return self.pool_bytes // self.slot_bytes

    def policy_for(self, tenant: str, name: str) -> NamespacePolicy:
        return self.policies.get(f"{tenant}/{name}", self.default_policy)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    router_id: str = "router-0"
    listen: str = "127.0.0.1:50050"
    etcd_endpoints: str = "127.0.0.1:2379"
    weight_recompute: float = 1.0  # cost of one block nobody holds
    weight_peer_fetch: float = 0.3  # cost of one block fetched from a peer
    weight_load: float = 4.0  # per in-flight request on a node
    weight_utilization: float = 2.0  # per unit of pool utilization
    weight_queue: float = 1.0  # per block of prefill queued on a node (in-flight routes)
    prefill_tokens_per_s: float = 8000.0  # recompute speed, to price peer fetches
    peer_gbps: float = 1.0  # expected peer transfer bandwidth
    inflight_timeout_s: float = 120.0  # forget a routed request never released
    metrics_port: int = 0
    metrics_host: str = ""  # Prometheus endpoint host; "": the host of `listen`
    otlp_endpoint: str = ""  # OTLP/gRPC traces; "": $OTEL_EXPORTER_OTLP_ENDPOINT, else off

    def __post_init__(self) -> None:
        for name in ("weight_recompute", "weight_peer_fetch", "weight_load",
                     "weight_utilization", "weight_queue"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.prefill_tokens_per_s <= 0 or self.peer_gbps <= 0:
            raise ValueError("prefill_tokens_per_s and peer_gbps must be > 0")


def _coerce(tp, value, name: str):
    """`value` as type `tp`; every failure is a ValueError that starts with the field."""
    try:
        return _coerce_value(tp, value, name)
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        if msg.startswith(name):
            raise
        raise ValueError(f"{name}: {msg}") from None


def _coerce_value(tp, value, name: str):
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    if tp is int:
        return parse_size(value) if name.endswith("bytes") else int(value)
    if tp is float:
        return float(value)
    if tp is str:
        return str(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, name)
    if origin is dict:
        _, vt = typing.get_args(tp)
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping, got {value!r}")
        return {str(k): _coerce(vt, v, f"{name}.{k}") for k, v in value.items()}
    raise ValueError(f"{name}: unsupported type {tp}")


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {prefix or cls.__name__} fields: {', '.join(unknown)}")
    kwargs = {k: _coerce(hints[k], v, f"{prefix}{'.' if prefix else ''}{k}")
              for k, v in data.items()}
    return cls(**kwargs)


def load_config(cls, path: str | None = None, env_prefix: str | None = None,
                overrides: dict | None = None):
    """File, then env, then overrides (None values ignored)."""
    data: dict = {}
    if path:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text) if path.endswith((".yaml", ".yml")) else json.loads(text)
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of {cls.__name__} fields, "
                             f"got {type(loaded).__name__}")
        data.update(loaded or {})
    if env_prefix:
        for f in dataclasses.fields(cls):
            env = os.environ.get(f"{env_prefix}{f.name.upper()}")
            if env is not None:
                data[f.name] = env
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return _build(cls, data)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
