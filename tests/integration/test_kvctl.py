"""kvctl's control-plane commands against real etcd and a real agent: both output formats,
exit codes (2 bad usage, 3 etcd unreachable, 4 node unreachable), --state-dir, and the
audit log. Most calls run kvctl's main() in-process (the same code `python -m kvstore.cli`
runs, without paying an interpreter start per call); a few go through the real process."""

from __future__ import annotations

import json

import grpc

import pytest
from support.common import free_port, make_namespace
from support.control import AgentClient, agent_cfg, kvctl, with_fake_member

from kvstore.cli.__main__ import main as kvctl_main

SPEC = make_namespace()
BETA = make_namespace(tenant="beta")


@pytest.fixture(autouse=True)
def _operator(monkeypatch):
    monkeypatch.setenv("KVSTORE_OPERATOR", "ops@test")
    monkeypatch.delenv("KVSTORE_ETCD", raising=False)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = kvctl_main(list(argv))
    except SystemExit as exc:  # argparse usage errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv: str, rc: int = 0):
    code, out, err = run(capsys, *argv, "--output", "json")
    assert code == rc, (code, out, err)
    return json.loads(out)


def test_unreadable_quota_records_are_named_not_hidden(etcd, capsys):
    """Records under tenants/ written by hand or another tool, which the agents ignore:
    `quota list` said "no quotas set" and `status` "0 tenants"; `quota get` said "not
    JSON" as a usage error (exit 2), naming neither the key nor what fixes it."""
    import asyncio

    from kvstore.coord.etcd import TENANTS, EtcdClient

    async def put(key: str, value: bytes) -> None:
        async with EtcdClient(etcd.endpoint, timeout=5) as c:
            await c.put(key, value)

    asyncio.run(put(TENANTS + "junk", b"not json"))
    asyncio.run(put(TENANTS + "odd", b'{"hbm_limit_bytes": "lots"}'))
    e = ("--etcd", etcd.endpoint)
    assert run(capsys, "quota", "set", "acme", "--hbm", "1GiB", *e)[0] == 0
    rc, out, err = run(capsys, "quota", "get", "junk", *e)
    assert rc == 1, (out, err)
    assert "etcd key tenants/junk holds no readable quota" in err
    assert "kvctl quota clear junk` removes it" in err
    rc, out, err = run(capsys, "quota", "list", *e)
    assert rc == 1 and "acme" in out, (out, err)
    assert "tenants/junk" in err and "tenants/odd" in err
    assert set(run_json(capsys, "quota", "list", *e, rc=1)) == {"acme"}  # JSON, still exit 1
    rc, out, _ = run(capsys, "status", *e)
    assert "quotas:      1 tenants, 2 unreadable records (kvctl quota list names them)" in out
    assert run_json(capsys, "status", *e, rc=rc)["quotas_unreadable"] == ["junk", "odd"]
    for tenant in ("junk", "odd"):
        assert run(capsys, "quota", "clear", tenant, *e)[0] == 0
    assert run(capsys, "quota", "list", *e)[0] == 0


