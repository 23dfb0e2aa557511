"""The chart's engine record key (docs/security.md, Engine records): generated into a
Secret of its own, mounted into the engines (whose registrar signs its etcd record with
it, `--record-key-file`) and into routers and gateways (`engine_record_key_file` in the
router.yaml they load), so they forward to and follow only records the release's
engines wrote. Agents do not get it."""

from __future__ import annotations

import base64
import json

import pytest
import yaml

from kvstore.config import RouterConfig
from kvstore.coord.engines import engine_record_key, read_engine_record
from kvstore.integrations.vllm_serve import engine_record, parse_args, record_key

from tests.deploy.test_helm import (  # noqa: F401 - helm is a fixture
    CHART,
    FIELD_REFS,
    agent_containers,
    chart_as_upgrade,
    helm,
    load_as_container,
    one,
    render,
    render_error,
    run_helm,
)

GATEWAY = "gateway-values.yaml"


def _mounted(docs, pod_spec: dict, container: dict, path: str) -> str:
    """The text of the Secret key a container sees at `path` (a mounted secret volume)."""
    for m in container["volumeMounts"]:
        if path.startswith(m["mountPath"] + "/"):
            vol = next(v for v in pod_spec["volumes"] if v["name"] == m["name"])
            item = path[len(m["mountPath"]) + 1 :]
            keys = {i["path"]: i["key"] for i in vol["secret"].get("items", [])}
            secret = next(
                d
                for d in docs
                if d["kind"] == "Secret" and d["metadata"]["name"] == vol["secret"]["secretName"]
            )
            return base64.b64decode(secret["data"][keys.get(item, item)]).decode()
    raise AssertionError(f"{path} is not mounted in {container['name']}")


def test_engines_sign_with_the_key_routers_and_gateways_verify_with(helm, tmp_path, monkeypatch):  # noqa: F811
    docs = render(helm, GATEWAY, "agent.gpusPerNode=2")
    secret = one(docs, "Secret", "-engine-record-key")
    key = base64.b64decode(secret["data"]["key"]).decode()
    assert len(key) >= 32
    held = {}
    for kind, suffix in (("Deployment", "-router"), ("Deployment", "-gateway")):
        spec = one(docs, kind, suffix)["spec"]["template"]["spec"]
        c = spec["containers"][0]
        cfg = load_as_container(
            docs, c, RouterConfig, "router.yaml", "KVSTORE_ROUTER_", tmp_path, monkeypatch
        )
        assert cfg.engine_record_key_file
        held[suffix] = _mounted(docs, spec, c, cfg.engine_record_key_file)
    assert held == {"-router": key, "-gateway": key}
    engines = one(docs, "DaemonSet", "-engine")["spec"]["template"]["spec"]
    assert len(engines["containers"]) == 2
    for c in engines["containers"]:
        cmd = c["command"]
        own = [a.replace("$(POD_IP)", FIELD_REFS["status.podIP"]) for a in cmd[3 : cmd.index("--")]]
        ns = tmp_path / "namespace.json"
        ns.write_text(json.dumps({"block_size": 16}))
        args, _ = parse_args([*own, "--namespace-file", str(ns)])
        assert _mounted(docs, engines, c, args.record_key_file) == key
        # what the registrar writes verifies under the routers' key
        (tmp_path / "key").write_text(key)
        args.record_key_file = str(tmp_path / "key")
        rec = engine_record(args)
        assert rec is not None
        assert read_engine_record(rec.to_json(record_key(args)), engine_record_key(key)) == rec
    agent = one(docs, "DaemonSet", "-agent")["spec"]["template"]
    assert "engine-record-key" not in json.dumps(agent)
    assert all("engine-record-key" not in json.dumps(c) for c in agent_containers(docs))


def test_the_routers_verify_records_without_a_gateway_or_engines(helm, tmp_path, monkeypatch):  # noqa: F811
    """Engines registered by registrars of the operator's own are verified too: the key
    is there with the routers alone."""
    docs = render(helm, "minimal-values.yaml")
    spec = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    cfg = load_as_container(
        docs, c, RouterConfig, "router.yaml", "KVSTORE_ROUTER_", tmp_path, monkeypatch
    )
    key = base64.b64decode(one(docs, "Secret", "-engine-record-key")["data"]["key"]).decode()
    assert _mounted(docs, spec, c, cfg.engine_record_key_file) == key


def test_a_given_or_existing_key_is_used(helm):  # noqa: F811
    docs = render(helm, GATEWAY, "auth.engineRecordKey=given-key-0123456789")
    data = one(docs, "Secret", "-engine-record-key")["data"]
    assert base64.b64decode(data["key"]).decode() == "given-key-0123456789"
    docs = render(helm, GATEWAY, "auth.existingEngineRecordKeySecret=mine")
    assert not [d for d in docs if d["metadata"]["name"].endswith("-engine-record-key")]
    for kind, suffix in (("Deployment", "-router"), ("Deployment", "-gateway")):
        vols = one(docs, kind, suffix)["spec"]["template"]["spec"]["volumes"]
        vol = next(v for v in vols if v["name"] == "engine-record-key")
        assert vol["secret"]["secretName"] == "mine"


def test_a_key_with_whitespace_is_refused(helm):  # noqa: F811
    """The registrar and the router strip the file's text: a key with spaces would be
    read as another key by one of them."""
    assert "engineRecordKey" in render_error(helm, GATEWAY, "auth.engineRecordKey=two words")


# ---- auth.engineRecords: staging signatures through an upgrade -------------------------


