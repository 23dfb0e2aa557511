"""kvctl's flush and kill switch at their edges, against real etcd, agent and router
processes: the switch turned off when it is off already (or on when on), and Ctrl-C
(SIGINT to a real kvctl process) before and after the change was committed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from concurrent import futures

import grpc

import pytest
from support.common import PY, ROOT, Lines, make_namespace
from support.control import AgentClient, agent_cfg, kvctl, kvctl_json

SPEC = make_namespace()


@pytest.fixture(autouse=True)
def _no_leftover_env(monkeypatch):
    monkeypatch.delenv("KVSTORE_ETCD", raising=False)


def test_killswitch_off_when_off_and_on_when_on(etcd, spawn_agent, start_router):
    """Deleting an absent key makes no watch event, so `off` when off used to wait the
    whole timeout for acknowledgements that never came and exit 5."""
    spawn_agent(**agent_cfg(etcd))
    spawn_agent(**agent_cfg(etcd))
    router = start_router("r0")
    router.wait_nodes({"agent-0", "agent-1"})

    r = kvctl("killswitch", "off", "--timeout", "5", etcd=etcd)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "kill switch already off: nothing changed" in r.stdout
    assert "nodes acknowledged: 3/3" in r.stdout, r.stdout
    j = kvctl_json("killswitch", "off", "--timeout", "5", etcd=etcd)
    assert j["ok"] and j["changed"] is False
    audit = kvctl_json("audit", etcd=etcd)
    assert [(a["target"], a["ok"]) for a in audit] == [("off", True), ("off", True)]
    assert "already off: nothing changed in etcd" in audit[0]["result"], audit[0]

    r = kvctl("killswitch", "on", "--reason", "INC-1", "--timeout", "10", etcd=etcd)
    assert r.returncode == 0, r.stderr
    assert "it was ON already" not in r.stderr
    r = kvctl("killswitch", "on", "--reason", "INC-2", "--timeout", "10", etcd=etcd)
    assert r.returncode == 0, r.stderr
    assert "it was ON already (reason: INC-1, by test-operator)" in r.stderr, r.stderr
    assert "nodes acknowledged: 3/3" in r.stdout
    assert kvctl_json("killswitch", "status", etcd=etcd)["info"]["reason"] == "INC-2"
    audit = kvctl_json("audit", etcd=etcd)[-1]
    assert audit["ok"] and "was on already: INC-1" in audit["result"], audit

    r = kvctl("killswitch", "off", "--timeout", "10", etcd=etcd)
    assert r.returncode == 0 and "caching resumes" in r.stdout, r.stderr
    assert kvctl_json("killswitch", "status", etcd=etcd) == {"enabled": False}


def test_ctrl_c_while_off_when_off_waits_leaves_no_unconfirmed_record(etcd, spawn_agent):
    """`off` when off changes nothing but waits for a member whose last acknowledgement
    still says on (one frozen through the real `off`). Ctrl-C in that wait said "nothing
    changed" and exited 130, yet left an audit record saying committed, unconfirmed."""
    spawn_agent(**agent_cfg(etcd, lease_ttl_s=30))
    frozen = spawn_agent(**agent_cfg(etcd, lease_ttl_s=30))
    r = kvctl("killswitch", "on", "--reason", "INC-4", "--timeout", "30", etcd=etcd)
    assert r.returncode == 0, r.stderr
    os.kill(_pid(frozen), signal.SIGSTOP)
    p = None
    try:
        r = kvctl("killswitch", "off", "--timeout", "1", etcd=etcd)
        assert r.returncode == 5, r.stderr  # off in etcd; the frozen agent's ack says on
        before = kvctl_json("audit", etcd=etcd)
        p = _kvctl_process(etcd.endpoint, "killswitch", "off", "--timeout", "120")
        out, err_lines = Lines(p.stdout), Lines(p.stderr)
        err_lines.wait_line("waiting for")
        p.send_signal(signal.SIGINT)
        p.wait(60)
        err = err_lines.rest()
    finally:
        if p is not None:
            _reap(p)
        os.kill(_pid(frozen), signal.SIGCONT)
    assert p.returncode == 130, (out.rest(), err)
    assert "kvctl killswitch: interrupted; nothing changed" in err, err
    new = kvctl_json("audit", etcd=etcd)[len(before) :]
    assert not [a for a in new if not a["ok"] or "unconfirmed" in a["result"]], new


