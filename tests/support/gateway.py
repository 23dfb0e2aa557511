"""Helpers for the gateway tests: a router process serving the gateway, stand-in OpenAI
workers (loadtest/standin_openai.py) and their registrar (kvstore.integrations.vllm_serve),
a word-level tokenizer with the tiny model's chat template, and a World of the three with
an agent, whose load the router's own gauges show."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from support.attack import etcd_items
from support.common import ROOT, free_port, make_namespace, wait_for

from loadtest.vllm_model import write_word_tokenizer

KV_TENANT = "gw"
KV_SECRET = "gateway-test-secret"
KEYS = {"key-acme": "acme", "key-globex": "globex"}
MODEL = "tiny"
SPEC = make_namespace(tenant=KV_TENANT)  # the engines' namespace: chain ids get priced


def _proc(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **(env or {})),
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
    )


def _ready(proc: subprocess.Popen, path: Path, log: Path, what: str, timeout: float = 60) -> str:
    def check():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        return path.exists() and path.read_text().strip()

    return wait_for(check, timeout, what=f"{what} ready file")


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class GatewayProc:
    """`python -m router --gateway-listen ...` with GatewayConfig fields from `config`."""

    def __init__(self, workdir: Path, etcd_endpoint: str, tokenizers: dict[str, str]) -> None:
        self.workdir, self.etcd_endpoint, self.tokenizers = workdir, etcd_endpoint, tokenizers
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.address = ""  # host:port of the gateway
        self.router_address = ""
        self.metrics_port = 0
        self.http: dict = {}  # httpx arguments its own calls use (verify, cert) over HTTPS

    def start(
        self, config: dict | None = None, keys: dict | None = None, router: dict | None = None
    ) -> "GatewayProc":
        """`router`: RouterConfig fields over the defaults (a `tls` section: the gateway
        serves HTTPS with it, and its own calls present `http`)."""
        w = self.workdir
        w.mkdir(parents=True, exist_ok=True)
        (w / "keys.json").write_text(json.dumps(keys or KEYS))
        (w / "kv.secret").write_text(KV_SECRET)
        gcfg = {
            "tokenizers": self.tokenizers,
            "api_keys_file": str(w / "keys.json"),
            "kv_secret_files": {KV_TENANT: str(w / "kv.secret")},
            **(config or {}),
        }
        (w / "gateway.json").write_text(json.dumps(gcfg))
        # The engines' tenant secret names what their own caches hold (KV events).
        # A Prometheus port always: the gateway's metrics page is there (the operator's).
        rcfg = {
            "allow_unauthenticated": True,
            "tenant_secret_files": {KV_TENANT: str(w / "kv.secret")},
            "metrics_port": free_port(),
            **(router or {}),
        }
        self.metrics_port = rcfg["metrics_port"]
        (w / "router.json").write_text(json.dumps(rcfg))
        for f in ("ready", "gw-ready"):
            (w / f).unlink(missing_ok=True)
        self.proc = _proc(
            [
                sys.executable,
                "-m",
                "router",
                "--router-id",
                w.name,
                "--listen",
                "127.0.0.1:0",
                "--etcd-endpoints",
                self.etcd_endpoint,
                "--config",
                str(w / "router.json"),
                "--ready-file",
                str(w / "ready"),
                "--gateway-listen",
                "127.0.0.1:0",
                "--gateway-config",
                str(w / "gateway.json"),
                "--gateway-ready-file",
                str(w / "gw-ready"),
                "--log-level",
                "DEBUG",
            ],
            w / "router.log",
        )
        self.router_address = _ready(self.proc, w / "ready", w / "router.log", "router")
        self.address = _ready(self.proc, w / "gw-ready", w / "router.log", "gateway")
        https = bool((router or {}).get("tls") or gcfg.get("tls_cert_file"))
        self.url = ("https://" if https and gcfg.get("https", True) else "http://") + self.address
        return self

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None

    @property
    def log(self) -> str:
        return (self.workdir / "router.log").read_text(errors="replace")

    def metrics(self) -> str:
        """The router's Prometheus page, with the gateway's metrics (plain HTTP: the
        router's metrics port has no TLS)."""
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text

    def engines(self) -> int:
        return int(httpx.get(self.url + "/health", timeout=5, **self.http).json()["engines"])


class StandIn:
    """A stand-in worker and its registrar, registered as engine `name` on node `node`."""

    def __init__(self, workdir: Path, etcd_endpoint: str, name: str, node: str = "") -> None:
        self.workdir, self.etcd_endpoint, self.name = workdir, etcd_endpoint, name
        self.node = node or f"node-{name}"
        self.worker: subprocess.Popen | None = None
        self.registrar: subprocess.Popen | None = None
        self.url = ""

    def start(
        self,
        model: str,
        fail_status: int = 0,
        namespace: dict | None = None,
        registrar_args: list[str] | None = None,
    ) -> "StandIn":
        w = self.workdir
        w.mkdir(parents=True, exist_ok=True)
        (w / "ready").unlink(missing_ok=True)
        self.worker = _proc(
            [
                sys.executable,
                "-m",
                "loadtest.standin_openai",
                "--ready-file",
                str(w / "ready"),
                "--name",
                self.name,
                "--fail-status",
                str(fail_status),
            ],
            w / "worker.log",
        )
        self.url = "http://" + _ready(self.worker, w / "ready", w / "worker.log", "stand-in")
        ns_args: list[str] = []
        if namespace is not None:
            (w / "ns.json").write_text(json.dumps(namespace))
            ns_args = ["--namespace-file", str(w / "ns.json")]
        self.registrar = _proc(
            [
                sys.executable,
                "-m",
                "kvstore.integrations.vllm_serve",
                "--engine-id",
                self.name,
                "--url",
                self.url,
                "--node-id",
                self.node,
                "--model",
                model,
                "--ttl",
                "2",
                "--check-interval",
                "0.3",
                "--etcd-endpoints",
                self.etcd_endpoint,
                *ns_args,
                *(registrar_args or []),
            ],
            w / "registrar.log",
        )
        return self

    def seen(self) -> list[dict]:
        return httpx.get(self.url + "/seen", timeout=5).json()

    def kill(self) -> None:
        """SIGKILL the worker; its registrar notices and deregisters it."""
        _stop(self.worker, signal.SIGKILL)

    def stop(self) -> None:
        _stop(self.registrar)
        _stop(self.worker)


def indexed_blocks(router_address: str) -> dict[str, int]:
    """Blocks the router has indexed per node (ListNodes)."""
    import grpc

    from kvstore.v1 import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(router_address) as ch:
        resp = router_pb2_grpc.RouterStub(ch).ListNodes(router_pb2.ListNodesRequest(), timeout=5)
    return {n.node_id: n.indexed_blocks for n in resp.nodes}


def sse_events(raw: bytes) -> list[dict]:
    """The JSON events of an SSE answer, without the final [DONE]."""
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


def register_engine(etcd_endpoint: str, record, key: bytes = b"") -> None:
    """Write an EngineRecord to etcd as a registrar would (no lease: the test's etcd
    goes away with it), signed with `key` (engine_record_key; b"": unsigned), for
    engines the registrar does not health-check (HTTPS)."""
    import asyncio

    from kvstore.coord.etcd import EtcdClient

    async def main() -> None:
        async with EtcdClient(etcd_endpoint) as client:
            await client.register_engine(record, 0, key)

    asyncio.run(main())


def https_standin(workdir: Path, name: str, cert: str, key: str, ca: str) -> tuple:
    """A stand-in worker serving HTTPS with `cert`/`key` and requiring client
    certificates of `ca` (vLLM's --ssl-certfile/--ssl-keyfile/--ssl-ca-certs); returns
    (process, https URL). Stop it with stop_proc."""
    tls = ["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", ca]
    proc, address = _worker(workdir, name, tls, "https stand-in")
    return proc, "https://" + address


def bare_standin(workdir: Path, name: str) -> tuple[subprocess.Popen, str]:
    """A stand-in worker with no registrar (a server of an attacker's, say): (process,
    http URL); GET URL/seen lists what reached it. Stop it with stop_proc."""
    proc, address = _worker(workdir, name, [], "stand-in")
    return proc, "http://" + address


def _worker(workdir: Path, name: str, extra: list[str], what: str) -> tuple:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "ready").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "loadtest.standin_openai", "--ready-file", str(workdir / "ready")]
    proc = _proc([*cmd, "--name", name, *extra], workdir / "worker.log")
    return proc, _ready(proc, workdir / "ready", workdir / "worker.log", what)


