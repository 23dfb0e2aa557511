"""The gateway's own Kubernetes objects, rendered from the chart: its HPA scales the gateway
Deployment, its PDB covers exactly the gateway pods, its Service reaches the container's
HTTP port, and every Deployment left without `replicas` is scaled by an HPA. (The HPA and
PDB templates were once deleted and no test noticed: test_references_resolve only checks
the objects that happen to be rendered.)"""

from __future__ import annotations

import pytest
import yaml

from kvstore.config import load_config

from tests.deploy.test_helm import (  # noqa: F401 - helm is a fixture
    CHART,
    VALUES,
    WORKLOADS,
    helm,
    of_kind,
    one,
    render,
    render_error,
)

GATEWAY = "gateway-values.yaml"


def _selected(docs: list[dict], selector: dict) -> set[tuple[str, str]]:
    """The workloads whose pods carry every label of the selector."""
    return {
        (w["kind"], w["metadata"]["name"])
        for w in docs
        if w["kind"] in WORKLOADS
        and selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    }


def test_gateway_hpa_scales_the_gateway_deployment(helm):  # noqa: F811
    docs = render(helm, GATEWAY)
    deploy = one(docs, "Deployment", "-gateway")
    hpa = one(docs, "HorizontalPodAutoscaler", "-gateway")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deploy["metadata"]["name"],
    }
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    assert "replicas" not in deploy["spec"], "the HPA owns the replica count"


def test_gateway_pdb_selects_exactly_the_gateway_pods(helm):  # noqa: F811
    docs = render(helm, GATEWAY)
    deploy = one(docs, "Deployment", "-gateway")
    pdb = one(docs, "PodDisruptionBudget", "-gateway")["spec"]
    assert _selected(docs, pdb["selector"]["matchLabels"]) == {
        ("Deployment", deploy["metadata"]["name"])
    }
    # minAvailable below the replicas the HPA keeps, or no pod could ever be evicted.
    hpa = one(docs, "HorizontalPodAutoscaler", "-gateway")["spec"]
    assert 0 < pdb["minAvailable"] < hpa["minReplicas"]


def test_gateway_service_reaches_the_gateway_http_port(helm):  # noqa: F811
    docs = render(helm, GATEWAY)
    deploy = one(docs, "Deployment", "-gateway")
    svc = one(docs, "Service", "-gateway")["spec"]
    assert _selected(docs, svc["selector"]) == {("Deployment", deploy["metadata"]["name"])}
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
    (port,) = svc["ports"]
    target = port["targetPort"]
    target = by_name[target] if isinstance(target, str) else target
    # The port the gateway's own config listens on (gateway.yaml's listen).
    gw_yaml = one(docs, "ConfigMap", "-gateway")["data"]["gateway.yaml"]
    listen = next(ln for ln in gw_yaml.splitlines() if ln.startswith("listen:"))
    assert target == by_name["http"] == int(listen.split(":")[-1].strip().strip('"'))


@pytest.mark.parametrize("values", VALUES)
def test_every_deployment_without_replicas_has_an_hpa(helm, values):  # noqa: F811
    docs = render(helm, values)
    targets = {
        (h["spec"]["scaleTargetRef"]["kind"], h["spec"]["scaleTargetRef"]["name"])
        for h in of_kind(docs, "HorizontalPodAutoscaler")
    }
    unscaled = [
        d["metadata"]["name"]
        for d in of_kind(docs, "Deployment")
        if "replicas" not in d["spec"] and ("Deployment", d["metadata"]["name"]) not in targets
    ]
    assert not unscaled, f"Deployments with neither replicas nor an HPA: {unscaled}"
    # And one with replicas set is not also fought over by an HPA.
    fixed = {("Deployment", d["metadata"]["name"]) for d in of_kind(docs, "Deployment")
             if "replicas" in d["spec"]}  # fmt: skip
    assert not fixed & targets


def test_gateway_without_autoscaling_keeps_its_replicas(helm):  # noqa: F811
    docs = render(helm, GATEWAY, "gateway.autoscaling.enabled=false", "gateway.replicas=3")
    assert one(docs, "Deployment", "-gateway")["spec"]["replicas"] == 3
    assert not [h for h in of_kind(docs, "HorizontalPodAutoscaler")
                if h["metadata"]["name"].endswith("-gateway")]  # fmt: skip


def _gateway_config(docs, tmp_path):
    from router.gateway.config import GatewayConfig

    path = tmp_path / "gateway.yaml"
    path.write_text(one(docs, "ConfigMap", "-gateway")["data"]["gateway.yaml"])
    return load_config(GatewayConfig, str(path))


def test_gateway_caps_each_tenants_requests_in_flight(helm, tmp_path):  # noqa: F811
    """GatewayConfig's own default is 0 (no cap: one tenant can hold every engine's
    slots); the chart renders its own non-zero default into gateway.yaml."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    default = values["gateway"]["maxInflightPerTenant"]
    assert 0 < default
    cfg = _gateway_config(render(helm, GATEWAY), tmp_path)
    assert cfg.max_inflight_per_tenant == default
    set_ = _gateway_config(render(helm, GATEWAY, "gateway.maxInflightPerTenant=7"), tmp_path)
    assert set_.max_inflight_per_tenant == 7
    off = _gateway_config(render(helm, GATEWAY, "gateway.maxInflightPerTenant=0"), tmp_path)
    assert off.max_inflight_per_tenant == 0  # no cap, said explicitly
    err = render_error(helm, GATEWAY, "gateway.maxInflightPerTenant=-1")
    assert "schema" in err and "maxInflightPerTenant" in err


def test_the_gateways_metrics_are_off_the_tenants_port(helm, tmp_path):  # noqa: F811
    """The gateway's metrics count every tenant's requests: rendered off the http port
    (public_metrics false), on each pod's router metrics port, behind a ClusterIP Service
    of their own that the ServiceMonitor scrapes; the tenants' Service has no such port."""
    docs = render(helm, GATEWAY, "metrics.serviceMonitor.enabled=true")
    assert _gateway_config(docs, tmp_path).public_metrics is False
    deploy = one(docs, "Deployment", "-gateway")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
    router_yaml = yaml.safe_load(one(docs, "ConfigMap", "-config")["data"]["router.yaml"])
    assert by_name["metrics"] == router_yaml["metrics_port"] > 0
    assert [p["name"] for p in one(docs, "Service", "-gateway")["spec"]["ports"]] == ["http"]
    svc = one(docs, "Service", "-gateway-metrics")["spec"]
    assert svc["type"] == "ClusterIP" and [p["targetPort"] for p in svc["ports"]] == ["metrics"]
    assert _selected(docs, svc["selector"]) == {("Deployment", deploy["metadata"]["name"])}
    sm = one(docs, "ServiceMonitor", "-gateway")["spec"]
    assert [e["port"] for e in sm["endpoints"]] == ["metrics"]
    assert sm["selector"]["matchLabels"].items() <= svc["selector"].items()
    public = render(helm, GATEWAY, "gateway.publicMetrics=true")
    assert _gateway_config(public, tmp_path).public_metrics is True
