"""Processes of the local development cluster (kvctl cluster up, kvstore/devcluster.py):
starting one with a fresh log, telling whether a pid is still the process we started, and
whether etcd, an agent, the router or the gateway answers."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import urllib.request
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


def tail(path: str | Path, n: int = 1500) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


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