def test_quota_commands_in_both_formats(etcd, capsys):
    e = ("--etcd", etcd.endpoint)
    rc, out, err = run(capsys, "quota", "set", "acme", "--hbm", "10GiB", "--nvme", "200GiB", *e)
    assert rc == 0, err
    assert out.split("\n")[0].split() == ["tenant", "hbm", "per", "node", "nvme", "per", "node"]
    assert out.split("\n")[1].split() == ["acme", "10.0", "GiB", "200.0", "GiB"]
    assert run_json(capsys, "quota", "get", "acme", *e) == {
        "acme": {"hbm_limit_bytes": 10 << 30, "nvme_limit_bytes": 200 << 30}
    }
    run(capsys, "quota", "set", "beta", "--nvme", "0", *e)  # 0: explicitly unlimited
    assert run_json(capsys, "quota", "set", "acme", "--hbm", "1GiB", *e) == {
        "acme": {"hbm_limit_bytes": 1 << 30, "nvme_limit_bytes": 200 << 30}
    }, "nvme kept"
    rc, out, _ = run(capsys, "quota", "list", *e)
    assert "beta (config) unlimited" in " ".join(out.split()), out
    assert set(run_json(capsys, "quota", "list", *e)) == {"acme", "beta"}
    assert run(capsys, "quota", "clear", "beta", *e)[0] == 0
    rc, _, err = run(capsys, "quota", "clear", "beta", *e)
    assert rc == 1 and "has no quota" in err
    rc, _, err = run(capsys, "quota", "get", "beta", *e)
    assert rc == 1 and "configured limits apply" in err
    for bad in (
        ("quota", "set", "acme"),
        ("quota", "set", "acme", "--hbm", "lots"),
        ("quota", "set", "a/b", "--hbm", "1GiB"),
        ("quota", "set", "acme", "--hbm", "20000000TB"),  # over uint64: broke every Stats
        ("quota", "set", "_cluster", "--hbm", "1GiB"),
        ("quota", "set", "ac me", "--hbm", "1GiB"),  # a typo, not a tenant
        ("quota", "set", "acme\n", "--hbm", "1GiB"),
        # timeouts that made every call fail at once, reported as an unreachable etcd
        ("status", "--etcd-timeout", "0"),
        ("status", "--etcd-timeout", "nan"),
        ("nodes", "--node-timeout", "-1"),
        ("flush", "acme/chat", "--timeout", "-5"),
        ("flush", "noslash"),
        ("status", "--output", "xml"),
    ):
        rc, _, err = run(capsys, *bad, *e)
        assert rc == 2, (bad, err)
        assert err.strip(), bad

    audit = run_json(capsys, "audit", *e)
    assert [(a["action"], a["target"], a["who"], a["ok"]) for a in audit] == [
        ("quota-set", "acme", "ops@test", True),
        ("quota-set", "beta", "ops@test", True),
        ("quota-set", "acme", "ops@test", True),
        ("quota-clear", "beta", "ops@test", True),
    ]
    rc, out, _ = run(capsys, "audit", "--limit", "1", *e)
    lines = out.strip().split("\n")
    assert lines[0].split()[:4] == ["when", "(UTC)", "who", "action"] and len(lines) == 2
    assert "quota-clear" in lines[1] and "ops@test" in lines[1]


def test_damaged_audit_records_are_named_not_skipped(etcd, capsys):
    """`kvctl audit` passed over a record it could not read without a word (exit 0): an
    edit by hand or a record cut short went unnoticed in the one log of what operators
    did. The others are still listed; the damaged ones are named on stderr, exit 1."""
    import asyncio

    from kvstore.coord.admin_records import AUDIT
    from kvstore.coord.etcd import EtcdClient

    async def put(key: str, value: bytes) -> None:
        async with EtcdClient(etcd.endpoint, timeout=5) as c:
            await c.put(key, value)

    e = ("--etcd", etcd.endpoint)
    assert run(capsys, "quota", "set", "acme", "--hbm", "1GiB", *e)[0] == 0
    asyncio.run(put(AUDIT + "99999999999999999999-zz", b'{"at": "soon"}'))
    rc, out, err = run(capsys, "audit", *e)
    assert rc == 1 and "quota-set" in out, (out, err)
    assert f"kvctl audit: etcd key {AUDIT}99999999999999999999-zz holds no readable" in err, err
    assert [a["action"] for a in run_json(capsys, "audit", *e, rc=1)] == ["quota-set"]
    # Times no calendar shows: they parsed, then printing them raised (a traceback, or
    # exit 2 "Invalid value NaN" with nothing listed).
    fields = b'"who": "x", "action": "flush", "target": "t", "ok": true, "result": "r"'
    for i, at in enumerate((b"1e300", b"-1e20", b"NaN", b"9" * 400)):
        asyncio.run(
            put(f"{AUDIT}9999999999999999999{i}-bad", b'{"at": ' + at + b", " + fields + b"}")
        )
    rc, out, err = run(capsys, "audit", "--limit", "0", *e)
    assert rc == 1 and "quota-set" in out and err.count("holds no readable") == 5, (out, err)
    assert run(capsys, "audit", "--limit", "1", *e)[0] == 1  # the damaged one is the last
    assert run(capsys, "audit", "--limit", "0", *e)[0] == 1


