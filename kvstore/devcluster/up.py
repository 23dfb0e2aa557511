"""`kvctl cluster up`: start etcd, the agents, the router (and engines), wait until each
answers and the router follows every agent, and record the cluster in cluster.json."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvstore.devcluster.down import stop_procs
from kvstore.devcluster.launch import (
    UpOptions,
    read_ready,
    sigterm_stops,
    start_agent,
    start_engines,
    start_etcd,
    start_router,
    wait_start,
)
from kvstore.devcluster.state import (
    STARTING_FILE,
    STATE_FILE,
    BadStateDir,
    ClusterError,
    ClusterState,
    EtcdUnreachable,
    Launched,
    Proc,
    check_state_dir,
    left_running,
    lock_holder,
    named,
    try_lock,
)
from kvstore.devengines import write_model
from kvstore.devprocs import Watched, alive, etcd_healthy, grpc_healthy, router_nodes
from kvstore.errors import KvError, shown

_DEFAULTS = UpOptions()


def up(state_dir: str | os.PathLike, opts: UpOptions = _DEFAULTS, say=print) -> ClusterState:
    state = check_state_dir(state_dir).resolve()
    try:
        state.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file on the way, no permission, read-only
        raise BadStateDir(f"cannot create the state directory {state}: {exc.strerror}") from None
    lock = try_lock(state, as_up=True)
    if lock is None:  # another up is starting here: two etcds on one data dir, otherwise
        raise ClusterError(
            f"kvctl cluster up (pid {lock_holder(state) or '?'}) is already starting a cluster in "
            f"{state}; wait for it, or stop it: kvctl cluster down --state-dir {state_dir}"
        )
    try:
        _refuse_if_running(state, state_dir)
        started = Launched(state)
        try:
            with sigterm_stops():
                return _up(state, opts, say, started)
        except BaseException:
            stop_procs(started, grace_s=5.0)
            raise
        finally:
            (state / STARTING_FILE).unlink(missing_ok=True)
    finally:
        os.close(lock)  # releases the lock


def _refuse_if_running(state: Path, given: str | os.PathLike) -> None:
    """Before `up` touches anything (etcd's data dir, starting.json): refused while what
    a killed `up` started, or a recorded cluster, still runs there."""
    left = left_running(state)
    if left:
        raise ClusterError(
            f"a kvctl cluster up that did not finish (killed?) left {named(left)} running "
            f"in {state} (listed in {STARTING_FILE}, or marked as its own; a new up would not "
            f"know them); stop them first: kvctl cluster down --state-dir {given}"
        )
    if not (state / STATE_FILE).exists():
        return
    try:
        old = ClusterState.load(state)
    except ClusterError:
        return  # a record we are about to replace
    running = [p.name for p in old.procs if alive(p.pid, p.kind)]
    if running:
        raise ClusterError(
            f"a cluster is already running in {state} ({', '.join(running)}); "
            f"stop it first: kvctl cluster down --state-dir {given}"
        )


def _up(state: Path, opts: UpOptions, say, started: list[Proc]) -> ClusterState:
    t0 = time.monotonic()
    server_tls = client = None
    if opts.tls:  # a fresh CA on every up: nothing from an older cluster is trusted
        from kvstore.tls_ca import make_dev_pki

        pki = make_dev_pki(str(state / "tls"))
        server_tls, client = pki.server, pki.client
    if opts.engines:  # before anything runs: a failure here leaves nothing behind
        say("writing the tiny model (vLLM venv)")
        write_model(state / "model")
    kept = (state / "etcd").is_dir()  # etcd's data from the last run
    etcd, endpoint, elog = start_etcd(state, server_tls)
    started.append(Proc("etcd", "etcd", etcd.pid, endpoint, str(elog)))
    deadline = time.monotonic() + opts.timeout_s  # --timeout: etcd to the gateway
    limit = f"--timeout {opts.timeout_s:g}s for the whole start"

    def wait(pending, what: str, watch: list[Watched]) -> None:
        wait_start(pending, deadline - time.monotonic(), what, watch, limit)

    scheme = "https" if opts.tls else "http"
    etcd_w = Watched("etcd", etcd, elog)
    try:
        wait(lambda: {} if etcd_healthy(endpoint, tls=client) else {
            "etcd": f"its health check {scheme}://{endpoint}/health to say true"
        }, "etcd to become healthy", [etcd_w])  # fmt: skip
    except ClusterError as exc:
        if not kept:
            raise
        raise type(exc)(
            f"{exc}\netcd's data is kept from the last run in {state / 'etcd'}: if etcd "
            "cannot open it, move the state directory aside (or remove it) and run up again "
            "(namespaces, quotas, the kill switch and the audit log go with it)"
        ) from None
    say(f"etcd      {endpoint}")
    try:
        warnings = asyncio.run(forget_last_run(endpoint, client))
    except KvError as exc:  # etcd healthy a moment ago, then not (still replaying its log)
        raise EtcdUnreachable(
            f"etcd at {endpoint} did not answer while up forgot the last run's members "
            f"({exc}); its log: {elog}"
        ) from None
    for line in warnings:  # whatever the output mode: the cluster serves nothing
        print(line, file=sys.stderr)
    m = _start_members(state, endpoint, opts, server_tls, started, etcd_w)
    addrs, raddr = _wait_members(m, wait, client)
    procs = [started[0]] + [
        Proc(f"agent-{i}", "agent", p.pid, addrs[f"agent-{i}"], str(log))
        for i, (p, _, log) in enumerate(m.agents)
    ]
    procs.append(Proc("router", "router", m.router.pid, raddr, str(m.rlog)))
    gw_url = f"{scheme}://{read_ready(m.readies['gateway'])}" if "gateway" in m.readies else ""
    procs += start_engines(
        state, opts, endpoint, list(addrs.values()), gw_url, say, started, client, m.watch
    )
    keys = str(state / "router" / "keys.json") if gw_url else ""
    tls_dir = str(state / "tls") if opts.tls else ""
    st = ClusterState(
        str(state), endpoint, raddr, tuple(procs), time.time(), gw_url, keys, tls_dir, m.metrics
    )
    st.save()
    _say_up(st, opts, say, t0)
    return st


async def forget_last_run(endpoint: str, tls) -> list[str]:
    """On the etcd this state directory kept from its last run: revoke its members'
    leases (their records go with them: the same ids register again at once instead of
    waiting out a dead process's lease) and their seen/ records (a member of the last
    run that this one does not start is not "missing"). Returns what an operator should
    know: a kill switch still on from the last run."""
    from kvstore.coord.admin import ControlPlane
    from kvstore.coord.etcd import EtcdClient
    from kvstore.coord.seen import forget_every_member

    async with EtcdClient(endpoint, timeout=10.0, tls=tls) as etcd:
        await etcd.revoke_every_lease()
        await forget_every_member(etcd)
        on, info = await ControlPlane(etcd).killswitch()
    if not on:
        return []
    return [
        f"warning: the kill switch is ON since the last run (reason: "
        f"{shown(info.get('reason') or '-')}, by {shown(info.get('by', '?'))}): nothing is "
        "cached or served until `kvctl killswitch off`"
    ]


@dataclass(frozen=True, slots=True)
class _Members:
    """The agents and the router `up` started, and what it waits on for them."""

    agents: list[tuple[subprocess.Popen, Path, Path]]  # (process, ready file, log)
    router: subprocess.Popen
    rready: Path
    rlog: Path
    metrics: str  # the router's Prometheus page ("" without the gateway)
    watch: list[Watched]  # every process started so far, etcd's included
    readies: dict[str, Path]  # name -> the ready file it writes once started


def _start_members(state: Path, endpoint: str, opts: UpOptions, tls, started, etcd_w) -> _Members:
    agents = []
    for i in range(opts.agents):  # each recorded at once: a kill -9 of up leaves it to down
        agents.append(start_agent(state, i, endpoint, opts, tls))
        started.append(Proc(f"agent-{i}", "agent", agents[-1][0].pid, "", str(agents[-1][2])))
    router, rready, rlog, metrics = start_router(state, endpoint, opts, tls)
    started.append(Proc("router", "router", router.pid, "", str(rlog)))
    watch = [Watched(f"agent-{i}", p, log) for i, (p, _, log) in enumerate(agents)]
    watch += [Watched("router", router, rlog), etcd_w]
    readies = {f"agent-{i}": r for i, (_, r, _) in enumerate(agents)} | {"router": rready}
    if opts.gateway_tokenizers or opts.engines:  # the router's OpenAI gateway
        readies["gateway"] = state / "router" / "gw-ready"
        watch.append(Watched("gateway", router, rlog))
    return _Members(agents, router, rready, rlog, metrics, watch, readies)


def _wait_members(m: _Members, wait, client) -> tuple[dict[str, str], str]:
    """Wait until every agent and the router started, answers gRPC health, and the
    router follows every agent; returns the agents' addresses and the router's."""
    wait(lambda: {
        name: f"its ready file {r} (written once it has started: listening, etcd read, "
        "registered)"
        for name, r in m.readies.items() if not read_ready(r)
    }, "every agent and the router to start", m.watch)  # fmt: skip
    addrs = {f"agent-{i}": read_ready(r) for i, (_, r, _) in enumerate(m.agents)}
    raddr = read_ready(m.rready)
    wait(lambda: {
        name: f"gRPC health at {a} to answer SERVING"
        for name, a in (addrs | {"router": raddr}).items() if not grpc_healthy(a, tls=client)
    }, "gRPC health of every agent and the router", m.watch)  # fmt: skip
    wait(lambda: _router_behind(raddr, addrs, client), "the router to follow every agent", m.watch)
    return addrs, raddr


def _router_behind(raddr: str, addrs: dict[str, str], client) -> dict[str, str]:
    try:
        nodes = {n.node_id: n.synced for n in router_nodes(raddr, tls=client)}
    except grpc.RpcError as exc:
        return {"router": f"ListNodes at {raddr} to answer ({exc.code().name})"}
    behind = [a for a in addrs if not nodes.get(a)]
    return {"router": f"to list and follow every agent's events at {raddr} (not yet: "
            f"{', '.join(behind)})"} if behind else {}  # fmt: skip


def _say_up(st: ClusterState, opts: UpOptions, say, t0: float) -> None:
    for p in st.procs[1:]:
        say(f"{p.name:<9} {p.address}")
    if st.metrics_url:
        say(f"metrics   {st.metrics_url} (the router's and the gateway's)")
    if st.tls_dir:
        extra = " (the engines' KV event ports: loopback only)" if opts.engines else ""
        say(f"mTLS on every port{extra}; CA and client pair in {st.tls_dir}")
    say(f"cluster up in {time.monotonic() - t0:.1f}s; state in {Path(st.state_dir) / STATE_FILE}")
