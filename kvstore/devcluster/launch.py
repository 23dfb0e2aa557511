"""Starting the dev cluster's processes: `up`'s options, etcd, the agents and the router
(their configuration files and secrets), the vLLM engines, and the waits between."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import TLSConfig
from kvstore.devcluster.state import ClusterError, Proc
from kvstore.devengines import (
    KV_TENANT,
    MODEL_NAME,
    EngineLaunch,
    gateway_files,
    model_block_bytes,
    start_engine,
    write_private,
)
from kvstore.devprocs import (
    WaitFailed,
    Watched,
    client_context,
    free_port,
    http_ok,
    spawn,
    wait_until,
)
from kvstore.units import parse_size


@dataclass(frozen=True, slots=True)
class UpOptions:
    agents: int = 2
    pool_bytes: str = "256MiB"
    slot_bytes: str = "64KiB"
    nvme_bytes: str = "1GiB"
    lease_ttl_s: int = 5
    timeout_s: float = 180.0
    router_log_level: str = "INFO"
    engines: int = 0  # vLLM CPU engines behind the gateway, one per agent in turn
    # model name -> tokenizer dir: serve the gateway without engines (the benchmark's
    # stand-in workers); with engines it serves the tiny model they run.
    gateway_tokenizers: tuple[tuple[str, str], ...] = ()
    engine_timeout_s: float = 600.0
    tls: bool = False  # mTLS on every port, from a throwaway CA in <state>/tls

    def __post_init__(self) -> None:
        if not 0 <= self.engines <= 8:
            raise ValueError(f"--engines must be between 0 and 8, got {self.engines}")
        # tls with engines: each engine serves HTTPS requiring the CA's certificates, its
        # connector and registrar present the client pair (EngineLaunch.tls_dir). Its KV
        # event ports are on loopback with or without tls (ZMQ has no TLS in vLLM).
        if not 1 <= self.agents <= 64:
            raise ValueError(f"--agents must be between 1 and 64, got {self.agents}")
        if self.lease_ttl_s < 2:
            raise ValueError("lease TTL must be >= 2 s (etcd's minimum)")
        self.sizes()  # before anything starts: a bad size failed in the agents' logs

    def sizes(self) -> tuple[int, int, int]:
        """(pool, slot, nvme) bytes per agent; ValueError naming the flag. The slot is
        the agents' (agent_slot_bytes), which must fit in the pool."""
        parsed = []
        for flag, text in (("--pool-bytes", self.pool_bytes), ("--slot-bytes", self.slot_bytes),
                           ("--nvme-bytes", self.nvme_bytes)):  # fmt: skip
            try:
                parsed.append(parse_size(text))
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
        pool, slot, nvme = parsed
        if slot <= 0:
            raise ValueError(f"--slot-bytes must be > 0, got {self.slot_bytes!r}")
        if self.engines:
            slot = max(slot, model_block_bytes())
        if pool < slot:
            why = " or one KV block of the engines' model" if self.engines else ""
            raise ValueError(
                f"--pool-bytes {self.pool_bytes} must hold at least one slot of {slot} "
                f"bytes (--slot-bytes {self.slot_bytes}{why})"
            )
        return pool, slot, nvme


def _etcd_tls_flags(tls: TLSConfig | None) -> list[str]:
    """etcd's own TLS: clients must present a certificate of the CA, and so must a peer
    on the peer port (the same pair, as the chart's members present)."""
    if tls is None:
        return []
    return [
        "--cert-file",
        tls.cert_file,
        "--key-file",
        tls.key_file,
        "--trusted-ca-file",
        tls.ca_file,
        "--client-cert-auth",
        "--peer-cert-file",
        tls.cert_file,
        "--peer-key-file",
        tls.key_file,
        "--peer-trusted-ca-file",
        tls.ca_file,
        "--peer-client-cert-auth",
    ]


def etcd_command(
    binary: str, name: str, data_dir: Path, client_url: str, peer_url: str, tls=None
) -> list[str]:
    """etcd's command line for a one-member cluster (kvctl cluster up, the chaos harness,
    the tests' fixture); `tls` (a TLSConfig) as _etcd_tls_flags, with https:// URLs."""
    if tls is not None and not all(u.startswith("https://") for u in (client_url, peer_url)):
        raise ValueError(f"etcd with TLS needs https:// URLs, not {client_url} and {peer_url}")
    return [
        binary,
        "--name",
        name,
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        client_url,
        "--advertise-client-urls",
        client_url,
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
        "--initial-cluster",
        f"{name}={peer_url}",
        "--log-level",
        "warn",
        *_etcd_tls_flags(tls),
    ]