def _traffic(client: AgentClient) -> None:
    """acme: one full hit (4/4 blocks) and one miss (0/12): request-weighted 50%,
    token-weighted 25%. beta: one full hit."""
    for spec in (SPEC, BETA):
        client.open(spec)
    ids = client.put_chain(SPEC, 1, 4, 0)
    assert client.lookup(SPEC, ids, 0).matched == 4
    from support.control import chain

    assert client.lookup(SPEC, chain(SPEC, 2, 12, 0)[0], 0).matched == 0
    beta = client.put_chain(BETA, 3, 2, 0)
    assert client.lookup(BETA, beta, 0).matched == 2


def test_status_nodes_stats_in_both_formats(etcd, spawn_agent, start_router, capsys):
    e = ("--etcd", etcd.endpoint)
    start_router()  # without one, status says degraded (test_status_names_agents_…)
    agent = spawn_agent(**agent_cfg(etcd))
    _traffic(AgentClient(agent.address))
    assert run(capsys, "flush", "acme/chat", *e)[0] == 0

    rc, out, err = run(capsys, "status", *e)
    assert rc == 0, err
    assert "health:      healthy" in out and "agents:      1/1 reachable" in out
    assert "kill switch: off" in out and "namespaces:  2" in out
    st = run_json(capsys, "status", *e)
    assert st["health"] == "healthy" and st["unreachable"] == []
    assert st["etcd"]["version"].startswith("3.") and st["namespaces"] == 2
    assert [n["node_id"] for n in st["nodes"]] == ["agent-0"]

    rc, out, _ = run(capsys, "nodes", *e)
    header, row = out.strip().split("\n")[:2]
    assert header.split()[:4] == ["node", "address", "device", "state"]
    assert row.split()[:4] == ["agent-0", agent.address, "cpu", "up"]
    nodes = run_json(capsys, "nodes", *e)["nodes"]
    hbm = next(t for t in nodes[0]["tiers"] if t["tier"] == "hbm")
    assert hbm["blocks"] == 2 and hbm["capacity_bytes"] == 16 << 20  # acme's 4 were flushed

    stats = run_json(capsys, "stats", *e)
    by = {t["tenant"]: t for t in stats["tenants"]}
    assert by["acme"]["request_hit_rate"] == 0.5 and by["acme"]["token_hit_rate"] == 0.25
    assert by["beta"]["request_hit_rate"] == 1.0 and by["beta"]["token_hit_rate"] == 1.0
    assert stats["evictions"] == {"blocks_dropped_flush": 4}
    only = run_json(capsys, "stats", "--tenant", "beta", *e)
    assert [t["tenant"] for t in only["tenants"]] == ["beta"]
    assert only["evictions"] == {}  # acme's flush is not beta's
    acme = run_json(capsys, "stats", "--tenant", "acme", *e)
    assert acme["evictions"] == {"blocks_dropped_flush": 4}  # was always "no evictions"
    rc, out, _ = run(capsys, "stats", "--tenant", "acme", *e)
    assert "no evictions" not in out and "blocks_dropped_flush  4" in out, out
    rc, out, _ = run(capsys, "stats", "--tenant", "beta", *e)
    assert "no evictions of tenant beta" in out
    # bytes summed over nodes are labelled so, next to the most on one node
    assert "hbm used: all nodes (max/node)" in out and "quotas are per node" in out
    rc, out, _ = run(capsys, "stats", *e)
    acme_row = next(line for line in out.split("\n") if line.startswith("acme"))
    assert acme_row.split()[1:4] == ["2", "50.0%", "25.0%"]
    assert "blocks_dropped_flush  4" in out and "namespace flushed" in out

    by_id = run_json(capsys, "flush", f"beta/{BETA.namespace_id.hex()}", *e)  # by namespace id
    assert [(n["ns_hex"], n["new_generation"]) for n in by_id["namespaces"]] == [
        (BETA.namespace_id.hex(), 1)
    ]

    # a registered node that does not answer: exit 4, named, the rest still shown
    def check_unreachable():
        rc, out, err = run(capsys, "nodes", "--node-timeout", "1", *e)
        assert rc == 4, (out, err)
        assert "node ghost at 127.0.0.1:9 is unreachable" in err
        assert "UNREACHABLE" in out and "agent-0" in out
        st = run_json(capsys, "status", "--node-timeout", "1", *e, rc=4)
        assert st["health"] == "degraded" and st["unreachable"] == ["ghost"]

    with_fake_member(etcd.endpoint, "ghost", check_unreachable)