def stop_proc(proc: subprocess.Popen | None) -> None:
    _stop(proc)


class World:
    """An agent (node agent-0), the gateway's router with a Prometheus port, and a
    stand-in engine on agent-0 publishing the namespace, so a forwarded request is held
    in the router's in-flight table on agent-0."""

    def __init__(self, tmp_path, etcd, spawn_agent, start_gateway, start_standin, **gw) -> None:
        self.etcd = etcd
        self.agent = spawn_agent(etcd_endpoints=etcd.endpoint, lease_ttl_s=2)
        self.metrics_port = free_port()
        tok = str(write_word_tokenizer(tmp_path / "tok"))
        router = {"metrics_port": self.metrics_port, **gw.pop("router", {})}
        self.gw = start_gateway({MODEL: tok}, gw.pop("config", None), router=router)
        self.gw.http = gw.pop("http", {})
        self.w = start_standin("w0", MODEL, namespace=SPEC.to_dict(), node="agent-0")
        wait_for(lambda: self.gw.engines() == 1, 30, 0.1, what="the engine in the gateway")
        wait_for(lambda: "agent-0" in self.router_inflight(), 30, 0.1, what="agent-0 routed")

    def router_inflight(self) -> dict[str, float]:
        page = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return {
            m.group(1): float(m.group(2))
            for m in re.finditer(r'^kvstore_router_inflight\{node="([^"]+)"\} (\S+)$', page, re.M)
        }

    def engine_load(self, engine: str) -> tuple[float, float]:
        """The router's load terms for one engine (its Prometheus port, an operator's):
        requests in flight, and their prefill work queued (blocks)."""
        page = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        terms = []
        for gauge in ("kvstore_router_engine_inflight", "kvstore_router_engine_queued_blocks"):
            m = re.search(rf'^{gauge}\{{engine="{re.escape(engine)}"\}} (\S+)$', page, re.M)
            assert m is not None, (gauge, engine, page)
            terms.append(float(m.group(1)))
        return terms[0], terms[1]

    def gateway_metrics(self) -> str:
        return self.gw.metrics()

    def gateway_inflight(self) -> float:
        m = re.search(r"^kvstore_gateway_inflight (\S+)$", self.gateway_metrics(), re.M)
        assert m is not None
        return float(m.group(1))

    def state(self) -> tuple:
        """What a refused request must not change (agents refresh their own records in
        etcd: nodes/ is compared by key only)."""
        items = etcd_items(self.etcd.endpoint)
        etcd = {k: (v if not k.startswith("nodes/") else b"") for k, v in items.items()}
        return etcd, self.router_inflight(), len(self.w.seen())
