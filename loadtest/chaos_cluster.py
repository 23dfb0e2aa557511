"""The cluster of the chaos harness (loadtest/chaos.py): etcd, agents and a router on
127.0.0.1, each on a port fixed for the whole run, so a restarted process comes back at
the address clients and etcd already know (as a restarted pod keeps its service address).

kvstore/devcluster/ (kvctl cluster up) starts detached clusters on free ports; here every
process is a child of the harness that it kills, pauses and restarts, and that it always
tears down (umounting the small tmpfs it may put under one agent's RocksDB directory).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvstore.devcluster import etcd_command
from kvstore.devprocs import ROOT, bindable, etcd_healthy, grpc_healthy, router_nodes

MiB = 1 << 20


class HarnessError(Exception):
    """The harness itself could not do what it needed (not a finding about the store)."""


@dataclass
class Managed:
    """One process the harness owns; `incarnation` counts its starts."""

    name: str
    kind: str  # etcd | agent | router
    cmd: list[str]
    log: Path
    address: str  # what clients dial
    ready: Path | None = None  # ready file the process writes once serving
    proc: subprocess.Popen | None = None
    incarnation: int = 0
    started_at: float = 0.0

    def start(self) -> None:
        if self.ready is not None:
            self.ready.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = str(ROOT) + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env=env,
                start_new_session=True,
            )
        self.incarnation += 1
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: int) -> None:
        if self.running():
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self, sig: int = signal.SIGKILL, wait_s: float = 15.0) -> None:
        """Send `sig` (SIGCONT first, or a stopped process never handles SIGTERM) and wait
        for the exit; SIGKILL if it outlives `wait_s`."""
        if not self.running():
            return
        self.send(signal.SIGCONT)
        self.send(sig)
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            self.proc.wait(10)

    def healthy(self) -> bool:
        if not self.running():
            return False
        if self.kind == "etcd":
            return etcd_healthy(self.address)
        if self.ready is not None and not self.ready.exists():
            return False
        return grpc_healthy(self.address)

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    agents: int = 3
    pool_bytes: int = 1 * MiB  # per agent: small, so blocks spill to NVMe early
    slot_bytes: int = 8192
    nvme_bytes: int = 32 * MiB  # well under the tmpfs: the disk fills only when told to
    lease_ttl_s: int = 3
    disk_mb: int = 0  # > 0: the last agent's RocksDB directory is a tmpfs of this size
    start_timeout_s: float = 180.0


# Every process keeps its port across restarts, so ports are chosen once, below the
# kernel's ephemeral range (32768-60999 by default): an outgoing connection of any process
# may take an ephemeral port between choosing it and a (re)start binding it.
_PORTS = range(20000, 32000)


@dataclass
class ChaosCluster:
    state: Path
    spec: ClusterSpec
    etcd: Managed | None = None
    agents: list[Managed] = field(default_factory=list)
    _taken: set[int] = field(default_factory=set)

    def free_port(self) -> int:
        """A port no process of this cluster has, that nothing listens on now."""
        while True:
            port = random.choice(_PORTS)
            if port not in self._taken and bindable(port):
                self._taken.add(port)
                return port

    router: Managed | None = None
    mounts: list[Path] = field(default_factory=list)
    closed: bool = False  # set by close(): nothing starts after that
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def procs(self) -> list[Managed]:
        return [p for p in (self.etcd, *self.agents, self.router) if p is not None]

    def data_dir(self, i: int) -> Path:
        return self.state / f"agent-{i}" / "data"

    # -------------------------------------------------------------------- start
    def start(self) -> None:
        self.etcd = self._etcd()
        self.etcd.start()
        self.wait_healthy([self.etcd], 30)
        self.agents = [self._agent(i) for i in range(self.spec.agents)]
        self.router = self._router()
        for p in [*self.agents, self.router]:
            p.start()
        self.wait_healthy([*self.agents, self.router], self.spec.start_timeout_s)
        self.wait_router_synced(60)

    def _etcd(self) -> Managed:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        if not os.access(binary, os.X_OK):
            raise HarnessError("etcd is not installed (apt-get install etcd-server)")
        cu, pu = f"http://127.0.0.1:{self.free_port()}", f"http://127.0.0.1:{self.free_port()}"
        cmd = etcd_command(binary, "chaos", self.state / "etcd", cu, pu)
        return Managed("etcd", "etcd", cmd, self.state / "etcd.log", cu[len("http://") :])

    def _agent(self, i: int) -> Managed:
        d = self.state / f"agent-{i}"
        data = self.data_dir(i)
        data.mkdir(parents=True, exist_ok=True)
        if self.spec.disk_mb and i == self.spec.agents - 1:
            self._mount_tmpfs(data, self.spec.disk_mb)
        address = f"127.0.0.1:{self.free_port()}"
        cfg = {
            "node_id": f"agent-{i}",
            "listen": address,
            "device": "cpu",
            "data_dir": str(data),
            "pool_bytes": self.spec.pool_bytes,
            "slot_bytes": self.spec.slot_bytes,
            "nvme_bytes": self.spec.nvme_bytes,
            "allow_unauthenticated": True,
            "etcd_endpoints": self.etcd.address,
            "lease_ttl_s": self.spec.lease_ttl_s,
            "ucx_enabled": False,
        }
        (d / "agent.json").write_text(json.dumps(cfg, indent=2) + "\n")
        cmd = [
            sys.executable,
            "-m",
            "node_agent",
            "--config",
            str(d / "agent.json"),
            "--ready-file",
            str(d / "ready"),
        ]
        return Managed(f"agent-{i}", "agent", cmd, d / "agent.log", address, d / "ready")

    def _router(self) -> Managed:
        d = self.state / "router"
        d.mkdir(parents=True, exist_ok=True)
        address = f"127.0.0.1:{self.free_port()}"
        # Like the agents (and kvctl cluster up): callers without a token are the cluster.
        config = d / "router.json"
        config.write_text(json.dumps({"allow_unauthenticated": True}) + "\n")
        cmd = [
            sys.executable,
            "-m",
            "router",
            "--config",
            str(config),
            "--router-id",
            "router-0",
            "--listen",
            address,
            "--etcd-endpoints",
            self.etcd.address,
            "--ready-file",
            str(d / "ready"),
            "--log-level",
            "WARNING",
        ]
        return Managed("router", "router", cmd, d / "router.log", address, d / "ready")

    def _mount_tmpfs(self, path: Path, size_mb: int) -> None:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
            check=True,
            capture_output=True,
        )
        self.mounts.append(path)

    # -------------------------------------------------------------------- waits
    def wait_healthy(self, procs: list[Managed], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in procs:
                if not p.running():
                    raise HarnessError(
                        f"{p.name} exited with status {p.proc.returncode}; "
                        f"end of {p.log}:\n{p.tail()}"
                    )
            if all(p.healthy() for p in procs):
                return
            time.sleep(0.1)
        raise HarnessError(
            f"timed out after {timeout_s:.0f}s waiting for "
            f"{', '.join(p.name for p in procs)} to serve"
        )

    def wait_router_synced(self, timeout_s: float) -> bool:
        """Until the router lists every running agent, in sync. False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                nodes = {n.node_id: n.synced for n in router_nodes(self.router.address)}
            except grpc.RpcError:
                nodes = {}
            want = {a.name for a in self.agents if a.running()}
            if want and all(nodes.get(name) for name in want):
                return True
            time.sleep(0.2)
        return False

    def restart(self, p: Managed, timeout_s: float = 120.0) -> bool:
        """Start `p` again (after it was killed); True once it serves. A process that exits
        or does not serve in time is left down and reported, not raised: that is a finding
        (e.g. an agent that cannot open its damaged RocksDB)."""
        with self._lock:  # the fault thread restarts; close() may be tearing down
            if self.closed:
                return False
            p.start()
        try:
            self.wait_healthy([p], timeout_s)
            return True
        except HarnessError:
            p.kill()
            return False

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        """Stop everything (router and agents first: they revoke their leases), umount, and
        never raise: this runs on every exit path."""
        with self._lock:
            self.closed = True
        for group in ([self.router, *self.agents], [self.etcd]):
            live = [p for p in group if p is not None and p.running()]
            for p in live:
                p.send(signal.SIGCONT)
                p.send(signal.SIGTERM)
            deadline = time.monotonic() + 15
            for p in live:
                try:
                    p.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill(signal.SIGKILL)
        for m in self.mounts:
            subprocess.run(["umount", "-l", str(m)], check=False, capture_output=True)
        self.mounts.clear()


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fill_disk(directory: Path) -> int:
    """Write a ballast file into `directory` until the filesystem is full; its size.
    Unbuffered: a buffered file kept the bytes the full disk refused and raised ENOSPC
    again when closed, out of the harness's fault thread."""
    ballast = directory / "chaos-ballast"
    written = 0
    with open(ballast, "wb", buffering=0) as f:
        for n in (MiB, 65536, 4096, 512):  # then top up the last partial megabyte
            chunk = b"\0" * n
            try:
                while w := f.write(chunk):
                    written += w
            except OSError:  # ENOSPC: full, as intended
                pass
        try:
            os.fsync(f.fileno())
        except OSError:
            pass
    return written


def clear_disk(directory: Path) -> None:
    (directory / "chaos-ballast").unlink(missing_ok=True)


def damage_sst(data_dir: Path, mode: str, seed: int) -> str:
    """Flip bytes in (mode 'flip') or cut in half ('truncate') the largest SST file of a
    stopped agent's RocksDB; returns the file name, '' when there is none."""
    ssts = sorted(data_dir.glob("*.sst"), key=lambda p: p.stat().st_size, reverse=True)
    if not ssts:
        return ""
    path = ssts[0]
    size = path.stat().st_size
    if mode == "truncate":
        os.truncate(path, size // 2)
        return path.name
    with open(path, "r+b") as f:  # 64 bytes in the middle of the data blocks
        f.seek(max(0, size // 2 - 32) + seed % 64)
        raw = bytearray(f.read(64))
        f.seek(-len(raw), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in raw))
    return path.name
