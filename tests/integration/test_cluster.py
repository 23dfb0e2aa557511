"""Cluster membership end to end (agents join and leave, etcd restarts) and the local
development cluster driven through `kvctl cluster` and ClusterClient."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from support.cluster import agent_config, settle, spawn_many
from support.common import ROOT, TEST_SECRET, make_namespace, prompt_tokens, wait_for

from kvstore.devcluster import STARTING_FILE, ClusterState
from kvstore.devprocs import alive
from kvstore.client import KVClient
from kvstore.client.cluster import ClusterClient
from kvstore.client.convert import block_shape
from kvstore.hashing import hash_chain, pack_ids

SPEC = make_namespace()
NS_ID = SPEC.namespace_id


def test_agents_join_and_leave(etcd, spawn_agent, start_router):
    a0, a1 = spawn_many(spawn_agent, 2, **agent_config(etcd, lease_ttl_s=2))
    router = start_router()
    router.wait_nodes({"agent-0", "agent-1"})
    # A crash: nothing revokes the lease; the router drops the node when it expires.
    a1.kill()
    router.wait_nodes({"agent-0"}, timeout=20)
    prompt = pack_ids(hash_chain(bytes(16), prompt_tokens(1, 64), 16))
    for i in range(3):
        assert router.route(NS_ID, prompt, request_id=f"r{i}").node_id == "agent-0"
    # A new agent joins and takes load.
    spawn_agent(**agent_config(etcd, lease_ttl_s=2))
    router.wait_nodes({"agent-0", "agent-2"})
    assert router.route(NS_ID, prompt, dry_run=True).node_id == "agent-2"  # a0 is busy
    # A clean shutdown revokes the lease: gone at once, no waiting for expiry.
    a0.stop()
    router.wait_nodes({"agent-2"}, timeout=5)
    assert "left; dropped" in router.log


def test_etcd_restart_keeps_serving_and_watches_resume(etcd, spawn_agent, start_router):
    a0 = spawn_agent(**agent_config(etcd, lease_ttl_s=3))
    router = start_router()
    router.wait_nodes({"agent-0": 0})
    etcd.stop()
    # etcd is down: the data path and routing keep working, the index keeps following.
    tokens = prompt_tokens(2, 8 * SPEC.block_size)
    with KVClient(a0.address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(SPEC)
        kv = torch.zeros(
            SPEC.num_layers, 2, len(tokens), SPEC.num_kv_heads, SPEC.head_dim, dtype=torch.float16
        )
        assert c.store(ns, tokens, kv).cache_write_tokens == len(tokens)
        ids = c.block_ids(ns, tokens)
        assert c.lookup(ns, ids).matched == 8
    router.wait_nodes({"agent-0": 8})
    assert router.route(NS_ID, pack_ids(ids), dry_run=True).matched_blocks == 8
    settle(1.0)
    etcd.start()
    # Watches resume: a node that registers after the restart is discovered, and the
    # first agent is still registered (its lease survived the outage or was renewed).
    spawn_agent(**agent_config(etcd, lease_ttl_s=3))
    router.wait_nodes({"agent-0": 8, "agent-1": 0}, timeout=30)
    settle(3.5)  # more than one lease TTL: a lost registration would show by now
    router.wait_nodes({"agent-0": 8, "agent-1": 0}, timeout=5)


# ------------------------------------------------------------------- local cluster
def kvctl(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args],
        cwd=ROOT,
        timeout=timeout,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


@pytest.fixture
def local_cluster(tmp_path):
    state = tmp_path / "cluster"
    yield state
    if (state / "cluster.json").exists():
        kvctl("cluster", "down", "--state-dir", str(state), "--grace", "5")


def test_kvctl_usage_errors(tmp_path):
    assert kvctl().returncode == 2
    r = kvctl("cluster", "up", "--agents", "0", "--state-dir", str(tmp_path))
    assert r.returncode == 2 and "--agents" in r.stderr
    r = kvctl("cluster", "status", "--state-dir", str(tmp_path / "none"))
    assert r.returncode == 1 and "no local cluster" in r.stderr
    r = kvctl("cluster", "down", "--state-dir", str(tmp_path / "none"))
    assert r.returncode == 0 and "nothing to stop" in r.stdout
    assert "--state-dir" in kvctl("cluster", "up", "--help").stdout
    r = kvctl("plan", "--model", "llama-3-8b", "--hbm", "40GiB", "--output", "json")
    assert r.returncode == 0 and json.loads(r.stdout)


def test_a_failed_up_quotes_this_runs_log_and_keeps_the_last_one(tmp_path):
    log = tmp_path / "agent-0" / "agent.log"
    log.parent.mkdir(parents=True)
    log.write_text("kvstore-agent: bad configuration: AN ERROR OF THE RUN BEFORE\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVSTORE_AGENT_EVICTION="bogus")
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "cluster", "up", "--agents", "1",
         "--state-dir", str(tmp_path), "--timeout", "60"],
        cwd=ROOT, timeout=120, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "eviction must be 'value' or 'lru', got 'bogus'" in r.stderr
    assert "RUN BEFORE" not in r.stderr and "RUN BEFORE" not in log.read_text()
    assert "RUN BEFORE" in (tmp_path / "agent-0" / "agent.log.prev").read_text()


def test_a_timed_out_up_names_the_component_what_it_awaited_and_its_log(tmp_path):
    """An agent that never comes up (it waits for an etcd that is not there: the
    environment overrides the endpoint up gave it): up exits 1 at --timeout, naming the
    agent, what it waited for, its log's path and the log's last lines, and stops what it
    had started."""
    from support.common import free_port

    nowhere = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVSTORE_AGENT_ETCD_ENDPOINTS=nowhere)
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "cluster", "up", "--agents", "1",
         "--state-dir", str(tmp_path), "--timeout", "25"],
        cwd=ROOT, timeout=120, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert r.returncode == 1, (r.stdout, r.stderr)
    err = r.stderr
    assert "timed out" in err and "--timeout 25" in err, err
    assert "agent-0 (pid " in err and f"{tmp_path / 'agent-0' / 'ready'}" in err, err
    assert f"{tmp_path / 'agent-0' / 'agent.log'}" in err, err
    assert f"waits for etcd at {nowhere}" in err, err  # the log's last lines, quoted
    assert "router (pid" not in err, err  # the router came up: not named
    assert not _ours(tmp_path)


def _start_up(state, *, after: float = 0.0) -> subprocess.Popen:
    """`kvctl cluster up --agents 1` in the background, once `state` shows it started
    (its etcd.log exists), or after `after` seconds."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "cluster", "up", "--agents", "1",
         "--engines", "0", "--state-dir", str(state), "--timeout", "60"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(lambda: (state / "etcd.log").exists() or proc.poll() is not None, 30,
             what="cluster up to start etcd")  # fmt: skip
    return proc


