"""Deployment artifacts, validated offline: the Helm chart (lint, render, strict Kubernetes
schema validation for 1.29 and 1.33, rendered configs loaded by the real config loader,
values schema), the container image definition, the gRPC health check script against a real
agent, and the Prometheus alerts and Grafana dashboard.

Helm comes from tools/install_helm.sh (into .tools/, once per session); the helm tests skip
only when it cannot be installed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from kvstore.config import AgentConfig, PeerConfig, RouterConfig, load_config
from kvstore.coord.etcd import channel_target, parse_endpoints
from kvstore.units import parse_size

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvstore"
HELM = ROOT / ".tools" / "helm"
VALUES = [
    "minimal-values.yaml",
    "production-values.yaml",
    "external-etcd-values.yaml",
    "gateway-values.yaml",
]
KUBE_VERSIONS = ["1.29.0", "1.33.0"]
RELEASE, NAMESPACE = "kv", "kvstore-test"
# Stand-ins for what the kubelet fills in (fieldRef) and for Secrets the values only name.
FIELD_REFS = {
    "spec.nodeName": "gpu-node-7",
    "status.podIP": "10.1.2.3",
    "metadata.name": "kv-kvstore-router-5d9c8-abcde",
}
EXISTING_SECRETS = {
    "tenants.json": json.dumps(
        {
            "acme": {"token_sha256": "ab" * 32, "hbm_limit_bytes": "1GiB"},
            "_cluster": {"token_sha256": "cd" * 32},
        }
    ),
    "token": "stand-in-cluster-token",
}
METRICS = {
    "kvstore_lookup_tokens_total",
    "kvstore_lookup_hit_tokens_total",
    "kvstore_requests_total",
    "kvstore_requests_hit_total",
    "kvstore_hit_length_tokens_bucket",
    "kvstore_saved_prefill_tokens_total",
    "kvstore_rpc_duration_seconds_bucket",
    "kvstore_tier_bytes",
    "kvstore_tier_capacity_bytes",
    "kvstore_evictions_total",
    "kvstore_flush_duration_seconds_bucket",
    "kvstore_router_decisions_total",
}
WORKLOADS = ("DaemonSet", "Deployment", "StatefulSet")


def require(module: str, requirement: str):
    """Dev dependencies of these tests; missing means a broken install, not a skip."""
    try:
        return __import__(module)
    except ImportError:
        pytest.fail(
            f"{requirement} is not installed (a dev dependency of tests/deploy/test_helm.py)"
        )


# ---- helm ---------------------------------------------------------------------------------


def _helm_works(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        return (
            subprocess.run(
                [str(path), "version", "--short"], capture_output=True, timeout=30
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def helm() -> str:
    if not _helm_works(HELM):
        try:
            proc = subprocess.run(
                ["bash", str(ROOT / "tools" / "install_helm.sh"), str(HELM)],
                capture_output=True,
                text=True,
                timeout=600,
            )
            why = proc.stderr[-500:]
        except subprocess.TimeoutExpired:
            why = "tools/install_helm.sh timed out"
        if not _helm_works(HELM):
            pytest.skip(f"helm could not be installed: {why}")
    return str(HELM)


def run_helm(
    helm: str, command: str, *args: str, chart: Path = CHART
) -> subprocess.CompletedProcess:
    release = [RELEASE] if command == "template" else []
    return subprocess.run(
        [helm, command, *release, str(chart), "-n", NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


_RENDERED: dict[tuple, list[dict]] = {}


def render(helm: str, values: str | None = None, *sets: str, kube: str = "1.33.0") -> list[dict]:
    key = (values, sets, kube)
    if key not in _RENDERED:
        args = ["template", "--kube-version", kube]
        if values:
            args += ["-f", str(CHART / "ci" / values)]
        for s in sets:
            args += ["--set", s]
        proc = run_helm(helm, *args)
        assert proc.returncode == 0, proc.stderr
        _RENDERED[key] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return _RENDERED[key]


def render_error(helm: str, values: str | None, *sets: str) -> str:
    args = ["template"] + (["-f", str(CHART / "ci" / values)] if values else [])
    for s in sets:
        args += ["--set", s]
    proc = run_helm(helm, *args)
    assert proc.returncode != 0, f"helm template accepted {sets}"
    return proc.stderr


def chart_as_upgrade(tmp_path: Path, edit_helpers) -> Path:
    """A copy of the chart for rendering what `helm upgrade` would over a running release:
    `helm template` reaches no cluster, so `edit_helpers` (text -> text) replaces the
    lookups in _helpers.tpl with what the test says the cluster holds, and NOTES (which
    only install and upgrade render) is rendered into a ConfigMap `notes` of its own."""
    chart = tmp_path / "kvstore"
    shutil.rmtree(chart, ignore_errors=True)
    shutil.copytree(CHART, chart)
    helpers = chart / "templates" / "_helpers.tpl"
    helpers.write_text(edit_helpers(helpers.read_text()))
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ include (print $.Template.BasePath "/NOTES.txt") . | quote }}}\n'
    )
    return chart


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, suffix: str = "") -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"expected one {kind} *{suffix}, got {len(found)}"
    return found[0]


@pytest.mark.parametrize("values", VALUES)
def test_helm_lint(helm, values):
    proc = run_helm(helm, "lint", "--strict", "-f", str(CHART / "ci" / values))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


# ---- strict Kubernetes validation -----------------------------------------------------------


def check_service_monitor(sm: dict, docs: list[dict]) -> list[str]:
    """No schema ships for the Prometheus Operator CRD: check what it must reference."""
    errs = []
    spec = sm.get("spec", {})
    if sm["apiVersion"] != "monitoring.coreos.com/v1":
        errs.append(f"apiVersion {sm['apiVersion']}")
    unknown = set(spec) - {"selector", "namespaceSelector", "endpoints", "jobLabel"}
    if unknown:
        errs.append(f"unknown spec fields {sorted(unknown)}")
    if spec.get("namespaceSelector") != {"matchNames": [NAMESPACE]}:
        errs.append(f"namespaceSelector {spec.get('namespaceSelector')}")
    want = spec["selector"]["matchLabels"]
    services = [
        s for s in of_kind(docs, "Service") if want.items() <= s["metadata"]["labels"].items()
    ]
    ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    for ep in spec.get("endpoints") or [None]:
        if ep is None or ep.get("port") not in ports:
            errs.append(f"endpoint {ep} names no port of the selected Services {sorted(ports)}")
        elif set(ep) - {"port", "path", "interval", "scrapeTimeout", "authorization"}:
            errs.append(f"unknown endpoint fields in {ep}")
        elif "authorization" in ep and not _bearer_from_a_rendered_secret(ep, docs):
            errs.append(f"authorization of {ep} is not a Bearer token of a rendered Secret")
        elif not all(re.fullmatch(r"\d+(ms|s|m|h)", ep[k]) for k in ("interval", "scrapeTimeout")):
            errs.append(f"bad durations in {ep}")
    return errs


def _bearer_from_a_rendered_secret(ep: dict, docs: list[dict]) -> bool:
    """A ServiceMonitor endpoint's SafeAuthorization: Bearer, from a key of a Secret the
    chart renders (the Operator reads it in the ServiceMonitor's namespace)."""
    auth = ep["authorization"]
    cred = auth.get("credentials") or {}
    if set(auth) - {"type", "credentials"} or auth.get("type", "Bearer") != "Bearer":
        return False
    return any(
        d["metadata"]["name"] == cred.get("name") and cred.get("key") in d.get("data", {})
        for d in of_kind(docs, "Secret")
    )


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("values", VALUES)
def test_rendered_manifests_validate_strictly(helm, values, kube):
    kubernetes_validate = require("kubernetes_validate", "kubernetes-validate==1.37.0")
    docs = render(helm, values, kube=kube)
    errors = []
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "ServiceMonitor":
            errors += [f"{name}: {e}" for e in check_service_monitor(doc, docs)]
            continue
        try:
            kubernetes_validate.validate(doc, kube, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name}: {'/'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{name}: {exc.message}")
    assert not errors, "\n".join(errors)
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "Deployment", "Service", "ConfigMap"} <= kinds


def _pod_labels(docs):
    return [
        (w, w["spec"]["template"]["metadata"]["labels"]) for w in docs if w["kind"] in WORKLOADS
    ]


@pytest.mark.parametrize("values", VALUES)
def test_references_resolve(helm, values):
    docs = render(helm, values)
    pods = _pod_labels(docs)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for svc in of_kind(docs, "Service"):
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= lab.items() for _, lab in pods), svc["metadata"]["name"]
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(sel.items() <= lab.items() for _, lab in pods), pdb["metadata"]["name"]
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) in names
        assert "replicas" not in one(docs, "Deployment", "-router")["spec"]
    given = yaml.safe_load((CHART / "ci" / values).read_text())
    secrets = {n for k, n in names if k == "Secret"} | {
        given.get(section, {}).get(key)
        for section, key in (
            ("auth", "existingSecret"),
            ("auth", "existingClusterTokenSecret"),
            ("tls", "existingSecret"),
            ("encryption", "existingSecret"),
            ("engines", "kvTokenSecret"),
            ("gateway", "existingApiKeySecret"),
        )
    }
    for wl, _ in pods:
        spec = wl["spec"]["template"]["spec"]
        for vol in spec.get("volumes", []):
            if "configMap" in vol:
                assert ("ConfigMap", vol["configMap"]["name"]) in names
            if "secret" in vol:
                assert vol["secret"]["secretName"] in secrets
        for c in spec["containers"]:
            for e in c.get("env", []):
                if "secretKeyRef" in e.get("valueFrom", {}):
                    assert e["valueFrom"]["secretKeyRef"]["name"] in secrets, e["name"]
            ports = {p["containerPort"] for p in c.get("ports", [])} | {
                p["name"] for p in c.get("ports", [])
            }
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if "exec" in c[probe]:  # with mTLS: kvstore-health 127.0.0.1:<port> --tls-*
                    port = int(c[probe]["exec"]["command"][1].rsplit(":", 1)[1])
                    assert port in ports, f"{c['name']} {probe}"
                    continue
                handler = c[probe].get("grpc") or c[probe].get("httpGet")
                assert handler["port"] in ports, f"{c['name']} {probe}"


