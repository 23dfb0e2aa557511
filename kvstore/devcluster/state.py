"""The dev cluster's state directory: cluster.json (what runs where), starting.json
(what a starting `up` launched so far) and the up lock, and the errors kvctl maps to exit
codes."""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstore.config import TLSConfig
from kvstore.devprocs import KINDS, alive, started_for
from kvstore.tls import files_in

STATE_FILE = "cluster.json"
LOCK_FILE = "up.lock"  # flock-ed by `up` from before it starts anything to its end; its pid
STARTING_FILE = "starting.json"  # what a starting `up` has launched so far (for `down`)


class ClusterError(Exception):
    """Something about the local cluster failed; `exit_code` is kvctl's exit status."""

    exit_code = 1


class EtcdUnreachable(ClusterError):
    exit_code = 3


class NodeUnreachable(ClusterError):
    exit_code = 4


class BadStateDir(ClusterError):
    """The state directory, or its cluster.json, is not what kvctl can use (a file for a
    directory, a directory for a file, unreadable, corrupt): bad usage, exit 2."""

    exit_code = 2


def check_state_dir(state_dir: str | os.PathLike) -> Path:
    """`state_dir` as a Path; BadStateDir when it exists and is not a directory."""
    path = Path(state_dir)
    if path.exists() and not path.is_dir():
        raise BadStateDir(f"{state_dir} is not a directory (the state directory to use)")
    return path


@dataclass(frozen=True, slots=True)
class Proc:
    name: str  # etcd, agent-0, ..., router
    kind: str  # etcd | agent | router
    pid: int
    address: str  # what clients dial (etcd: its client endpoint)
    log: str


@dataclass(frozen=True, slots=True)
class ClusterState:
    state_dir: str
    etcd_endpoint: str
    router_address: str
    procs: tuple[Proc, ...]
    started_at: float
    gateway_url: str = ""  # the router's OpenAI gateway, with --engines
    gateway_keys: str = ""  # its API keys file (dev keys)
    tls_dir: str = ""  # with --tls: ca.crt, client.crt, client.key (kvstore.tls.files_in)
    # The router's Prometheus page, with the gateway's metrics (every tenant's counts: not
    # on the gateway's own port). Plain HTTP on loopback.
    metrics_url: str = ""

    @property
    def client_tls(self) -> TLSConfig | None:
        """What a client of this cluster presents; None for a plaintext one."""
        return files_in(self.tls_dir) if self.tls_dir else None

    @property
    def agents(self) -> list[Proc]:
        return [p for p in self.procs if p.kind == "agent"]

    def save(self) -> None:
        path = Path(self.state_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, state_dir: str | os.PathLike) -> "ClusterState":
        path = check_state_dir(state_dir) / STATE_FILE
        try:
            data = json.loads(path.read_text())
            data["procs"] = _procs(path, data["procs"])
            return cls(**data)
        except FileNotFoundError:
            raise ClusterError(_no_cluster(path.parent, state_dir)) from None
        except IsADirectoryError:
            raise BadStateDir(
                f"{path} is a directory, not a cluster record; remove it and run "
                "kvctl cluster up again"
            ) from None
        except OSError as exc:
            raise BadStateDir(f"cannot read {path}: {exc.strerror}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BadStateDir(
                f"{path} is unreadable ({exc}); remove it and run kvctl cluster up again"
            ) from None


def _procs(path: Path, entries) -> tuple[Proc, ...]:
    """The processes listed in `path` (cluster.json, starting.json); BadStateDir naming
    the file and the entry for a kind this cluster never starts (a hand edit)."""
    procs = tuple(Proc(**p) for p in entries)
    for i, p in enumerate(procs):
        if p.kind not in KINDS:
            raise BadStateDir(
                f"{path}: procs[{i}] ({p.name!r}, pid {p.pid}) has kind {p.kind!r}, which "
                f"is none of {', '.join(KINDS)}; correct that entry"
            )
    return procs


def starting_procs(state: Path) -> tuple[Proc, ...]:
    """What an `up` recorded in starting.json as started (nothing when there is none)."""
    path = state / STARTING_FILE
    try:
        return _procs(path, json.loads(path.read_text())["procs"])
    except (FileNotFoundError, NotADirectoryError):
        return ()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadStateDir(f"{path} is unreadable ({exc})") from None