def test_etcd_unreachable_and_state_dir(tmp_path, etcd, capsys):
    dead = f"127.0.0.1:{free_port()}"
    for argv in (
        ("status",),
        ("nodes",),
        ("stats",),
        ("audit",),
        ("quota", "list"),
        ("killswitch", "status"),
        ("flush", "acme/chat"),
    ):
        rc, out, err = run(capsys, *argv, "--etcd", dead, "--etcd-timeout", "1")
        assert rc == 3, (argv, err)
        assert f"etcd unreachable at {dead}" in err and "is etcd running?" in err
        assert out == ""

    rc, _, err = run(capsys, "status", "--state-dir", str(tmp_path / "none"))
    assert rc == 2 and "no local cluster" in err
    from kvstore.devcluster import ClusterState

    ClusterState(str(tmp_path), etcd.endpoint, "", (), 0.0).save()
    st = run_json(capsys, "status", "--state-dir", str(tmp_path))
    assert st["etcd_endpoints"] == [etcd.endpoint] and st["health"] == "no agents"


def test_real_process_exit_codes_and_wiring(etcd):
    r = kvctl("killswitch", "status", "--output", "json", etcd=etcd, process=True)
    assert r.returncode == 0 and json.loads(r.stdout) == {"enabled": False}, r.stderr
    r = kvctl("status", etcd=f"127.0.0.1:{free_port()}", process=True)
    assert r.returncode == 3 and "etcd unreachable" in r.stderr
    r = kvctl("flush", "acme", process=True)
    assert r.returncode == 2 and "TENANT/NAMESPACE" in r.stderr
    for cmd in ("plan", "analyze"):  # existing commands stay wired next to the new ones
        r = kvctl(cmd, "--help", process=True)
        assert r.returncode == 0 and f"usage: kvctl {cmd}" in r.stdout


def test_stats_count_each_request_once_whichever_calls_it_made(etcd, spawn_agent, capsys):
    """Engine requests reach the agent as several calls: a Get alone (the replay), Lookups
    repeated while the request waits then a Get of a tail (vLLM's scheduler and worker),
    a plain fetch. `kvctl stats` counts each once, its hit = what the request got."""
    import torch

    from kvstore.client import KVClient
    from kvstore.client.convert import block_shape, torch_dtype
    from support.common import TEST_SECRET, prompt_tokens

    e = ("--etcd", etcd.endpoint)
    agent = spawn_agent(**agent_cfg(etcd))
    bs = SPEC.block_size
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as c:
        ns = c.open_namespace(SPEC)
        tokens = prompt_tokens(5, 6 * bs)
        kv = [torch.zeros(block_shape(SPEC), dtype=torch_dtype(SPEC.kv_dtype))] * 4
        c.store(ns, tokens[: 4 * bs], kv)  # 4 of the 6 blocks cached
        ids = c.block_ids(ns, tokens)
        # 1: Get alone, all 6 blocks asked, 4 served (gRPC and shared memory alike).
        assert len(c.get(ns, ids, request_id="replay-1")) == 4
        # 2: Get alone of a prompt not cached: a miss.
        miss = c.block_ids(ns, prompt_tokens(6, 3 * bs))
        assert c.get_views(ns, miss, request_id="replay-2") == []
        # 3: three Lookups while waiting, then a Get of blocks 2..3 (the engine held 0..1).
        for _ in range(3):
            assert c.lookup(ns, ids[:5], request_id="vllm-7").matched == 4
        assert len(c.get_views(ns, ids[2:4], ids[1], request_id="vllm-7")) == 2
        # 4: a fetch (its Lookup and Get, one request).
        assert c.fetch(ns, tokens).cached_blocks == 4
        # 5: the engine's own prefix cache held blocks 0..1: kvstore's part is 2 of 3.
        assert c.lookup(ns, ids[:5], request_id="vllm-8", caller_held=2).matched == 4
        # 6: the engine held every block it asked about: not kvstore's request at all.
        assert c.lookup(ns, ids[:4], request_id="vllm-9", caller_held=4).matched == 4
        # A caller cannot hold more blocks than it names.
        with pytest.raises(grpc.RpcError) as bad:
            c.lookup(ns, ids[:2], request_id="vllm-10", caller_held=3)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "caller_held is 3, more than the 2 blocks named" in bad.value.details()
    stats = run_json(capsys, "stats", "--tenant", SPEC.tenant, *e)
    (acme,) = stats["tenants"]
    assert (acme["lookups"], acme["lookup_hits"]) == (5, 4)
    assert (acme["lookup_blocks"], acme["lookup_hit_blocks"]) == (
        6 + 3 + 5 + 6 + 3,
        4 + 0 + 4 + 4 + 2,
    )
    assert acme["request_hit_rate"] == 0.8


