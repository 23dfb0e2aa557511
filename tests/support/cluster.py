"""Helpers for the cluster tests (test_router.py, test_cluster.py): real router processes,
agent spawning in parallel, waiting on what the router reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from support.common import ROOT, wait_for

from kvstore.tls import channel
from kvstore.v1 import router_pb2, router_pb2_grpc


class RouterProc:
    def __init__(self, workdir: Path, etcd_endpoint: str, name: str) -> None:
        self.workdir = workdir
        self.etcd_endpoint = etcd_endpoint
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self._channel: grpc.Channel | None = None
        self.stub: router_pb2_grpc.RouterStub | None = None

    def start(
        self,
        listen: str = "127.0.0.1:0",
        timeout: float = 30.0,
        token: str | None = None,
        config: dict | None = None,
        tls=None,
    ) -> "RouterProc":
        """`config`: RouterConfig fields, written to a file the router loads; `tls`: the
        client pair (a TLSConfig) this helper's own calls present to a router with mTLS."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        ready = self.workdir / "ready"
        ready.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if token:
            env["KVSTORE_CLUSTER_TOKEN"] = token
        cfg_path = self.workdir / "router.json"
        # Like the agents the fixtures start: tokenless callers act as the cluster, unless
        # the test's config says otherwise (tests/integration/test_router_auth.py).
        cfg_path.write_text(json.dumps({"allow_unauthenticated": True, **(config or {})}))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "router",
                "--router-id",
                self.name,
                "--listen",
                listen,
                "--etcd-endpoints",
                self.etcd_endpoint,
                "--ready-file",
                str(ready),
                "--config",
                str(cfg_path),
                "--log-level",
                "DEBUG",
            ],
            cwd=ROOT,
            env=env,
            stdout=open(self.workdir / "router.log", "ab"),
            stderr=subprocess.STDOUT,
        )

        def is_ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}: {self.log[-2000:]}")
            return ready.exists() and ready.read_text().strip()

        self.address = wait_for(is_ready, timeout, what="router ready file")
        self._channel = channel(self.address, tls)
        self.stub = router_pb2_grpc.RouterStub(self._channel)
        return self

    def _close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def stop(self, sig=signal.SIGTERM) -> None:
        self._close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    @property
    def log(self) -> str:
        return (self.workdir / "router.log").read_text(errors="replace")

    # ------------------------------------------------------------------- queries
    def nodes(self) -> dict[str, router_pb2.NodeInfo]:
        resp = self.stub.ListNodes(router_pb2.ListNodesRequest(), timeout=5)
        return {n.node_id: n for n in resp.nodes}

    def route(self, ns_id: bytes, packed: bytes, **kw) -> router_pb2.RouteResponse:
        return self.stub.Route(
            router_pb2.RouteRequest(namespace_id=ns_id, block_ids=packed, **kw), timeout=5
        )

    def release(self, request_id: str, prefill_done: bool = False) -> None:
        self.stub.Release(
            router_pb2.ReleaseRequest(request_id=request_id, prefill_done=prefill_done), timeout=5
        )

    def wait_nodes(self, expect: dict[str, int] | set[str], timeout: float = 30.0):
        """Until the router lists exactly these nodes, all in sync (and, for a dict, with
        these indexed block counts)."""

        def check():
            try:
                nodes = self.nodes()
            except grpc.RpcError:
                return False
            if set(nodes) != set(expect) or not all(n.synced for n in nodes.values()):
                return False
            if isinstance(expect, dict):
                return all(nodes[k].indexed_blocks == v for k, v in expect.items()) and nodes
            return nodes

        return wait_for(check, timeout, interval=0.1, what=f"router {self.name} to list {expect}")


def spawn_many(spawn_agent, n: int, **config) -> list:
    """Start n agents concurrently (each start is mostly a torch import)."""
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(lambda _: spawn_agent(**config), range(n)))


def agent_config(etcd, **kw) -> dict:
    cfg = {"etcd_endpoints": etcd.endpoint, "lease_ttl_s": 2}
    cfg.update(kw)
    return cfg


def settle(seconds: float) -> None:
    """Give an asynchronous pipeline time to (not) act, for negative checks only."""
    time.sleep(seconds)
