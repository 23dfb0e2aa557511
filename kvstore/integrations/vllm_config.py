"""What the vLLM connector reads from vLLM: its settings (`kv_connector_extra_config`) and
the namespace, derived from the engine's own configuration and never typed by hand.

Nothing here imports vLLM: the engine config is read by attribute, so a field vLLM renames
shows up as a refusal with its name ("cannot name the namespace: ..."), not as a crash.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import TLSConfig
from kvstore.integrations.hf import _check_full_attention, _rope_fields
from kvstore.namespace import KV_DTYPE_BYTES, Namespace
from kvstore.salt import salt_secret, salted  # re-exported: the connector's names
from kvstore.tls import TLSFilesError, files_in, read_files

__all__ = ["ConnectorSettings", "NamespaceRefused", "engine_namespace", "salted", "salt_secret"]

MiB = 1 << 20
# Weights hashed to name a local model without a revision; bigger ones need --revision.
_MAX_HASHED_BYTES = 2 << 30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
)


class NamespaceRefused(ValueError):
    """The engine's configuration lacks something a namespace needs; the reason says what."""


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """`kv_connector_extra_config` keys: `agent` (host:port, required), `tenant` (required),
    `tenant_secret` or `tenant_secret_file` (one required), `token` or `token_file`,
    `name` (namespace name, default "vllm"), `shm_mib` (staging per client, default 64),
    `save_queue` (pending saves before new ones are dropped, default 64), `local_lane`
    (default true: the hot calls skip gRPC over the agent's Unix socket on the same host),
    `timeout_s` (deadline of each agent call, default 2: a frozen agent stalls a scheduler
    step at most that long, then the engine recomputes), `namespace_file` (the scheduler
    writes the namespace spec there as JSON: the engine's registrar publishes it), `router`
    (host:port of a kvstore router: on a local miss it names the peer to pull from when
    that pays; optional), `pull_timeout_s` (bound of one peer pull, default 10: the request
    waits that long at most, then recomputes what did not arrive).

    mTLS to the agent and the router (an agent running with `tls`): `tls_ca_file`,
    `tls_cert_file`, `tls_key_file` (all three), or `tls_dir` (a directory holding ca.crt,
    client.crt and client.key, what `kvctl cluster up --tls` writes in <state>/tls), and
    optionally `tls_server_name` (the name the agent's certificate carries, when it is
    dialled by an address the certificate does not name). The same-host local lane stays
    a Unix socket guarded by its permissions and peer credentials: its socket path is
    learnt over the mTLS channel, and the lane itself carries no TLS."""

    agent: str
    tenant: str
    tenant_secret: str
    token: str | None
    name: str = "vllm"
    shm_bytes: int = 64 * MiB
    save_queue: int = 64
    local_lane: bool = True
    timeout_s: float = 2.0
    namespace_file: str = ""
    router: str | None = None
    pull_timeout_s: float = 10.0
    tls: TLSConfig | None = None

    @classmethod
    def from_extra(cls, extra: dict | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        missing = [k for k in ("agent", "tenant") if not extra.get(k)]
        secret = extra.get("tenant_secret") or _read_file(extra.get("tenant_secret_file"))
        if not secret:
            missing.append("tenant_secret or tenant_secret_file")
        if missing:
            raise NamespaceRefused("kv_connector_extra_config lacks " + ", ".join(missing))
        token = extra.get("token") or _read_file(extra.get("token_file")) or None
        return cls(
            agent=str(extra["agent"]),
            tenant=str(extra["tenant"]),
            tenant_secret=secret,
            token=token,
            name=str(extra.get("name", "vllm")),
            shm_bytes=int(extra.get("shm_mib", 64)) * MiB,
            save_queue=int(extra.get("save_queue", 64)),
            local_lane=bool(extra.get("local_lane", True)),
            timeout_s=float(extra.get("timeout_s", 2.0)),
            namespace_file=str(extra.get("namespace_file", "")),
            router=str(extra["router"]) if extra.get("router") else None,
            pull_timeout_s=float(extra.get("pull_timeout_s", 10.0)),
            tls=_tls(extra),
        )


_TLS_KEYS = ("tls_ca_file", "tls_cert_file", "tls_key_file")


def _tls(extra: dict) -> TLSConfig | None:
    """The connector's mTLS files, checked now: a missing or unreadable file disables
    the connector with the file named, instead of a failed handshake at every call."""
    given = [k for k in _TLS_KEYS if extra.get(k)]
    if extra.get("tls_dir") and given:
        raise NamespaceRefused("kv_connector_extra_config: tls_dir or tls_*_file, not both")
    if extra.get("tls_dir"):
        base = files_in(str(extra["tls_dir"]))
    elif given:
        if len(given) != len(_TLS_KEYS):
            missing = sorted(set(_TLS_KEYS) - set(given))
            raise NamespaceRefused(
                f"kv_connector_extra_config: {', '.join(missing)} must be set with "
                + ", ".join(given)
            )
        base = TLSConfig(
            str(extra["tls_ca_file"]), str(extra["tls_cert_file"]), str(extra["tls_key_file"])
        )
    elif extra.get("tls_server_name"):
        raise NamespaceRefused("kv_connector_extra_config: tls_server_name needs the TLS files")
    else:
        return None
    tls = TLSConfig(
        base.ca_file,
        base.cert_file,
        base.key_file,
        server_name=str(extra.get("tls_server_name", "")),
    )
    try:
        read_files(tls)
    except TLSFilesError as exc:
        raise NamespaceRefused(str(exc)) from None
    return tls


def _read_file(path: str | None) -> str:
    if not path:
        return ""
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise NamespaceRefused(f"cannot read {path}: {exc.strerror}") from None


def _fingerprint(root: str, names: tuple[str, ...] | None, what: str) -> str:
    """A content hash of a local model (or tokenizer) directory: its revision when the
    engine was given none. Weight files count in full, so changed weights, same name,
    never share KV."""
    d = Path(root)
    files = sorted(
        p
        for p in d.iterdir()
        if p.is_file()
        and (
            p.name in names
            if names is not None
            else p.name == "config.json" or p.suffix in _WEIGHT_SUFFIXES
        )
    )
    if not files:
        raise NamespaceRefused(f"{what} directory {root} has no files to fingerprint")
    if sum(p.stat().st_size for p in files) > _MAX_HASHED_BYTES:
        raise NamespaceRefused(
            f"{what} {root} has no revision and is too big to hash; "
            "start vLLM with --revision / --tokenizer-revision"
        )
    h = hashlib.blake2b(digest_size=16)
    for p in files:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(MiB), b""):
                h.update(chunk)
    return "local-" + h.hexdigest()


