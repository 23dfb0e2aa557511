"""--log-level of the agent and the router, and kvctl cluster up --router-log-level: a bad
level is refused by argparse (one line, exit 2), not by logging.basicConfig with a
traceback once the process has started."""

from __future__ import annotations

import pytest

from kvstore.cli.__main__ import main as kvctl
from node_agent.__main__ import parse_args as agent_args
from router.__main__ import parse_args as router_args


@pytest.mark.parametrize(
    "parse",
    [
        lambda level: agent_args(["--log-level", level]),
        lambda level: router_args(["--log-level", level]),
        lambda level: kvctl(
            ["cluster", "up", "--agents", "1", "--engines", "0", "--router-log-level", level]
        ),
    ],
    ids=["agent", "router", "kvctl-cluster-up"],
)
def test_a_bad_log_level_is_a_usage_error(parse, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_STATE_DIR", str(tmp_path))  # whatever up would start: there
    with pytest.raises(SystemExit) as exc:
        parse("bogus")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown log level 'bogus'" in err and "DEBUG, INFO, WARNING" in err
    assert "Traceback" not in err


def test_log_levels_are_taken_in_any_case():
    assert agent_args(["--log-level", "debug"]).log_level == "DEBUG"
    assert router_args(["--log-level", "Warning"]).log_level == "WARNING"
    assert agent_args([]).log_level == router_args([]).log_level == "INFO"
