"""The chart's tls.* values configure every process (kvstore.config.TLSConfig in agent.yaml
and router.yaml, pointing at the mounted Secret), the bundled etcd serves TLS with client
certificates, probes present the pair (the kubelet's gRPC probe cannot), and the optional
cert-manager Certificate writes the Secret everything mounts, naming what clients check."""

from __future__ import annotations

import pytest

from kvstore.config import AgentConfig, RouterConfig

from tests.deploy.test_helm import (  # noqa: F401 - helm is a fixture
    agent_containers,
    helm,
    load_as_container,
    one,
    render,
    render_error,
)

TLS = (
    "tls.enabled=true",
    "tls.certManager.enabled=true",
    "tls.certManager.issuerRef.name=cluster-ca",
    "tls.certManager.issuerRef.kind=ClusterIssuer",
)


def _mount_of(container: dict, volume: str) -> str:
    return next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume)


def _volume_secret(pod_spec: dict, volume: str) -> str:
    return next(v["secret"]["secretName"] for v in pod_spec["volumes"] if v["name"] == volume)


@pytest.mark.parametrize("values", ["minimal-values.yaml", "production-values.yaml"])
def test_tls_values_configure_every_process(helm, values, tmp_path, monkeypatch):  # noqa: F811
    docs = render(helm, values, *TLS)
    cert = one(docs, "Certificate", "-tls")
    secret = cert["spec"]["secretName"]
    assert cert["spec"]["issuerRef"] == {
        "name": "cluster-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    ds = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    router_pod = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]
    router = router_pod["containers"][0]
    rcfg = load_as_container(
        docs, router, RouterConfig, "router.yaml", "KVSTORE_ROUTER_", tmp_path, monkeypatch
    )
    agents = [
        (
            c,
            load_as_container(
                docs, c, AgentConfig, "agent.yaml", "KVSTORE_AGENT_", tmp_path, monkeypatch
            ),
        )
        for c in agent_containers(docs)
    ]
    for container, cfg, pod in [(router, rcfg, router_pod)] + [(c, a, ds) for c, a in agents]:
        tls = cfg.tls
        assert tls.enabled and tls.require_client_cert and tls.etcd
        mount = _mount_of(container, "tls")
        assert {tls.ca_file, tls.cert_file, tls.key_file} == {
            f"{mount}/ca.crt",
            f"{mount}/tls.crt",
            f"{mount}/tls.key",
        }
        assert _volume_secret(pod, "tls") == secret
        assert tls.server_name in cert["spec"]["dnsNames"]  # what channels check
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            cmd = container[probe]["exec"]["command"]
            assert cmd[0] == "/opt/kvstore/bin/kvstore-health" and "grpc" not in container[probe]
            assert f"--tls-cert={tls.cert_file}" in cmd
            assert f"--tls-server-name={tls.server_name}" in cmd
    etcd = one(docs, "StatefulSet", "-etcd")["spec"]["template"]["spec"]
    args = etcd["containers"][0]["args"]
    assert "--client-cert-auth" in args
    assert any(a.startswith("--listen-client-urls=https://") for a in args)
    assert _volume_secret(etcd, "tls") == secret
    first = rcfg.etcd_endpoints.split(",")[0].rsplit(":", 1)[0]
    assert first in cert["spec"]["dnsNames"]  # EtcdClient checks the first endpoint
    # and each member its own name (their peers and advertised client URLs)
    assert "*." + first in cert["spec"]["dnsNames"]


def test_without_tls_nothing_changes_and_bad_tls_values_are_refused(helm, tmp_path):  # noqa: F811
    docs = render(helm, "minimal-values.yaml")
    assert not [d for d in docs if d["kind"] == "Certificate"]
    cm = one(docs, "ConfigMap", "-config")
    assert "tls:" not in cm["data"]["agent.yaml"] and "tls:" not in cm["data"]["router.yaml"]
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    assert "grpc" in router["readinessProbe"]
    err = render_error(helm, "minimal-values.yaml", "tls.enabled=true")
    assert "tls.certManager.enabled" in err
    err = render_error(
        helm, "minimal-values.yaml", "tls.enabled=true", "tls.certManager.enabled=true"
    )
    assert "issuerRef.name" in err


def test_gateway_serves_https_from_the_tls_secret(helm, tmp_path, monkeypatch):  # noqa: F811
    from kvstore.config import load_config
    from router.gateway.config import GatewayConfig
    from router.gateway.tls import GatewayTLS

    def gateway(*sets: str) -> tuple[dict, GatewayConfig, RouterConfig]:
        # the chart's engines serve plain HTTP: with https they need allowPlaintextEngines
        docs = render(
            helm, "gateway-values.yaml", *TLS, "gateway.allowPlaintextEngines=true", *sets
        )
        pod = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
        path = tmp_path / "gateway.yaml"
        path.write_text(one(docs, "ConfigMap", "-gateway")["data"]["gateway.yaml"])
        c = pod["containers"][0]
        rcfg = load_as_container(
            docs, c, RouterConfig, "router.yaml", "KVSTORE_ROUTER_", tmp_path, monkeypatch
        )
        assert _volume_secret(pod, "tls") == one(docs, "Certificate", "-tls")["spec"]["secretName"]
        return c, load_config(GatewayConfig, str(path)), rcfg

    c, cfg, rcfg = gateway("gateway.https=true", "gateway.requireClientCert=true")
    tls = GatewayTLS.resolve(cfg, rcfg.tls)
    assert tls is not None and tls.require_client_cert
    mount = _mount_of(c, "tls")
    assert (tls.ca_file, tls.cert_file, tls.key_file) == (
        f"{mount}/ca.crt",
        f"{mount}/tls.crt",
        f"{mount}/tls.key",
    )
    # The kubelet presents no certificate: exec probe on gRPC, a TCP check on HTTPS.
    assert "--tls-cert=" + tls.cert_file in c["livenessProbe"]["exec"]["command"]
    assert c["readinessProbe"]["tcpSocket"]["port"] == "http"
    c, cfg, rcfg = gateway("gateway.https=true")
    tls = GatewayTLS.resolve(cfg, rcfg.tls)
    assert tls is not None and not tls.require_client_cert
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    c, cfg, rcfg = gateway()  # https off: plain HTTP although the router has TLS
    assert GatewayTLS.resolve(cfg, rcfg.tls) is None
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
    err = render_error(helm, "gateway-values.yaml", *TLS, "gateway.requireClientCert=true")
    assert "gateway.requireClientCert needs gateway.https" in err


def test_a_https_gateway_with_the_charts_plain_http_engines_is_refused(helm, tmp_path):  # noqa: F811
    """The chart's engines register http://<pod IP>, and a gateway serving HTTPS forwards
    only to https:// engines: rendered, it would have none and answer every request 503.
    The chart says so and what to set; with allowPlaintextEngines the gateway takes them."""
    from kvstore.config import load_config
    from router.gateway.config import GatewayConfig

    err = render_error(helm, "gateway-values.yaml", *TLS, "gateway.https=true")
    assert "gateway.allowPlaintextEngines=true" in err and "engines.enabled=false" in err
    docs = render(
        helm,
        "gateway-values.yaml",
        *TLS,
        "gateway.https=true",
        "gateway.allowPlaintextEngines=true",
    )
    engine = one(docs, "DaemonSet", "-engine")["spec"]["template"]["spec"]["containers"][0]
    assert any(a.startswith("--url=http://") for a in engine["command"])
    path = tmp_path / "gateway.yaml"
    path.write_text(one(docs, "ConfigMap", "-gateway")["data"]["gateway.yaml"])
    cfg = load_config(GatewayConfig, str(path))
    assert cfg.https and cfg.allow_plaintext_engines
    # https without the chart's engines (registrars of your own): nothing to refuse
    render(helm, "gateway-values.yaml", *TLS, "gateway.https=true", "engines.enabled=false")


def _engine_settings(docs) -> list[tuple[dict, dict, object]]:
    """Each engine container with its kv_connector_extra_config and registrar args."""
    import json

    from kvstore.integrations.vllm_serve import parse_args

    out = []
    for c in one(docs, "DaemonSet", "-engine")["spec"]["template"]["spec"]["containers"]:
        cmd = c["command"]
        kvt = next(a for a in cmd if a.startswith("--kv-transfer-config="))
        extra = json.loads(kvt.split("=", 1)[1])["kv_connector_extra_config"]
        args, _ = parse_args(cmd[3 : cmd.index("--")])
        out.append((c, extra, args))
    return out


def test_engines_reach_tls_agents_and_etcd_with_the_releases_pair(helm, tmp_path, monkeypatch):  # noqa: F811
    """With tls.enabled the agents and etcd require client certificates: the engines'
    connector and registrar present the release's pair from the tls Secret (the connector
    checks the agent's certificate, dialled by host IP, against the name it carries);
    without them the connector was refused by the agent and the registrar by etcd, and no
    engine ever registered."""
    docs = render(helm, "gateway-values.yaml", *TLS, "agent.gpusPerNode=2")
    pod = one(docs, "DaemonSet", "-engine")["spec"]["template"]["spec"]
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    rcfg = load_as_container(
        docs, router, RouterConfig, "router.yaml", "KVSTORE_ROUTER_", tmp_path, monkeypatch
    )
    agent_pod = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    assert _volume_secret(pod, "tls") == _volume_secret(agent_pod, "tls")
    settings = _engine_settings(docs)
    assert len(settings) == 2
    for c, extra, args in settings:
        mount = _mount_of(c, "tls")
        files = (f"{mount}/ca.crt", f"{mount}/tls.crt", f"{mount}/tls.key")
        assert (rcfg.tls.ca_file, rcfg.tls.cert_file, rcfg.tls.key_file) == files
        assert (extra["tls_ca_file"], extra["tls_cert_file"], extra["tls_key_file"]) == files
        assert extra["tls_server_name"] == rcfg.tls.server_name
        assert (args.tls_ca, args.tls_cert, args.tls_key) == files
    # etcd in plaintext: the registrar presents nothing to it; the connector still does
    docs = render(helm, "gateway-values.yaml", *TLS, "tls.etcd=false")
    ((_, extra, args),) = _engine_settings(docs)
    assert extra["tls_cert_file"] and args.tls_cert is None
    docs = render(helm, "gateway-values.yaml")  # no TLS: neither
    ((c, extra, args),) = _engine_settings(docs)
    assert not [k for k in extra if k.startswith("tls_")] and args.tls_cert is None
    assert all(m["name"] != "tls" for m in c["volumeMounts"])
