"""Chaos harness: a bounded multi-tenant workload through the cluster client that checks
every byte it reads while faults are injected on a schedule.

It starts its own etcd, agents and router on 127.0.0.1 (loadtest/chaos_cluster.py) in a
temporary state directory and tears them down on every exit path (Ctrl-C included).
One thread per tenant runs chat sessions at most `--rate` requests per second
(loadtest/chaos_load.py); after the warm-up a fault starts every `--fault-every-s`
(loadtest/chaos_faults.py): kill -9 and SIGSTOP of agents, disk full, router kill, etcd
restart, damaged SST files. The load runs `--minutes`, and on until the last fault has
finished plus `--tail-s`. Progress on stderr; one JSON line on stdout:

- ops: requests served (fetched, every byte verified, new blocks stored); attempts.
- wrong_bytes: bytes read that differ from the payload derived from the block id.
- client_errors: failed attempts by gRPC status (or exception type).
- max_unavailable_s: the longest time one request took from the start of its first
  attempt to the end of its successful one (failed attempts are retried every
  `--retry-s`; one abandoned after `--give-up-s`, or still failing when the load
  stopped, counts until then). Goal: at most 2 x the lease TTL.
- nvme_recovered_ratio: over every kill -9, of the blocks held only on NVMe by the killed
  agent at least `--nvme-bound-s` before the kill, the share found again after its
  restart (the bound defaults to the agents' NVMe flush interval where AgentConfig has
  one, else 2 s). Goal: >= 0.9. null when no block was on NVMe.
- slot_leaks: after the load stops, summed over the agents, |occupied pool slots -
  blocks held in the pool| (Stats RPC). Goal: 0.
- rss_drift_pct: the largest RSS growth of an agent process that lived from the end of
  the warm-up to the end of the load (restarts go to the other agents, so the last one
  does), from its first samples after the warm-up to its last (means of three, sampled
  every second). Goal: <= 5 (meant over a 10-minute soak).

`goals` sets each against its limit; the exit status is 0 whatever the goals say, 1 when
the harness itself broke (no JSON then), 130 on Ctrl-C.

    python -m loadtest.chaos                      # 1 minute, 3 agents, 3 tenants
    python -m loadtest.chaos --minutes 10         # soak
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvstore.client import KVClient
from kvstore.config import AgentConfig
from kvstore.v1 import common_pb2
from loadtest.chaos_cluster import ChaosCluster, ClusterSpec, HarnessError, rss_bytes
from loadtest.chaos_faults import FAULTS, FaultParams, FaultRunner
from loadtest.chaos_load import Figures, LoadParams, TenantWorker, Tracker

MiB = 1 << 20
_BOUND_FIELDS = (
    "nvme_flush_interval_s",
    "flush_interval_s",
    "memtable_flush_interval_s",
    "nvme_flush_s",
)


def say(msg: str) -> None:
    print(f"[chaos] {msg}", file=sys.stderr, flush=True)


def default_bound() -> tuple[float, str]:
    """The agents' crash-loss bound, if AgentConfig states one; else 2 s."""
    fields = {f.name: f for f in dataclasses.fields(AgentConfig)}
    for name in _BOUND_FIELDS:
        value = fields[name].default if name in fields else None
        if isinstance(value, (int, float)) and value > 0:
            return float(value), f"AgentConfig.{name}"
    return 2.0, "default (AgentConfig states no NVMe flush interval)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.chaos",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--minutes", type=float, default=1.0, help="load duration (soak: 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--rate", type=float, default=8.0, help="requests/s per tenant, at most")
    p.add_argument("--lease-ttl-s", type=int, default=3)
    p.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated subset of {','.join(FAULTS)} ('' for none)",
    )
    p.add_argument("--fault-every-s", type=float, default=8.0)
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="no faults, no RSS baseline before this (default: 15%% of the run, at least 8 s)",
    )
    p.add_argument("--tail-s", type=float, default=5.0, help="load after the last fault")
    p.add_argument("--nvme-bound-s", type=float, default=None)
    p.add_argument("--stop-s", type=float, default=None, help="SIGSTOP length (1.5 x TTL)")
    p.add_argument("--disk-hold-s", type=float, default=4.0)
    p.add_argument(
        "--disk-mb",
        type=int,
        default=256,
        help="tmpfs under the last agent (room for its 32 MiB NVMe tier, RocksDB's "
        "64 MiB memtable flushes and compactions)",
    )
    p.add_argument("--pool-kib", type=int, default=256, help="device pool per agent")
    p.add_argument("--retry-s", type=float, default=0.1)
    p.add_argument("--give-up-s", type=float, default=None, help="default 5 x TTL")
    p.add_argument(
        "--client-churn-s",
        type=float,
        default=0.0,
        help="each tenant opens a fresh ClusterClient this often (0: never)",
    )
    p.add_argument("--keep-state", action="store_true", help="keep logs and data")
    args = p.parse_args(argv)
    args.faults = tuple(f for f in args.faults.split(",") if f)
    bad = [f for f in args.faults if f not in FAULTS]
    if bad:
        p.error(f"unknown fault(s) {', '.join(bad)}; choose from {', '.join(FAULTS)}")
    if args.minutes <= 0 or args.tenants < 1 or not 1 <= args.agents <= 16 or args.rate <= 0:
        p.error("--minutes and --rate must be > 0, --tenants >= 1, --agents in 1..16")
    if args.lease_ttl_s < 2:
        p.error("--lease-ttl-s must be >= 2 (etcd's minimum)")
    return args