# ---- rendered configuration, loaded by the processes' own loader ------------------------------


def _secret_value(docs, ref: dict) -> str:
    for s in of_kind(docs, "Secret"):
        if s["metadata"]["name"] == ref["name"]:
            return base64.b64decode(s["data"][ref["key"]]).decode()
    return EXISTING_SECRETS[ref["key"]]  # the values named an existing Secret


def container_env(docs, container: dict) -> dict[str, str]:
    """The environment the kubelet gives the container, $(VAR) references expanded."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = FIELD_REFS[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = _secret_value(docs, e["valueFrom"]["secretKeyRef"])
    return env


def load_as_container(docs, container, cls, filename, prefix, tmp_path, monkeypatch):
    cm = one(docs, "ConfigMap", "-config")
    path = tmp_path / filename
    path.write_text(cm["data"][filename])
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert container["command"][-1] in mounts, "the config file the process loads is mounted"
    for key in [k for k in os.environ if k.startswith((prefix, "KVSTORE_PEER_"))]:
        monkeypatch.delenv(key)
    for key, value in container_env(docs, container).items():
        monkeypatch.setenv(key, value)
    return load_config(cls, str(path), prefix)


def agent_containers(docs) -> list[dict]:
    return one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("values", VALUES)
def test_rendered_configs_load(helm, values, tmp_path, monkeypatch):
    docs = render(helm, values)
    cm = one(docs, "ConfigMap", "-config")
    for name, cls in (("agent.yaml", AgentConfig), ("router.yaml", RouterConfig)):
        (tmp_path / name).write_text(cm["data"][name])
        load_config(cls, str(tmp_path / name))  # the file alone is a complete config
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    rcfg = load_as_container(
        docs, router, RouterConfig, "router.yaml", "KVSTORE_ROUTER_", tmp_path, monkeypatch
    )
    assert rcfg.router_id == FIELD_REFS["metadata.name"]
    assert rcfg.listen.endswith(f":{router['ports'][0]['containerPort']}")
    cfgs = [
        load_as_container(
            docs, c, AgentConfig, "agent.yaml", "KVSTORE_AGENT_", tmp_path, monkeypatch
        )
        for c in agent_containers(docs)
    ]
    assert len({c.node_id for c in cfgs}) == len({c.data_dir for c in cfgs}) == len(cfgs)
    assert len({c.listen for c in cfgs}) == len(cfgs)
    for cfg, c in zip(cfgs, agent_containers(docs)):
        port = int(cfg.listen.rsplit(":", 1)[1])
        assert c["ports"][0]["containerPort"] == port
        assert cfg.advertise == f"{FIELD_REFS['status.podIP']}:{port}"
        assert cfg.node_id.startswith(FIELD_REFS["spec.nodeName"])
        assert any(
            cfg.data_dir.startswith(m["mountPath"] + "/")
            for m in c["volumeMounts"]
            if m["name"] == "data"
        ), "RocksDB lives on the NVMe volume"
        assert cfg.etcd_endpoints == rcfg.etcd_endpoints != ""
        assert cfg.tenants or cfg.allow_unauthenticated


def test_gateway_config_loads_and_engines_reach_their_agents(helm, tmp_path, monkeypatch):
    from router.gateway.config import ApiKeys, GatewayConfig

    docs = render(helm, "gateway-values.yaml")
    gw = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    path = tmp_path / "gateway.yaml"
    path.write_text(one(docs, "ConfigMap", "-gateway")["data"]["gateway.yaml"])
    cfg = load_config(GatewayConfig, str(path))
    # https engines only when serving HTTPS; large prompts on 2 threads, 1 per tenant.
    assert cfg.allow_plaintext_engines is False
    assert (cfg.tokenize_threads, cfg.max_tokenizing_per_tenant) == (2, 1)
    assert cfg.caller_priority is False  # shared engines: callers' priorities refused
    on = tmp_path / "gateway-priority.yaml"
    on.write_text(
        one(
            render(helm, "gateway-values.yaml", "gateway.callerPriority=true"),
            "ConfigMap",
            "-gateway",
        )["data"]["gateway.yaml"]
    )
    assert load_config(GatewayConfig, str(on)).caller_priority is True
    c = gw["containers"][0]
    assert c["command"][-1] in {m["mountPath"] for m in c["volumeMounts"]}
    assert cfg.listen.endswith(f":{c['ports'][0]['containerPort']}")
    secret = one(docs, "Secret", "-gateway")["data"]
    keys = ApiKeys(json.loads(base64.b64decode(secret["keys.json"])))
    assert keys.tenant("sk-acme-example") == "acme" and keys.tenant("nope") is None
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    for f in [cfg.api_keys_file, cfg.salt_key_file, *cfg.kv_secret_files.values()]:
        assert str(Path(f).parent) in mounts, f
    # Each engine's connector dials agent i on its node's host port, as that node's agent.
    agents = agent_containers(docs)
    engines = one(docs, "DaemonSet", "-engine")["spec"]["template"]["spec"]["containers"]
    assert len(engines) == len(agents)
    for e, a in zip(engines, agents):
        port = a["ports"][0]["containerPort"]
        assert a["ports"][0]["hostPort"] == port
        kvt = json.loads(next(x for x in e["command"] if x.startswith("--kv-transfer-config="))
                         .split("=", 1)[1])  # fmt: skip
        extra = kvt["kv_connector_extra_config"]
        assert extra["agent"] == f"$(HOST_IP):{port}"
        assert extra["tenant"] in cfg.kv_secret_files
        node = next(x for x in e["command"] if x.startswith("--node-id=")).split("=", 1)[1]
        assert node == container_env(docs, a)["KVSTORE_AGENT_NODE_ID"].replace(
            FIELD_REFS["spec.nodeName"], "$(NODE_NAME)"
        )
        assert extra["namespace_file"] in " ".join(e["command"])


def test_production_agents_one_gpu_each(helm, tmp_path, monkeypatch):
    docs = render(helm, "production-values.yaml")
    containers = agent_containers(docs)
    assert len(containers) == 8
    cfgs = [
        load_as_container(
            docs, c, AgentConfig, "agent.yaml", "KVSTORE_AGENT_", tmp_path, monkeypatch
        )
        for c in containers
    ]
    # The device plugin shows each container only its own GPU, as cuda:0.
    assert {c.device for c in cfgs} == {"cuda:0"}
    for c in containers:
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert [int(c.listen.rsplit(":", 1)[1]) for c in cfgs] == list(range(50051, 50059))
    assert set(cfgs[0].tenants) == {"acme", "globex", "_cluster", "_agent"}
    assert cfgs[0].tenants["acme"].hbm_limit_bytes == 100 << 30
    assert cfgs[0].policies["acme/chat"].pin_budget_bytes == 4096 << 20
    assert cfgs[0].tenant_pin_fraction == 0.5  # the chart's default
    assert not cfgs[0].allow_unauthenticated
    # The token hashes live in the Secret, not in the ConfigMap.
    assert "token_sha256" not in one(docs, "ConfigMap", "-config")["data"]["agent.yaml"]


def test_cluster_token_matches_its_hash(helm, tmp_path, monkeypatch):
    docs = render(helm, "production-values.yaml")
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    token = container_env(docs, router)["KVSTORE_CLUSTER_TOKEN"]
    assert len(token) >= 32  # generated: the values give none
    agent = load_as_container(
        docs,
        agent_containers(docs)[0],
        AgentConfig,
        "agent.yaml",
        "KVSTORE_AGENT_",
        tmp_path,
        monkeypatch,
    )
    # The agent's interceptor resolves a bearer token by its SHA-256.
    assert agent.tenants["_cluster"].token_sha256 == hashlib.sha256(token.encode()).hexdigest()


def test_agents_hold_the_agent_token_routers_do_not(helm, tmp_path, monkeypatch):
    """Peers prove they are agents (docs/security.md): the agent credential is mounted into
    agents only, its hash is the "_agent" entry, and it is not the cluster token."""
    docs = render(helm, "production-values.yaml")
    container = agent_containers(docs)[0]
    agent = load_as_container(
        docs, container, AgentConfig, "agent.yaml", "KVSTORE_AGENT_", tmp_path, monkeypatch
    )
    mount = next(m for m in container["volumeMounts"] if m["name"] == "agent-token")
    assert agent.agent_token_file == mount["mountPath"] + "/token"
    volumes = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]["volumes"]
    secret_name = next(v for v in volumes if v["name"] == "agent-token")["secret"]["secretName"]
    secret = one(docs, "Secret", "-agent-token")
    assert secret["metadata"]["name"] == secret_name
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 32
    assert agent.tenants["_agent"].token_sha256 == hashlib.sha256(token.encode()).hexdigest()
    assert agent.tenants["_agent"].token_sha256 != agent.tenants["_cluster"].token_sha256
    router = one(docs, "Deployment", "-router")["spec"]["template"]
    assert "agent-token" not in json.dumps(router)


def test_routers_authenticate_the_agents_tenants(helm, tmp_path, monkeypatch):
    """Tenants authenticate to routers as to agents: one Secret, no anonymous routers."""
    docs = render(helm, "production-values.yaml")
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    rcfg = load_as_container(
        docs, router, RouterConfig, "router.yaml", "KVSTORE_ROUTER_", tmp_path, monkeypatch
    )
    agent = load_as_container(
        docs,
        agent_containers(docs)[0],
        AgentConfig,
        "agent.yaml",
        "KVSTORE_AGENT_",
        tmp_path,
        monkeypatch,
    )
    assert rcfg.tenants == agent.tenants and "_cluster" in rcfg.tenants
    assert not rcfg.allow_unauthenticated and rcfg.max_inflight_per_tenant > 0
    assert "token_sha256" not in one(docs, "ConfigMap", "-config")["data"]["router.yaml"]


def test_agents_without_device_plugin_take_cuda_index(helm, tmp_path, monkeypatch):
    docs = render(helm, "external-etcd-values.yaml")
    containers = agent_containers(docs)
    cfgs = [
        load_as_container(
            docs, c, AgentConfig, "agent.yaml", "KVSTORE_AGENT_", tmp_path, monkeypatch
        )
        for c in containers
    ]
    assert [c.device for c in cfgs] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert all("nvidia.com/gpu" not in c["resources"]["limits"] for c in containers)
    assert (
        cfgs[0].etcd_endpoints
        == "etcd-a.infra.svc:2379,etcd-b.infra.svc:2379,etcd-c.infra.svc:2379"
    )
    assert not of_kind(docs, "StatefulSet")
    assert {c.metrics_port for c in cfgs} == {0}


def test_peer_settings_reach_every_agent_alike(helm, tmp_path, monkeypatch):
    """Peer transfer settings are chart values, rendered into agent.yaml's `peer:` section:
    every agent of the release loads the same ones (agents of one host must agree)."""
    default = [
        load_as_container(
            docs, c, AgentConfig, "agent.yaml", "KVSTORE_AGENT_", tmp_path, monkeypatch
        )
        for docs in [render(helm, "production-values.yaml")]
        for c in agent_containers(docs)
    ]
    assert {c.peer for c in default} == {PeerConfig()} and all(c.ucx_enabled for c in default)
    docs = render(
        helm,
        "production-values.yaml",
        "agent.peer.batchMiB=32",
        "agent.peer.sharedMemory=false",
        "agent.peer.inPlace=false",
        "agent.peer.sameHostReads=false",
        "agent.peer.ioTimeoutSeconds=3",
        "agent.peer.ucxEnabled=false",
    )
    cfgs = [
        load_as_container(
            docs, c, AgentConfig, "agent.yaml", "KVSTORE_AGENT_", tmp_path, monkeypatch
        )
        for c in agent_containers(docs)
    ]
    assert {c.peer for c in cfgs} == {
        PeerConfig(
            batch_bytes=32 << 20,
            shared_memory=False,
            in_place=False,
            same_host_reads=False,
            io_timeout_s=3.0,
        )
    }
    assert not any(c.ucx_enabled for c in cfgs)


def _mebibytes(quantity: str) -> int:
    m = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert m, quantity
    return int(m.group(1)) << (10 if m.group(2) == "Gi" else 0)


def test_cpu_device_memory_limit_covers_pool(helm):
    docs = render(helm, "minimal-values.yaml", "agent.poolMiB=4096")
    c = agent_containers(docs)[0]
    cm = one(docs, "ConfigMap", "-config")
    pool = parse_size(yaml.safe_load(cm["data"]["agent.yaml"])["pool_bytes"])
    assert pool == 4096 << 20
    assert _mebibytes(c["resources"]["limits"]["memory"]) << 20 >= pool
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
    gpu = agent_containers(render(helm, "production-values.yaml"))[0]
    assert _mebibytes(gpu["resources"]["limits"]["memory"]) == 8192  # pool is in HBM


def test_local_volume_sized_for_all_gpus(helm):
    docs = render(helm, "production-values.yaml")
    spec = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "data"]
    claim = vol["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "local-nvme"
    assert int(claim["resources"]["requests"]["storage"].removesuffix("Gi")) >= 8 * 500
    err = render_error(
        helm, "production-values.yaml", "agent.storage.localPersistentVolume.sizeGiB=100"
    )
    assert "smaller than nvmeGiB x gpusPerNode (4000)" in err
    hostpath = one(render(helm, "minimal-values.yaml"), "DaemonSet", "-agent")
    (vol,) = [v for v in hostpath["spec"]["template"]["spec"]["volumes"] if v["name"] == "data"]
    assert vol["hostPath"]["path"] == f"/mnt/nvme/kvstore/{NAMESPACE}/{RELEASE}-kvstore"


def test_bundled_etcd_members_match_endpoints(helm):
    docs = render(helm, "production-values.yaml")
    sts = one(docs, "StatefulSet", "-etcd")
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    (cluster,) = [a.split("=", 1)[1] for a in args if a.startswith("--initial-cluster=")]
    members = [
        m.split("=")[1].removeprefix("http://").replace(":2380", ":2379")
        for m in cluster.split(",")
    ]
    agent = yaml.safe_load(one(docs, "ConfigMap", "-config")["data"]["agent.yaml"])
    # One name for every member: the headless Service, which resolves to all of them (a
    # gRPC channel balances over the addresses of one name, not over several names).
    (endpoint,) = agent["etcd_endpoints"].split(",")
    service, port = endpoint.rsplit(":", 1)
    assert port == "2379" and all(m == f"{m.split('.')[0]}.{service}:2379" for m in members)
    assert channel_target(parse_endpoints(endpoint)) == f"dns:///{endpoint}"
    # The etcd client checks etcd's certificate against that name.
    with_cert = render(
        helm,
        "production-values.yaml",
        "tls.enabled=true",
        "tls.certManager.enabled=true",
        "tls.certManager.issuerRef.name=ca",
    )
    assert service in one(with_cert, "Certificate")["spec"]["dnsNames"]
    headless = one(docs, "Service", "-etcd-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    assert one(docs, "PodDisruptionBudget", "-etcd")["spec"]["maxUnavailable"] == 1


def test_service_monitor_only_when_enabled(helm):
    assert not of_kind(render(helm, "minimal-values.yaml"), "ServiceMonitor")
    docs = render(helm, "production-values.yaml")
    agent_sm = one(docs, "ServiceMonitor", "-agent")
    assert [e["port"] for e in agent_sm["spec"]["endpoints"]] == [
        f"metrics-gpu{i}" for i in range(8)
    ]
    assert agent_sm["metadata"]["labels"]["release"] == "prometheus"
    one(docs, "ServiceMonitor", "-router")


def _metrics_containers(docs) -> list[tuple[dict, dict]]:
    """(container, its pod spec) of every process with a Prometheus page."""
    pods = [one(docs, "DaemonSet", "-agent"), one(docs, "Deployment", "-router")]
    pods += [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-gateway")]
    return [
        (c, p["spec"]["template"]["spec"])
        for p in pods
        for c in p["spec"]["template"]["spec"]["containers"]
    ]


def test_metrics_pages_need_a_bearer_token_by_default(helm):
    """The pages hold every tenant's counts: agents, routers and gateways read a token
    file from a Secret the chart generates, and the ServiceMonitors present it."""
    docs = render(helm, "gateway-values.yaml", "metrics.serviceMonitor.enabled=true")
    secret = one(docs, "Secret", "-metrics-token")
    assert len(base64.b64decode(secret["data"]["token"])) == 48
    cm = one(docs, "ConfigMap", "-config")["data"]
    for name in ("agent.yaml", "router.yaml"):
        cfg = yaml.safe_load(cm[name])
        assert cfg["metrics_port"] > 0 and "metrics_open" not in cfg
        assert cfg["metrics_token_file"] == "/etc/kvstore/metrics-token/token"
    containers = _metrics_containers(docs)
    gpus = len(agent_containers(docs))
    assert len(containers) == gpus + 2  # an agent per GPU, the router, the gateway
    for c, pod in containers:
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "metrics-token"]
        assert mount["mountPath"] == "/etc/kvstore/metrics-token" and mount["readOnly"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "metrics-token"]
        assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    endpoints = [e for sm in of_kind(docs, "ServiceMonitor") for e in sm["spec"]["endpoints"]]
    assert len(endpoints) == gpus + 2
    assert all(
        e["authorization"] == {
            "type": "Bearer", "credentials": {"name": secret["metadata"]["name"], "key": "token"}
        }
        for e in endpoints
    )  # fmt: skip


def test_metrics_open_serves_the_pages_without_a_token(helm):
    docs = render(helm, "production-values.yaml", "metrics.open=true")
    assert not [
        d for d in of_kind(docs, "Secret") if d["metadata"]["name"].endswith("-metrics-token")
    ]
    cm = one(docs, "ConfigMap", "-config")["data"]
    assert all(yaml.safe_load(cm[n])["metrics_open"] is True for n in ("agent.yaml", "router.yaml"))
    for c, pod in _metrics_containers(docs):
        assert "metrics-token" not in {m["name"] for m in c["volumeMounts"]}
        assert "metrics-token" not in {v["name"] for v in pod["volumes"]}
    assert not [
        e
        for sm in of_kind(docs, "ServiceMonitor")
        for e in sm["spec"]["endpoints"]
        if "authorization" in e
    ]


def test_an_existing_metrics_token_secret_is_used_not_rendered(helm):
    docs = render(helm, "production-values.yaml", "metrics.existingTokenSecret=scrape")
    assert not [
        d for d in of_kind(docs, "Secret") if d["metadata"]["name"].endswith("-metrics-token")
    ]
    for _, pod in _metrics_containers(docs):
        (vol,) = [v for v in pod["volumes"] if v["name"] == "metrics-token"]
        assert vol["secret"]["secretName"] == "scrape"
    sm = one(docs, "ServiceMonitor", "-router")
    assert sm["spec"]["endpoints"][0]["authorization"]["credentials"]["name"] == "scrape"


def test_network_policies(helm):
    docs = render(helm, "production-values.yaml")
    agent = one(docs, "NetworkPolicy", "-agent")["spec"]
    ports = {p["port"] for rule in agent["ingress"] for p in rule.get("ports", [])}
    assert set(range(50051, 50059)) | set(range(9500, 9508)) <= ports
    # Agent to agent: every port (UCX peer transfers choose theirs).
    assert any("ports" not in r for r in agent["ingress"])
    etcd = one(docs, "NetworkPolicy", "-etcd")["spec"]
    assert all(
        r.get("from")
        for r in etcd["ingress"]
        if {"port": 2379, "protocol": "TCP"} in r.get("ports", [])
    ), "etcd clients are restricted to this release"
    assert not of_kind(render(helm, "minimal-values.yaml"), "NetworkPolicy")


BAD_VALUES = [
    ("router.replicas=-1", "router.replicas"),
    ("agent.bogus=1", "bogus"),
    ("etcd.bundled.replicas=2", "etcd.bundled.replicas"),
    ("agent.device=tpu", "agent.device"),
    ("agent.gpusPerNode=0", "agent.gpusPerNode"),
    ("auth.tenants.acme.tokenSha256=not-a-hash", "auth.tenants.acme.tokenSha256"),
    ("agent.peer.stagingSets=2", "agent.peer.stagingSets"),
    ("agent.peer.ioTimeoutSeconds=0", "agent.peer.ioTimeoutSeconds"),
    ("agent.peer.inPlace=sometimes", "agent.peer.inPlace"),
    ("agent.peer.sameHostReads=1", "agent.peer.sameHostReads"),
    ("agent.peer.bachMiB=64", "bachMiB"),
    ("encryption.keys.acme\\.1\\.key=c2hvcnQ=", "encryption.keys"),  # not 32 bytes
    ("encryption.keys.acme\\.one\\.key=" + "A" * 43 + "=", "encryption.keys"),
    ("encryption.active.acme=0", "encryption.active.acme"),
    # a bare IPv6 address reads as host and port wrongly (kvstore.units.host_problem)
    ("etcd.external.endpoints[0]=2001:db8::5", "etcd.external.endpoints"),
    ("etcd.external.endpoints[0]=grpc://x:1", "etcd.external.endpoints"),
]


@pytest.mark.parametrize("setting,where", BAD_VALUES)
def test_schema_rejects_bad_values(helm, setting, where):
    err = render_error(helm, "minimal-values.yaml", setting)
    # Helm 3.18 names the value as a.b.c; later releases as a JSON pointer /a/b/c.
    assert "schema" in err and (where in err or "/" + where.replace(".", "/") in err), err


@pytest.mark.parametrize(
    "sets,message",
    [
        ((), "no tenants and allowUnauthenticated is false"),
        (("etcd.mode=external",), "etcd.external.endpoints is empty"),
        (("tls.enabled=true",), "tls.enabled needs tls.existingSecret"),
        (("auth.existingSecret=mine",), "go together"),
        (("encryption.enabled=true",), "encryption.enabled needs encryption.existingSecret"),
        # ports past 65535 for the last agents of a node (the schema caps the base only)
        (("agent.gpusPerNode=2", "agent.grpcBasePort=65535"),
         "agent.grpcBasePort + 1 is 65536, beyond the last port (65535)"),
        (("agent.gpusPerNode=4", "agent.metricsBasePort=65534"),
         "agent.metricsBasePort + 2 is 65536, beyond the last port"),
        (("agent.cpu.request=4", "agent.cpu.limit=1"),
         "agent.cpu.request (4) is more than agent.cpu.limit (1)"),
        (("agent.cpu.request=1500m", "agent.cpu.limit=1.2"),
         "agent.cpu.request (1500m) is more than agent.cpu.limit (1.2)"),
        (("metrics.serviceMonitor.enabled=true", "agent.metricsBasePort=0"),
         "the agents serve no metrics, so they would never be scraped"),
    ],
)  # fmt: skip
def test_template_refuses_unusable_settings(helm, sets, message):
    values = None if not sets else "minimal-values.yaml"
    assert message in render_error(helm, values, *sets)


def test_at_rest_keys_reach_every_agent(helm, tmp_path, monkeypatch):
    """Encryption at rest: the key Secret is mounted where agent.yaml's keys_dir points, in
    every agent container, readable by the agent's group only; keys given inline render
    into a Secret whose files the agent's own loader accepts."""
    from kvstore.tiers.sealing import generate_key, load_keyrings

    docs = render(helm, "production-values.yaml")
    (vol,) = [
        v
        for v in one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "at-rest-keys"
    ]
    assert vol["secret"] == {"secretName": "kvstore-at-rest-keys", "defaultMode": 0o440}
    for c in agent_containers(docs):
        cfg = load_as_container(
            docs, c, AgentConfig, "agent.yaml", "KVSTORE_AGENT_", tmp_path, monkeypatch
        )
        assert cfg.encryption.enabled and cfg.encryption.active == {"acme": 2}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts[cfg.encryption.keys_dir]["name"] == "at-rest-keys"
        assert mounts[cfg.encryption.keys_dir]["readOnly"] is True

    key = base64.b64encode(generate_key()).decode()
    docs = render(
        helm,
        "minimal-values.yaml",
        "encryption.enabled=true",
        f"encryption.keys.acme\\.1\\.key={key}",
    )
    secret = one(docs, "Secret", "-at-rest")
    keys = tmp_path / "keys"
    keys.mkdir()
    for name, data in secret["data"].items():
        (keys / name).write_bytes(base64.b64decode(data))
        (keys / name).chmod(0o440)
    assert dict(load_keyrings(str(keys))["acme"].keys) == {1: base64.b64decode(key)}
    c = agent_containers(docs)[0]
    cfg = load_as_container(
        docs, c, AgentConfig, "agent.yaml", "KVSTORE_AGENT_", tmp_path, monkeypatch
    )
    assert cfg.encryption.keys_dir in {m["mountPath"] for m in c["volumeMounts"]}
    assert not load_config(AgentConfig, None).encryption.enabled  # off by default


