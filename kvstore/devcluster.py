"""Local development cluster: one etcd, N node agents (CPU device, small pools) and a
router on 127.0.0.1, detached from the shell that started them.

Everything lives under a state directory::

    cluster.json          what runs where (pids, addresses, logs)
    up.lock               flock-ed by `up` for its whole run (its pid): a second `up`
                          is refused, `down` stops a starting one
    starting.json         while `up` runs: what it has started (a killed `up`'s are
                          stopped by `down`; while they run, `up` is refused and
                          `status` names them)
    etcd/  etcd.log       etcd data (fresh on every `up`) and log
    agent-<i>/            agent.json (config), data/ (RocksDB), agent.log
    router/               router.log
    model/, engine-<i>/   with --engines: the tiny model; each engine's engine.log
    tls/                  with --tls: a throwaway CA (ca.crt), the processes' pair
                          (server.crt/.key; the engines serve HTTPS with it) and a
                          client pair for kvctl, tests and the engines' connectors and
                          registrars (client.crt/.key); kvstore/tls_ca.py

`up` starts the processes in their own sessions (a Ctrl-C in the shell does not reach
them), waits until each answers gRPC health and the router has every agent in sync, and
writes cluster.json. `down` sends SIGTERM and SIGCONT (agents revoke their etcd leases;
a stopped process runs again to handle it), then SIGKILL after a grace period, saying
whom it waits for and whom it killed. `status` reports each process and what the router has indexed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
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
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from kvstore.devengines import (
    KV_TENANT,
    MODEL_NAME,
    EngineLaunch,
    gateway_files,
    model_block_bytes,
    start_engine,
    stop_engine,
    write_model,
    write_private,
)
from kvstore.config import TLSConfig
from kvstore.devprocs import (
    KINDS,
    Ended,
    WaitFailed,
    Watched,
    alive,
    client_context,
    etcd_healthy,
    free_port,
    grpc_healthy,
    http_ok,
    router_nodes,
    spawn,
    terminate,
    wait_until,
)
from kvstore.units import parse_size
from kvstore.tls import files_in

STATE_FILE = "cluster.json"
LOCK_FILE = "up.lock"  # flock-ed by `up` from before it starts anything to its end; its pid
STARTING_FILE = "starting.json"  # what a starting `up` has launched so far (for `down`)


class ClusterError(Exception):
    """Something about the local cluster failed; `exit_code` is kvctl's exit status."""

    exit_code = 1


class EtcdUnreachable(ClusterError):
    exit_code = 3


class NodeUnreachable(ClusterError):
    exit_code = 4


class BadStateDir(ClusterError):
    """The state directory, or its cluster.json, is not what kvctl can use (a file for a
    directory, a directory for a file, unreadable, corrupt): bad usage, exit 2."""

    exit_code = 2


def check_state_dir(state_dir: str | os.PathLike) -> Path:
    """`state_dir` as a Path; BadStateDir when it exists and is not a directory."""
    path = Path(state_dir)
    if path.exists() and not path.is_dir():
        raise BadStateDir(f"{state_dir} is not a directory (the state directory to use)")
    return path


@dataclass(frozen=True, slots=True)
class Proc:
    name: str  # etcd, agent-0, ..., router
    kind: str  # etcd | agent | router
    pid: int
    address: str  # what clients dial (etcd: its client endpoint)
    log: str