def can_mount_tmpfs(state: Path) -> str:
    """'' when a tmpfs can be mounted here, else why not."""
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs for the full disk"
    probe = state / "tmpfs-probe"
    probe.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
        check=False,
        capture_output=True,
        text=True,
    )
    if r.returncode:
        return f"mount -t tmpfs failed: {r.stderr.strip()[:200]}"
    subprocess.run(["umount", str(probe)], check=False, capture_output=True)
    return ""


class RssSampler(threading.Thread):
    """Every second, each agent's RSS, keyed by (agent, incarnation)."""

    def __init__(self, cluster: ChaosCluster, t0: float, stop: threading.Event) -> None:
        super().__init__(name="rss", daemon=True)
        self.cluster, self.t0, self.stop_ev = cluster, t0, stop
        self.samples: dict[tuple[str, int], list[tuple[float, int]]] = {}

    def run(self) -> None:
        while not self.stop_ev.wait(1.0):
            for a in self.cluster.agents:
                rss = rss_bytes(a.pid) if a.running() else 0
                if rss:
                    key = (a.name, a.incarnation)
                    self.samples.setdefault(key, []).append((time.monotonic() - self.t0, rss))

    def drift(self, warmup_s: float, end_s: float) -> tuple[float | None, dict]:
        """The largest growth (%) among the agent processes that lived through the whole
        load after the warm-up, and every process's figures (a restarted one's baseline is
        `warmup_s` after its own start)."""
        best, per = None, {}
        for (name, inc), series in self.samples.items():
            since = max(warmup_s, series[0][0] + warmup_s)
            s = [(t, r) for t, r in series if t >= since]
            if len(s) < 6:
                continue
            first = sum(r for _, r in s[:3]) / 3
            last = sum(r for _, r in s[-3:]) / 3
            pct = 100.0 * (last - first) / first
            span = s[-1][0] - s[0][0]
            # Counted: processes that lived from the warm-up to the end (a restarted one
            # warms up again, so its growth is start-up, not drift; it is listed).
            counts = series[0][0] <= warmup_s and s[-1][0] >= end_s - 3
            per[f"{name}#{inc}"] = {
                "first_mib": round(first / MiB, 1),
                "pct": round(pct, 2),
                "last_mib": round(last / MiB, 1),
                "span_s": round(span),
                "counts": counts,
            }
            if counts and (best is None or pct > best):
                best = pct
        return best, per