def _ours(state) -> list[str]:
    """Live processes whose command line names `state` (etcd, agents, router)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{d}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                continue
            if str(state) in cmd and "kvstore.cli" not in cmd and not zombie:
                found.append(cmd)
    return found


def test_a_second_up_while_the_first_is_starting_is_refused(local_cluster):
    first = _start_up(local_cluster)
    second = kvctl("cluster", "up", "--agents", "1", "--state-dir", str(local_cluster))
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"(pid {first.pid}) is already starting a cluster" in second.stderr
    assert "Traceback" not in second.stderr
    st = ClusterState.load(local_cluster)  # the first one's, and only it runs there
    assert all(alive(p.pid, p.kind) for p in st.procs) and len(_ours(local_cluster)) == 3
    r = kvctl("cluster", "down", "--state-dir", str(local_cluster))
    assert r.returncode == 0 and not _ours(local_cluster)


def test_down_while_up_is_starting_stops_it(local_cluster):
    starting = _start_up(local_cluster)
    r = kvctl("cluster", "down", "--state-dir", str(local_cluster), "--grace", "5")
    assert r.returncode == 0, r.stderr
    assert f"kvctl cluster up (pid {starting.pid}) is still starting" in r.stdout
    assert "stopped etcd" in r.stdout
    _, err = starting.communicate(timeout=60)
    assert starting.returncode == 1 and "stopped (SIGTERM" in err
    assert not (local_cluster / "cluster.json").exists()
    assert not _ours(local_cluster)


def test_an_etcd_data_dir_etcd_cannot_open_is_named_with_what_to_do(local_cluster):
    """etcd's data is kept from run to run: one it cannot open (a crash mid-write, a
    disk that filled) failed every up the same way, with etcd's panic and no way out."""
    db = local_cluster / "etcd" / "member" / "snap" / "db"
    db.parent.mkdir(parents=True)
    db.write_bytes(b"not a bolt database" * 512)
    (local_cluster / "etcd" / "member" / "wal").mkdir()
    state = ["--state-dir", str(local_cluster)]
    r = kvctl("cluster", "up", "--agents", "1", *state, "--timeout", "30")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "etcd's data is kept from the last run in" in r.stderr, r.stderr
    assert "move the state directory aside (or remove it)" in r.stderr
    assert not _ours(local_cluster)