@dataclass(frozen=True, slots=True)
class ClusterState:
    state_dir: str
    etcd_endpoint: str
    router_address: str
    procs: tuple[Proc, ...]
    started_at: float
    gateway_url: str = ""  # the router's OpenAI gateway, with --engines
    gateway_keys: str = ""  # its API keys file (dev keys)
    tls_dir: str = ""  # with --tls: ca.crt, client.crt, client.key (kvstore.tls.files_in)
    # The router's Prometheus page, with the gateway's metrics (every tenant's counts: not
    # on the gateway's own port). Plain HTTP on loopback.
    metrics_url: str = ""

    @property
    def client_tls(self) -> TLSConfig | None:
        """What a client of this cluster presents; None for a plaintext one."""
        return files_in(self.tls_dir) if self.tls_dir else None

    @property
    def agents(self) -> list[Proc]:
        return [p for p in self.procs if p.kind == "agent"]

    def save(self) -> None:
        path = Path(self.state_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, state_dir: str | os.PathLike) -> "ClusterState":
        path = check_state_dir(state_dir) / STATE_FILE
        try:
            data = json.loads(path.read_text())
            data["procs"] = _procs(path, data["procs"])
            return cls(**data)
        except FileNotFoundError:
            raise ClusterError(_no_cluster(path.parent, state_dir)) from None
        except IsADirectoryError:
            raise BadStateDir(
                f"{path} is a directory, not a cluster record; remove it and run "
                "kvctl cluster up again"
            ) from None
        except OSError as exc:
            raise BadStateDir(f"cannot read {path}: {exc.strerror}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BadStateDir(
                f"{path} is unreadable ({exc}); remove it and run kvctl cluster up again"
            ) from None


def _procs(path: Path, entries) -> tuple[Proc, ...]:
    """The processes listed in `path` (cluster.json, starting.json); BadStateDir naming
    the file and the entry for a kind this cluster never starts (a hand edit)."""
    procs = tuple(Proc(**p) for p in entries)
    for i, p in enumerate(procs):
        if p.kind not in KINDS:
            raise BadStateDir(
                f"{path}: procs[{i}] ({p.name!r}, pid {p.pid}) has kind {p.kind!r}, which "
                f"is none of {', '.join(KINDS)}; correct that entry"
            )
    return procs


def _starting_procs(state: Path) -> tuple[Proc, ...]:
    """What an `up` recorded in starting.json as started (nothing when there is none)."""
    path = state / STARTING_FILE
    try:
        return _procs(path, json.loads(path.read_text())["procs"])
    except (FileNotFoundError, NotADirectoryError):
        return ()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadStateDir(f"{path} is unreadable ({exc})") from None


def left_running(state_dir: str | os.PathLike) -> list[Proc]:
    """What a `kvctl cluster up` that did not finish left running (killed: one that
    fails stops what it started), by its starting.json; [] when nothing."""
    return [p for p in _starting_procs(Path(state_dir)) if alive(p.pid, p.kind)]


def named(procs) -> str:
    return ", ".join(f"{p.name} (pid {p.pid})" for p in procs)


def _no_cluster(state: Path, given: str | os.PathLike) -> str:
    """Why `state` has no cluster.json, and what to do: an `up` is starting there, a
    killed one left processes running (a new `up` would not know them), or nothing."""
    down = f"kvctl cluster down --state-dir {given}"
    pid = starting(state)
    if pid is not None:
        return (
            f"kvctl cluster up (pid {pid or '?'}) is still starting a cluster in {given} "
            f"(no {STATE_FILE} yet); wait for it, or stop it: {down}"
        )
    left = left_running(state)
    if left:
        return (
            f"no cluster recorded in {given} (no {STATE_FILE}), but a kvctl cluster up "
            f"that did not finish (killed?) left {named(left)} running (listed in "
            f"{state / STARTING_FILE}); stop them with: {down}"
        )
    return (
        f"no local cluster in {given} (no {STATE_FILE}); start one with: kvctl cluster up "
        f"--state-dir {given}"
    )


def _quiet(_msg: str) -> None:
    pass


def stop_procs(procs: list[Proc], grace_s: float = 10.0, say=_quiet) -> list[Ended]:
    """Stop the engines (each its session: SIGTERM, SIGKILL after `grace_s`), then the
    rest (devprocs.terminate: SIGTERM and SIGCONT, SIGKILL after `grace_s`); `say` gets
    progress. Returns what ended, and how."""
    engines = [p for p in procs if p.kind == "engine" and alive(p.pid, p.kind)]
    for p in engines:  # an engine is a session: registrar, vLLM, its engine core
        say(f"stopping {p.name} (pid {p.pid}) and its vLLM processes: SIGTERM, SIGKILL "
            f"after {grace_s:g}s")  # fmt: skip
        stop_engine(p.pid, grace_s)
    ended = [Ended(p.name, p.pid) for p in engines]
    return ended + terminate([p for p in procs if p.kind != "engine"], grace_s, say)


