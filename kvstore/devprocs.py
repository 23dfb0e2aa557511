"""Processes of the local development cluster (kvctl cluster up, kvstore/devcluster.py):
starting one with a fresh log, telling whether a pid is still the process we started,
whether etcd, an agent, the router or the gateway answers, and waiting for them with an
error that names the one that did not come up, what it waited for, and its log."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.config import TLSConfig
from kvstore.tls import channel

ROOT = Path(__file__).resolve().parent.parent
# What a live process of each kind has in its command line (alive: pids are recycled).
_MARKERS = {"etcd": "etcd", "agent": "node_agent", "router": "router", "engine": "vllm_serve"}


def free_port() -> int:
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


def fresh_log(path: Path) -> BinaryIO:
    """`path` opened for a new run's log: the previous run's becomes <path>.prev, so an
    error tail (or a test reading the log) quotes this run only."""
    if path.exists():
        os.replace(path, path.with_name(path.name + ".prev"))
    return open(path, "wb")


def spawn(cmd: list[str], log_path: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start `cmd` in its own session, logging to a fresh `log_path` (fresh_log)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    with fresh_log(log_path) as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd or ROOT,
            env=env,
            start_new_session=True,
        )


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
