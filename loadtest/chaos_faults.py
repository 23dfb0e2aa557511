"""The fault schedule of the chaos harness (loadtest/chaos.py).

From the end of the warm-up, a fault starts every `every_s` (or when the previous one has
finished, if later), cycling through FAULTS: one of each, then more until `last_start_s`.
One at a time:

- kill9: the NVMe census of an agent (below), `bound_s` of waiting, SIGKILL, `down_s`
  down, restart on the same port and data directory, then the recovery check.
- sigstop: SIGSTOP an agent for `stop_s` (longer than its lease: the router drops it,
  clients already talking to it wait), then SIGCONT.
- disk_full: fill the tmpfs under the last agent's RocksDB directory with a ballast file
  for `disk_hold_s`, then remove it (skipped, and said so, when no tmpfs could be mounted).
- router_kill: SIGKILL the router, restart it on its port (it rebuilds its index).
- etcd_restart: SIGKILL etcd, restart it on the same data directory and ports.
- damage_sst: stop an agent (SIGTERM: it writes its pool to RocksDB and flushes), flip
  64 bytes in the middle of its largest SST file (every other time: cut it in half),
  restart it.

NVMe census: for every session that stored blocks on the agent, one Lookup of its chain
(presence in the pool is prefix-closed, so the blocks held only on NVMe are the chain's
[hbm, matched) run). The kill comes `bound_s` after the census *ended*, so every block
counted was on NVMe at least that long before it. After the restart the same chains are
looked up again: a census block is recovered when it is in the leading run again.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import grpc

from kvstore.client import KVClient
from loadtest.chaos_cluster import (
    ChaosCluster,
    Managed,
    clear_disk,
    damage_sst,
    fill_disk,
)
from loadtest.chaos_load import Tracker, tenant_secret, tenant_spec

FAULTS = ("kill9", "sigstop", "disk_full", "router_kill", "etcd_restart", "damage_sst")


@dataclass
class FaultRecord:
    kind: str
    target: str
    at_s: float  # load time it started
    duration_s: float = 0.0
    recovered: bool = False  # the target serves again (and the router lists every agent)
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FaultParams:
    kinds: tuple[str, ...]
    tenants: int
    bound_s: float
    stop_s: float
    disk_hold_s: float
    down_s: float
    every_s: float
    warmup_s: float
    last_start_s: float
    lease_ttl_s: int
    seed: int


class FaultRunner(threading.Thread):
    def __init__(
        self,
        cluster: ChaosCluster,
        tracker: Tracker,
        p: FaultParams,
        t0: float,
        stop: threading.Event,
        say,
    ) -> None:
        super().__init__(name="faults", daemon=True)
        self.cluster, self.tracker, self.p, self.t0, self.stop_ev, self.say = (
            cluster,
            tracker,
            p,
            t0,
            stop,
            say,
        )
        self.records: list[FaultRecord] = []
        self.census_blocks = 0
        self.recovered_blocks = 0
        self.finished_at: float | None = None  # load time the last fault ended
        self.crashed: BaseException | None = None
        self._count: dict[str, int] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        try:
            due, k = self.p.warmup_s, 0
            # One of each listed fault always; more cycles while they start in time.
            while self.p.kinds and (k < len(self.p.kinds) or due <= self.p.last_start_s):
                if self.stop_ev.wait(max(0.0, due - self.now())):
                    break
                kind = self.p.kinds[k % len(self.p.kinds)]
                k += 1
                self.records.append(self._run_one(kind))
                due = max(due + self.p.every_s, self.now())
        except BaseException as exc:  # noqa: BLE001 - reported as a broken harness
            self.crashed = exc
        finally:
            self.finished_at = self.now()

    def _run_one(self, kind: str) -> FaultRecord:
        n = self._count.get(kind, 0)
        self._count[kind] = n + 1
        target = self._pick(kind, n)
        rec = FaultRecord(kind, target.name if target else "", round(self.now(), 2))
        self.say(f"fault {kind} on {rec.target or '-'} at {rec.at_s:.1f}s")
        began = time.monotonic()
        if target is None:
            rec.detail["skipped"] = "no live target"
        else:
            getattr(self, f"_{kind}")(target, rec, n)
            # Recovered: the target serves and the router lists every agent again.
            rec.recovered = target.healthy() and self.cluster.wait_router_synced(
                3 * self.p.lease_ttl_s + 10
            )
        rec.duration_s = round(time.monotonic() - began, 2)
        self.say(
            f"fault {kind} done in {rec.duration_s:.1f}s, recovered={rec.recovered} {rec.detail}"
        )
        return rec

    def _pick(self, kind: str, n: int) -> Managed | None:
        c = self.cluster
        if kind == "router_kill":
            return c.router
        if kind == "etcd_restart":
            return c.etcd
        if kind in ("disk_full", "sigstop"):  # the tmpfs agent; never restarted on purpose
            return c.agents[-1] if c.agents[-1].running() else None
        # Restarts go to the other agents, so one agent lives through the whole run (RSS).
        pool = c.agents[:-1] or c.agents
        start = n if kind == "kill9" else n + 1
        for j in range(len(pool)):
            a = pool[(start + j) % len(pool)]
            if a.running():
                return a
        return None

    # ------------------------------------------------------------------ faults
    def _kill9(self, a: Managed, rec: FaultRecord, n: int) -> None:
        census = self._census(a, rec)
        self.stop_ev.wait(self.p.bound_s)
        a.kill(signal.SIGKILL)
        self.stop_ev.wait(self.p.down_s)
        t = time.monotonic()
        ok = self.cluster.restart(a)
        rec.detail["restart_s"] = round(time.monotonic() - t, 2)
        back = self._present(a, census, rec) if ok else {}
        rec.detail.update(self._recovery(a) if ok else {})
        got = sum(len(census[i] & back.get(i, set())) for i in census) if back is not None else 0
        total = sum(len(b) for b in census.values())
        rec.detail.update(census_blocks=total, recovered_blocks=got, restarted=ok)
        if back is not None:  # a check that could not be made is no loss: not counted
            self.census_blocks += total
            self.recovered_blocks += got

    def _sigstop(self, a: Managed, rec: FaultRecord, n: int) -> None:
        a.send(signal.SIGSTOP)
        try:
            self.stop_ev.wait(self.p.stop_s)
        finally:
            a.send(signal.SIGCONT)
        rec.detail["stopped_s"] = self.p.stop_s

    def _disk_full(self, a: Managed, rec: FaultRecord, n: int) -> None:
        d = self.cluster.data_dir(self.cluster.agents.index(a))
        try:
            rec.detail["ballast_bytes"] = fill_disk(d)
            self.stop_ev.wait(self.p.disk_hold_s)
        finally:
            clear_disk(d)

    def _router_kill(self, r: Managed, rec: FaultRecord, n: int) -> None:
        r.kill(signal.SIGKILL)
        t = time.monotonic()
        rec.detail["restarted"] = self.cluster.restart(r)
        rec.detail["restart_s"] = round(time.monotonic() - t, 2)

    def _etcd_restart(self, e: Managed, rec: FaultRecord, n: int) -> None:
        e.kill(signal.SIGKILL)
        rec.detail["restarted"] = self.cluster.restart(e, timeout_s=30)

    def _damage_sst(self, a: Managed, rec: FaultRecord, n: int) -> None:
        a.kill(signal.SIGTERM, wait_s=30)
        mode = "flip" if n % 2 == 0 else "truncate"
        name = damage_sst(
            self.cluster.data_dir(self.cluster.agents.index(a)), mode, self.p.seed + n
        )
        rec.detail.update(mode=mode, file=name or "(no SST file)")
        t = time.monotonic()
        ok = self.cluster.restart(a)
        rec.detail.update(restarted=ok, restart_s=round(time.monotonic() - t, 2))
        rec.detail.update(self._recovery(a) if ok else {})

    # ------------------------------------------------------------------ census
    def _recovery(self, a: Managed) -> dict:
        """What a restarted agent's recovery from RocksDB kept and dropped (Stats)."""
        for _ in range(10):  # a just-started agent on a busy host may need a retry
            try:
                with KVClient(a.address, use_shm=False) as c:
                    counters = c.stats().counters
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or self.stop_ev.wait(0.5):
                    return {"stats_error": exc.code().name}
        else:
            return {"stats_error": "UNAVAILABLE"}
        return {
            "recovered_on_start": counters.get("recovered_blocks", 0),
            "dropped_on_start": counters.get("recovery_dropped", 0),
        }

    def _lookups(self, a: Managed, tenant: int):
        """(chain ids, LookupResponse) for every session that stored blocks on `a`."""
        chains = self.tracker.chains(tenant, a.name)
        with KVClient(a.address, tenant_secret=tenant_secret(tenant), use_shm=False) as c:
            h = c.open_namespace(tenant_spec(tenant))
            for tokens in chains:
                ids = c.block_ids(h, tokens)
                yield ids, c.lookup(h, ids)

    def _census(self, a: Managed, rec: FaultRecord) -> dict[int, set[bytes]]:
        """NVMe-only blocks per tenant. Also counted: those below a prefix held in the
        pool (a restart finds them only if that prefix has NVMe copies too: recovery
        drops blocks whose parent did not survive)."""
        out: dict[int, set[bytes]] = {}
        below_pool: set[bytes] = set()
        try:
            for i in range(self.p.tenants):
                out[i] = set()
                for ids, r in self._lookups(a, i):
                    out[i].update(ids[r.hbm : r.matched])
                    if r.hbm:
                        below_pool.update(ids[r.hbm : r.matched])
        except grpc.RpcError as exc:
            rec.detail["census_error"] = exc.code().name
        rec.detail["census_below_pool_prefix"] = len(below_pool)
        return out

    def _present(
        self, a: Managed, census: dict[int, set[bytes]], rec: FaultRecord
    ) -> dict[int, set[bytes]] | None:
        """The chains' leading runs on the restarted agent; None when it cannot be asked
        (a fresh connection to a just-started agent on a busy host may need a retry)."""
        for _ in range(10):
            try:
                return {
                    i: {b for ids, r in self._lookups(a, i) for b in ids[: r.matched]}
                    for i in census
                }
            except grpc.RpcError as exc:
                rec.detail["recovery_check_error"] = exc.code().name
                if exc.code() != grpc.StatusCode.UNAVAILABLE or self.stop_ev.wait(0.5):
                    break
        return None
