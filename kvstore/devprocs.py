"""Processes of the local development cluster (kvctl cluster up, kvstore/devcluster/):
starting one with a fresh log, telling whether a pid is still the process we started,
whether etcd, an agent, the router or the gateway answers, waiting for them with an
error that names the one that did not come up, what it waited for, and its log, and
stopping them (SIGTERM, SIGCONT, SIGKILL after a grace period, with progress)."""

from __future__ import annotations

import os
import random
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.config import TLSConfig
from kvstore.tls import channel

ROOT = Path(__file__).resolve().parent.parent
# What a live process of each kind has in its command line (alive: pids are recycled).
_MARKERS = {"etcd": "etcd", "agent": "node_agent", "router": "router", "engine": "vllm_serve"}
KINDS = tuple(_MARKERS)  # the kinds of process a local cluster starts
# The module each python kind runs (`python -m <module>`): program_kind's exact match.
_MODULES = {"node_agent": "agent", "router": "router", "kvstore.integrations.vllm_serve": "engine"}
# In the environment of every process `kvctl cluster up` starts: its state directory.
CLUSTER_ENV = "KVSTORE_DEV_CLUSTER"


# Set by kvstore/cli/__init__.py (its QUIETED) when kvctl set GRPC_VERBOSITY itself.
_KVCTL_QUIETED = "KVSTORE_KVCTL_SET_GRPC_VERBOSITY"


def program_kind(argv: list[str]) -> str | None:
    """The kind a local cluster process has by its program (etcd's binary, or python -m
    one of our modules), not by a substring anywhere in its command line; None otherwise."""
    if argv and os.path.basename(argv[0]) == "etcd":
        return "etcd"
    if len(argv) >= 3 and argv[1] == "-m":
        return _MODULES.get(argv[2])
    return None


def started_for(state: Path) -> list[tuple[int, str]]:
    """(pid, kind) of this user's live processes of a local cluster's kinds
    (program_kind) that an `up` in `state` started: CLUSTER_ENV=`state` in their
    environment. The same command started by hand has no such mark and is not ours."""
    mark = f"{CLUSTER_ENV}={state.resolve()}".encode()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.stat(f"/proc/{d}").st_uid != os.getuid():
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")[:-1]
            kind = program_kind(argv)
            if kind is None:
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                ours = mark in f.read().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        if ours and proc_state(int(d)) not in ("", "exited"):
            found.append((int(d), kind))
    return found


# free_port's ports: below Linux's ephemeral range (32768-60999 by default), from which the
# kernel gives every outgoing connection its own port, so that none takes a port between
# free_port() and its server's bind; and below the chaos cluster's (loadtest/chaos_cluster).
FREE_PORTS = range(10000, 20000)


def _share_of_free_ports() -> range:
    """This process's share of FREE_PORTS: all of it, or under pytest-xdist
    (PYTEST_XDIST_WORKER=gwN of PYTEST_XDIST_WORKER_COUNT) the worker's own slice, which
    the processes it starts inherit with its environment."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()):
        return FREE_PORTS
    n = max(int(count), 1)
    share = len(FREE_PORTS) // n
    lo = FREE_PORTS.start + (int(worker[2:]) % n) * share
    return range(lo, lo + share)


class _FreePorts:
    """This process's share of FREE_PORTS, handed out in turn from a random start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._share: range | None = None
        self._next = 0

    def take(self) -> int | None:
        with self._lock:
            if self._share is None:
                self._share = _share_of_free_ports()
                self._next = random.randrange(len(self._share))
            for _ in range(len(self._share)):
                port = self._share[self._next]
                self._next = (self._next + 1) % len(self._share)
                if bindable(port):
                    return port
        return None


def bindable(port: int) -> bool:
    """Whether a socket could bind `port` on 127.0.0.1 now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:  # held, or a connection of it lingers (TIME_WAIT)
            return False
    return True


_free_ports = _FreePorts()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, for a server about to start: the
    next bindable one of this process's share of FREE_PORTS, so that the process hands
    none out twice within thousands, another test worker never, and no outgoing
    connection takes it meanwhile. Where the whole share is held, the kernel's pick."""
    port = _free_ports.take()
    if port is not None:
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int, kind: str) -> bool:
    """The process exists, is not a zombie, and is the kind we started (a recycled pid
    running something else does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return state != "Z" and _MARKERS[kind] in cmdline


def reap(pid: int) -> None:
    try:  # only our own children can be reaped; others are reaped by init
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


# /proc/<pid>/stat state letters, for people
_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible I/O",
    "T": "stopped",
    "t": "stopped by a tracer",
    "Z": "exited",
    "I": "idle",
}


def proc_state(pid: int) -> str:
    """What the process is doing (running, sleeping, stopped, …); '' when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            letter = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return _STATES.get(letter, letter)


