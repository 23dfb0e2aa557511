"""The engine registrar's command line (kvstore.integrations.vllm_serve): --check-interval
must be finite seconds > 0 (0 or less spun the health loop at full CPU, silently), and
--help describes it in whole sentences."""

from __future__ import annotations

import pytest

from kvstore.integrations.vllm_serve import parse_args

REQUIRED = ["--engine-id", "e0", "--url", "http://127.0.0.1:8000", "--node-id", "agent-0",
            "--model", "tiny"]  # fmt: skip


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_a_check_interval_that_is_not_positive_seconds_is_refused(value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([*REQUIRED, "--check-interval", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --check-interval" in err and repr(value) in err


def test_a_positive_check_interval_is_taken():
    args, cmd = parse_args([*REQUIRED, "--check-interval", "0.5", "--", "engine", "--flag"])
    assert args.check_interval == 0.5 and cmd == ["engine", "--flag"]


def test_help_describes_the_registrar_in_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "register a vLLM OpenAI server (with our connector) in etcd for the gateway, " \
        "for as long as it answers /health." in out  # fmt: skip