def _modes(docs, tmp_path, monkeypatch) -> tuple[set[str], list[bool]]:
    """(the routers' and gateways' engine_record_unsigned, whether each engine container's
    registrar is given --record-key-file), as the processes would read them."""
    unsigned = set()
    for suffix in ("-router", "-gateway"):
        c = one(docs, "Deployment", suffix)["spec"]["template"]["spec"]["containers"][0]
        cfg = load_as_container(
            docs, c, RouterConfig, "router.yaml", "KVSTORE_ROUTER_", tmp_path, monkeypatch
        )
        assert cfg.engine_record_key_file  # the key is there in every mode
        unsigned.add(cfg.engine_record_unsigned)
    signing = []
    for c in one(docs, "DaemonSet", "-engine")["spec"]["template"]["spec"]["containers"]:
        cmd = c["command"]
        own = [a.replace("$(POD_IP)", FIELD_REFS["status.podIP"]) for a in cmd[3 : cmd.index("--")]]
        args, _ = parse_args(own)
        signing.append(args.record_key_file is not None)
    return unsigned, signing


@pytest.mark.parametrize(
    "mode, unsigned, signs",
    [
        ("", "refuse", True),  # a fresh install: verify
        ("verify", "refuse", True),
        ("sign", "accept", True),
        ("unsigned", "accept", False),  # an engine image without --record-key-file
    ],
)
def test_each_engine_records_mode_renders(helm, tmp_path, monkeypatch, mode, unsigned, signs):  # noqa: F811
    docs = render(helm, GATEWAY, "agent.gpusPerNode=2", f"auth.engineRecords={mode}")
    assert _modes(docs, tmp_path, monkeypatch) == ({unsigned}, [signs, signs])


def test_an_unknown_engine_records_mode_is_refused(helm):  # noqa: F811
    assert "engineRecords" in render_error(helm, GATEWAY, "auth.engineRecords=off")


def _upgrade(helm, tmp_path, live: str, *sets: str) -> tuple[str, str]:  # noqa: F811
    """(router.yaml, NOTES) as `helm upgrade` renders them over a running release whose
    router.yaml is `live`: `helm template` reaches no cluster, so a copy of the chart has
    the lookup of the running ConfigMap replaced by `live` (and NOTES rendered into a
    ConfigMap of its own)."""

    def answer(text: str) -> str:
        lookup = next(ln for ln in text.splitlines() if "lookup" in ln and "router.yaml" in ln)
        return text.replace(lookup, "{{- " + json.dumps(live) + " -}}")

    chart = chart_as_upgrade(tmp_path, answer)
    args = ["--is-upgrade", "-f", str(CHART / "ci" / GATEWAY)]
    for s in sets:
        args += ["--set", s]
    out = {}
    for show in ("configmap.yaml", "zz-notes.yaml"):
        proc = run_helm(helm, "template", *args, "--show-only", f"templates/{show}", chart=chart)
        assert proc.returncode == 0, proc.stderr
        out[show] = yaml.safe_load(proc.stdout)["data"]
    return out["configmap.yaml"]["router.yaml"], out["zz-notes.yaml"]["notes"]


BEFORE_SIGNING = "router_id: router-0\nallow_unauthenticated: false\n"
SIGNING = "router_id: router-0\nengine_record_key_file: /etc/kvstore/engine-record-key/key\n"


def _router_unsigned(router_yaml: str) -> str:
    return yaml.safe_load(router_yaml)["engine_record_unsigned"]


def test_an_upgrade_from_a_release_before_signing_accepts_unsigned_records_first(
    helm,  # noqa: F811
    tmp_path,
):
    """The running routers hold no key: the upgraded routers, which restart within
    seconds, keep taking the engines' unsigned records while the engines restart one by
    one to sign theirs (no 503 in between); NOTES says how to finish."""
    router, notes = _upgrade(helm, tmp_path, BEFORE_SIGNING)
    assert _router_unsigned(router) == "accept"
    assert "engine records: sign" in notes and "auth.engineRecords=verify" in notes
    # the next upgrade, with the value still empty, keeps it: never verify by itself
    router, _ = _upgrade(helm, tmp_path, router)
    assert _router_unsigned(router) == "accept"
    # the operator's word, once the engines sign
    router, notes = _upgrade(helm, tmp_path, router, "auth.engineRecords=verify")
    assert _router_unsigned(router) == "refuse" and "engine records:" not in notes
    router, _ = _upgrade(helm, tmp_path, router)
    assert _router_unsigned(router) == "refuse"


def test_an_upgrade_keeps_the_running_releases_mode(helm, tmp_path):  # noqa: F811
    # a release that verified (the first signing release wrote no mode): verify
    router, notes = _upgrade(helm, tmp_path, SIGNING)
    assert _router_unsigned(router) == "refuse" and "engine records:" not in notes
    # unsigned (an old engine image) stays unsigned until the operator says otherwise
    was, _ = _upgrade(helm, tmp_path, BEFORE_SIGNING, "auth.engineRecords=unsigned")
    router, notes = _upgrade(helm, tmp_path, was)
    assert "auth.engineRecords: unsigned" in router and _router_unsigned(router) == "accept"
    assert "Rebuild the engine image" in notes
    # helm template alone (no cluster): a fresh install's mode
    docs = render(helm, GATEWAY, "agent.gpusPerNode=2", "auth.engineRecords=")
    router = one(docs, "ConfigMap", "-config")["data"]["router.yaml"]
    assert _router_unsigned(router) == "refuse"
