"""kvctl's help texts and the messages and exit codes of mistakes that need no cluster:
the kill switch needs a reason, no cluster configured is a usage problem (2), a cluster
state directory named in an error reads as a source, not as a flag."""

from __future__ import annotations

import pytest

from kvstore.cli.__main__ import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse: --help and usage errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_describes_every_option(capsys):
    rc, out, _ = run(capsys, "cluster", "up", "--help")
    assert rc == 0
    flat = " ".join(out.split())
    assert "--output {table,json} table: progress and addresses" in flat, out
    rc, out, _ = run(capsys, "quota", "set", "--help")
    assert rc == 0 and "0 removes the limit" in " ".join(out.split())
    rc, out, _ = run(capsys, "killswitch", "--help")
    assert "why (required with on)" in " ".join(out.split())


@pytest.mark.parametrize("reason", [None, "", "   "])
def test_killswitch_on_needs_a_reason(capsys, reason):
    extra = [] if reason is None else ["--reason", reason]
    # etcd is never reached: the refusal comes first (an unroutable endpoint)
    rc, out, err = run(capsys, "killswitch", "on", *extra, "--etcd", "127.0.0.1:1")
    assert rc == 2 and "killswitch on needs --reason" in err and out == ""


def test_no_cluster_configured_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for var in ("KVSTORE_ETCD", "KVSTORE_STATE_DIR"):
        monkeypatch.delenv(var, raising=False)
    rc, out, err = run(capsys, "status")
    assert rc == 2, err
    assert "no cluster to talk to (none is configured)" in err and "etcd unreachable" not in err


def test_cluster_status_names_where_the_state_dir_came_from(tmp_path, capsys):
    state = tmp_path / "gone"
    state.mkdir()
    rc, _, err = run(capsys, "cluster", "status", "--state-dir", str(state))
    assert rc == 1 and "start one with" in err, err
    assert "[--state-dir]" not in err and "(state directory from --state-dir)" in err


def test_arguments_quoted_in_messages_are_clipped_with_their_length():
    """One helper (kvstore.errors.clip) for kvctl's messages and the control plane's
    "no namespace named …": repr'd, or as typed (`bare`) when printable, and a long one
    cut at 80 characters with its length."""
    from kvstore.errors import clip

    assert clip("acme") == "'acme'" and clip("acme/chat", bare=True) == "acme/chat"
    assert clip(" acme", bare=True) == "' acme'" and clip("a\nb", bare=True) == "'a\\nb'"
    long = "n" * 100_000
    assert clip(long) == repr("n" * 80) + "… (100000 chars)"
    assert clip(long, bare=True) == "n" * 80 + "… (100000 chars)"
    assert clip("x" * 100, 60).endswith("… (100 chars)")


def test_version(capsys):
    from importlib.metadata import version

    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.strip() == f"kvctl {version('kvstore')}"


@pytest.mark.parametrize(
    "argv",
    [
        ("status", "--seen-window", "y" * 300),  # argparse's own error, our type's words
        ("killswitch", "k" * 300),  # argparse's invalid choice
        ("plan", "--hbm", "1GiB", "--model", "m" * 300),
        ("plan", "--hbm", "1GiB", "--model", "llama-3-8b", "--kv-dtype", "d" * 300),
        ("quota", "set", "acme", "--hbm", "9" * 300 + "GiB"),
        ("status", "--bogus", "u" * 300),  # unrecognized arguments
    ],
)
def test_a_long_argument_is_echoed_cut_at_80_characters(capsys, argv):
    """docs/api.md: arguments echoed in messages are cut at 80 characters with their
    length; these echoed all 300."""
    rc, _, err = run(capsys, *argv, *(("--etcd", "127.0.0.1:1") if argv[0] != "plan" else ()))
    assert rc == 2, err
    assert "chars)" in err and max(map(len, err.split())) < 100, err


@pytest.mark.parametrize(
    "argv,command,extras",
    [
        (("status", "--bogus"), "kvctl status", "--bogus"),
        (("cluster", "status", "--bogus"), "kvctl cluster status", "--bogus"),
        (("quota", "get", "acme", "--x", "1"), "kvctl quota get", "--x 1"),
    ],
)
def test_an_unknown_option_is_refused_with_its_commands_usage(capsys, argv, command, extras):
    """It was refused with kvctl's top-level usage ("kvctl [-h] [--version] COMMAND"),
    which says nothing of the command's options."""
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and err.startswith(f"usage: {command} "), err
    assert f"{command}: error: unrecognized arguments: {extras}\n" in err, err