def test_status_names_agents_and_routers_seen_but_gone(etcd, spawn_agent, start_router, capsys):
    """An agent killed with -9 stays expected once its lease expired: status says degraded
    (exit 4) and names it with when it was last seen, stats says it summed fewer agents;
    `nodes forget` drops a decommissioned one. No router at all is degraded too."""
    from support.common import wait_for

    e = ("--etcd", etcd.endpoint)
    router = start_router()
    dead = spawn_agent(**agent_cfg(etcd))
    spawn_agent(**agent_cfg(etcd))
    wait_for(
        lambda: (
            run(capsys, "status", *e)[0] == 0 and "2/2 reachable" in run(capsys, "status", *e)[1]
        ),
        what="both agents and the router registered",
    )
    wait_for(lambda: _seen_ids(etcd) >= {"agent/agent-0", "agent/agent-1"}, what="seen records")
    dead.kill()
    wait_for(
        lambda: [n["node_id"] for n in run_json(capsys, "nodes", *e, rc=4)["nodes"]] == ["agent-1"],
        timeout=30,
        what="agent-0's lease expired",
    )
    rc, out, err = run(capsys, "status", *e)
    assert rc == 4, (out, err)
    assert "health:      degraded" in out and "agents:      1/2 reachable (1 missing)" in out
    assert "agent agent-0 at " in out and "missing: last seen" in out
    assert "kvctl nodes forget agent-0" in err
    st = run_json(capsys, "status", *e, rc=4)
    assert st["health"] == "degraded"
    assert [(m["kind"], m["member_id"]) for m in st["missing"]] == [("agent", "agent-0")]
    rc, out, err = run(capsys, "nodes", *e)
    assert rc == 4 and "MISSING (last seen" in out
    rc, out, err = run(capsys, "stats", *e)
    assert rc == 4 and "PARTIAL: summed over 1 of 2 agents (agent-0 not counted)" in out
    stats = run_json(capsys, "stats", *e, rc=4)
    assert (stats["agents_summed"], stats["agents_expected"]) == (1, 2)
    # a window shorter than since it was seen: no longer expected
    assert run(capsys, "status", "--seen-window", "0.001s", *e)[0] == 0

    rc, _, err = run(capsys, "nodes", "forget", "agent-1", *e)
    assert rc == 1 and "is live" in err
    rc, out, err = run(capsys, "nodes", "forget", "agent-0", *e)
    assert rc == 0 and "forgot agent-0" in out, err
    rc, out, err = run(capsys, "status", *e)
    assert rc == 0 and "health:      healthy" in out and "1/1 reachable" in out, (out, err)
    assert run_json(capsys, "audit", *e)[-1]["action"] == "nodes-forget"

    router.stop()  # a clean stop: the router leaves, its seen record with it
    wait_for(lambda: run(capsys, "status", *e)[0] == 4, what="the router gone")
    rc, out, err = run(capsys, "status", *e)
    assert "health:      degraded" in out and "routers:     0 (none registered" in out
    assert "no router registered" in err


