"""The dev cluster's agents can hold its engines' KV blocks (`kvctl cluster up --engines`,
what `make run` and the gateway benchmark start): with 64 KiB slots every Lookup and Put
of the tiny model's 128 KiB blocks was refused, so the engines only ever recomputed. With
`--tls` each engine serves HTTPS requiring the dev CA's client certificates, its connector
and registrar present the client pair. With or without it, its KV event ports stay on
loopback: vLLM's ZMQ sockets have no TLS and carry every tenant's prompt token ids."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvstore.coord.engines import EngineRecord
from kvstore.devcluster import UpOptions, agent_slot_bytes, engine_launch
from kvstore.devengines import (
    MODEL_HEADS,
    MODEL_HIDDEN,
    MODEL_KV_HEADS,
    MODEL_LAYERS,
    EngineLaunch,
    model_block_bytes,
)
from kvstore.integrations.vllm_serve import engine_record, parse_args
from router.engine_feed import connectable, subscriber_binds
from tests.support.common import make_namespace


def test_agent_slots_hold_one_block_of_the_engines_model():
    block = EngineLaunch.__dataclass_fields__["block_size"].default
    spec = make_namespace(num_layers=MODEL_LAYERS, num_kv_heads=MODEL_KV_HEADS,
                          head_dim=MODEL_HIDDEN // MODEL_HEADS, kv_dtype="float32",
                          block_size=block)  # fmt: skip
    assert model_block_bytes(block) == spec.block_bytes  # what the connector's blocks take
    assert agent_slot_bytes(UpOptions(engines=2)) >= spec.block_bytes
    assert agent_slot_bytes(UpOptions(engines=0)) == 64 << 10  # no engines: as configured


def _launch(**kw) -> EngineLaunch:
    return EngineLaunch("engine-0", 8123, "/m", "tiny", "127.0.0.1:50051", "agent-0",
                        "engines", "/s/kv.secret", "127.0.0.1:2379", "/s/engine-0",
                        kv_events_ports=(5557, 5558), **kw)  # fmt: skip


def _after(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_an_engine_with_tls_serves_https_requiring_the_cas_client_certificates():
    launch = _launch(tls_dir="/s/tls")
    assert launch.url == "https://127.0.0.1:8123"
    vllm = launch.vllm_command()
    assert _after(vllm, "--ssl-keyfile") == "/s/tls/server.key"
    assert _after(vllm, "--ssl-certfile") == "/s/tls/server.crt"
    assert _after(vllm, "--ssl-ca-certs") == "/s/tls/ca.crt"
    assert _after(vllm, "--ssl-cert-reqs") == "2"  # ssl.CERT_REQUIRED
    extra = json.loads(_after(vllm, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["tls_dir"] == "/s/tls"  # the connector's mTLS to its agent and router
    events = json.loads(_after(vllm, "--kv-events-config"))
    # Loopback only: vLLM binds the replay port there and connects its publisher to the
    # router, which binds 127.0.0.1:5557 (ZMQ carries no TLS).
    assert (events["endpoint"], events["replay_endpoint"]) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    )


def test_the_registrar_of_a_tls_engine_checks_and_registers_it_over_tls():
    cmd = _launch(tls_dir="/s/tls").command()
    own = cmd[: cmd.index("--")]  # the registrar's arguments, before vLLM's command
    assert _after(own, "--tls-dir") == "/s/tls"
    assert _after(own, "--url") == "https://127.0.0.1:8123"
    assert _after(own, "--kv-events-endpoint") == "tcp://127.0.0.1:5557"
    assert _after(own, "--kv-events-replay-endpoint") == "tcp://127.0.0.1:5558"


def test_a_plaintext_engine_is_launched_as_before():
    launch = _launch()
    assert launch.url == "http://127.0.0.1:8123"
    cmd = launch.command()
    assert not [a for a in cmd if a.startswith(("--ssl-", "--tls-"))]
    extra = json.loads(_after(cmd, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert "tls_dir" not in extra


@pytest.mark.parametrize("tls", [False, True])
def test_the_clusters_engines_keep_their_kv_events_on_loopback(tmp_path, tls):
    """`tcp://*:PORT` made vLLM bind its PUB and its replay ROUTER on 0.0.0.0, in
    plaintext. On loopback, vLLM connects its PUB to the router, which binds it, and
    binds its replay socket there; the registrar advertises exactly those endpoints."""
    opts = UpOptions(engines=2, tls=tls)
    agents = ["127.0.0.1:50051", "127.0.0.1:50052"]
    for i in range(opts.engines):
        launch = engine_launch(tmp_path, opts, i, "127.0.0.1:2379", agents)
        cmd = launch.command()
        own, vllm = cmd[: cmd.index("--")], cmd[cmd.index("--") + 1 :]
        events = json.loads(_after(vllm, "--kv-events-config"))
        assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
        pub, replay = events["endpoint"], events["replay_endpoint"]
        for ep in (pub, replay):
            assert ep.startswith("tcp://127.0.0.1:"), ep
        assert (
            _after(own, "--kv-events-endpoint"),
            _after(own, "--kv-events-replay-endpoint"),
        ) == (
            pub,
            replay,
        )
        assert subscriber_binds(pub)  # the router binds the loopback address vLLM dials
        assert connectable(replay, launch.url) == replay  # and dials the replay socket there
        assert launch.url.startswith("https://" if tls else "http://")


def test_the_device_an_engine_computes_on_reaches_its_record(tmp_path):
    """The dev cluster's engines share the host's CPU cores: each names the device, and
    the registrar puts it in the record the router adds queues up by."""
    cmd = replace(_launch(device="cpu:host-a"), workdir=str(tmp_path)).command()
    own = cmd[cmd.index("-m") + 2 : cmd.index("--")]  # the registrar's own arguments
    assert _after(own, "--device") == "cpu:host-a"
    (tmp_path / "namespace.json").write_text(json.dumps({"block_size": 32}))
    args, _ = parse_args([*own, "--namespace-file", str(tmp_path / "namespace.json")])
    rec = engine_record(args)
    assert rec is not None and rec.device == "cpu:host-a"
    assert EngineRecord.from_json(rec.to_json()).device == "cpu:host-a"
    assert "--device" not in _launch().command()  # none named: a device of its own
    with pytest.raises(ValueError, match="device must be a string"):
        replace(rec, device="x" * 257)


def test_an_engine_restarted_in_its_workdir_logs_this_run_only(tmp_path, monkeypatch):
    """engine.log starts fresh on every start (it appended, so an error tail or a test
    reading it could quote an earlier run); the previous run's is engine.log.prev."""
    import sys

    from kvstore import devengines

    launch = replace(_launch(), workdir=str(tmp_path / "e0"))
    for run in ("first", "second"):  # the engine's command: a process printing its run
        monkeypatch.setattr(
            EngineLaunch, "command", lambda self, run=run: [sys.executable, "-c", f"print({run!r})"]
        )
        assert devengines.start_engine(launch).wait(60) == 0
    assert (tmp_path / "e0" / "engine.log").read_text() == "second\n"
    assert (tmp_path / "e0" / "engine.log.prev").read_text() == "first\n"


def test_the_clusters_engines_sign_their_records_with_the_clusters_key(tmp_path):
    """Every engine's registrar gets the state directory's engine record key, the one
    the dev cluster's router verifies with (made once, owner-only)."""
    opts = UpOptions(engines=2)
    for i in range(opts.engines):
        cmd = engine_launch(tmp_path, opts, i, "127.0.0.1:2379", ["127.0.0.1:50051"]).command()
        assert _after(cmd[: cmd.index("--")], "--record-key-file") == str(
            tmp_path / "engine-record-key"
        )
    assert (tmp_path / "engine-record-key").stat().st_mode & 0o777 == 0o600
    assert "--record-key-file" not in _launch().command()  # none given: unsigned