def left_running(state_dir: str | os.PathLike) -> list[Proc]:
    """What a `kvctl cluster up` that did not finish left running (killed: one that
    fails stops what it started), by its starting.json and unrecorded(); [] when
    nothing."""
    listed = starting_procs(Path(state_dir))
    return [p for p in listed if alive(p.pid, p.kind)] + unrecorded(Path(state_dir), listed)


def unrecorded(state: Path, listed: tuple[Proc, ...] | None = None) -> list[Proc]:
    """Processes an `up` in `state` started (devprocs.started_for: marked so in their
    environment) that neither cluster.json nor starting.json lists: an `up` killed
    (SIGKILL) after starting a process and before writing it to starting.json leaves one.
    Named by kind ("router", not "router-0": the record that named it is what is missing).
    `listed`: starting.json's processes, where the caller has read it already (one read,
    so that both see the same file)."""
    known = {p.pid for p in (starting_procs(state) if listed is None else listed)}
    try:
        if (state / STATE_FILE).exists():
            known |= {p.pid for p in ClusterState.load(state).procs}
    except ClusterError:
        pass  # an unreadable cluster.json: its processes count as unrecorded
    return [Proc(kind, kind, pid, "", "") for pid, kind in started_for(state)
            if pid not in known]  # fmt: skip


def named(procs) -> str:
    return ", ".join(f"{p.name} (pid {p.pid})" for p in procs)


def _no_cluster(state: Path, given: str | os.PathLike) -> str:
    """Why `state` has no cluster.json, and what to do: an `up` is starting there, a
    killed one left processes running (a new `up` would not know them), or nothing."""
    down = f"kvctl cluster down --state-dir {given}"
    pid = starting(state)
    if pid is not None:
        return (
            f"kvctl cluster up (pid {pid or '?'}) is still starting a cluster in {given} "
            f"(no {STATE_FILE} yet); wait for it, or stop it: {down}"
        )
    left = left_running(state)
    if left:
        return (
            f"no cluster recorded in {given} (no {STATE_FILE}), but a kvctl cluster up "
            f"that did not finish (killed?) left {named(left)} running (listed in "
            f"{state / STARTING_FILE}, or marked as its own); stop them with: {down}"
        )
    return (
        f"no local cluster in {given} (no {STATE_FILE}); start one with: kvctl cluster up "
        f"--state-dir {given}"
    )


class Launched(list):
    """The processes this `up` started, also written to <state>/starting.json at once:
    `down` stops them should this `up` die before it records a cluster."""

    def __init__(self, state: Path) -> None:
        super().__init__()
        self._path = state / STARTING_FILE

    def append(self, proc: Proc) -> None:
        super().append(proc)
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"up_pid": os.getpid(), "procs": [asdict(p) for p in self]}))
        os.replace(tmp, self._path)


def try_lock(state: Path, as_up: bool = False, create: bool = True) -> int | None:
    """The up lock (a file descriptor), or None while another process holds it (or,
    not `create`, when there is no lock file: no `up` ever ran here). `as_up`: our pid is
    written in it, for a refused `up` or `down` to name; a probe or `down` writes
    nothing (an `up` refused meanwhile would name the wrong process). The descriptor is
    not inherited by the processes `up` starts. BadStateDir when it cannot be opened."""
    path = state / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        if create:
            raise BadStateDir(f"{path} cannot be created (no such directory)") from None
        return None
    except OSError as exc:
        raise BadStateDir(f"{path} cannot be opened: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    if as_up:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def lock_holder(state: Path) -> int | None:
    """The pid written in the lock file (that of the `up` holding it, if one does)."""
    try:
        return int((state / LOCK_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def starting(state_dir: str | os.PathLike) -> int | None:
    """The pid of a `kvctl cluster up` still starting a cluster in `state_dir`, if any."""
    state = Path(state_dir)
    if not state.is_dir():
        return None
    if not (state / LOCK_FILE).exists():
        return None
    lock = try_lock(state, create=False)
    if lock is not None:
        os.close(lock)
        return None
    return lock_holder(state) or 0  # 0: it has not written its pid yet
