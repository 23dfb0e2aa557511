"""Numbers in the values as an operator passes them to the real helm: a fraction from the
command line (`--set` makes it a string; `--set-json`, as the chart README says, passes a
number), a disruption budget out of range (one message naming the broken rule, no bare
"anyOf"), and an agent lease shorter than etcd grants."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.test_helm import (  # noqa: F401 - helm is a fixture
    CHART,
    helm,
    one,
    render,
    render_error,
    run_helm,
)

GATEWAY = "gateway-values.yaml"
MINIMAL = "minimal-values.yaml"


def _agent_yaml(stdout: str) -> dict:
    docs = [d for d in yaml.safe_load_all(stdout) if d]
    return yaml.safe_load(one(docs, "ConfigMap", "-config")["data"]["agent.yaml"])


def test_a_fraction_from_the_command_line_takes_set_json(helm):  # noqa: F811
    err = render_error(helm, MINIMAL, "agent.tenantPinFraction=0.3")
    assert "agent.tenantPinFraction: Invalid type. Expected: number, given: string" in err
    readme = (CHART / "README.md").read_text()
    assert "`--set-json agent.tenantPinFraction=0.3`" in readme  # what the README offers
    proc = run_helm(
        helm, "template", "-f", str(CHART / "ci" / MINIMAL),
        "--set-json", "agent.tenantPinFraction=0.3",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert _agent_yaml(proc.stdout)["tenant_pin_fraction"] == 0.3


@pytest.mark.parametrize(
    "values,component", [(MINIMAL, "router"), (GATEWAY, "router"), (GATEWAY, "gateway")]
)
@pytest.mark.parametrize(
    "value,rule",
    [
        ("-1", "Must be greater than or equal to 0"),
        ("150%", "Does not match pattern '^([0-9]|[1-9][0-9]|100)%$'"),
        ("1.5", "Does not match pattern '^([0-9]|[1-9][0-9]|100)%$'"),
    ],
)
def test_a_budget_out_of_range_names_the_rule_it_breaks(helm, values, component, value, rule):  # noqa: F811
    err = render_error(helm, values, f"{component}.podDisruptionBudget.minAvailable={value}")
    assert f"- {component}.podDisruptionBudget.minAvailable: {rule}" in err, err
    assert "anyOf" not in err, err  # the line that named no rule


def test_an_agent_lease_shorter_than_etcd_grants_is_refused(helm):  # noqa: F811
    err = render_error(helm, MINIMAL, "agent.leaseTtlSeconds=1")
    assert "agent.leaseTtlSeconds: Must be greater than or equal to 2" in err, err
    docs = render(helm, MINIMAL, "agent.leaseTtlSeconds=2")
    agent = yaml.safe_load(one(docs, "ConfigMap", "-config")["data"]["agent.yaml"])
    assert agent["lease_ttl_s"] == 2