def _wait(pending, timeout_s: float, what: str, watch: list[Watched], limit: str = "") -> None:
    """devprocs.wait_until, stopped by a SIGTERM to this `up` (_sigterm_stops); its
    failure (a component that exited or did not come up in time, named with what it
    waited for and the end of its log) is a ClusterError."""
    try:
        wait_until(pending, max(0.0, timeout_s), what, watch, _stop_requested, limit)
    except WaitFailed as exc:
        raise ClusterError(str(exc)) from None


# -------------------------------------------------------------------------- up
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
    """etcd's own TLS: clients must present a certificate of the CA."""
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
    ]


def etcd_command(
    binary: str, name: str, data_dir: Path, client_url: str, peer_url: str, tls=None
) -> list[str]:
    """etcd's command line for a one-member cluster (kvctl cluster up, the chaos harness,
    the tests' fixture); `tls` (a TLSConfig) as _etcd_tls_flags."""
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


def _start_etcd(state: Path, tls: TLSConfig | None) -> tuple[subprocess.Popen, str, Path]:
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    if not os.access(binary, os.X_OK):
        raise ClusterError("etcd is not installed (apt-get install etcd-server)")
    data = state / "etcd"
    shutil.rmtree(data, ignore_errors=True)  # coordination state is fresh on every up
    cport, pport = free_port(), free_port()
    scheme = "https" if tls is not None else "http"
    cu, pu = f"{scheme}://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
    log = state / "etcd.log"
    proc = spawn(etcd_command(binary, "local", data, cu, pu, tls), log)
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


def _start_agent(state: Path, i: int, etcd: str, opts: UpOptions, tls: TLSConfig | None):
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
    )
    return proc, ready, log


def _start_router(state: Path, etcd: str, opts: UpOptions, tls: TLSConfig | None):
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


def _start_engines(state, opts, etcd, agents, gw_url, say, started, client, watch) -> list[Proc]:
    """vLLM engines on the agents in turn, registered in etcd; waits until the gateway
    has every one (`watch`: the cluster's other processes, for a death meanwhile)."""
    procs, watch = [], list(watch)
    for i in range(opts.engines):
        d = state / f"engine-{i}"
        launch = engine_launch(state, opts, i, etcd, agents)
        proc = start_engine(launch, new_session=True)
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

        _wait(pending, opts.engine_timeout_s, "every engine to register with the gateway",
              watch, "the engines' limit")  # fmt: skip
        say(f"gateway   {gw_url} (API keys in {state / 'router' / 'keys.json'})")
    return procs


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def up(state_dir: str | os.PathLike, opts: UpOptions = UpOptions(), say=print) -> ClusterState:
    state = check_state_dir(state_dir).resolve()
    try:
        state.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file on the way, no permission, read-only
        raise BadStateDir(f"cannot create the state directory {state}: {exc.strerror}") from None
    lock = _try_lock(state, as_up=True)
    if lock is None:  # another up is starting here: two etcds on one data dir, otherwise
        raise ClusterError(
            f"kvctl cluster up (pid {_holder(state) or '?'}) is already starting a cluster in "
            f"{state}; wait for it, or stop it: kvctl cluster down --state-dir {state_dir}"
        )
    try:
        _refuse_if_running(state, state_dir)
        started = _Launched(state)
        try:
            with _sigterm_stops():
                return _up(state, opts, say, started)
        except BaseException:
            stop_procs(started, grace_s=5.0)
            raise
        finally:
            (state / STARTING_FILE).unlink(missing_ok=True)
    finally:
        os.close(lock)  # releases the lock


class _Launched(list):
    """The processes this `up` started, also written to <state>/starting.json at once:
    `down` stops them should this `up` die before it records a cluster."""

    def __init__(self, state: Path) -> None:
        super().__init__()
        self._path = state / STARTING_FILE

    def append(self, proc: Proc) -> None:
        super().append(proc)
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"up_pid": os.getpid(), "procs": [asdict(p) for p in self]}))
        os.replace(tmp, self._path)


