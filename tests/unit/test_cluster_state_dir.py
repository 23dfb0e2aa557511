"""A --state-dir kvctl cannot use (a file, a cluster.json that is a directory or is
corrupt) is one line on stderr and exit 2 (bad usage) from every command that reads it:
kvctl status, kvctl cluster status|up|down. Nothing is started."""

from __future__ import annotations

import json

import pytest

from kvstore.cli.__main__ import main


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "passwd"
    path.write_text("root:x:0:0::/root:/bin/sh\n")
    return path


@pytest.fixture
def json_is_a_dir(tmp_path):
    (tmp_path / "state" / "cluster.json").mkdir(parents=True)
    return tmp_path / "state"


@pytest.fixture
def corrupt(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "cluster.json").write_text("{nope")
    return tmp_path / "state"


def _record(kind: str) -> dict:
    procs = [{"name": "etcd", "kind": "etcd", "pid": 1, "address": "127.0.0.1:1", "log": ""},
             {"name": "agent-0", "kind": kind, "pid": 1, "address": "", "log": ""}]  # fmt: skip
    return {"state_dir": "/s", "etcd_endpoint": "127.0.0.1:1", "router_address": "",
            "procs": procs, "started_at": 0.0}  # fmt: skip


@pytest.fixture
def unknown_kind(tmp_path):
    """A hand edit: a kind no cluster starts (alive() had no marker for it: KeyError)."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "cluster.json").write_text(json.dumps(_record("agnet")))
    return tmp_path / "state"


@pytest.fixture
def unknown_kind_starting(tmp_path):
    """The same in what a killed `up` left (starting.json), with no cluster.json."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "starting.json").write_text(json.dumps(_record("agnet")))
    return tmp_path / "state"


COMMANDS = [
    ["status"],
    ["cluster", "status"],
    ["cluster", "down"],
]
CASES = [
    ("a_file", "is not a directory"),
    ("json_is_a_dir", "cluster.json is a directory, not a cluster record"),
    ("corrupt", "cluster.json is unreadable (Expecting property name"),
    (
        "unknown_kind",
        "cluster.json: procs[1] ('agent-0', pid 1) has kind 'agnet', which is "
        "none of etcd, agent, router, engine; correct that entry",
    ),
    ("unknown_kind_starting", "starting.json: procs[1] ('agent-0', pid 1) has kind 'agnet'"),
]


def _run(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert out == ""
    return rc, err


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
@pytest.mark.parametrize(("case", "message"), CASES, ids=[c for c, _ in CASES])
def test_a_state_dir_that_cannot_be_used_is_exit_2_in_one_line(
    argv, case, message, request, capsys
):
    state = request.getfixturevalue(case)
    rc, err = _run(capsys, [*argv, "--state-dir", str(state)])
    assert rc == 2, err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("under", ["", "sub"])
def test_cluster_up_in_a_file_is_exit_2_in_one_line(a_file, under, capsys):
    state = a_file / under if under else a_file
    rc, err = _run(capsys, ["cluster", "up", "--agents", "1", "--state-dir", str(state)])
    assert rc == 2
    assert err.startswith("kvctl cluster up: ") and err.count("\n") == 1
    assert "Not a directory" in err or "is not a directory" in err
    assert a_file.read_text().startswith("root:")


def test_probing_for_a_starting_up_creates_and_writes_nothing(tmp_path):
    """`kvctl cluster down` asks whether an `up` is starting: that probe took the lock
    itself and wrote its own pid in it (an `up` refused at that moment named the probe),
    and it created the lock file in a directory no `up` had used."""
    from kvstore import devcluster

    assert devcluster.starting(tmp_path) is None
    assert not (tmp_path / devcluster.LOCK_FILE).exists()
    (tmp_path / devcluster.LOCK_FILE).write_text("999\n")  # a finished up's
    assert devcluster.starting(tmp_path) is None
    assert (tmp_path / devcluster.LOCK_FILE).read_text() == "999\n"


@pytest.mark.parametrize("grace", ["-1", "-0.5", "nan", "inf"])
def test_down_refuses_a_grace_that_is_not_a_number_of_seconds(grace, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["cluster", "down", "--state-dir", str(tmp_path), f"--grace={grace}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert f"--grace: must be a number of seconds from 0 to 3600, got '{grace}'" in err, err


def test_down_with_no_grace_is_accepted(tmp_path, capsys):
    assert main(["cluster", "down", "--state-dir", str(tmp_path), "--grace", "0"]) == 0
    assert "nothing to stop" in capsys.readouterr().out