def start_etcd(state: Path, tls: TLSConfig | None) -> tuple[subprocess.Popen, str, Path]:
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    if not os.access(binary, os.X_OK):
        raise ClusterError("etcd is not installed (apt-get install etcd-server)")
    # Kept from the last run, as a production etcd is: namespaces and their generations
    # (a flush made while an agent was down stays in force when it comes back with the
    # old blocks on NVMe), quotas, the kill switch, the audit log. up forgets the last
    # run's members (forget_last_run).
    data = state / "etcd"
    cport, pport = free_port(), free_port()
    scheme = "https" if tls is not None else "http"
    cu, pu = f"{scheme}://127.0.0.1:{cport}", f"{scheme}://127.0.0.1:{pport}"
    log = state / "etcd.log"
    # Its data outlives the run: compacted to the last 10,000 revisions (every 5 min), so
    # that run after run does not fill etcd's backend (2 GiB, then read-only).
    compaction = ["--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000"]
    proc = spawn([*etcd_command(binary, "local", data, cu, pu, tls), *compaction], log, state)
    return proc, f"127.0.0.1:{cport}", log


def _secret_file(state: Path, name: str) -> Path:
    """A random secret in `state/name`, made once per state directory, readable by its
    owner only (devengines.write_private, as the gateway's keys and kv secret)."""
    path = state / name
    if not path.exists():
        write_private(path, secrets.token_urlsafe(32) + "\n")
    return path


def _agent_token(state: Path) -> tuple[Path, str]:
    """The agent credential ("_agent", docs/security.md) the agents present to each other
    on peer pulls; returns the file and the token's SHA-256 (the agents' tenants entry)."""
    path = _secret_file(state, "agent-token")
    return path, hashlib.sha256(path.read_text().strip().encode()).hexdigest()


def engine_record_key_file(state: Path) -> Path:
    """The engine record key (docs/security.md, Engine records): the router and its
    gateway take only engines/ records signed with it, which the engines' registrars do
    (`--record-key-file`); so does a registrar of your own started against this cluster."""
    return _secret_file(state, "engine-record-key")


def _tls_section(tls: TLSConfig | None) -> dict:
    if tls is None:
        return {}
    return {"tls": {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file}}


def agent_slot_bytes(opts: UpOptions) -> int:
    """The pool's slot size: with engines, at least one KV block of their model (the
    default 64 KiB slots refused every block of the tiny model's 128 KiB)."""
    return opts.sizes()[1]


def start_agent(state: Path, i: int, etcd: str, opts: UpOptions, tls: TLSConfig | None):
    d = state / f"agent-{i}"
    d.mkdir(parents=True, exist_ok=True)
    token_file, token_sha256 = _agent_token(state)
    cfg = {
        "node_id": f"agent-{i}",
        "listen": "127.0.0.1:0",
        "device": "cpu",
        "data_dir": str(d / "data"),
        "pool_bytes": opts.pool_bytes,
        "slot_bytes": agent_slot_bytes(opts),
        "nvme_bytes": opts.nvme_bytes,
        "allow_unauthenticated": True,
        "etcd_endpoints": etcd,
        "lease_ttl_s": opts.lease_ttl_s,
        # Callers without a token are still admitted (development); pulls between these
        # agents authenticate as the agent identity.
        "agent_token_file": str(token_file),
        "tenants": {"_agent": {"token_sha256": token_sha256}},
        **_tls_section(tls),
    }
    (d / "agent.json").write_text(json.dumps(cfg, indent=2) + "\n")
    ready = d / "ready"
    ready.unlink(missing_ok=True)
    log = d / "agent.log"
    proc = spawn(
        [
            sys.executable,
            "-m",
            "node_agent",
            "--config",
            str(d / "agent.json"),
            "--ready-file",
            str(ready),
        ],
        log,
        state,
    )
    return proc, ready, log


