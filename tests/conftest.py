"""Fixtures for every test, and the markers that say what kind a test is.

Kinds (one folder each, marked by folder, so `pytest -m unit` runs the unit tests alone):
- `unit`: no processes, no network; RocksDB files in tmp dirs are fine.
- `integration`: real etcd, agents, routers, UCX and gRPC on 127.0.0.1 with free ports.
- `gpu`: the CUDA paths (skipped without a GPU, apart from what runs on CPU).
- `deploy`: the Helm chart and the image definition.

Fixtures:
- `etcd`: a real etcd 3.4 server (Debian's etcd-server) in a temp dir; `.endpoint`,
  `.stop()`, `.start()` (same data dir and ports, for restart tests).
- `spawn_agent(**config)`: starts `python -m node_agent` with an AgentConfig written to a
  file; returns an AgentProc with `.address`, `.kill()` (SIGKILL), `.stop()` (SIGTERM),
  `.restart()`.
- `start_router(name=None, token=None, config=None)`: a real router process on that etcd.
- `pki`: trustme certificates in tmp_path (tests/support/tls.py): `.server` (what every
  process presents, valid for 127.0.0.1 and localhost), `.client`, `.stranger` (another
  CA's client pair), `.ca` (to issue more), `.section()` (a config's `tls` section).
- `tls_etcd`: like `etcd`, serving TLS with `pki.server` and requiring a client
  certificate of its CA.
- `start_tls_router(config=None)`: a router with mTLS (`pki.server`) on `tls_etcd`; its
  helper calls present `pki.client`.
- `make_ns(**overrides)`: a complete, valid Namespace.
- `make_store(n_slots=8, nvme_bytes=1MiB, path=None, **BlockStore kwargs)`: a real
  BlockStore over a CPU DevicePool and a RocksDB tier in tmp_path.
- `small_background_batches`: batches of any size copy in the background (the agent's
  big-batch path), for the small blocks of the test namespace.
- `start_gateway(tokenizers, config=None, keys=None, router=None)`: a router process
  serving the OpenAI gateway on that etcd (tests/support/gateway.py); `.url`; `router`:
  RouterConfig fields (a `tls` section: HTTPS).
- `start_standin(name, model, fail_status=0, namespace=None, node="")`: a stand-in OpenAI
  worker registered as an engine (on `node`, default node-<name>) by the real registrar
  (kvstore.integrations.vllm_serve).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support.cluster import RouterProc
from support.common import AgentProc, EtcdProc, make_namespace, store_maker
from support.gateway import GatewayProc, StandIn
from support.tls import make_pki

KINDS = ("unit", "integration", "gpu", "deploy")
HERE = Path(__file__).resolve().parent

# Started in the background by a shell without job control (`make test &` in a script,
# some CI runners), this process inherits SIGINT ignored, and so would every process the
# tests start: the tests of what Ctrl-C does to kvctl and `kvctl cluster up` would see
# their SIGINT ignored. Python runs its own handler again; children exec with the default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        kind = Path(str(item.fspath)).resolve().relative_to(HERE).parts[0]
        if kind not in KINDS:
            raise pytest.UsageError(
                f"{item.nodeid}: tests live in tests/<kind>/, kind one of {', '.join(KINDS)}"
            )
        item.add_marker(getattr(pytest.mark, kind))


@pytest.fixture
def etcd(tmp_path):
    e = EtcdProc(tmp_path / "etcd-data")
    e.start()
    yield e
    e.stop()


@pytest.fixture
def pki(tmp_path):
    return make_pki(tmp_path / "pki")


@pytest.fixture
def tls_etcd(tmp_path, pki):
    e = EtcdProc(tmp_path / "etcd-tls-data", tls=pki.server)
    e.start()
    yield e
    e.stop()


@pytest.fixture
def start_tls_router(tmp_path, tls_etcd, pki):
    routers: list[RouterProc] = []

    def start(config: dict | None = None) -> RouterProc:
        r = RouterProc(tmp_path / f"tls-router-{len(routers)}", tls_etcd.endpoint, "router-tls")
        routers.append(r)
        return r.start(config={**pki.section(), **(config or {})}, tls=pki.client)

    yield start
    for r in routers:
        r.stop()


@pytest.fixture
def spawn_agent(tmp_path):
    procs: list[AgentProc] = []
    counter = iter(range(1000))

    def spawn(**config) -> AgentProc:
        n = next(counter)
        workdir = tmp_path / f"agent-{n}"
        cfg = {
            "node_id": f"agent-{n}",
            "listen": "127.0.0.1:0",
            "data_dir": str(workdir / "data"),
            "pool_bytes": "16MiB",
            "slot_bytes": "64KiB",
            "nvme_bytes": "64MiB",
            "device": "cpu",
            "allow_unauthenticated": True,
            "expire_interval_s": 0.5,
        }
        cfg.update(config)
        agent = AgentProc(workdir, cfg)
        procs.append(agent)
        return agent.start()

    yield spawn
    for a in procs:
        a.stop()


@pytest.fixture
def small_background_batches(monkeypatch):
    """Batches of any size copy in the background (BatchCopier.write_start / read_start;
    the agent does so from PARALLEL_MIN_BYTES = 8 MiB), so that the test namespace's
    small blocks take that path."""
    from kvstore import store_copy

    monkeypatch.setattr(store_copy, "PARALLEL_MIN_BYTES", 1)


@pytest.fixture
def make_ns():
    return make_namespace


@pytest.fixture
def make_store(tmp_path):
    """`make_store(n_slots=8, nvme_bytes=1MiB, path=None, **BlockStore kwargs)`: a real
    BlockStore over a CPU DevicePool and a RocksDB tier in tmp_path (nvme_bytes=0: none)."""
    yield from store_maker(tmp_path, "cpu")


@pytest.fixture
def start_router(tmp_path, etcd):
    routers: list[RouterProc] = []

    def start(
        name: str | None = None, token: str | None = None, config: dict | None = None
    ) -> RouterProc:
        r = RouterProc(
            tmp_path / f"router-{len(routers)}", etcd.endpoint, name or f"router-{len(routers)}"
        )
        routers.append(r)
        return r.start(token=token, config=config)

    yield start
    for r in routers:
        r.stop()


@pytest.fixture
def start_gateway(tmp_path, etcd):
    gateways: list[GatewayProc] = []

    def start(tokenizers: dict, config: dict | None = None, keys: dict | None = None, router=None):
        g = GatewayProc(tmp_path / f"gateway-{len(gateways)}", etcd.endpoint, tokenizers)
        gateways.append(g)
        return g.start(config, keys, router)

    yield start
    for g in gateways:
        g.stop()


@pytest.fixture
def start_standin(tmp_path, etcd):
    workers: list[StandIn] = []

    def start(
        name: str,
        model: str,
        fail_status: int = 0,
        namespace: dict | None = None,
        node: str = "",
        registrar_args: list[str] | None = None,
    ):
        w = StandIn(tmp_path / f"standin-{name}", etcd.endpoint, name, node)
        workers.append(w)
        return w.start(model, fail_status, namespace, registrar_args)

    yield start
    for w in workers:
        w.stop()
