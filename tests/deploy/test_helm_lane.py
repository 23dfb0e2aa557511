"""The chart's agent.localLane values configure every agent's local lane (issue 18): the
socket's group (`local_lane_group`: mode 0660 for its members instead of 0600), the
connection caps (all tenants', one tenant's), the idle timeouts and the staging region
caps (a region's size, a tenant's regions together), loaded by the real config loader
from the rendered agent.yaml; the agent pod belongs to that group so it can hand its
socket to it."""

from __future__ import annotations

import pytest

from kvstore.config import AgentConfig

from tests.deploy.test_helm import (  # noqa: F401 - helm is a fixture
    agent_containers,
    helm,
    load_as_container,
    one,
    render,
    render_error,
)


def _agent_configs(docs, tmp_path, monkeypatch) -> list[AgentConfig]:
    return [
        load_as_container(
            docs, c, AgentConfig, "agent.yaml", "KVSTORE_AGENT_", tmp_path, monkeypatch
        )
        for c in agent_containers(docs)
    ]


def _limits(c: AgentConfig) -> tuple:
    return (
        c.local_lane_max_connections,
        c.local_lane_max_connections_per_tenant,
        c.local_lane_idle_timeout_s,
        c.local_lane_region_idle_timeout_s,
        c.local_lane_max_region_bytes,
        c.local_lane_max_tenant_region_bytes,
    )


def _pod_security(docs) -> dict:
    return one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]["securityContext"]


@pytest.mark.parametrize("values", ["minimal-values.yaml", "production-values.yaml"])
def test_lane_defaults_keep_the_socket_to_the_agents_user(helm, values, tmp_path, monkeypatch):  # noqa: F811
    docs = render(helm, values)
    cfgs = _agent_configs(docs, tmp_path, monkeypatch)
    assert {(c.local_lane, c.local_lane_group) for c in cfgs} == {(True, "")}
    defaults = AgentConfig()
    assert {_limits(c) for c in cfgs} == {_limits(defaults)}
    assert "supplementalGroups" not in _pod_security(docs)


def test_lane_group_and_limits_reach_every_agent(helm, tmp_path, monkeypatch):  # noqa: F811
    docs = render(
        helm,
        "production-values.yaml",
        "agent.localLane.group=2042",
        "agent.localLane.maxConnections=8",
        "agent.localLane.idleTimeoutSeconds=5",
        "agent.localLane.maxConnectionsPerTenant=3",
        "agent.localLane.regionIdleTimeoutSeconds=120",
        "agent.localLane.maxRegionMiB=256",
        "agent.localLane.maxTenantRegionMiB=512",
    )
    cfgs = _agent_configs(docs, tmp_path, monkeypatch)
    assert len(cfgs) > 1  # production values: several agents per pod, all alike
    assert {c.local_lane_group for c in cfgs} == {"2042"}
    assert {_limits(c) for c in cfgs} == {(8, 3, 5.0, 120.0, 256 << 20, 512 << 20)}
    assert _pod_security(docs)["supplementalGroups"] == [2042]


def test_lane_can_be_turned_off(helm, tmp_path, monkeypatch):  # noqa: F811
    docs = render(helm, "minimal-values.yaml", "agent.localLane.enabled=false")
    assert not any(c.local_lane for c in _agent_configs(docs, tmp_path, monkeypatch))


@pytest.mark.parametrize(
    "setting,where",
    [
        # A group name means nothing inside the agent's container: a gid.
        ("agent.localLane.group=kvstore-workers", "agent.localLane.group"),
        ("agent.localLane.maxConnections=0", "agent.localLane.maxConnections"),
        ("agent.localLane.idleTimeoutSeconds=0", "agent.localLane.idleTimeoutSeconds"),
        ("agent.localLane.maxConnectionsPerTenant=-1", "agent.localLane.maxConnectionsPerTenant"),
        ("agent.localLane.regionIdleTimeoutSeconds=0", "agent.localLane.regionIdleTimeoutSeconds"),
        ("agent.localLane.maxRegionMiB=0", "agent.localLane.maxRegionMiB"),
        ("agent.localLane.maxTenantRegionMiB=-1", "agent.localLane.maxTenantRegionMiB"),
        ("agent.localLane.mode=0666", "agent.localLane: Additional property mode"),
    ],
)
def test_schema_rejects_bad_lane_values(helm, setting, where):  # noqa: F811
    err = render_error(helm, "minimal-values.yaml", setting)
    # Helm 3.18 names the value as a.b.c; later releases as a JSON pointer /a/b/c.
    pointer = "/" + where.split(":")[0].replace(".", "/")
    assert "schema" in err and (where in err or pointer in err), err