def slot_leaks(cluster: ChaosCluster) -> tuple[int | None, dict]:
    """|occupied slots - pool blocks| per running agent, once nothing is in flight."""
    per, total = {}, 0
    for a in cluster.agents:
        if not a.running():
            per[a.name] = "down"
            continue
        try:
            with KVClient(a.address, use_shm=False) as c:
                for _ in range(50):  # quiesce: no request in flight on the agent
                    st = c.stats()
                    if not st.in_flight:
                        break
                    time.sleep(0.1)
        except Exception as exc:  # noqa: BLE001 - reported per agent
            per[a.name] = f"unreachable ({type(exc).__name__})"
            continue
        hbm = next(t for t in st.tiers if t.tier == common_pb2.HBM)
        leak = abs((hbm.slots_total - hbm.slots_free) - hbm.blocks)
        per[a.name] = leak
        total += leak
    measured = any(isinstance(v, int) for v in per.values())
    return (total if measured else None), per


def goal(value, limit, cmp: str) -> dict:
    ok = value is not None and (value <= limit if cmp == "<=" else value >= limit)
    return {"value": value, "limit": limit, "cmp": cmp, "ok": ok}


def run_load(cluster: ChaosCluster, args, skipped: dict) -> dict:
    duration = args.minutes * 60
    warmup = args.warmup_s if args.warmup_s is not None else max(8.0, 0.15 * duration)
    ttl = args.lease_ttl_s
    bound, bound_src = (
        (args.nvme_bound_s, "--nvme-bound-s") if args.nvme_bound_s is not None else default_bound()
    )
    stop, t0 = threading.Event(), time.monotonic()
    figs, tracker = Figures(), Tracker()
    lp = LoadParams(
        cluster.router.address,
        args.tenants,
        args.rate,
        args.seed,
        args.retry_s,
        args.give_up_s if args.give_up_s is not None else 5.0 * ttl,
        args.client_churn_s,
    )
    workers = [TenantWorker(i, lp, figs, tracker, stop, t0) for i in range(args.tenants)]
    kinds = tuple(k for k in args.faults if k not in skipped)
    fp = FaultParams(
        kinds,
        args.tenants,
        bound,
        args.stop_s or 1.5 * ttl,
        args.disk_hold_s,
        1.0,
        args.fault_every_s,
        warmup,
        max(warmup, duration - args.tail_s),
        ttl,
        args.seed,
    )
    faults = FaultRunner(cluster, tracker, fp, t0, stop, say)
    rss = RssSampler(cluster, t0, stop)
    for t in (*workers, faults, rss):
        t.start()
    wait_s = 2.0  # on Ctrl-C, do not wait for a fault's restart: close() ends it all
    try:
        end = _progress(figs, faults, t0, duration, args.tail_s)
        wait_s = 60.0
    finally:
        stop.set()
        for t in (*workers, faults, rss):
            t.join(wait_s)
    broken = [t.crashed for t in (*workers, faults) if t.crashed is not None]
    if broken:
        raise HarnessError(f"a harness thread failed: {broken[0]!r}") from broken[0]
    leaks, per_agent = slot_leaks(cluster)
    drift, drift_of = rss.drift(warmup, end)
    ratio = faults.recovered_blocks / faults.census_blocks if faults.census_blocks else None
    return _result(
        args,
        figs,
        faults,
        leaks,
        per_agent,
        drift,
        drift_of,
        ratio,
        skipped,
        dict(
            duration_s=round(end, 1),
            warmup_s=warmup,
            nvme_bound_s=bound,
            nvme_bound_source=bound_src,
        ),
    )


def _progress(
    figs: Figures, faults: FaultRunner, t0: float, duration: float, tail_s: float
) -> float:
    """Report every 5 s until the load is due to end; returns the load time it ended."""
    hard_stop = 3 * duration + 600  # a fault stuck in a restart must not hang the run
    last = 0.0
    while True:
        time.sleep(0.5)
        now = time.monotonic() - t0
        done = faults.finished_at is not None and now >= faults.finished_at + tail_s
        if (now >= duration and done) or now >= hard_stop:
            return now
        if now - last >= 5:
            last = now
            with figs.lock:
                say(
                    f"{now:6.1f}s ops={figs.ops} attempts={figs.attempts} "
                    f"errors={sum(figs.errors.values())} wrong_bytes={figs.wrong_bytes} "
                    f"abandoned={figs.abandoned} max_unavailable={figs.max_unavailable_s:.2f}s"
                )


