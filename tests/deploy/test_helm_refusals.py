"""Values an operator probe found rendering silently into pods that cannot run: the chart
refuses each with one message naming the values to change (a `fail` in a template, or the
values schema), or renders what a Kubernetes operator would expect instead."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from tests.deploy.test_helm import (  # noqa: F401 - helm is a fixture
    CHART,
    NAMESPACE,
    helm,
    one,
    render,
    render_error,
    run_helm,
)

GATEWAY = "gateway-values.yaml"
MINIMAL = "minimal-values.yaml"


# ---- ports: two listeners of one pod (or hostPorts of one node) on one port ---------------


@pytest.mark.parametrize(
    "values,sets,names",
    [
        # The gateway's HTTP port on its own router's gRPC port (50060).
        (GATEWAY, ("gateway.port=50060",), ("gateway.port", "gateway.grpcPort")),
        (GATEWAY, ("router.metricsPort=8000",), ("gateway.port", "router.metricsPort")),
        # The router's gRPC port on its metrics port (9400).
        (MINIMAL, ("router.grpcPort=9400",), ("router.grpcPort", "router.metricsPort")),
        # Agent i listens on grpcBasePort + i and serves metrics on metricsBasePort + i.
        (
            MINIMAL,
            ("agent.metricsBasePort=50051",),
            ("agent.grpcBasePort", "agent.metricsBasePort"),
        ),
        (
            MINIMAL,
            ("agent.gpusPerNode=2", "agent.metricsBasePort=50052"),
            ("agent.grpcBasePort + 1", "agent.metricsBasePort"),
        ),
        (
            GATEWAY,  # agents' gRPC ports are hostPorts here (the engines dial them)
            ("agent.gpusPerNode=4", "agent.metricsBasePort=50048"),
            ("agent.grpcBasePort", "agent.metricsBasePort + 3"),
        ),
    ],
)
def test_ports_of_one_pod_that_collide_are_refused(helm, values, sets, names):  # noqa: F811
    err = render_error(helm, values, *sets)
    assert "ports overlap" in err and all(n in err for n in names), err


def test_distinct_ports_next_to_each_other_render(helm):  # noqa: F811
    render(helm, MINIMAL, "agent.gpusPerNode=2", "agent.metricsBasePort=50053")
    render(helm, GATEWAY, "gateway.port=50061", "router.grpcPort=9401")


# ---- the gateway's tokenizers ---------------------------------------------------------------


def test_gateway_without_the_volume_its_tokenizers_are_on_is_refused(helm, tmp_path):  # noqa: F811
    # /models is not mounted, and the gateway would crashloop on "cannot load
    # tokenizer.json": the key dropped (null), or an empty volume source.
    err = render_error(helm, GATEWAY, "gateway.modelVolume=null")
    assert "gateway.modelVolume is empty" in err and "gateway.tokenizers.llama-3-8b" in err, err
    values = yaml.safe_load((CHART / "ci" / GATEWAY).read_text())
    values["gateway"]["modelVolume"] = {}
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    assert "gateway.modelVolume is empty" in render_error(helm, str(tmp_path / "values.yaml"))


def test_engines_without_the_volume_their_model_is_on_are_refused(helm):  # noqa: F811
    # /models fell back to an empty emptyDir: vLLM would find no model there
    err = render_error(helm, GATEWAY, "engines.modelVolume=null")
    assert "engines.modelVolume is empty" in err and "engines.modelPath is /models" in err, err


def test_tokenizers_the_gateway_image_holds_need_no_volume(helm):  # noqa: F811
    docs = render(
        helm,
        GATEWAY,
        "gateway.modelVolume=null",
        "gateway.tokenizers.llama-3-8b=/opt/tokenizers/llama-3-8b",
    )
    spec = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    assert "models" not in {v["name"] for v in spec["volumes"]}


def test_engines_model_without_a_gateway_tokenizer_is_refused(helm):  # noqa: F811
    err = render_error(helm, GATEWAY, "engines.servedModelName=llama-3-70b")
    assert 'engines.servedModelName "llama-3-70b" is not a key of gateway.tokenizers' in err
    assert "(llama-3-8b)" in err, err
    # Without the gateway nothing tokenizes: the engines alone are fine.
    render(helm, GATEWAY, "engines.servedModelName=llama-3-70b", "gateway.enabled=false")


# ---- the engines' tenant ----------------------------------------------------------------------


def test_engines_tenant_missing_from_inline_tenants_is_refused(helm):  # noqa: F811
    err = render_error(helm, GATEWAY, "engines.kvTenant=acme")
    assert 'engines.kvTenant "acme" is not in auth.tenants (engines)' in err, err
    assert "auth.tenants.acme" in err
    err = render_error(helm, GATEWAY, "auth.tenants=null", "auth.allowUnauthenticated=true")
    assert 'engines.kvTenant "engines" is not in auth.tenants (none)' in err, err
    # Tenants from an existing Secret are the operator's: the chart cannot see them.
    render(
        helm,
        GATEWAY,
        "engines.kvTenant=acme",
        "auth.existingSecret=kvstore-tenants",
        "auth.existingClusterTokenSecret=kvstore-cluster-token",
    )


# ---- disruption budgets that would block every drain ------------------------------------------


def _pdbs(docs) -> dict[str, dict]:
    return {
        d["metadata"]["name"].rsplit("-", 1)[1]: d["spec"]
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
    }


def test_one_replica_gets_no_disruption_budget(helm):  # noqa: F811
    # The default budget (minAvailable 1) on one pod would block every eviction of it.
    docs = render(
        helm,
        GATEWAY,
        "router.autoscaling.enabled=false",
        "router.replicas=1",
        "gateway.autoscaling.minReplicas=1",
    )
    assert set(_pdbs(docs)) == {"etcd"}
    assert _pdbs(render(helm, GATEWAY))["router"]["minAvailable"] == 1  # two replicas


@pytest.mark.parametrize(
    "sets,message",
    [
        (
            ("router.autoscaling.enabled=false", "router.podDisruptionBudget.minAvailable=5"),
            "router.podDisruptionBudget.minAvailable (5) is not below router.replicas (2)",
        ),
        (
            ("router.podDisruptionBudget.minAvailable=2",),  # the HPA keeps 2
            "router.podDisruptionBudget.minAvailable (2) is not below "
            "router.autoscaling.minReplicas (2)",
        ),
        (
            ("gateway.autoscaling.minReplicas=3", "gateway.podDisruptionBudget.minAvailable=70%"),
            "gateway.podDisruptionBudget.minAvailable (70%, 3 pods) is not below "
            "gateway.autoscaling.minReplicas (3)",
        ),
    ],
)
def test_budgets_that_keep_every_replica_are_refused(helm, sets, message):  # noqa: F811
    assert message in render_error(helm, GATEWAY, *sets)


def test_budgets_that_let_one_pod_go_render(helm):  # noqa: F811
    docs = render(
        helm,
        GATEWAY,
        "gateway.autoscaling.minReplicas=3",
        "gateway.podDisruptionBudget.minAvailable=60%",  # 1.8, rounded up: 2 of 3
    )
    assert _pdbs(docs)["gateway"]["minAvailable"] == "60%"
    err = render_error(helm, GATEWAY, "gateway.podDisruptionBudget.minAvailable=150%")
    assert "schema" in err and "minAvailable" in err, err


# ---- image references -------------------------------------------------------------------------

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    "setting,where",
    [
        ("image.tag=v2 #canary", "image.tag"),  # rendered unquoted: deployed ...:v2
        ("image.tag=:::", "image.tag"),  # rendered unquoted: a YAML parse error
        ("image.tag=" + "v" * 129, "image.tag"),
        ("engines.image.tag=v1 #x", "engines.image.tag"),
        ("etcd.bundled.image.tag=-v3", "etcd.bundled.image.tag"),
        ("image.digest=sha256:abc #x", "image.digest"),
    ],
)
def test_image_tags_outside_the_oci_grammar_are_refused(helm, setting, where):  # noqa: F811
    err = render_error(helm, MINIMAL, setting)
    assert "schema" in err and (where in err or "/" + where.replace(".", "/") in err), err


def test_image_references_are_quoted_and_take_a_digest(helm):  # noqa: F811
    proc = run_helm(helm, "template", "-f", str(CHART / "ci" / GATEWAY), "--set",
                    f"image.digest={DIGEST}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    refs = re.findall(r"^\s*image: (.*)$", proc.stdout, re.MULTILINE)
    assert len(refs) >= 4 and all(r.startswith('"') and r.endswith('"') for r in refs), refs
    docs = render(helm, GATEWAY, f"image.digest={DIGEST}")
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["image"] == f"ghcr.io/kvstore/kvstore:0.1.0@{DIGEST}"


# ---- the agents' data dir on the node ---------------------------------------------------------


def _data_host_path(helm: str, namespace: str) -> str:  # noqa: F811
    proc = run_helm(helm, "template", "-f", str(CHART / "ci" / MINIMAL), "-n", namespace)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    spec = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "data"]
    return vol["hostPath"]["path"]


def test_releases_of_one_name_in_two_namespaces_keep_apart_on_a_node(helm):  # noqa: F811
    team_a, team_b = _data_host_path(helm, "team-a"), _data_host_path(helm, "team-b")
    assert team_a == "/mnt/nvme/kvstore/team-a/kv-kvstore"
    assert team_b == "/mnt/nvme/kvstore/team-b/kv-kvstore"


def test_upgrade_notes_name_the_old_and_new_data_dirs(helm, tmp_path):  # noqa: F811
    # NOTES.txt renders only at install/upgrade: include it from an extra template.
    chart = tmp_path / "kvstore"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ include (print $.Template.BasePath "/NOTES.txt") . | quote }}}\n'
    )

    def notes(*args: str) -> str:
        proc = run_helm(helm, "template", "-f", str(CHART / "ci" / MINIMAL), *args,
                        "--show-only", "templates/zz-notes.yaml", chart=chart)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return yaml.safe_load(proc.stdout)["data"]["notes"]

    upgrade = notes("--is-upgrade")
    assert f"/mnt/nvme/kvstore/{NAMESPACE}/kv-kvstore" in upgrade
    assert "/mnt/nvme/kvstore/kv-kvstore" in upgrade
    assert "/mnt/nvme/kvstore/kv-kvstore" not in notes()  # a fresh install has no old dir