def _try_lock(state: Path, as_up: bool = False, create: bool = True) -> int | None:
    """The up lock (a file descriptor), or None while another process holds it (or,
    not `create`, when there is no lock file: no `up` ever ran here). `as_up`: our pid is
    written in it, for a refused `up` or `down` to name; a probe or `down` writes
    nothing (an `up` refused meanwhile would name the wrong process). The descriptor is
    not inherited by the processes `up` starts. BadStateDir when it cannot be opened."""
    path = state / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        if create:
            raise BadStateDir(f"{path} cannot be created (no such directory)") from None
        return None
    except OSError as exc:
        raise BadStateDir(f"{path} cannot be opened: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    if as_up:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _holder(state: Path) -> int | None:
    """The pid written in the lock file (that of the `up` holding it, if one does)."""
    try:
        return int((state / LOCK_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def starting(state_dir: str | os.PathLike) -> int | None:
    """The pid of a `kvctl cluster up` still starting a cluster in `state_dir`, if any."""
    state = Path(state_dir)
    if not state.is_dir():
        return None
    if not (state / LOCK_FILE).exists():
        return None
    lock = _try_lock(state, create=False)
    if lock is not None:
        os.close(lock)
        return None
    return _holder(state) or 0  # 0: it has not written its pid yet


_stop_requested = threading.Event()


@contextlib.contextmanager
def _sigterm_stops():
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


def _refuse_if_running(state: Path, given: str | os.PathLike) -> None:
    """Before `up` touches anything (etcd's data dir, starting.json): refused while what
    a killed `up` started, or a recorded cluster, still runs there."""
    left = left_running(state)
    if left:
        raise ClusterError(
            f"a kvctl cluster up that did not finish (killed?) left {named(left)} running "
            f"in {state} (listed in {STARTING_FILE}; a new up would not know them); stop "
            f"them first: kvctl cluster down --state-dir {given}"
        )
    if not (state / STATE_FILE).exists():
        return
    try:
        old = ClusterState.load(state)
    except ClusterError:
        return  # a record we are about to replace
    running = [p.name for p in old.procs if alive(p.pid, p.kind)]
    if running:
        raise ClusterError(
            f"a cluster is already running in {state} ({', '.join(running)}); "
            f"stop it first: kvctl cluster down --state-dir {given}"
        )


def _up(state: Path, opts: UpOptions, say, started: list[Proc]) -> ClusterState:
    t0 = time.monotonic()
    server_tls = client = None
    if opts.tls:  # a fresh CA on every up: nothing from an older cluster is trusted
        from kvstore.tls_ca import make_dev_pki

        pki = make_dev_pki(str(state / "tls"))
        server_tls, client = pki.server, pki.client
    if opts.engines:  # before anything runs: a failure here leaves nothing behind
        say("writing the tiny model (vLLM venv)")
        write_model(state / "model")
    etcd, endpoint, elog = _start_etcd(state, server_tls)
    started.append(Proc("etcd", "etcd", etcd.pid, endpoint, str(elog)))
    deadline = time.monotonic() + opts.timeout_s  # --timeout: etcd to the gateway
    limit = f"--timeout {opts.timeout_s:g}s for the whole start"

    def wait(pending, what: str, watch: list[Watched]) -> None:
        _wait(pending, deadline - time.monotonic(), what, watch, limit)

    scheme = "https" if opts.tls else "http"
    etcd_w = Watched("etcd", etcd, elog)
    wait(lambda: {} if etcd_healthy(endpoint, tls=client) else {
        "etcd": f"its health check {scheme}://{endpoint}/health to say true"
    }, "etcd to become healthy", [etcd_w])  # fmt: skip
    say(f"etcd      {endpoint}")
    agents = []
    for i in range(opts.agents):  # each recorded at once: a kill -9 of up leaves it to down
        agents.append(_start_agent(state, i, endpoint, opts, server_tls))
        started.append(Proc(f"agent-{i}", "agent", agents[-1][0].pid, "", str(agents[-1][2])))
    router, rready, rlog, metrics = _start_router(state, endpoint, opts, server_tls)
    started.append(Proc("router", "router", router.pid, "", str(rlog)))
    watch = [Watched(f"agent-{i}", p, log) for i, (p, _, log) in enumerate(agents)]
    watch += [Watched("router", router, rlog), etcd_w]
    readies = {f"agent-{i}": r for i, (_, r, _) in enumerate(agents)} | {"router": rready}
    gw_ready = state / "router" / "gw-ready"
    if opts.gateway_tokenizers or opts.engines:  # the router's OpenAI gateway
        readies["gateway"] = gw_ready
        watch.append(Watched("gateway", router, rlog))
    wait(lambda: {
        name: f"its ready file {r} (written once it has started: listening, etcd read, "
        "registered)"
        for name, r in readies.items() if not _read(r)
    }, "every agent and the router to start", watch)  # fmt: skip
    addrs = {f"agent-{i}": _read(r) for i, (_, r, _) in enumerate(agents)}
    raddr = _read(rready)
    wait(lambda: {
        name: f"gRPC health at {a} to answer SERVING"
        for name, a in (addrs | {"router": raddr}).items() if not grpc_healthy(a, tls=client)
    }, "gRPC health of every agent and the router", watch)  # fmt: skip

    def router_behind() -> dict[str, str]:
        try:
            nodes = {n.node_id: n.synced for n in router_nodes(raddr, tls=client)}
        except grpc.RpcError as exc:
            return {"router": f"ListNodes at {raddr} to answer ({exc.code().name})"}
        behind = [a for a in addrs if not nodes.get(a)]
        return {"router": f"to list and follow every agent's events at {raddr} (not yet: "
                f"{', '.join(behind)})"} if behind else {}  # fmt: skip

    wait(router_behind, "the router to follow every agent", watch)
    procs = [started[0]] + [
        Proc(f"agent-{i}", "agent", p.pid, addrs[f"agent-{i}"], str(log))
        for i, (p, _, log) in enumerate(agents)
    ]
    procs.append(Proc("router", "router", router.pid, raddr, str(rlog)))
    gw_url = f"{scheme}://{_read(gw_ready)}" if "gateway" in readies else ""
    procs += _start_engines(
        state, opts, endpoint, list(addrs.values()), gw_url, say, started, client, watch
    )
    keys = str(state / "router" / "keys.json") if gw_url else ""
    tls_dir = str(state / "tls") if opts.tls else ""
    st = ClusterState(
        str(state), endpoint, raddr, tuple(procs), time.time(), gw_url, keys, tls_dir, metrics
    )
    st.save()
    for p in procs[1:]:
        say(f"{p.name:<9} {p.address}")
    if metrics:
        say(f"metrics   {metrics} (the router's and the gateway's)")
    if tls_dir:
        extra = " (the engines' KV event ports: loopback only)" if opts.engines else ""
        say(f"mTLS on every port{extra}; CA and client pair in {tls_dir}")
    say(f"cluster up in {time.monotonic() - t0:.1f}s; state in {state / STATE_FILE}")
    return st


# ------------------------------------------------------------------ down, status
def down(state_dir: str | os.PathLike, grace_s: float = 10.0, say=_quiet) -> list[Ended]:
    """Stop the engines, router and agents (they revoke their leases), then etcd: SIGTERM
    (and SIGCONT, for a stopped process), SIGKILL after `grace_s`; `say` gets progress
    (whom it waits for, whom it kills). An `up` still starting there is stopped first
    (SIGTERM; it stops what it started), and whatever a dead `up` left in starting.json
    is stopped too. Holds the up lock, so no `up` starts in the middle."""
    state = check_state_dir(state_dir)
    if not state.is_dir():
        raise ClusterError(f"no local cluster in {state_dir} (no such directory)")
    lock = _try_lock(state)
    by_up: list[Ended] = []
    if lock is None:
        lock, by_up = _stop_starting_up(state, grace_s, say)
    try:
        merged = {e.name: e for e in by_up}  # what up stopped itself, unless left over
        merged.update((e.name, e) for e in _stop_starting_leftovers(state, grace_s, say))
        return [*merged.values(), *_stop_recorded(state, grace_s, say)]
    finally:
        os.close(lock)


def _stop_starting_up(state: Path, grace_s: float, say) -> tuple[int, list[Ended]]:
    """SIGTERM the `up` holding the lock (and SIGCONT, should it be stopped), wait for it
    to let go (SIGKILL after `grace_s` + its own 5 s of stopping); returns the lock and
    what that `up` had started (by the last starting.json seen; it stops them itself)."""
    pid = _holder(state)
    seen: list[Ended] = []
    for sig, wait_s in ((signal.SIGTERM, grace_s + 10), (signal.SIGKILL, 5.0)):
        if pid:
            say(f"sending {sig.name} to kvctl cluster up (pid {pid})")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                if sig == signal.SIGTERM:
                    os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                procs = json.loads((state / STARTING_FILE).read_text())["procs"]
                seen = [Ended(p["name"], int(p["pid"])) for p in procs]
            lock = _try_lock(state)
            if lock is not None:
                return lock, seen
            time.sleep(0.1)
            pid = pid or _holder(state)
    raise ClusterError(f"kvctl cluster up (pid {pid or '?'}) in {state} did not stop")


def _stop_starting_leftovers(state: Path, grace_s: float, say) -> list[Ended]:
    stopped = _stop_in_order(list(_starting_procs(state)), grace_s, say)
    (state / STARTING_FILE).unlink(missing_ok=True)
    return stopped


def _stop_recorded(state: Path, grace_s: float, say) -> list[Ended]:
    if not (state / STATE_FILE).exists():
        return []
    stopped = _stop_in_order(list(ClusterState.load(state).procs), grace_s, say)
    (state / STATE_FILE).unlink(missing_ok=True)
    return stopped


def _stop_in_order(procs: list[Proc], grace_s: float, say) -> list[Ended]:
    engines = [p for p in procs if p.kind == "engine"]
    first = [p for p in procs if p.kind not in ("etcd", "engine")]
    return (
        stop_procs(engines, grace_s, say)
        + stop_procs(first, grace_s, say)
        + stop_procs([p for p in procs if p.kind == "etcd"], grace_s, say)
    )


async def _registered(endpoint: str, tls: TLSConfig | None) -> set[str]:
    from kvstore.coord.etcd import EtcdClient

    async with EtcdClient(endpoint, timeout=2.0, tls=tls) as c:
        return {r.node_id for r in await c.list_nodes()}


def status(state_dir: str | os.PathLike) -> dict:
    """What runs, what answers, what the router knows. Raises nothing for dead parts:
    the caller decides the exit status from the report."""
    st = ClusterState.load(state_dir)
    tls = st.client_tls
    etcd_ok = etcd_healthy(st.etcd_endpoint, tls=tls)
    registered: set[str] = set()
    if etcd_ok:
        try:
            registered = asyncio.run(_registered(st.etcd_endpoint, tls))
        except Exception:  # noqa: BLE001 - status reports, it does not fail
            etcd_ok = False
    indexed: dict[str, tuple[int, bool]] = {}
    try:
        indexed = {
            n.node_id: (n.indexed_blocks, n.synced)
            for n in router_nodes(st.router_address, tls=tls)
        }
        router_ok = True
    except grpc.RpcError:
        router_ok = False
    comps = []
    for p in st.procs:
        up_ = alive(p.pid, p.kind)
        if p.kind == "etcd":
            answers = etcd_ok
        elif p.kind == "router":
            answers = router_ok
        elif p.kind == "engine":
            answers = http_ok(p.address + "/health", tls)
        else:
            answers = bool(p.address) and grpc_healthy(p.address, tls=tls)
        row = {
            "name": p.name,
            "kind": p.kind,
            "pid": p.pid,
            "address": p.address,
            "alive": up_,
            # what answers health at the address: ours (alive), or another process
            "healthy": answers,
            "log": p.log,
        }
        if answers and not up_:  # restarted by hand, say: not ours to stop
            row["stranger"] = (
                f"pid {p.pid} gone; something else answers at {p.address} (not started "
                "by this cluster; `kvctl cluster down` won't stop it)"
            )
        if p.kind == "agent":
            blocks, synced = indexed.get(p.name, (0, False))
            row.update(registered=p.name in registered, indexed_blocks=blocks, synced=synced)
        comps.append(row)
    return {
        "state_dir": st.state_dir,
        "etcd_endpoint": st.etcd_endpoint,
        "router_address": st.router_address,
        "gateway_url": st.gateway_url,
        "metrics_url": st.metrics_url,
        "uptime_s": round(time.time() - st.started_at),
        "components": comps,
    }
