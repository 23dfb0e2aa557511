"""The vLLM connector and its registrar with mTLS (issue 18): the connector's agent link
(kvstore.integrations.vllm_agent, the code the connector runs, without vLLM) stores,
finds and loads blocks on a real agent that serves only mTLS, with the same-host lane
still used for the hot calls; without the files it only recomputes. The registrar
(vllm_serve) registers an engine in an etcd that requires client certificates. One real
vLLM run (few engine starts, under the shared vLLM lock when run by hand) shares a
prefix between two engines through a TLS agent."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from support.common import PY, ROOT, make_namespace, prompt_tokens, wait_for
from support.gateway import StandIn

from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.coord.etcd import EtcdClient
from kvstore.integrations.vllm_agent import AgentLink
from kvstore.integrations.vllm_config import ConnectorSettings

SECRET = "tls-connector-secret"
SPEC = make_namespace(name="vllm")
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


def tls_agent(spawn_agent, pki, **cfg):
    return spawn_agent(**pki.section(), **cfg)


def link(address: str, **extra) -> AgentLink:
    settings = ConnectorSettings.from_extra(
        {"agent": address, "tenant": "acme", "tenant_secret": SECRET, "shm_mib": 1, **extra}
    )
    return AgentLink(settings, SPEC, "test", retry_s=0.01)


def blocks(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (n, SPEC.block_bytes), dtype=torch.uint8, generator=g)
    return raw.view(torch_dtype(SPEC.kv_dtype)).view(n, *block_shape(SPEC))


def lane_calls(address: str, pki) -> int:
    with KVClient(address, use_shm=False, tls=pki.client) as c:
        return int(dict(c.stats().counters)["local_lane_calls"])


def test_connector_link_stores_and_loads_over_mtls_and_the_lane(spawn_agent, pki):
    agent = tls_agent(spawn_agent, pki)
    tls_dir = str(Path(pki.client.ca_file).parent)  # ca.crt, client.crt, client.key
    tokens = prompt_tokens(3, 4 * SPEC.block_size + 1)
    data = blocks(4)

    writer = link(agent.address, tls_dir=tls_dir)
    ids, matched = writer.prefix(tokens, 4, None)
    assert len(ids) == 4 and matched == 0
    assert writer.save(ids, None, None, data) == 4
    writer.close()

    reader = link(
        agent.address,
        tls_ca_file=pki.client.ca_file,
        tls_cert_file=pki.client.cert_file,
        tls_key_file=pki.client.key_file,
    )
    before = lane_calls(agent.address, pki)
    assert reader.prefix(tokens, 4, None) == (ids, 4)
    got: list[torch.Tensor] = []
    assert reader.load(ids, None, None, lambda first, b: got.append(b.clone())) == 4
    assert torch.equal(torch.cat(got).view(torch.uint8), data.view(torch.uint8))
    # Lookup and Get went over the same-host lane (no TLS there: a Unix socket with
    # peer credentials, whose path the client learnt over mTLS).
    assert lane_calls(agent.address, pki) >= before + 2
    reader.close()

    # Without the files the agent refuses the handshake: nothing cached, recompute.
    plain = link(agent.address)
    assert plain.prefix(tokens, 4, None) == ([], 0)
    plain.close()


def test_registrar_registers_an_engine_in_an_etcd_requiring_client_certificates(
    tmp_path, tls_etcd, pki
):
    w = StandIn(tmp_path / "e0", tls_etcd.endpoint, "e0")
    tls_dir = str(Path(pki.client.ca_file).parent)
    w.start("tiny", registrar_args=["--tls-dir", tls_dir])

    async def registered() -> list[str]:
        async with EtcdClient(tls_etcd.endpoint, tls=pki.client) as c:
            return [e.engine_id for e in await c.list_engines()]

    try:
        wait_for(lambda: asyncio.run(registered()) == ["e0"], timeout=30)
    finally:
        w.stop()
    assert "Traceback" not in (tmp_path / "e0" / "registrar.log").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tls-ca", "/nonexistent/ca.crt"], "cert_file, key_file must be set"),
        (["--tls-dir", "/nonexistent"], "cannot read the CA file"),
    ],
)
def test_registrar_bad_tls_arguments_exit_2_with_one_line(args, message):
    r = subprocess.run(
        [PY, "-m", "kvstore.integrations.vllm_serve", "--engine-id", "e0", "--url",
         "http://127.0.0.1:1", "--node-id", "n0", "--model", "tiny", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm: run `make vllm-env`")
@pytest.mark.timeout(900)
def test_vllm_engines_share_a_prefix_through_an_mtls_agent(tmp_path, spawn_agent, pki):
    agent = tls_agent(spawn_agent, pki, slot_bytes="64KiB", pool_bytes="16MiB")
    tls_dir = str(Path(pki.client.ca_file).parent)
    base = {"agent": agent.address, "tenant": "acme", "tenant_secret": SECRET, "shm_mib": 8}
    prompt = prompt_tokens(11, 200)
    req = {"prompt": [t % 1000 + 1 for t in prompt], "max_tokens": 8}
    plan = {
        "model": str(tmp_path / "tiny-llama"),
        "tiny": {"seed": 1},
        "block_size": 32,
        "engines": [
            {"kvstore": None, "batches": [[req]]},
            {"kvstore": base, "batches": [[req]]},  # no files: refused, recomputes
            {"kvstore": {**base, "tls_dir": tls_dir}, "batches": [[req]]},
            {"kvstore": {**base, "tls_dir": tls_dir}, "batches": [[req]]},
        ],
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    r = subprocess.run(
        [str(VLLM_PY), "-m", "loadtest.vllm_run", str(tmp_path / "plan.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=840, stdin=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    log = r.stdout + r.stderr
    (tmp_path / "vllm.log").write_text(log)
    assert r.returncode == 0, log[-6000:]
    events = [json.loads(x) for x in r.stdout.splitlines() if x.startswith('{"event"')]
    ref, plain, first, second = [e["outputs"][0] for e in events if e["event"] == "batch"]
    assert plain == {"tokens": ref["tokens"], "cached": 0}
    assert first == {"tokens": ref["tokens"], "cached": 0}
    # The fresh engine loads what the first stored, over mTLS: every full block but the
    # one holding the last prompt token; the same greedy tokens as no connector.
    assert second == {"tokens": ref["tokens"], "cached": (200 - 1) // 32 * 32}
    assert "Traceback" not in log, log[-6000:]