def test_ctrl_c_while_up_is_starting_stops_what_it_started_and_says_so(local_cluster):
    starting = _start_up(local_cluster)
    starting.send_signal(signal.SIGINT)
    _, err = starting.communicate(timeout=60)
    assert starting.returncode == 1, err
    assert "interrupted; what it had started is stopped" in err, err
    assert "Traceback" not in err and not _ours(local_cluster)


def _launched(state, name: str) -> bool:
    """`up` recorded `name` as started (starting.json; its log appears a moment before,
    when the process is not yet started: a kill then leaves nothing for `down` to know)."""
    try:
        record = json.loads((state / STARTING_FILE).read_text())
    except (OSError, ValueError):
        return False
    return name in [p["name"] for p in record["procs"]]


def test_down_stops_what_a_killed_up_had_started(local_cluster):
    starting = _start_up(local_cluster)
    wait_for(lambda: _launched(local_cluster, "agent-0"), 30, what="an agent, recorded")
    starting.kill()
    starting.wait(timeout=10)
    assert _ours(local_cluster)  # etcd and an agent at least, recorded nowhere but there
    r = kvctl("cluster", "down", "--state-dir", str(local_cluster), "--grace", "5")
    assert r.returncode == 0 and "agent-0" in r.stdout, r.stdout + r.stderr
    assert not _ours(local_cluster)


