"""GatewayConfig: the gateway's settings (`kvstore-router --gateway-config FILE`, then
KVSTORE_GATEWAY_<FIELD> variables, then flags), and the API-key file it reads."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvstore.config import check_listen

__all__ = ["GatewayConfig", "ApiKeys", "Grant", "POLICIES", "ReloadingApiKeys", "read_secret"]

log = logging.getLogger("kvstore.gateway")

POLICIES = ("cache", "round_robin", "hash")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    listen: str = ""  # host:port of the OpenAI API; "": no gateway
    # Served model name -> local directory with its tokenizer.json and chat template
    # (tokenizer_config.json "chat_template" or chat_template.jinja), read offline.
    tokenizers: dict[str, str] = field(default_factory=dict)
    # YAML/JSON mapping API key -> tenant (a Kubernetes Secret in the chart). Keys are kept
    # only as SHA-256 in memory and never logged.
    api_keys_file: str = ""
    # The engines' kvstore tenant -> file with its tenant secret (the connector's
    # tenant_secret_file): the chain roots the gateway hashes prompts with.
    kv_secret_files: dict[str, str] = field(default_factory=dict)
    # Keys the per-tenant cache_salt (HMAC of the tenant); "": the first kv secret.
    salt_key_file: str = ""
    policy: str = "cache"  # cache (the router's cost function), round_robin, hash
    max_inflight_per_engine: int = 16  # beyond it the engine is saturated: 429 when all are
    # A tenant with this many requests in flight gets 429 (0: no cap), so one tenant
    # cannot fill every engine and starve the others.
    max_inflight_per_tenant: int = 0
    retry_after_s: int = 1
    engine_suspend_s: float = 5.0  # an engine that failed a forward is skipped this long
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    max_body_bytes: int = 4 << 20
    # Clients that send slowly or stall (anyone, without a key: they are cut off before
    # the API key is read). The request line and headers must arrive within
    # header_timeout_s of the connection opening, or on a keep-alive connection of the
    # next request's first byte (an idle one closes after 30 s); the body within
    # body_timeout_s of the headers. Late: 408 and the connection closed (a connection
    # that sent nothing is closed without a word).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 64 << 10  # request line and headers; more: 431, connection closed
    # A client that reads nothing of its answer for send_timeout_s while the gateway has
    # more to send (the connection's buffers full) is cut off: its connection is closed
    # and its request released (the engine's request aborted, its engine and tenant slots
    # given back), as when a client leaves. A slow reader that keeps reading is not.
    send_timeout_s: float = 60.0
    # Open client connections. A new one beyond it makes room by closing the connection
    # that matters least: one with no request being served (idle keep-alive, silent since
    # it opened, or its request's head or body still arriving: that one is answered 503),
    # the one waiting longest first. Only when every other connection has a request in
    # flight is the new connection's request refused (503, Retry-After).
    max_connections: int = 1024
    # The same, counted per client address (0: no cap): over it, the client's own waiting
    # connection that has waited longest is closed, or, all of them being served, its new
    # request is 503. Off by default: behind a Kubernetes Service (externalTrafficPolicy
    # Cluster), an ingress or a load balancer that does not keep the source address, every
    # client arrives from the same few addresses, and any cap would be max_connections
    # under another name, refusing everyone. Set it where the gateway sees its clients'
    # own addresses, well above what one client's connection pool holds.
    max_connections_per_client: int = 0
    max_prompt_tokens: int = 1 << 20  # longer prompts are refused (400)
    # Large prompts (bodies over 8 KiB) are parsed and tokenized on this many threads, all
    # tenants together, at most max_tokenizing_per_tenant of one tenant's at once (its
    # others wait, counted in flight for max_inflight_per_tenant): one tenant's flood of
    # large prompts keeps at most that many cores busy (router/gateway/admission.py).
    tokenize_threads: int = 2
    max_tokenizing_per_tenant: int = 1
    # The most completions one request may ask of the engine (`n`, `best_of`); more is
    # refused (400). A request's n choices weigh on the engine like n requests, and count
    # as n against max_inflight_per_engine and max_inflight_per_tenant (at most the cap).
    max_choices: int = 16
    # vLLM's `priority` (lower is served first, under its priority scheduling): callers
    # share the engines, so one that sets it would jump the others' queue. Off: a
    # request with a priority other than 0 is refused (400). True passes the caller's
    # through (one tenant's gateway, or callers trusted alike).
    caller_priority: bool = False
    # /metrics on the gateway's own port. Off by default: the page counts every tenant's
    # requests, and any caller reaching the port would read them. The same page is always
    # on the router's Prometheus port (metrics_port), the operator's.
    public_metrics: bool = False
    # HTTPS: the router's tls: section (ca_file, cert_file, key_file) by default, or these
    # files (a certificate of its own for the public name, say); rewritten files apply to
    # new connections without a restart (router/gateway/tls.py). No files: plain HTTP.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""  # trusted for client certificates and https:// engines
    https: bool = True  # False: plain HTTP although TLS files are there (a TLS proxy ahead)
    # Clients must present a certificate from the CA (mTLS); API keys still name tenants.
    require_client_cert: bool = False
    # A gateway serving HTTPS forwards to https:// engines only: an engine record with an
    # http:// URL is left out (logged, kvstore_gateway_engines_refused_total), since its
    # prompts would cross the network in plaintext. True admits them (engines on the
    # gateway's host, or a network encrypted below HTTP). Without HTTPS: no effect.
    allow_plaintext_engines: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.listen:
            # Here, before anything starts (not at bind time, after joining etcd); named
            # "gateway listen", apart from the router's own gRPC listen.
            check_listen("gateway listen", self.listen)
        for name in (
            "max_inflight_per_engine",
            "retry_after_s",
            "max_body_bytes",
            "max_choices",
            "max_header_bytes",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("tokenize_threads", "max_tokenizing_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_prompt_tokens < 1:  # 0 would refuse every prompt, not lift the cap
            raise ValueError(
                "max_prompt_tokens must be >= 1 (the most tokens a prompt may have), "
                f"got {self.max_prompt_tokens}"
            )
        if self.max_inflight_per_tenant < 0:
            raise ValueError("max_inflight_per_tenant must be >= 0 (0: no cap)")
        if self.max_connections_per_client < 0:
            raise ValueError(
                "max_connections_per_client must be >= 0 (0: no cap), "
                f"got {self.max_connections_per_client}"
            )
        for name in (
            "engine_suspend_s",
            "connect_timeout_s",
            "request_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
            "send_timeout_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):  # nan > 0 is False, inf > 0 True
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_ca_file and not self.tls_cert_file:
            raise ValueError("tls_ca_file needs tls_cert_file and tls_key_file")
        if self.listen:
            if not self.tokenizers:
                raise ValueError("tokenizers must name at least one model's tokenizer directory")
            if not self.api_keys_file:
                raise ValueError("api_keys_file is required (API key -> tenant)")


def read_secret(path: str, what: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if not value:
        raise ValueError(f"{what}: {path} is empty")
    return value


@dataclass(frozen=True, slots=True)
class Grant:
    """What an API key may do: act as `tenant`, on `models` only (None: every model)."""

    tenant: str
    models: frozenset[str] | None = None

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


class ApiKeys:
    """API key -> tenant, or -> {"tenant": T, "models": [...]} for a key limited to some
    models (others: 403). Looked up by SHA-256 digest: the keys themselves are not kept,
    and a lookup's timing depends on the digest, which tells an attacker nothing."""

    def __init__(self, keys: dict[str, Any]) -> None:
        self._by_digest: dict[bytes, Grant] = {}
        for key, value in keys.items():
            self._by_digest[hashlib.sha256(key.encode()).digest()] = _grant(key, value)

    @classmethod
    def load(cls, path: str, allow_empty: bool = False) -> "ApiKeys":
        """`allow_empty`: an empty mapping (`{}`) loads, with no keys (every request 401);
        at start-up it is refused, a gateway nobody can use being a mistake. An empty
        file (or only YAML comments) is never a mapping: a file being rewritten in place
        is empty for a moment."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"api_keys_file: cannot read {path}: {exc.strerror}") from None
        if not text.strip():
            raise ValueError(f"api_keys_file {path} is empty")
        try:
            data = yaml.safe_load(text) if path.endswith((".yaml", ".yml")) else json.loads(text)
        except (ValueError, yaml.YAMLError) as exc:
            raise ValueError(f"api_keys_file {path}: not YAML/JSON: {type(exc).__name__}") from None
        if not isinstance(data, dict) or not (data or allow_empty):
            raise ValueError(f"api_keys_file {path}: expected a mapping of key -> tenant")
        return cls({str(k): v for k, v in data.items()})

    def grant(self, key: str) -> Grant | None:
        return self._by_digest.get(hashlib.sha256(key.encode()).digest())

    def tenant(self, key: str) -> str | None:
        g = self.grant(key)
        return g.tenant if g is not None else None

    def __len__(self) -> int:
        return len(self._by_digest)


class ReloadingApiKeys:
    """The api_keys_file, read again when it changes (checked at most once per
    `interval_s`, by its stat: a rewrite, or a Kubernetes Secret's symlink swap), so a
    leaked key is revoked by editing the file, without a restart, and every key by
    writing an empty mapping, `{}` (then every request is 401). A file that does not load
    keeps the keys in force, with a warning, never locking every tenant out: one half
    written or with a bad entry, an empty file (what a rewrite in place shows for a
    moment) and a missing one (a replace by delete and create, an unmounted volume) alike.
    Revoking takes `{}`, not deleting the file."""

    def __init__(self, path: str, interval_s: float = 1.0) -> None:
        self.path, self.interval_s = path, interval_s
        self._keys = ApiKeys.load(path)  # a bad file at start-up stops the gateway
        self._seen = self._stat()
        self._next = time.monotonic() + interval_s

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _refresh(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        seen = self._stat()
        if seen == self._seen:
            return
        self._seen = seen
        if seen is None:
            log.warning(
                "api_keys_file %s is missing; keeping the %d keys in force until it is back "
                "(to revoke every key, write {} to it)",
                self.path,
                len(self._keys),
            )
            return
        try:
            self._keys = ApiKeys.load(self.path, allow_empty=True)
        except ValueError as exc:
            log.warning(
                "api_keys_file changed but does not load; keeping the keys in force: %s", exc
            )
            return
        if len(self._keys):
            log.info("api_keys_file reloaded: %d keys", len(self._keys))
        else:
            log.warning("api_keys_file reloaded: no keys; every request is refused (401)")

    def grant(self, key: str) -> Grant | None:
        self._refresh()
        return self._keys.grant(key)

    def tenant(self, key: str) -> str | None:
        g = self.grant(key)
        return g.tenant if g is not None else None

    def __len__(self) -> int:
        return len(self._keys)


def _grant(key: str, value: Any) -> Grant:
    # The message never names the key: the file is a Secret.
    bad = "api keys: every key needs a non-empty tenant, or {tenant, models: [names]}"
    if isinstance(value, dict):
        tenant, models = value.get("tenant"), value.get("models")
        if set(value) - {"tenant", "models"} or (
            models is not None
            and not (isinstance(models, list) and all(isinstance(m, str) and m for m in models))
        ):
            raise ValueError(bad)
        value, allowed = tenant, (frozenset(models) if models is not None else None)
    else:
        allowed = None
    if not key or not isinstance(value, str) or not value:
        raise ValueError(bad)
    return Grant(value, allowed)
