"""The chart's engines publish vLLM KV events (issue 16 item 2): vLLM's --kv-events-config
names the endpoints the registrar advertises in etcd, which the routers resolve to the
engine pod's own ports, and the NetworkPolicy lets only the release's routers and
gateways reach those ports (vLLM's ZMQ sockets have no authentication and no TLS, and
carry prompt token ids). Without it the router never learned what the engines' own
caches held in Kubernetes."""

from __future__ import annotations

import json
import tomllib

import pytest

from kvstore.integrations.vllm_serve import engine_record, parse_args
from router.engine_feed import connectable, subscriber_binds

from tests.deploy.test_helm import (  # noqa: F401 - helm is a fixture
    CHART,
    FIELD_REFS,
    ROOT,
    WORKLOADS,
    helm,
    one,
    render,
    render_error,
)

GATEWAY = "gateway-values.yaml"


def _engines(docs) -> list[dict]:
    return one(docs, "DaemonSet", "-engine")["spec"]["template"]["spec"]["containers"]


def _split(container: dict) -> tuple[list[str], list[str]]:
    """The registrar's arguments (after `-m kvstore.integrations.vllm_serve`) and vLLM's."""
    cmd = container["command"]
    assert cmd[:3] == ["python3", "-m", "kvstore.integrations.vllm_serve"]
    i = cmd.index("--")
    return cmd[3:i], cmd[i + 1 :]


def _flag(args: list[str], name: str) -> str | None:
    found = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    assert len(found) <= 1, name
    return found[0] if found else None


def _pod_ip(value: str) -> str:
    return value.replace("$(POD_IP)", FIELD_REFS["status.podIP"])


@pytest.mark.parametrize("gpus", [1, 3])
def test_vllm_publishes_where_the_registrar_says_and_routers_reach_it(helm, gpus, tmp_path):  # noqa: F811
    docs = render(helm, GATEWAY, f"agent.gpusPerNode={gpus}")
    engines = _engines(docs)
    assert len(engines) == gpus
    seen: set[int] = set()
    for c in engines:
        own, vllm = _split(c)
        events = json.loads(_flag(vllm, "--kv-events-config") or "{}")
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        assert events["topic"] == ""  # vLLM's default, as the dev cluster's engines
        # The registrar's own parser reads what it will put in the engine's etcd record.
        ns = tmp_path / "namespace.json"
        ns.write_text(json.dumps({"block_size": 16}))
        args, _ = parse_args([_pod_ip(a) for a in own] + ["--namespace-file", str(ns)])
        rec = engine_record(args)
        assert rec is not None
        assert (rec.kv_events_endpoint, rec.kv_events_replay_endpoint) == (
            events["endpoint"],
            events["replay_endpoint"],
        )
        # vLLM binds them in its pod; every router replica connects at the pod IP (the
        # host of the advertised URL), to the ports the container declares.
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        gpu = c["name"].removeprefix("engine-")
        pod_ip = FIELD_REFS["status.podIP"]
        assert not subscriber_binds(rec.kv_events_endpoint)
        assert connectable(rec.kv_events_endpoint, rec.url) == (
            f"tcp://{pod_ip}:{ports[f'kv-events-{gpu}']}"
        )
        assert connectable(rec.kv_events_replay_endpoint, rec.url) == (
            f"tcp://{pod_ip}:{ports[f'kv-replay-{gpu}']}"
        )
        assert not seen & set(ports.values()), "engines of one pod share its ports"
        seen |= set(ports.values())


def _admitted(docs, rule: dict) -> set[str] | None:
    """The workloads (kind/name) whose pods a rule lets in; None: any source."""
    if "from" not in rule or not rule["from"]:
        return None
    out = set()
    for peer in rule["from"]:
        if set(peer) != {"podSelector"}:
            return None  # an ipBlock or another namespace: not only this release's pods
        sel = peer["podSelector"].get("matchLabels", {})
        for w in docs:
            if (
                w["kind"] in WORKLOADS
                and sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
            ):
                out.add(f"{w['kind']}/{w['metadata']['name']}")
    return out


