"""The engine registrar's command line (kvstore.integrations.vllm_serve): --check-interval
must be finite seconds > 0 (0 or less spun the health loop at full CPU, silently), and
--help describes it in whole sentences; --record-key-file (the key its etcd record is
signed with) is read at start, a bad file a one-line exit 2."""

from __future__ import annotations

import pytest

from kvstore.coord.engines import engine_record_key
from kvstore.integrations.vllm_serve import main, parse_args, record_key

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


def test_the_record_key_file_gives_the_key_the_gateway_verifies_with(tmp_path):
    key_file = tmp_path / "engine-record-key"
    key_file.write_text("the-key\n")
    args, _ = parse_args([*REQUIRED, "--record-key-file", str(key_file)])
    assert record_key(args) == engine_record_key("the-key")
    assert record_key(parse_args(REQUIRED)[0]) == b""  # unsigned, as before


@pytest.mark.parametrize("content", [None, "", "\n"])
def test_a_record_key_file_that_is_missing_or_empty_exits_2_naming_it(tmp_path, capsys, content):
    key_file = tmp_path / "engine-record-key"
    if content is not None:
        key_file.write_text(content)
    assert main([*REQUIRED, "--record-key-file", str(key_file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--record-key-file" in err and str(key_file) in err


def test_help_names_the_record_key_file(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--record-key-file RECORD_KEY_FILE a file holding the engine record key" in out