def _during(faults: FaultRunner, at_s: float) -> str:
    """The fault under way when the longest-unavailable request started ('' for none)."""
    under_way = [f for f in faults.records if f.at_s - 0.5 <= at_s <= f.at_s + f.duration_s]
    return max(under_way, key=lambda f: f.at_s).kind if under_way else ""


def _result(
    args,
    figs: Figures,
    faults: FaultRunner,
    leaks,
    per_agent,
    drift,
    drift_of,
    ratio,
    skipped,
    run: dict,
) -> dict:
    ttl = args.lease_ttl_s

    def r(v, n=3):
        return None if v is None else round(v, n)

    out = {
        "ops": figs.ops,
        "attempts": figs.attempts,
        "abandoned": figs.abandoned,
        "open_at_end": figs.open_at_end,
        "wrong_bytes": figs.wrong_bytes,
        "wrong_blocks": figs.wrong_blocks,
        "verified_blocks": figs.verified_blocks,
        "verified_bytes": figs.verified_bytes,
        "hit_blocks": figs.hit_blocks,
        "stored_blocks": figs.stored_blocks,
        "served_by": dict(sorted(figs.served_by.items())),
        "client_errors": dict(figs.errors),
        "last_error": figs.last_error,
        "max_unavailable_s": r(figs.max_unavailable_s, 2),
        "max_unavailable_at_s": r(figs.max_unavailable_at_s, 1),
        "max_unavailable_during": _during(faults, figs.max_unavailable_at_s),
        "nvme_recovered_ratio": r(ratio),
        "nvme_census_blocks": faults.census_blocks,
        "nvme_recovered_blocks": faults.recovered_blocks,
        "slot_leaks": leaks,
        "slot_leaks_per_agent": per_agent,
        "rss_drift_pct": r(drift, 2),
        "rss_per_agent": drift_of,
        "lease_ttl_s": ttl,
        **run,
        "faults": [dataclasses.asdict(f) for f in faults.records],
        "skipped_faults": skipped,
        "config": {
            "minutes": args.minutes,
            "seed": args.seed,
            "tenants": args.tenants,
            "agents": args.agents,
            "rate": args.rate,
            "pool_kib": args.pool_kib,
            "client_churn_s": args.client_churn_s,
        },
    }
    out["goals"] = {
        "wrong_bytes": goal(figs.wrong_bytes, 0, "<="),
        "slot_leaks": goal(leaks, 0, "<="),
        "max_unavailable_s": goal(out["max_unavailable_s"], 2 * ttl, "<="),
        "nvme_recovered_ratio": goal(out["nvme_recovered_ratio"], 0.9, ">="),
        "rss_drift_pct": goal(out["rss_drift_pct"], 5.0, "<="),
    }
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    state = Path(tempfile.mkdtemp(prefix="kv-chaos-"))
    # Ctrl-C and SIGTERM end the run with a teardown (also where SIGINT came ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    skipped: dict[str, str] = {}
    cluster = None
    try:
        why = can_mount_tmpfs(state) if "disk_full" in args.faults else ""
        if why:
            skipped["disk_full"] = why
        spec = ClusterSpec(
            agents=args.agents,
            pool_bytes=args.pool_kib * 1024,
            lease_ttl_s=args.lease_ttl_s,
            disk_mb=0 if why or "disk_full" not in args.faults else args.disk_mb,
        )
        cluster = ChaosCluster(state, spec)
        say(f"starting etcd, {args.agents} agents and a router in {state}")
        cluster.start()
        say(f"cluster up; load for {args.minutes:g} min, faults: {', '.join(args.faults)}")
        result = run_load(cluster, args, skipped)
    except KeyboardInterrupt:
        say("interrupted; tearing down")
        return 130
    except HarnessError as exc:
        say(f"harness failed: {exc}")
        return 1
    finally:
        if cluster is not None:
            cluster.close()
        if args.keep_state:
            say(f"state kept in {state}")
        else:
            shutil.rmtree(state, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