def start_router(state: Path, etcd: str, opts: UpOptions, tls: TLSConfig | None):
    d = state / "router"
    d.mkdir(parents=True, exist_ok=True)
    gateway: list[str] = []
    tokenizers = dict(opts.gateway_tokenizers)
    if opts.engines:
        tokenizers[MODEL_NAME] = str(state / "model")
    if tokenizers:
        (d / "gw-ready").unlink(missing_ok=True)
        gcfg = gateway_files(d, tokenizers)
        gateway = ["--gateway-listen", "127.0.0.1:0", "--gateway-config", str(gcfg),
                   "--gateway-ready-file", str(d / "gw-ready")]  # fmt: skip
    ready = d / "ready"
    ready.unlink(missing_ok=True)
    log = d / "router.log"
    # Like the agents: no tenants, callers without a token act as the cluster (dev only).
    rcfg: dict = {
        "allow_unauthenticated": True,
        "engine_record_key_file": str(engine_record_key_file(state)),
        **_tls_section(tls),
    }
    if tokenizers:  # the gateway's metrics are on the router's Prometheus port
        rcfg["metrics_port"] = free_port()
    if opts.engines:  # to name the engines' cached blocks from their KV events
        rcfg["tenant_secret_files"] = {KV_TENANT: str(d / "kv.secret")}
    (d / "router.json").write_text(json.dumps(rcfg, indent=2) + "\n")
    proc = spawn(
        [
            sys.executable,
            "-m",
            "router",
            "--router-id",
            "router-0",
            "--listen",
            "127.0.0.1:0",
            "--etcd-endpoints",
            etcd,
            "--ready-file",
            str(ready),
            "--config",
            str(d / "router.json"),
            "--log-level",
            opts.router_log_level,
            *gateway,
        ],
        log,
        state,
    )
    port = rcfg.get("metrics_port")
    return proc, ready, log, f"http://127.0.0.1:{port}/metrics" if port else ""


def _gateway_engines(url: str, tls: TLSConfig | None) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2, context=client_context(tls)) as r:
            return int(json.loads(r.read())["engines"])
    except (OSError, ValueError, KeyError):
        return -1


def engine_launch(
    state: Path, opts: UpOptions, i: int, etcd: str, agents: list[str]
) -> EngineLaunch:
    """Engine i of the cluster, on agent i mod len(agents); its KV event sockets are on
    loopback in every mode (EngineLaunch.kv_events_ports)."""
    return EngineLaunch(
        f"engine-{i}", free_port(), str(state / "model"), MODEL_NAME, agents[i % len(agents)],
        f"agent-{i % len(agents)}", KV_TENANT, str(state / "router" / "kv.secret"), etcd,
        str(state / f"engine-{i}"), ttl_s=opts.lease_ttl_s,
        kv_events_ports=(free_port(), free_port()),
        tls_dir=str(state / "tls") if opts.tls else "", device=f"cpu:{socket.gethostname()}",
        record_key_file=str(engine_record_key_file(state)),
    )  # fmt: skip


def start_engines(state, opts, etcd, agents, gw_url, say, started, client, watch) -> list[Proc]:
    """vLLM engines on the agents in turn, registered in etcd; waits until the gateway
    has every one (`watch`: the cluster's other processes, for a death meanwhile)."""
    procs, watch = [], list(watch)
    for i in range(opts.engines):
        d = state / f"engine-{i}"
        launch = engine_launch(state, opts, i, etcd, agents)
        proc = start_engine(launch, new_session=True, cluster=state)
        p = Proc(launch.engine_id, "engine", proc.pid, launch.url, str(d / "engine.log"))
        started.append(p)
        procs.append(p)
        watch.append(Watched(p.name, proc, d / "engine.log"))
    if procs:
        say(f"starting {len(procs)} vLLM CPU engines (about 30 s each here)")

        def pending() -> dict[str, str]:
            listed = _gateway_engines(gw_url, client)
            if listed == len(procs):
                return {}
            out = {
                p.name: f"its health check {p.address}/health to answer 200 (vLLM loads "
                "the model, then registers the engine in etcd)"
                for p in procs
                if not http_ok(p.address + "/health", client)
            }
            return out or {
                "gateway": f"{gw_url}/health to list {len(procs)} engines (it lists "
                f"{max(listed, 0)}; each engine's registrar puts it in etcd once healthy)"
            }

        wait_start(pending, opts.engine_timeout_s, "every engine to register with the gateway",
              watch, "the engines' limit")  # fmt: skip
        say(f"gateway   {gw_url} (API keys in {state / 'router' / 'keys.json'})")
    return procs


def read_ready(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


_stop_requested = threading.Event()


@contextlib.contextmanager
def sigterm_stops():
    """While `up` runs in the main thread: SIGTERM (what `down` sends a starting `up`)
    makes its next wait raise, so that it stops what it started and releases the lock;
    the previous handler is restored after."""
    _stop_requested.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: _stop_requested.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def wait_start(pending, timeout_s: float, what: str, watch: list[Watched], limit: str = "") -> None:
    """devprocs.wait_until, stopped by a SIGTERM to this `up` (sigterm_stops); its
    failure (a component that exited or did not come up in time, named with what it
    waited for and the end of its log) is a ClusterError."""
    try:
        wait_until(pending, max(0.0, timeout_s), what, watch, _stop_requested, limit)
    except WaitFailed as exc:
        raise ClusterError(str(exc)) from None
