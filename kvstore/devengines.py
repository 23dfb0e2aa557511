"""vLLM CPU engines on 127.0.0.1 behind the gateway, for the dev cluster (`kvctl cluster
up --engines N`), the gateway's tests and its benchmark: each engine is vLLM's OpenAI
server (in the vLLM venv, `make vllm-env`) with our connector on one agent, started by its
registrar (kvstore.integrations.vllm_serve, in this venv), which registers it in etcd
once it answers /health and its connector wrote its namespace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvstore.devprocs import CLUSTER_ENV, fresh_log

__all__ = ["EngineLaunch", "VLLM_ENV", "VLLM_PY", "gateway_files", "start_engine", "stop_engine"]

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
# What vLLM CPU needs here (facts in loadtest/vllm_run.py); offline, no telemetry.
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    engine_id: str
    port: int
    model_dir: str
    served_name: str
    agent: str  # host:port of the agent its connector uses
    node_id: str  # that agent's node id
    kv_tenant: str
    kv_secret_file: str
    etcd_endpoint: str
    workdir: str
    block_size: int = 32
    max_model_len: int = 2048
    prefix_caching: bool = True
    ttl_s: int = 3
    # (publisher, replay) ports of the engine's KV events, so the router learns what the
    # engine's own prefix cache holds; None publishes none. Always on loopback, TLS or
    # not: vLLM's ZMQ sockets have no authentication or TLS and carry every tenant's
    # prompt token ids. vLLM binds the replay port on 127.0.0.1 and connects its
    # publisher to 127.0.0.1:PORT, which the router binds (router/engine_feed.py), so
    # neither port is reachable from another host (`tcp://*:PORT` bound both on 0.0.0.0).
    kv_events_ports: tuple[int, int] | None = None
    # With mTLS (`kvctl cluster up --tls`): the dev CA's directory (kvstore/tls_ca.py).
    # The connector and the registrar present its client pair; vLLM serves HTTPS with
    # its server pair (valid for 127.0.0.1) and requires a certificate of its CA.
    tls_dir: str = ""
    # The compute it runs on, as the router sees it (EngineRecord.device): the dev
    # cluster's CPU engines all share this host's cores.
    device: str = ""
    # The engine record key the registrar signs its etcd record with (--record-key-file;
    # the dev cluster's router holds it as engine_record_key_file). "": unsigned.
    record_key_file: str = ""

    @property
    def url(self) -> str:
        return f"{'https' if self.tls_dir else 'http'}://127.0.0.1:{self.port}"

    def kv_transfer_config(self) -> dict:
        extra = {
            "agent": self.agent,
            "tenant": self.kv_tenant,
            "tenant_secret_file": self.kv_secret_file,
            "shm_mib": 8,
            "namespace_file": str(Path(self.workdir) / "namespace.json"),
        }
        if self.tls_dir:
            extra["tls_dir"] = self.tls_dir
        return {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }

    def vllm_command(self) -> list[str]:
        cmd = [
            str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir, "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--block-size", str(self.block_size), "--enforce-eager",
            "--max-model-len", str(self.max_model_len), "--seed", "0",
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
            "--kv-transfer-config", json.dumps(self.kv_transfer_config()),
        ]  # fmt: skip
        if not self.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        endpoints = self._events_endpoints()
        if endpoints is not None:
            pub, replay = endpoints
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": pub,
                "replay_endpoint": replay,
            }
            cmd += ["--kv-events-config", json.dumps(events)]
        return cmd + self._ssl_args()

    def _ssl_args(self) -> list[str]:
        if not self.tls_dir:
            return []
        d = Path(self.tls_dir)
        # --ssl-cert-reqs 2 is ssl.CERT_REQUIRED: no client certificate, no handshake.
        return ["--ssl-keyfile", str(d / "server.key"), "--ssl-certfile", str(d / "server.crt"),
                "--ssl-ca-certs", str(d / "ca.crt"), "--ssl-cert-reqs", "2"]  # fmt: skip

    def _events_endpoints(self) -> tuple[str, str] | None:
        if self.kv_events_ports is None:
            return None
        pub, replay = self.kv_events_ports
        return f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"

    def _events_args(self) -> list[str]:
        endpoints = self._events_endpoints()
        if endpoints is None:
            return []
        pub, replay = endpoints
        return ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]

    def _registrar_tls_args(self) -> list[str]:
        # The registrar presents the same client pair to etcd and to the engine's /health.
        return ["--tls-dir", self.tls_dir] if self.tls_dir else []

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "kvstore.integrations.vllm_serve",
            "--engine-id", self.engine_id, "--url", self.url, "--node-id", self.node_id,
            "--model", self.served_name, "--etcd-endpoints", self.etcd_endpoint,
            "--namespace-file", str(Path(self.workdir) / "namespace.json"),
            "--ttl", str(self.ttl_s), "--check-interval", "0.5", *self._events_args(),
            *self._registrar_tls_args(), *(["--device", self.device] if self.device else []),
            *(["--record-key-file", self.record_key_file] if self.record_key_file else []),
            "--", *self.vllm_command(),
        ]  # fmt: skip


def start_engine(
    launch: EngineLaunch, new_session: bool = False, cluster: Path | None = None
) -> subprocess.Popen:
    """Start the registrar (which starts vLLM); its log is <workdir>/engine.log (fresh_log).
    `cluster`: the state directory of the `kvctl cluster up` starting it (CLUSTER_ENV)."""
    d = Path(launch.workdir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "namespace.json").unlink(missing_ok=True)  # the connector writes it afresh
    env = dict(os.environ, **VLLM_ENV, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    if cluster is not None:
        env[CLUSTER_ENV] = str(cluster.resolve())
    with fresh_log(d / "engine.log") as log:
        return subprocess.Popen(
            launch.command(),
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )


# API keys of the dev cluster's gateway (dev only: they are in its state directory).
DEMO_KEYS = {"demo-key-acme": "acme", "demo-key-globex": "globex", "demo-key-initech": "initech"}
KV_TENANT = "engines"  # the engines' own kvstore tenant; the gateway salts per API tenant
MODEL_NAME = "tiny"


# The tiny model's shape (loadtest/vllm_model.py: 4 attention heads, 2 KV heads, float32).
MODEL_LAYERS, MODEL_HIDDEN, MODEL_HEADS, MODEL_KV_HEADS = 4, 256, 4, 2


def model_block_bytes(block_size: int = 32) -> int:
    """One KV block of the tiny model: what the agents' pool slots must hold, or every
    Lookup and Put of its engines is refused (INVALID_ARGUMENT) and they only recompute."""
    head_dim = MODEL_HIDDEN // MODEL_HEADS
    return MODEL_LAYERS * 2 * block_size * MODEL_KV_HEADS * head_dim * 4


def write_model(model_dir: Path, timeout_s: float = 600.0) -> Path:
    """The tiny local Llama with its tokenizer and chat template (loadtest/vllm_model.py),
    written by the vLLM venv, which has transformers."""
    subprocess.run(
        [str(VLLM_PY), "-m", "loadtest.vllm_model", str(model_dir), "--layers",
         str(MODEL_LAYERS), "--hidden", str(MODEL_HIDDEN)],
        cwd=ROOT, check=True, capture_output=True, timeout=timeout_s,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    return model_dir


def write_private(path: Path, text: str) -> None:
    """`text` into `path`, readable by its owner only (0600, a file that was there
    included): API keys and secrets, which other users of the host must not read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def gateway_files(d: Path, tokenizers: dict[str, str], extra: dict | None = None) -> Path:
    """API keys, the engines' kv secret and the GatewayConfig file, in `d`; returns the
    config's path. The secret is fresh on every call."""
    import secrets as _secrets

    d.mkdir(parents=True, exist_ok=True)
    write_private(d / "keys.json", json.dumps(DEMO_KEYS, indent=2) + "\n")
    secret = d / "kv.secret"
    if not secret.exists():
        write_private(secret, _secrets.token_hex(16))
    else:  # written 0644 by an older kvctl
        secret.chmod(0o600)
    cfg = {
        "tokenizers": tokenizers,
        "api_keys_file": str(d / "keys.json"),
        "kv_secret_files": {KV_TENANT: str(secret)},
        **(extra or {}),
    }
    (d / "gateway.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return d / "gateway.json"


def stop_engine(pid: int, grace_s: float = 30.0) -> None:
    """SIGTERM the engine's session (registrar, vLLM and its engine core) and SIGCONT it
    (a stopped process handles SIGTERM only once it runs), then SIGKILL."""
    import signal
    import time

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
            if sig == signal.SIGTERM:
                os.killpg(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.2)
