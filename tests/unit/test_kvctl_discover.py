"""Which cluster a bare kvctl command talks to (kvstore/cli/discover.py): --etcd >
--state-dir > $KVSTORE_ETCD > $KVSTORE_STATE_DIR > the nearest .state/cluster from the
current directory up to the repository root; with nothing found, an error that says what
was looked at and how to point kvctl at a cluster. State directories are real cluster.json
files written by ClusterState.save."""

from __future__ import annotations

import pytest

from kvstore.cli import discover
from kvstore.cli.discover import ETCD_ENV, STATE_ENV, NoCluster
from kvstore.devcluster import ClusterError, ClusterState

NO_ENV: dict[str, str] = {}


def _save(state_dir, endpoint: str) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    ClusterState(str(state_dir), endpoint, "", (), 0.0).save()


def test_precedence_flag_env_then_nearest_state_dir(tmp_path):
    repo = tmp_path / "repo"
    deep = repo / "a" / "b"
    deep.mkdir(parents=True)
    (repo / ".git").mkdir()
    _save(repo / ".state" / "cluster", "127.0.0.1:1111")
    _save(tmp_path / "other", "127.0.0.1:2222")

    found = discover.etcd(None, None, NO_ENV, start=deep)
    assert found.value == "127.0.0.1:1111"
    assert str(repo / ".state" / "cluster" / "cluster.json") in found.source
    assert discover.state_dir(None, NO_ENV, start=deep).value == str(repo / ".state/cluster")

    env = {STATE_ENV: str(tmp_path / "other")}
    assert discover.etcd(None, None, env, start=deep).value == "127.0.0.1:2222"
    assert discover.state_dir(None, env, start=deep).value == str(tmp_path / "other")
    env[ETCD_ENV] = "10.0.0.1:2379"
    assert discover.etcd(None, None, env, start=deep).value == "10.0.0.1:2379"
    assert discover.etcd(None, str(repo / ".state/cluster"), env).value == "127.0.0.1:1111"
    assert discover.etcd(
        "10.0.0.9:2379", str(tmp_path / "other"), env, start=deep
    ) == discover.Found("10.0.0.9:2379", "--etcd")
    assert discover.state_dir("given", env, start=deep).value == "given"
    # cluster up starts a cluster here, not in a parent
    assert (
        discover.state_dir(None, NO_ENV, start=deep, look_up=False).value == discover.DEFAULT_STATE
    )

    with pytest.raises(ClusterError, match=rf"\${STATE_ENV}=.*no local cluster in"):
        discover.etcd(None, None, {STATE_ENV: str(tmp_path / "none")}, start=deep)


def test_search_stops_at_the_repository_root(tmp_path):
    _save(tmp_path / ".state" / "cluster", "127.0.0.1:1111")  # outside the repository
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / ".git").write_text("gitdir: elsewhere\n")  # a worktree's .git is a file
    with pytest.raises(NoCluster) as err:
        discover.etcd(None, None, NO_ENV, start=repo / "src")
    msg = str(err.value)
    assert f"in {repo / 'src'}, {repo}." in msg and str(tmp_path) + "," not in msg
    for hint in (
        "make run",
        "kvctl cluster up",
        "--etcd HOST:PORT",
        "--state-dir DIR",
        f"${ETCD_ENV}",
        f"${STATE_ENV}",
    ):
        assert hint in msg, hint


@pytest.mark.parametrize(
    "argv,said",
    [
        (["status", "--etcd", ""], "argument --etcd: is empty"),
        (["status", "--etcd", " "], "argument --etcd: is empty"),
        (["status", "--state-dir", ""], "argument --state-dir: is empty"),
        # `cluster down --state-dir "$UNSET"` stopped the cluster of a parent directory
        (["cluster", "down", "--state-dir", ""], "argument --state-dir: is empty"),
        (["cluster", "status", "--state-dir", " "], "argument --state-dir: is empty"),
        (["cluster", "up", "--state-dir", ""], "argument --state-dir: is empty"),
        (["audit", "--limit", "-3"], "argument --limit: must be 0 or more"),  # was exit 0
    ],
)
def test_a_bad_flag_is_a_usage_error_before_any_search(argv, said, capsys):
    """`kvctl status --etcd "$UNSET"` talked to whatever local cluster it found instead."""
    from kvstore.cli.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert said in capsys.readouterr().err
