"""--log-level of the agent and the router, and kvctl cluster up --router-log-level: a bad
level is refused by argparse (one line, exit 2), not by logging.basicConfig with a
traceback once the process has started."""

from __future__ import annotations

import subprocess
import sys

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


_EMIT = """
import logging, sys
from kvstore.process import configure_logging
configure_logging(sys.argv[1])
for name in ("kvstore.router", "grpc._cython.cygrpc"):
    for level in (logging.DEBUG, logging.INFO, logging.WARNING):
        logging.getLogger(name).log(level, "from %s at %s", name, logging.getLevelName(level))
"""


@pytest.mark.parametrize(
    "level,ours,theirs",
    [
        ("DEBUG", {"DEBUG", "INFO", "WARNING"}, {"INFO", "WARNING"}),
        ("INFO", {"INFO", "WARNING"}, {"INFO", "WARNING"}),
        ("WARNING", {"WARNING"}, {"WARNING"}),
    ],
)
def test_the_log_level_is_kvstores_and_libraries_stay_at_info(level, ours, theirs):
    """DEBUG turns on kvstore's own debug lines (the routing terms), not grpc's: a line per
    call and a traceback per cancelled stream, which buried them (a process, since
    logging's root is configured once)."""
    out = subprocess.run(
        [sys.executable, "-c", _EMIT, level], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    seen: dict[str, set[str]] = {"kvstore.router": set(), "grpc._cython.cygrpc": set()}
    for line in out.stderr.splitlines():
        name, at = line.split(" from ")[1].split(" at ")
        seen[name].add(at)
        assert f" {at} {name} from " in line  # the format: time, level, logger, message
    assert seen == {"kvstore.router": ours, "grpc._cython.cygrpc": theirs}