def test_notes_tell_how_to_reach_kvctl(helm, tmp_path):
    # NOTES.txt is only rendered by install, which needs a cluster: render it through a
    # copy of the chart with one extra template that includes it.
    chart = tmp_path / "kvstore"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ include (print $.Template.BasePath "/NOTES.txt") . | quote }}}\n'
    )
    proc = run_helm(
        helm,
        "template",
        "-f",
        str(CHART / "ci" / "external-etcd-values.yaml"),
        "--show-only",
        "templates/zz-notes.yaml",
        chart=chart,
    )
    assert proc.returncode == 0, proc.stderr
    notes = yaml.safe_load(proc.stdout)["data"]["notes"]
    assert f"kubectl -n {NAMESPACE} exec -it deploy/{RELEASE}-kvstore-router" in notes
    assert "kvctl status --etcd etcd-a.infra.svc:2379,etcd-b" in notes
    assert "app.kubernetes.io/component=kvctl" in notes


# ---- container image --------------------------------------------------------------------------


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_dockerfile_consistent_with_project_and_chart(helm):
    dockerfile = require("dockerfile", "dockerfile==3.4.0")  # BuildKit's own parser
    cmds = dockerfile.parse_file(str(ROOT / "Dockerfile"))
    froms = [c.value for c in cmds if c.cmd == "FROM"]
    assert [f[-1] for f in froms] == ["build", "runtime"]
    arg = next(c.value[0] for c in cmds if c.cmd == "ARG")
    assert arg == "PYTHON_IMAGE=python:3.11-slim-bookworm"
    scripts = _pyproject()["project"]["scripts"]
    (cmd,) = [c.value for c in cmds if c.cmd == "CMD"]
    assert cmd[0] in scripts
    (user,) = [c.value[0] for c in cmds if c.cmd == "USER"]
    uid = int(user.split(":")[0])
    assert uid != 0
    docs = render(helm, "minimal-values.yaml")
    for wl in docs:
        if wl["kind"] in ("DaemonSet", "Deployment"):
            assert wl["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid
            for c in wl["spec"]["template"]["spec"]["containers"]:
                assert c["command"][0] in scripts
    (hc,) = [c for c in cmds if c.cmd == "HEALTHCHECK"]
    copies = [c.value for c in cmds if c.cmd == "COPY"]
    assert any(v[-1].endswith("/" + hc.value[1]) for v in copies), "health script is installed"


def test_dockerfile_dependency_step_reads_pyproject(tmp_path):
    dockerfile = require("dockerfile", "dockerfile==3.4.0")
    cmds = dockerfile.parse_file(str(ROOT / "Dockerfile"))
    assert not any(c.heredocs for c in cmds), "heredocs are BuildKit-only (buildah 1.28)"
    (run,) = [c.value[0] for c in cmds if c.cmd == "RUN" and "tomllib" in c.value[0]]
    argv = shlex.split(run.split(">")[0])
    assert argv[:2] == ["python", "-c"]
    out = subprocess.run(
        [sys.executable, "-c", argv[2]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    project = _pyproject()["project"]
    assert out == project["dependencies"] + project["optional-dependencies"]["server"]
    assert len([r for r in out if r.startswith("torch")]) == 1  # the CPU-index install step


def test_dockerignore_keeps_what_the_build_needs():
    lines = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "*", "allowlist: everything else stays out of the build context"
    kept = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    packages = {
        p.rstrip("*") for p in _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages | {"pyproject.toml", "setup.py", "deploy/docker"} <= kept
    assert all((ROOT / k).exists() for k in kept)


def test_health_check_script_against_real_agent(spawn_agent):
    agent = spawn_agent()
    script = [sys.executable, str(ROOT / "deploy" / "docker" / "kvstore_health.py")]

    def probe(*args):
        return subprocess.run(script + list(args), capture_output=True, text=True, timeout=60)

    ok = probe(agent.address)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    assert probe(agent.address, "--service", "kvstore.v1.NodeAgent").returncode == 0
    unknown = probe(agent.address, "--service", "no.such.Service")
    assert unknown.returncode == 2 and "NOT_FOUND" in unknown.stderr
    agent.stop()
    down = probe(agent.address, "--timeout", "1")
    assert down.returncode == 2 and "UNAVAILABLE" in down.stderr


# ---- monitoring ---------------------------------------------------------------------------------


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bkvstore_[a-z_]+", expr))


def test_alert_rules_are_complete():
    rules = [
        r
        for g in yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())["groups"]
        for r in g["rules"]
    ]
    names = {r["alert"] for r in rules}
    assert {
        "KvstoreTokenHitRateDrop",
        "KvstoreDevicePoolPressure",
        "KvstoreAgentDown",
        "KvstoreFlushSlow",
    } <= names
    for r in rules:
        assert r["expr"].strip() and re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        assert r["annotations"]["summary"], r["alert"]
        assert r["expr"].count("(") == r["expr"].count(")"), r["alert"]
        assert metric_names(r["expr"]) <= METRICS, r["alert"]
    hit = next(r for r in rules if r["alert"] == "KvstoreTokenHitRateDrop")["expr"]
    assert {"kvstore_lookup_hit_tokens_total", "kvstore_lookup_tokens_total"} <= metric_names(hit)


def test_dashboard_uses_only_exported_metrics():
    dash = json.loads((ROOT / "deploy/grafana/kvstore-dashboard.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    used: set[str] = set()
    for p in panels:
        assert p["targets"] and p["gridPos"]["w"] > 0, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert metric_names(t["expr"]), f"{p['title']}: {t['expr']}"
            assert metric_names(t["expr"]) <= METRICS, f"{p['title']}: {t['expr']}"
            used |= metric_names(t["expr"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            assert metric_names(var["definition"]) <= METRICS
    assert used == METRICS, f"not shown: {METRICS - used}"


def test_two_tenants_with_one_token_hash_are_refused(helm):
    """The agents refuse such a tenants.json at start (one token would authenticate as
    whichever tenant came last); the chart says so before anything is deployed."""
    digest = "ab" * 32
    err = render_error(
        helm,
        "minimal-values.yaml",
        f"auth.tenants.acme.tokenSha256={digest}",
        f"auth.tenants.globex.tokenSha256={digest}",
    )
    assert "auth.tenants.acme and auth.tenants.globex have the same tokenSha256" in err, err


def test_bracketed_ipv6_etcd_endpoints_render(helm):
    docs = render(
        helm,
        "minimal-values.yaml",
        "etcd.mode=external",
        "etcd.external.endpoints[0]=[2001:db8::5]:2379",
    )
    assert "[2001:db8::5]:2379" in json.dumps(docs)


def test_agents_cap_message_size_and_calls_per_tenant(helm, tmp_path):
    """agent.maxMessageMiB, maxCallsPerTenant, streamIdleTimeoutSeconds and
    maxConcurrentRpcs reach agent.yaml (docs/security.md, "Memory before
    authentication"): 8 MiB messages, 128 calls per tenant, no port-wide cap."""
    cm = one(render(helm, "minimal-values.yaml"), "ConfigMap", "-config")
    (tmp_path / "agent.yaml").write_text(cm["data"]["agent.yaml"])
    cfg = load_config(AgentConfig, str(tmp_path / "agent.yaml"))
    assert (cfg.max_message_bytes, cfg.max_concurrent_rpcs) == (8 << 20, 0)
    assert (cfg.max_calls_per_tenant, cfg.stream_idle_timeout_s) == (128, 30.0)
    assert (cfg.max_health_watches, cfg.max_health_watches_per_peer) == (64, 8)
    assert cfg.max_health_checks_per_peer == 16
    docs = render(helm, "minimal-values.yaml", "agent.maxHealthChecksPerPeer=6")
    (tmp_path / "agent.yaml").write_text(one(docs, "ConfigMap", "-config")["data"]["agent.yaml"])
    assert load_config(AgentConfig, str(tmp_path / "agent.yaml")).max_health_checks_per_peer == 6


def test_routers_cap_calls_per_tenant_and_health_watches(helm, tmp_path):
    """router.maxCallsPerTenant, streamIdleTimeoutSeconds, maxHealthWatches,
    maxHealthWatchesPerPeer and maxHealthChecksPerPeer reach router.yaml (docs/security.md,
    "Calls at once, per tenant" and "Health checks"), defaults and values set alike."""
    for sets, want in (
        ((), (128, 30.0, 64, 8, 16)),
        (
            (
                "router.maxCallsPerTenant=7",
                "router.streamIdleTimeoutSeconds=4",
                "router.maxHealthWatches=3",
                "router.maxHealthWatchesPerPeer=1",
                "router.maxHealthChecksPerPeer=5",
            ),
            (7, 4.0, 3, 1, 5),
        ),
    ):
        cm = one(render(helm, "minimal-values.yaml", *sets), "ConfigMap", "-config")
        (tmp_path / "router.yaml").write_text(cm["data"]["router.yaml"])
        cfg = load_config(RouterConfig, str(tmp_path / "router.yaml"))
        got = (
            cfg.max_calls_per_tenant,
            cfg.stream_idle_timeout_s,
            cfg.max_health_watches,
            cfg.max_health_watches_per_peer,
            cfg.max_health_checks_per_peer,
        )
        assert got == want, sets
    # below 4 the kubelet's overlapping probes could be refused: the schema says so
    for key in ("router", "agent"):
        err = render_error(helm, "minimal-values.yaml", f"{key}.maxHealthChecksPerPeer=2")
        assert f"{key}.maxHealthChecksPerPeer" in err, err


@pytest.mark.parametrize(("slot_kib", "mib"), [(8128, 8), (8192, 9), (16384, 17)])
def test_a_large_slot_gets_the_message_size_it_needs(helm, tmp_path, slot_kib, mib):
    """Before the fix maxMessageMiB defaulted to 8 whatever the slot: with slotKiB from
    8129 the chart rendered and every agent refused to start. Now "auto" renders what a
    slot needs (one block plus 64 KiB, whole MiB) where that is over 8 MiB, and the
    agent's own config check takes it."""
    docs = render(helm, "minimal-values.yaml", f"agent.slotKiB={slot_kib}")
    (tmp_path / "big.yaml").write_text(one(docs, "ConfigMap", "-config")["data"]["agent.yaml"])
    cfg = load_config(AgentConfig, str(tmp_path / "big.yaml"))
    assert cfg.max_message_bytes == mib << 20


def test_a_message_size_too_small_for_the_slot_fails_the_render(helm):
    """An explicit maxMessageMiB that cannot hold a slot stops `helm template` naming the
    least it takes, instead of agents that would not start."""
    err = render_error(helm, "minimal-values.yaml", "agent.slotKiB=16384", "agent.maxMessageMiB=8")
    assert "agent.maxMessageMiB 8 cannot hold" in err and "at least 17" in err, err