def test_what_a_killed_up_left_is_named_and_kept_from_another_up(local_cluster):
    """`up` killed mid-start: what it started runs on, recorded in starting.json only.
    `cluster status` and `kvctl status` name it and say to run down (not to start a
    cluster); another `up` is refused before it touches anything (etcd's data dir, the
    record); down then stops all of it."""
    starting = _start_up(local_cluster)
    wait_for(lambda: _launched(local_cluster, "router"), 30, what="the router, recorded")
    starting.kill()
    starting.wait(timeout=10)
    record = (local_cluster / STARTING_FILE).read_text()
    etcd_pid = next(p["pid"] for p in json.loads(record)["procs"] if p["kind"] == "etcd")
    down_cmd = f"kvctl cluster down --state-dir {local_cluster}"
    try:
        for command, code in ((("cluster", "status"), 1), (("status",), 2)):
            r = kvctl(*command, "--state-dir", str(local_cluster))
            assert r.returncode == code, (command, r.stdout, r.stderr)
            assert f"etcd (pid {etcd_pid})" in r.stderr and down_cmd in r.stderr, r.stderr
            assert "start one" not in r.stderr and "Traceback" not in r.stderr, r.stderr
        again = kvctl("cluster", "up", "--agents", "1", "--state-dir", str(local_cluster))
        assert again.returncode == 1, again.stdout + again.stderr
        assert f"etcd (pid {etcd_pid})" in again.stderr and down_cmd in again.stderr
        assert (local_cluster / STARTING_FILE).read_text() == record
        assert alive(etcd_pid, "etcd") and (local_cluster / "etcd" / "member").is_dir()
    finally:
        r = kvctl("cluster", "down", "--state-dir", str(local_cluster), "--grace", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(name in r.stdout for name in ("etcd", "agent-0", "router")), r.stdout
    assert not _ours(local_cluster)


def test_a_process_a_killed_up_started_but_never_recorded_is_found_and_stopped(local_cluster):
    """`up` killed (SIGKILL) between starting the router and writing it to starting.json
    (made here by taking the router out of the record after the kill: the window itself
    is a few instructions wide, and CI hit it once): status and another up name it by
    its command line, which names the state directory, and down stops it too."""
    starting = _start_up(local_cluster)
    wait_for(lambda: _launched(local_cluster, "router"), 30, what="the router, recorded")
    starting.kill()
    starting.wait(timeout=10)
    path = local_cluster / STARTING_FILE
    record = json.loads(path.read_text())
    router_pid = next(p["pid"] for p in record["procs"] if p["kind"] == "router")
    record["procs"] = [p for p in record["procs"] if p["kind"] != "router"]
    path.write_text(json.dumps(record))
    try:
        r = kvctl("cluster", "status", "--state-dir", str(local_cluster))
        assert r.returncode == 1 and f"router (pid {router_pid})" in r.stderr, r.stderr
        again = kvctl("cluster", "up", "--agents", "1", "--state-dir", str(local_cluster))
        assert again.returncode == 1 and f"router (pid {router_pid})" in again.stderr
        assert alive(router_pid, "router")
    finally:
        r = kvctl("cluster", "down", "--state-dir", str(local_cluster), "--grace", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"found router (pid {router_pid}), started by an up in" in r.stdout + r.stderr
    sigterms = [line for line in r.stderr.splitlines() if "sent SIGTERM to" in line]
    assert f"router (pid {router_pid})" in sigterms[0] and "etcd" in sigterms[-1], r.stderr
    assert not alive(router_pid, "router") and not _ours(local_cluster)


def _up_one(state) -> ClusterState:
    r = kvctl("cluster", "up", "--agents", "1", "--state-dir", str(state), "--pool-bytes", "16MiB")
    assert r.returncode == 0, r.stderr
    return ClusterState.load(state)


def test_down_wakes_a_frozen_agent_so_that_it_stops_cleanly(local_cluster):
    """A SIGSTOPped agent handles no SIGTERM until it runs again: down sends SIGCONT after
    it and says so, and the agent stops as it should (leaves etcd, writes its pool to
    NVMe), not by SIGKILL at the end of the grace period."""
    st = _up_one(local_cluster)
    agent = st.agents[0]
    os.kill(agent.pid, signal.SIGSTOP)
    r = kvctl("cluster", "down", "--state-dir", str(local_cluster), "--grace", "20")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert f"agent-0 (pid {agent.pid}) was stopped (SIGSTOP?): sent SIGCONT" in r.stderr
    assert "stopped" in r.stdout and "agent-0" in r.stdout and "SIGKILL" not in r.stdout
    assert not _ours(local_cluster)
    with open(agent.log) as f:
        assert "agent agent-0 stopped" in f.read()  # its clean stop's last line


def test_down_kills_what_hangs_past_the_grace_and_says_so(local_cluster):
    """etcd frozen: every member's stop waits on it (leaving etcd), past a 1 s grace.
    down says what it waits for, SIGKILLs them, reports whom it killed, leaves nothing."""
    st = _up_one(local_cluster)
    etcd = next(p for p in st.procs if p.kind == "etcd")
    agent = st.agents[0]
    os.kill(etcd.pid, signal.SIGSTOP)
    try:
        r = kvctl("cluster", "down", "--state-dir", str(local_cluster), "--grace", "1")
    finally:
        if alive(etcd.pid, "etcd"):
            os.kill(etcd.pid, signal.SIGCONT)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert f"sent SIGTERM to agent-0 (pid {agent.pid})" in r.stderr, r.stderr
    assert f"agent-0 (pid {agent.pid}) still running 1s after SIGTERM" in r.stderr, r.stderr
    assert "killed with SIGKILL" in r.stdout and f"agent-0 (pid {agent.pid}, " in r.stdout
    assert not _ours(local_cluster)


def test_status_names_what_answers_in_place_of_a_dead_component(local_cluster):
    """etcd killed and started again by hand on its address: status says that its pid is
    gone and that something answers there which down will not stop (not just "dead")."""
    etcd = next(p for p in _up_one(local_cluster).procs if p.kind == "etcd")
    with open(f"/proc/{etcd.pid}/cmdline", "rb") as f:
        command = [a.decode() for a in f.read().split(b"\0") if a]
    os.kill(etcd.pid, signal.SIGKILL)
    wait_for(lambda: not alive(etcd.pid, "etcd"), 10, what="etcd to die")
    log = local_cluster.parent / "etcd-by-hand.log"
    with open(log, "wb") as out:
        by_hand = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
    try:
        seen = ["no status yet"]

        def etcd_row():
            r = kvctl("cluster", "status", "--state-dir", str(local_cluster), "--output", "json")
            rows = json.loads(r.stdout)["components"] if r.stdout else []
            row = next((c for c in rows if c["kind"] == "etcd"), None)
            seen[0] = json.dumps(row) if row else r.stdout + r.stderr
            return row if row and row["healthy"] else None

        # 60 s, and what was seen: one make test on two workers waited 30 s here without
        # status seeing this etcd answer (why is unknown; alone the test takes 10 s).
        try:
            row = wait_for(etcd_row, 60, what="status to see an etcd answering")
        except TimeoutError:
            state = "running" if by_hand.poll() is None else f"exited {by_hand.returncode}"
            raise AssertionError(
                f"status never saw the etcd started by hand answer ({state}); last status "
                f"row: {seen[0]}; its log:\n{log.read_text()[-3000:]}"
            ) from None
        assert not row["alive"], row
        assert row["stranger"] == (
            f"pid {etcd.pid} gone; something else answers at {etcd.address} (not started "
            "by this cluster; `kvctl cluster down` won't stop it)"
        )
        table = kvctl("cluster", "status", "--state-dir", str(local_cluster)).stdout
        assert "not ours" in table and f"something else answers at {etcd.address}" in table
        r = kvctl("cluster", "down", "--state-dir", str(local_cluster), "--grace", "5")
        assert r.returncode == 0 and by_hand.poll() is None  # not ours: left running
    finally:
        by_hand.terminate()
        by_hand.wait(timeout=30)
    assert not _ours(local_cluster)


def test_local_cluster_up_demo_status_down(local_cluster):
    r = kvctl(
        "cluster", "up", "--agents", "2", "--state-dir", str(local_cluster), "--pool-bytes", "32MiB"
    )
    assert r.returncode == 0, r.stderr
    assert "router" in r.stdout and "agent-1" in r.stdout
    st = ClusterState.load(local_cluster)
    assert len(st.agents) == 2 and all(alive(p.pid, p.kind) for p in st.procs)
    again = kvctl("cluster", "up", "--state-dir", str(local_cluster))
    assert again.returncode == 1 and "already running" in again.stderr

    # Through the router: the second request for a prompt is served from cache.
    tokens = prompt_tokens(5, 200)
    with ClusterClient(st.router_address, tenant_secret=TEST_SECRET, use_shm=False) as cc:
        ns = cc.open_namespace(SPEC)
        kv = torch.randn(
            SPEC.num_layers, 2, len(tokens), SPEC.num_kv_heads, SPEC.head_dim, dtype=torch.float16
        )
        first = cc.fetch(ns, tokens)
        assert first.cached_tokens == 0 and first.node_id in ("agent-0", "agent-1")
        assert cc.store(ns, first, tokens, kv).cache_write_tokens == 192
        second = wait_for(lambda: _hit(cc, ns, tokens), 15, what="a routed cache hit")
        assert second.node_id == first.node_id
        assert torch.equal(torch.cat(second.hit.blocks, dim=2), kv[:, :, :192])

    demo = subprocess.run(
        [sys.executable, "-m", "loadtest.demo", "--state-dir", str(local_cluster), "--turns", "2"],
        cwd=ROOT,
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert demo.returncode == 0, demo.stderr
    assert "token-weighted hit rate" in demo.stdout and "round-robin" in demo.stdout

    r = kvctl("cluster", "status", "--state-dir", str(local_cluster), "--output", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    agents = [c for c in report["components"] if c["kind"] == "agent"]
    assert all(a["healthy"] and a["registered"] and a["synced"] for a in agents)
    assert sum(a["indexed_blocks"] for a in agents) >= 12
    table = kvctl("cluster", "status", "--state-dir", str(local_cluster))
    assert "agent-0" in table.stdout and "blocks indexed" in table.stdout

    etcd_pid = next(p.pid for p in st.procs if p.kind == "etcd")
    _status_waits_as_long_as_told_for_a_frozen_etcd(local_cluster, etcd_pid)
    os.kill(etcd_pid, signal.SIGKILL)
    wait_for(lambda: not alive(etcd_pid, "etcd"), 10, what="etcd to die")
    assert kvctl("cluster", "status", "--state-dir", str(local_cluster)).returncode == 3

    r = kvctl("cluster", "down", "--state-dir", str(local_cluster))
    assert r.returncode == 0 and "agent-0" in r.stdout
    assert not any(alive(p.pid, p.kind) for p in st.procs)
    assert kvctl("cluster", "status", "--state-dir", str(local_cluster)).returncode == 1


def _status_waits_as_long_as_told_for_a_frozen_etcd(state, etcd_pid: int) -> None:
    """--etcd-timeout: a frozen etcd is unreachable (exit 3) once the wait is over; one
    resumed before the wait is over (here after more than the default 3 s) is healthy."""
    status = [sys.executable, "-m", "kvstore.cli", "cluster", "status", "--state-dir", str(state)]
    bad = kvctl(*status[3:], "--etcd-timeout", "0")
    assert bad.returncode == 2 and "--etcd-timeout" in bad.stderr, bad.stderr
    os.kill(etcd_pid, signal.SIGSTOP)
    try:
        short = kvctl(*status[3:], "--etcd-timeout", "0.5", "--output", "json")
        assert short.returncode == 3, short.stdout + short.stderr
        etcd = next(c for c in json.loads(short.stdout)["components"] if c["kind"] == "etcd")
        assert etcd["alive"] and not etcd["healthy"]
        long = subprocess.Popen(
            [*status, "--etcd-timeout", "60"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(8)  # its start-up (1-2 s) and more than the default wait
    finally:
        os.kill(etcd_pid, signal.SIGCONT)
    out, err = long.communicate(timeout=120)
    assert long.returncode == 0, out + err


def _hit(cc: ClusterClient, ns, tokens):
    hit = cc.fetch(ns, tokens)
    cc.release(hit)
    return hit if hit.cached_tokens == 192 else None


def test_a_flush_made_while_an_agent_was_down_outlives_down_and_up(local_cluster):
    """Every `cluster up` started a fresh etcd: an agent stopped during a flush came back
    after `down` and `up` with the old generation's blocks on NVMe, registered the
    namespace at that generation in the new etcd and served them again. etcd's data is
    now kept from run to run, the kill switch with it (up says so when it is on); the last
    run's members are forgotten, so a smaller cluster is not missing any."""
    state = ["--state-dir", str(local_cluster)]
    assert kvctl("cluster", "up", "--agents", "2", *state).returncode == 0
    st = ClusterState.load(local_cluster)
    ghost = make_namespace(name="ghost")
    tokens = prompt_tokens(77, 4 * ghost.block_size)
    with KVClient(st.agents[1].address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(ghost)
        ids = c.block_ids(ns, tokens)
        blocks = [torch.randn(block_shape(ghost)).to(torch.float16) for _ in ids]
        assert c.put(ns, ids, blocks).stored == 4 and ns.generation == 0
    agent1 = st.agents[1].pid
    os.kill(agent1, signal.SIGTERM)  # a clean stop: its pool goes to NVMe
    wait_for(lambda: not alive(agent1, "agent"), 30, what="agent-1 to stop")
    r = kvctl("flush", "acme/ghost", "--timeout", "20", *state)
    assert r.returncode == 0, r.stdout + r.stderr
    r = kvctl("killswitch", "on", "--reason", "INC-12", *state)
    assert r.returncode == 0, r.stdout + r.stderr
    assert kvctl("cluster", "down", *state).returncode == 0

    r = kvctl("cluster", "up", "--agents", "2", *state)
    assert r.returncode == 0, r.stderr
    assert "kill switch is ON since the last run (reason: INC-12" in r.stderr, r.stderr
    assert kvctl("killswitch", "off", *state).returncode == 0
    st = ClusterState.load(local_cluster)
    with KVClient(st.agents[1].address, tenant_secret=TEST_SECRET, use_shm=False) as c:
        ns = c.open_namespace(ghost)
        assert ns.generation == 1
        assert c.lookup(ns, ids).matched == 0  # the old generation's blocks are gone
    for p in st.procs:  # the host went down: no process stopped cleanly
        os.kill(p.pid, signal.SIGKILL)
    wait_for(lambda: not any(alive(p.pid, p.kind) for p in st.procs), 30, what="the kill")

    r = kvctl("cluster", "up", "--agents", "1", *state)
    assert r.returncode == 0, r.stderr
    r = kvctl("status", *state)
    assert r.returncode == 0, r.stdout + r.stderr  # agent-1 of the last run: not missing