def _ingress_by_port(docs, policy: dict) -> dict[int, set[str] | None]:
    """Port -> the workloads admitted to it (None: anyone), over every rule."""
    out: dict[int, set[str] | None] = {}
    rules = policy["spec"]["ingress"]
    assert all("ports" in r for r in rules), "a rule without ports opens every port"
    for rule in rules:
        who = _admitted(docs, rule)
        for p in rule["ports"]:
            before = out.get(p["port"], set())
            out[p["port"]] = None if who is None or before is None else before | who
    return out


@pytest.mark.parametrize("gateway", [True, False])
def test_only_routers_and_gateways_reach_the_event_ports(helm, gateway):  # noqa: F811
    docs = render(helm, GATEWAY, f"gateway.enabled={str(gateway).lower()}", "agent.gpusPerNode=2")
    daemonset = one(docs, "DaemonSet", "-engine")
    policy = one(docs, "NetworkPolicy", "-engine")
    sel = policy["spec"]["podSelector"]["matchLabels"]
    assert sel.items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    by_port = _ingress_by_port(docs, policy)
    want = {"Deployment/kv-kvstore-router"} | (
        {"Deployment/kv-kvstore-gateway"} if gateway else set()
    )
    for c in _engines(docs):
        ports = {p["name"].rsplit("-", 1)[0]: p["containerPort"] for p in c["ports"]}
        assert by_port[ports["kv-events"]] == want, c["name"]
        assert by_port[ports["kv-replay"]] == want, c["name"]
        # The OpenAI port: the gateway's pods alone when there is one (a direct caller
        # skips its keys and cache_salt); open when the engines are the front door.
        assert by_port[ports["http"]] == ({"Deployment/kv-kvstore-gateway"} if gateway else None)
    assert len(by_port) == 3 * 2  # nothing else is let in


def test_more_direct_callers_of_the_engines_are_named_peers(helm):  # noqa: F811
    peer = "engines.clientPeers[0].podSelector.matchLabels.app=batch"
    docs = render(helm, GATEWAY, peer)
    policy = one(docs, "NetworkPolicy", "-engine")
    (rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 8000]
    assert rule["from"][1] == {"podSelector": {"matchLabels": {"app": "batch"}}}
    assert len(rule["from"]) == 2


def test_events_off_renders_no_event_sockets(helm):  # noqa: F811
    docs = render(helm, GATEWAY, "engines.kvEvents.enabled=false")
    for c in _engines(docs):
        own, vllm = _split(c)
        assert _flag(vllm, "--kv-events-config") is None
        assert (
            _flag(own, "--kv-events-endpoint") is _flag(own, "--kv-events-replay-endpoint") is None
        )
        assert [p["name"] for p in c["ports"]] == [c["name"].replace("engine-", "http-")]
    by_port = _ingress_by_port(docs, one(docs, "NetworkPolicy", "-engine"))
    assert list(by_port.values()) == [{"Deployment/kv-kvstore-gateway"}]  # the OpenAI port


@pytest.mark.parametrize(
    "sets",
    [
        ("engines.kvEvents.publishBasePort=8000",),  # engines.port
        ("agent.gpusPerNode=2", "engines.kvEvents.replayBasePort=5558"),  # 5557 + 1
    ],
)
def test_overlapping_engine_ports_are_refused(helm, sets):  # noqa: F811
    assert "overlap" in render_error(helm, GATEWAY, *sets)


def test_engine_image_requirements_follow_pyproject():
    """The stock vllm/vllm-openai image has no kvstore: values.yaml's recipe installs
    deploy/docker/engine-requirements.txt, then kvstore with --no-deps (vLLM's torch
    stays). The list must be the connector's requirements less torch, plus the
    registrar's etcd client at the server extra's pin."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    path = ROOT / "deploy" / "docker" / "engine-requirements.txt"
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    reqs = {ln for ln in lines if ln and not ln.startswith("#")}
    client = {r for r in project["dependencies"] if not r.startswith("torch")}
    etcd = {r for r in project["optional-dependencies"]["server"] if r.startswith("etcd3aio")}
    assert len(etcd) == 1
    assert reqs - {"httpx>=0.28"} == client | etcd
    assert not [r for r in reqs if r.startswith("torch")]
    values = (CHART / "values.yaml").read_text()
    assert "deploy/docker/engine-requirements.txt" in values and "--no-deps" in values