def _revision(name: str, revision: str | None, names, what: str) -> str:
    if revision:
        return str(revision)
    if os.path.isdir(name):
        return _fingerprint(name, names, what)
    raise NamespaceRefused(
        f"{what} {name!r} has no revision; start vLLM with "
        f"--{'tokenizer-' if what == 'tokenizer' else ''}revision so "
        "its KV is named by exact weights"
    )


def _kv_dtype(model_config, cache_config) -> str:
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype != "auto":
        name = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}.get(
            cache_dtype, cache_dtype
        )
    else:
        name = str(model_config.dtype).removeprefix("torch.")
    if name not in KV_DTYPE_BYTES:
        raise NamespaceRefused(f"KV cache dtype {name!r} is not one kvstore stores")
    return name


def engine_namespace(
    vllm_config, settings: ConnectorSettings, tp_rank: int, engine_version: str
) -> Namespace:
    """The namespace of this engine's KV, from its configuration."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if getattr(vllm_config, "lora_config", None) is not None:
        raise NamespaceRefused("LoRA adapters are not supported yet (their KV differs per adapter)")
    hf = mc.hf_config
    try:
        _check_full_attention(hf)
        rope_type, rope_theta, rope_scaling = _rope_fields(hf)
    except ValueError as exc:
        raise NamespaceRefused(str(exc)) from None
    if pc.pipeline_parallel_size != 1:
        raise NamespaceRefused("pipeline parallelism is not supported yet")
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "?"
    return Namespace(
        tenant=settings.tenant,
        name=settings.name,
        model_name=str(mc.model),
        model_revision=_revision(mc.model, mc.revision, None, "model"),
        adapter_id="none",
        adapter_revision="none",
        tokenizer_id=str(mc.tokenizer),
        tokenizer_revision=_revision(
            mc.tokenizer, mc.tokenizer_revision, _TOKENIZER_FILES, "tokenizer"
        ),
        rope_type=rope_type,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        # KV from another engine, version or device is not bit-identical: never shared.
        attention_impl=f"vllm-{engine_version}-{device}",
        kv_dtype=_kv_dtype(mc, cc),
        prompt_template_version="token-ids",
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(),
        tp_rank=tp_rank,
        tp_size=pc.tensor_parallel_size,
        block_size=cc.block_size,
    )