def test_an_agent_stopped_cleanly_is_stopped_not_missing(etcd, spawn_agent, start_router, capsys):
    """An agent that stopped on SIGTERM (it left etcd itself) is listed as stopped, with
    when, and does not make status, nodes or stats exit 4; one frozen past its lease at
    the same time is missing (exit 4). Coming back under its id clears the mark; `nodes
    forget` drops a stopped one's record."""
    import os
    import signal

    from support.common import wait_for

    e = ("--etcd", etcd.endpoint)
    start_router()
    spawn_agent(**agent_cfg(etcd))
    leaver = spawn_agent(**agent_cfg(etcd))
    frozen = spawn_agent(**agent_cfg(etcd))
    wait_for(lambda: _seen_ids(etcd) >= {f"agent/agent-{i}" for i in range(3)}, what="seen")
    wait_for(lambda: run(capsys, "status", *e)[0] == 0, what="every member registered")

    leaver.stop()  # SIGTERM: revokes its lease, marks its seen record stopped
    rc, out, err = run(capsys, "status", *e)
    assert rc == 0, (out, err)
    assert "health:      healthy" in out and "agents:      2/2 reachable (1 stopped)" in out
    assert "agent agent-1 at " in out and "stopped cleanly" in out
    st = run_json(capsys, "status", *e)
    assert [(m["kind"], m["member_id"]) for m in st["stopped"]] == [("agent", "agent-1")]
    assert st["missing"] == [] and st["problems"] == []
    rc, out, err = run(capsys, "nodes", *e)
    assert rc == 0 and "stopped (" in out, (out, err)
    rc, out, err = run(capsys, "stats", *e)
    assert rc == 0 and "PARTIAL" not in out, (out, err)
    stats = run_json(capsys, "stats", *e)
    assert (stats["agents_summed"], stats["agents_expected"]) == (2, 2)
    assert [m["member_id"] for m in stats["stopped"]] == ["agent-1"]

    os.kill(frozen.proc.pid, signal.SIGSTOP)  # vanishes without leaving: missing
    try:
        wait_for(lambda: run(capsys, "status", *e)[0] == 4, timeout=30, what="its lease gone")
        st = run_json(capsys, "status", *e, rc=4)
        assert [m["member_id"] for m in st["missing"]] == ["agent-2"]
        assert [m["member_id"] for m in st["stopped"]] == ["agent-1"]
        rc, out, _ = run(capsys, "nodes", *e)
        assert rc == 4 and "MISSING (last seen" in out and "stopped (" in out
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    wait_for(lambda: run(capsys, "status", *e)[0] == 0, timeout=30, what="agent-2 back")

    leaver.start()  # back under its id: its record is written afresh
    wait_for(lambda: run_json(capsys, "status", *e)["stopped"] == [], what="agent-1 back")
    leaver.stop()
    wait_for(lambda: run_json(capsys, "status", *e)["stopped"] != [], what="stopped again")
    rc, out, err = run(capsys, "nodes", "forget", "agent-1", *e)
    assert rc == 0 and "forgot agent-1" in out, err
    st = run_json(capsys, "status", *e)
    assert st["stopped"] == [] and st["missing"] == []


def _seen_ids(etcd) -> set[str]:
    """The seen/ records the members wrote (raw etcd, no kvstore helper)."""
    import asyncio

    from kvstore.coord.etcd import EtcdClient

    async def main():
        async with EtcdClient(etcd.endpoint) as client:
            _, items = await client.list("seen/")
            return {kv.key.removeprefix("seen/") for kv in items}

    return asyncio.run(main())


def test_quota_set_warns_of_a_tenant_never_seen_and_says_how_it_applies(etcd, capsys):
    e = ("--etcd", etcd.endpoint)
    rc, _, err = run(capsys, "quota", "set", "nosuchtenant", "--hbm", "1MiB", *e)
    assert rc == 0, err  # a quota may be set before the tenant's first namespace
    assert "warning: no namespace of tenant 'nosuchtenant' is registered in etcd" in err
    assert "each agent applies it when its quota watch delivers it" in err
    assert "does not wait for the agents" in err
    rc, _, err = run(capsys, "quota", "set", "other", "--hbm", "1MiB", "--strict", *e)
    assert rc == 1 and "nothing set (--strict)" in err
    assert set(run_json(capsys, "quota", "list", *e)) == {"nosuchtenant"}
    rc, out, _ = run(capsys, "quota", "set", "--help")
    assert "0 removes the limit" in " ".join(out.split())


def test_output_to_a_closed_pipe_ends_quietly(etcd):
    """`kvctl status | head -5`: the reader is gone before kvctl writes; no traceback."""
    import os
    import subprocess

    from support.common import PY, ROOT

    for argv in (("status",), ("audit",), ("killswitch", "status")):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader already left
        try:
            p = subprocess.run(
                [PY, "-m", "kvstore.cli", *argv, "--etcd", etcd.endpoint],
                cwd=ROOT,
                env={k: v for k, v in os.environ.items() if k != "KVSTORE_ETCD"},
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
            )
        finally:
            os.close(write_end)
        assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr
        assert p.returncode == 141, (argv, p.stderr)  # as `yes | head -1` (SIGPIPE), not 1
