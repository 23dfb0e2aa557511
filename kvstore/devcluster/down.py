"""`kvctl cluster down`: stop what a cluster (or a starting or dead `up`) runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from kvstore.devcluster.state import (
    STARTING_FILE,
    STATE_FILE,
    ClusterError,
    ClusterState,
    Proc,
    check_state_dir,
    lock_holder,
    named,
    starting_procs,
    try_lock,
    unrecorded,
)
from kvstore.devengines import stop_engine
from kvstore.devprocs import Ended, alive, terminate


def quiet(_msg: str) -> None:
    pass


def stop_procs(procs: list[Proc], grace_s: float = 10.0, say=quiet) -> list[Ended]:
    """Stop the engines (each its session: SIGTERM, SIGKILL after `grace_s`), then the
    rest (devprocs.terminate: SIGTERM and SIGCONT, SIGKILL after `grace_s`); `say` gets
    progress. Returns what ended, and how."""
    engines = [p for p in procs if p.kind == "engine" and alive(p.pid, p.kind)]
    for p in engines:  # an engine is a session: registrar, vLLM, its engine core
        say(f"stopping {p.name} (pid {p.pid}) and its vLLM processes: SIGTERM, SIGKILL "
            f"after {grace_s:g}s")  # fmt: skip
        stop_engine(p.pid, grace_s)
    ended = [Ended(p.name, p.pid) for p in engines]
    return ended + terminate([p for p in procs if p.kind != "engine"], grace_s, say)


def down(state_dir: str | os.PathLike, grace_s: float = 10.0, say=quiet) -> list[Ended]:
    """Stop the engines, router and agents (they revoke their leases), then etcd: SIGTERM
    (and SIGCONT, for a stopped process), SIGKILL after `grace_s`; `say` gets progress
    (whom it waits for, whom it kills). An `up` still starting there is stopped first
    (SIGTERM; it stops what it started), and whatever a dead `up` left in starting.json,
    or running unrecorded (state.unrecorded), is stopped too. Holds the up lock, so no
    `up` starts in the middle."""
    state = check_state_dir(state_dir)
    if not state.is_dir():
        raise ClusterError(f"no local cluster in {state_dir} (no such directory)")
    lock = try_lock(state)
    by_up: list[Ended] = []
    if lock is None:
        lock, by_up = _stop_starting_up(state, grace_s, say)
    try:
        merged = {e.name: e for e in by_up}  # what up stopped itself, unless left over
        merged.update((e.name, e) for e in _stop_starting_leftovers(state, grace_s, say))
        return [*merged.values(), *_stop_recorded(state, grace_s, say)]
    finally:
        os.close(lock)


def _stop_starting_up(state: Path, grace_s: float, say) -> tuple[int, list[Ended]]:
    """SIGTERM the `up` holding the lock (and SIGCONT, should it be stopped), wait for it
    to let go (SIGKILL after `grace_s` + its own 5 s of stopping); returns the lock and
    what that `up` had started (by the last starting.json seen; it stops them itself)."""
    pid = lock_holder(state)
    seen: list[Ended] = []
    for sig, wait_s in ((signal.SIGTERM, grace_s + 10), (signal.SIGKILL, 5.0)):
        if pid:
            say(f"sending {sig.name} to kvctl cluster up (pid {pid})")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                if sig == signal.SIGTERM:
                    os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                procs = json.loads((state / STARTING_FILE).read_text())["procs"]
                seen = [Ended(p["name"], int(p["pid"])) for p in procs]
            lock = try_lock(state)
            if lock is not None:
                return lock, seen
            time.sleep(0.1)
            pid = pid or lock_holder(state)
    raise ClusterError(f"kvctl cluster up (pid {pid or '?'}) in {state} did not stop")


def _stop_starting_leftovers(state: Path, grace_s: float, say) -> list[Ended]:
    """What a dead `up` listed in starting.json, and what it started but never listed
    (state.unrecorded: killed between the two), in one order: engines, agents and
    router, etcd."""
    listed = starting_procs(state)
    strays = unrecorded(state, listed)
    if strays:
        say(f"found {named(strays)}, started by an up in {state} and recorded nowhere (that "
            "up killed while starting it); stopping it too")  # fmt: skip
    stopped = _stop_in_order([*listed, *strays], grace_s, say)
    (state / STARTING_FILE).unlink(missing_ok=True)
    return stopped


def _stop_recorded(state: Path, grace_s: float, say) -> list[Ended]:
    if not (state / STATE_FILE).exists():
        return []
    stopped = _stop_in_order(list(ClusterState.load(state).procs), grace_s, say)
    (state / STATE_FILE).unlink(missing_ok=True)
    return stopped


def _stop_in_order(procs: list[Proc], grace_s: float, say) -> list[Ended]:
    engines = [p for p in procs if p.kind == "engine"]
    first = [p for p in procs if p.kind not in ("etcd", "engine")]
    return (
        stop_procs(engines, grace_s, say)
        + stop_procs(first, grace_s, say)
        + stop_procs([p for p in procs if p.kind == "etcd"], grace_s, say)
    )
