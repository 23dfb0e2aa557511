"""Values an operator probe found rendering silently into pods that cannot run: the chart
refuses each with one message naming the values to change (a `fail` in a template, or the
values schema), or renders what a Kubernetes operator would expect instead."""

from __future__ import annotations

import pytest

from tests.deploy.test_helm import (  # noqa: F401 - helm is a fixture
    helm,
    render,
    render_error,
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