def _kvctl_process(endpoint: str, *argv: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_ETCD"}
    return subprocess.Popen(
        [PY, "-m", "kvstore.cli", *argv, "--etcd", endpoint],
        cwd=ROOT,
        env={**env, "KVSTORE_OPERATOR": "ops@test"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(
    "argv",
    [("flush", "acme/chat"), ("killswitch", "on", "--reason", "INC-3")],
    ids=["flush", "killswitch"],
)
def test_ctrl_c_after_the_commit_exits_5_and_says_committed(etcd, spawn_agent, argv):
    """One agent frozen (SIGSTOP): kvctl waits for its acknowledgement; Ctrl-C then
    exited 1 without a word, though the change was in force."""
    spawn_agent(**agent_cfg(etcd, lease_ttl_s=30))
    frozen = spawn_agent(**agent_cfg(etcd, lease_ttl_s=30))
    AgentClient(frozen.address).open(SPEC)
    os.kill(_pid(frozen), signal.SIGSTOP)
    p = _kvctl_process(etcd.endpoint, *argv, "--timeout", "120")
    try:
        out, err_lines = Lines(p.stdout), Lines(p.stderr)
        first = err_lines.wait_line("at etcd revision")
        revision = re.search(r"at etcd revision (\d+)", first).group(1)  # type: ignore[union-attr]
        p.send_signal(signal.SIGINT)
        p.wait(60)
        err = err_lines.rest()
    finally:
        _reap(p)
        os.kill(_pid(frozen), signal.SIGCONT)
    assert p.returncode == 5, (out.rest(), err)
    assert f"interrupted: COMMITTED at etcd revision {revision}" in err, err
    assert "acknowledgements unconfirmed" in err and "Traceback" not in err
    audit = kvctl_json("audit", etcd=etcd)[-1]
    assert audit["ok"] is False and "acknowledgements unconfirmed" in audit["result"]


class _MuteEtcd(grpc.GenericRpcHandler):
    """Fault injection: a gRPC server in place of etcd that takes every call and answers
    none (an etcd that hangs); `methods` lists the calls it got."""

    def __init__(self) -> None:
        self.methods: list[str] = []
        self.called = threading.Event()
        self._release = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[self])
        self.endpoint = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def service(self, details):
        def hang(request: bytes, context) -> bytes:
            self.methods.append(details.method)
            self.called.set()
            self._release.wait(60)
            context.abort(grpc.StatusCode.UNAVAILABLE, "test: released")

        return grpc.unary_unary_rpc_method_handler(hang)

    def close(self) -> None:
        self._release.set()
        self._server.stop(0)


def test_ctrl_c_before_the_commit_exits_130_and_changes_nothing():
    """etcd hangs: kvctl waits on its first call (flush lists the records before it
    writes); Ctrl-C there changed nothing, and says so."""
    mute = _MuteEtcd()
    try:
        p = _kvctl_process(mute.endpoint, "flush", "acme/chat", "--etcd-timeout", "120")
        assert mute.called.wait(60), p.communicate()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        mute.close()
    assert p.returncode == 130, (out, err)
    assert "kvctl flush: interrupted; nothing changed" in err, err
    assert "Traceback" not in err
    assert mute.methods == ["/etcdserverpb.KV/Range"], mute.methods  # no Txn was sent


def _reap(p: subprocess.Popen) -> None:
    """A kvctl a failed test left waiting is killed, not left to its --timeout."""
    if p.poll() is None:
        p.kill()
    p.wait(30)


def _pid(proc) -> int:
    assert proc.proc is not None, "not running"
    return proc.proc.pid


def test_usage_messages_are_specific_and_short(etcd, spawn_agent, tmp_path):
    """Negative sizes and durations got argparse's "expected one argument"; a 100 kB
    name was echoed whole, twice; --reason was taken and ignored with off and status; a
    misspelt tenant listed nothing without a word; an empty trace analysed to zeros."""
    AgentClient(spawn_agent(**agent_cfg(etcd)).address).open(SPEC)
    for argv, says in (
        (("quota", "set", "acme", "--hbm", "-5GiB"), "--hbm cannot be negative, got '-5GiB'"),
        (("quota", "set", "acme", "--nvme=-1"), "--nvme cannot be negative"),
        # 5 bytes, under one block: every block of the tenant evicted at once
        (("quota", "set", "acme", "--hbm", "5"), "--hbm '5' has no unit; give one, e.g. 5GiB"),
        (("status", "--seen-window", "-1h"), "--seen-window: must be more than 0, got '-1h'"),
        (("plan", "--hbm", "-40GiB"), "--hbm: a size cannot be negative, got '-40GiB'"),
        (("audit", "--limit", "-3"), "--limit: must be 0 or more, got -3"),
        (("killswitch", "off", "--reason", "why"), "--reason goes with `killswitch on` only"),
        (("killswitch", "status", "--reason", "why"), "--reason goes with `killswitch on`"),
        (("killswitch", "on", "--reason", "x" * 5000), "--reason is 5000 characters"),
        (("killswitch", "on", "--reason", "INC\x1b[2J"), "--reason 'INC\\x1b[2J' has control"),
        (("killswitch", "on", "--reason", "two\nlines"), "has control characters"),
        (("quota", "set", "a" * 300, "--hbm", "1GiB"), "longer than 256 characters"),
        (("stats", "--tenant", ""), "tenant name '' is empty"),
    ):
        r = kvctl(*argv, etcd=etcd)
        assert r.returncode == 2, (argv[:3], r.stderr)
        assert says in r.stderr, (argv[:3], r.stderr)
        assert "expected one argument" not in r.stderr

    huge = "n" * 100_000
    r = kvctl("flush", f"acme/{huge}", etcd=etcd)
    assert r.returncode in (1, 2) and len(r.stderr) < 1000, len(r.stderr)
    assert "(100005 chars)" in r.stderr or "(100000 chars)" in r.stderr, r.stderr

    r = kvctl("namespaces", "--tenant", "acmee", etcd=etcd)
    assert r.returncode == 0 and "no such tenant 'acmee'" in r.stderr, r.stderr
    assert "no such tenant" not in r.stdout and "acmee: 0 namespaces" in r.stdout  # said once
    assert "Did you mean acme?" in r.stderr
    r = kvctl("stats", "--tenant", "ACME", etcd=etcd)
    assert "no such tenant 'ACME'" in r.stderr and "Did you mean acme?" in r.stderr, r.stderr

    assert kvctl("killswitch", "on", "--reason", "INC-9 pollution", etcd=etcd).returncode == 0
    r = kvctl("audit", etcd=etcd)
    assert "(reason: INC-9 pollution)" in r.stdout, r.stdout
    r = kvctl("killswitch", "--help", etcd=None)
    assert "acknowledgements (default 30" in " ".join(r.stdout.split())
    for cmd, described in (
        ("status", "0 with health degraded when only a tier reports a problem"),
        ("stats", "node-wide counters"),
        ("audit", "recorded in etcd in the transaction that makes it"),
    ):
        assert described in " ".join(kvctl(cmd, "--help").stdout.split()), cmd
    assert "(default 50; 0: all)" in " ".join(kvctl("audit", "--help").stdout.split())

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = kvctl("analyze", str(empty))
    assert r.returncode == 1 and "the trace holds no requests" in r.stderr, r.stderr


def test_what_etcd_holds_reaches_the_terminal_escaped(etcd):
    """An operator's login name (KVSTORE_OPERATOR, else LOGNAME) is stored as it is: with
    an escape sequence in it, `audit` and `killswitch status` printed it raw, and the
    terminal obeyed it. Every table cell and the switch's line show such characters
    escaped; the JSON output keeps the value as stored."""
    who = "mallory\x1b[2J\x1b[31m"
    r = kvctl("killswitch", "on", "--reason", "INC-7", etcd=etcd, KVSTORE_OPERATOR=who)
    assert r.returncode == 0, r.stderr
    for argv in (("audit",), ("killswitch", "status")):
        out = kvctl(*argv, etcd=etcd).stdout
        assert "\x1b" not in out and "mallory\\x1b[2J\\x1b[31m" in out, (argv, out)
    assert kvctl_json("killswitch", "status", etcd=etcd)["info"]["by"].startswith(who)
    assert kvctl("killswitch", "off", etcd=etcd).returncode == 0