class Target(Protocol):
    """A process to stop: devcluster.Proc."""

    @property
    def name(self) -> str: ...
    @property
    def pid(self) -> int: ...
    @property
    def kind(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Ended:
    """A process that `terminate` (or an engine's stop) ended."""

    name: str
    pid: int
    killed: bool = False  # SIGKILL at the end of the grace period
    state: str = ""  # what it was doing then (sleeping, running, in uninterruptible I/O)
    survived: bool = False  # still there after SIGKILL (uninterruptible I/O: it dies after)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def terminate(
    targets: list[Target],
    grace_s: float,
    say: Callable[[str], None] = lambda _msg: None,
    every_s: float = 2.0,
    kill_wait_s: float = 5.0,
) -> list[Ended]:
    """SIGTERM every live one, and SIGCONT after it: a stopped process (SIGSTOP, a
    debugger's ^Z) handles no SIGTERM until it runs again, and then stops cleanly. Waits
    up to `grace_s` (saying every `every_s` whom it waits for), then SIGKILLs the rest
    (which works on a stopped process too) and waits up to `kill_wait_s` for them to
    go. Returns what ended, and how."""
    live = [t for t in targets if alive(t.pid, t.kind)]
    if not live:
        return []
    stopped = {t.pid for t in live if proc_state(t.pid).startswith("stopped")}
    for t in live:
        _signal(t.pid, signal.SIGTERM)
        _signal(t.pid, signal.SIGCONT)
    names = ", ".join(f"{t.name} (pid {t.pid})" for t in live)
    say(f"sent SIGTERM to {names}; SIGKILL after {grace_s:g}s")
    for t in live:
        if t.pid in stopped:
            say(f"{t.name} (pid {t.pid}) was stopped (SIGSTOP?): sent SIGCONT so that it "
                "handles SIGTERM")  # fmt: skip
    left = _wait_gone(live, grace_s, every_s, say, "SIGTERM")
    killed: dict[int, str] = {}
    for t in left:
        killed[t.pid] = proc_state(t.pid)
        say(f"{t.name} (pid {t.pid}) still running {grace_s:g}s after SIGTERM "
            f"({killed[t.pid]}): SIGKILL")  # fmt: skip
        _signal(t.pid, signal.SIGKILL)
    survivors = {t.pid for t in _wait_gone(left, kill_wait_s, every_s, say, "SIGKILL")}
    for t in live:
        if t.pid in survivors:
            say(f"{t.name} (pid {t.pid}) is still there {kill_wait_s:g}s after SIGKILL "
                f"({proc_state(t.pid)}): it ends when its I/O does")  # fmt: skip
    return [
        Ended(t.name, t.pid, t.pid in killed, killed.get(t.pid, ""), t.pid in survivors)
        for t in live
    ]


def _wait_gone(procs: list[Target], wait_s: float, every_s: float, say, after: str) -> list:
    """Up to `wait_s` for `procs` to exit (reaping our own children), saying every
    `every_s` whom it still waits for; returns those still alive."""
    t0 = time.monotonic()
    next_say = t0 + every_s
    while True:
        for t in procs:
            reap(t.pid)
        procs = [t for t in procs if alive(t.pid, t.kind)]
        waited = time.monotonic() - t0
        if not procs or waited >= wait_s:
            return procs
        if waited >= next_say - t0:
            who = ", ".join(f"{t.name} (pid {t.pid}, {proc_state(t.pid)})" for t in procs)
            say(f"waiting for {who}: {waited:.0f}s of {wait_s:g}s after {after}")
            next_say += every_s
        time.sleep(0.1)


def fresh_log(path: Path) -> BinaryIO:
    """`path` opened for a new run's log: the previous run's becomes <path>.prev, so an
    error tail (or a test reading the log) quotes this run only."""
    if path.exists():
        os.replace(path, path.with_name(path.name + ".prev"))
    return open(path, "wb")


def spawn(cmd: list[str], log_path: Path, state: Path) -> subprocess.Popen:
    """Start `cmd` in its own session, logging to a fresh `log_path` (fresh_log), marked
    as started for the cluster in `state` (CLUSTER_ENV); returns once /proc shows it
    running its program (until_execed)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{CLUSTER_ENV: str(state.resolve())})
    if env.pop(_KVCTL_QUIETED, None):  # kvctl's own quieting of gRPC is not theirs
        env.pop("GRPC_VERBOSITY", None)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    with fresh_log(log_path) as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
    until_execed(proc)
    return proc


def until_execed(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """Wait until `proc` runs its new program as /proc shows it. Popen returns once the
    child's exec has closed its close-on-exec descriptors, before the kernel has laid out
    the new program's arguments: /proc/PID/cmdline reads empty meanwhile (right after
    Popen returned, in 1024 of 1500 starts on a quiet host, 1454 of 1500 on a loaded one;
    2026-12-07), and alive() and started_for() would pass the process over (a stop right
    after a start would leave it running). Returns at once if it exits."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                if f.read(1):
                    return
        except OSError:
            return
        time.sleep(0.0005)


def tail(path: str | Path, lines: int = 12, width: int = 300) -> str:
    """The last `lines` lines of a log, each cut at `width` characters and indented, for
    an error message; says so when the log is empty or unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"    (cannot read it: {exc.strerror or exc})"
    last = text.splitlines()[-lines:]
    if not any(line.strip() for line in last):
        return "    (empty)"
    return "\n".join("    | " + (ln if len(ln) <= width else ln[:width] + " …") for ln in last)


class WaitFailed(Exception):
    """A wait_until that ended without its condition: the message names each component
    still pending, what it waited for, and the end of its log."""


@dataclass(frozen=True, slots=True)
class Watched:
    """A component of the cluster being waited for: its name as the operator knows it
    (etcd, agent-0, router, gateway, engine-1), its process and its log."""

    name: str
    proc: subprocess.Popen
    log: Path

    def describe(self, waiting_for: str) -> str:
        state = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        return (
            f"  {self.name} (pid {self.proc.pid}, {state}): waiting for {waiting_for}; "
            f"the end of its log {self.log}:\n{tail(self.log)}"
        )


def wait_until(
    pending: Callable[[], dict[str, str]],
    timeout_s: float,
    what: str,
    watch: list[Watched],
    stop: threading.Event | None = None,
    limit: str = "",
) -> None:
    """Poll `pending` (component name -> what it still waits for; empty when done) until
    it is empty. WaitFailed when a watched process exits (naming it, its status and its
    log), at `timeout_s` (naming every pending component, `limit` saying which setting
    bounded the wait), or when `stop` is set."""
    deadline = time.monotonic() + timeout_s
    left: dict[str, str] = {}
    while True:
        if stop is not None and stop.is_set():
            raise WaitFailed(
                f"stopped (SIGTERM: kvctl cluster down?) while waiting for {what}; "
                "stopped what this up had started"
            )
        for w in watch:
            if w.proc.poll() is not None:
                raise WaitFailed(
                    f"{w.name} (pid {w.proc.pid}) exited with status {w.proc.returncode} "
                    f"while waiting for {what}; the end of its log {w.log}:\n"
                    f"{tail(w.log, lines=20)}"
                )
        left = pending()
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if not left:
        return
    by_name = {w.name: w for w in watch}
    lines = [
        by_name[n].describe(why) if n in by_name else f"  {n}: waiting for {why}"
        for n, why in left.items()
    ]
    bound = f" ({limit})" if limit else ""
    raise WaitFailed(
        f"timed out after {timeout_s:.0f}s{bound} waiting for {what}; not ready:\n"
        + "\n".join(lines)
    )


# ------------------------------------------------------------------ health checks
def etcd_healthy(endpoint: str, timeout: float = 1.0, tls: TLSConfig | None = None) -> bool:
    ctx = None
    if tls is not None:  # etcd checks the client certificate on /health too
        ctx = ssl.create_default_context(cafile=tls.ca_file)
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    scheme = "https" if ctx else "http"
    try:
        with urllib.request.urlopen(
            f"{scheme}://{endpoint}/health", timeout=timeout, context=ctx
        ) as r:
            return b"true" in r.read()
    except OSError:
        return False


def client_context(tls: TLSConfig | None) -> ssl.SSLContext | None:
    """For the gateway and the engines over HTTPS: the CA, presenting the client pair
    (engines require one)."""
    if tls is None:
        return None
    ctx = ssl.create_default_context(cafile=tls.ca_file)
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    return ctx


def http_ok(url: str, tls: TLSConfig | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=client_context(tls)) as r:
            return r.status == 200
    except OSError:
        return False


def grpc_healthy(address: str, timeout: float = 1.0, tls: TLSConfig | None = None) -> bool:
    try:
        with channel(address, tls) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def router_nodes(address: str, timeout: float = 2.0, tls: TLSConfig | None = None) -> list:
    from kvstore.v1 import router_pb2, router_pb2_grpc

    with channel(address, tls) as ch:
        return list(
            router_pb2_grpc.RouterStub(ch)
            .ListNodes(router_pb2.ListNodesRequest(), timeout=timeout)
            .nodes
        )
