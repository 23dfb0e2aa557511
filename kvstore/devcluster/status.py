"""`kvctl cluster status`: what runs, what answers, what the router has indexed."""

from __future__ import annotations

import asyncio
import os
import time

import grpc

from kvstore.config import TLSConfig
from kvstore.devcluster.state import ClusterState, Proc
from kvstore.devprocs import alive, etcd_healthy, grpc_healthy, http_ok, router_nodes


# Seconds status waits for etcd's /health and for its node listing unless told otherwise
# (kvctl cluster status --etcd-timeout): kvctl's per-call default. At 1 s (health) and 2 s
# (listing) a healthy etcd on a busy host could be reported unreachable; a dead one still
# answers at once (refused).
ETCD_TIMEOUT_S = 3.0


async def _registered(endpoint: str, tls: TLSConfig | None, timeout: float) -> set[str]:
    from kvstore.coord.etcd import EtcdClient

    async with EtcdClient(endpoint, timeout=timeout, tls=tls) as c:
        return {r.node_id for r in await c.list_nodes()}


def status(state_dir: str | os.PathLike, etcd_timeout: float = ETCD_TIMEOUT_S) -> dict:
    """What runs, what answers, what the router knows. Raises nothing for dead parts:
    the caller decides the exit status from the report. `etcd_timeout`: seconds for
    etcd's health, then as much for its node listing."""
    st = ClusterState.load(state_dir)
    tls = st.client_tls
    etcd_ok = etcd_healthy(st.etcd_endpoint, etcd_timeout, tls=tls)
    registered: set[str] = set()
    if etcd_ok:
        try:
            registered = asyncio.run(_registered(st.etcd_endpoint, tls, etcd_timeout))
        except Exception:  # noqa: BLE001 - status reports, it does not fail
            etcd_ok = False
    indexed: dict[str, tuple[int, bool]] = {}
    try:
        indexed = {
            n.node_id: (n.indexed_blocks, n.synced)
            for n in router_nodes(st.router_address, tls=tls)
        }
        router_ok = True
    except grpc.RpcError:
        router_ok = False
    answering = {"etcd": etcd_ok, "router": router_ok}
    comps = [_component(p, answering, tls, registered, indexed) for p in st.procs]
    return {
        "state_dir": st.state_dir,
        "etcd_endpoint": st.etcd_endpoint,
        "router_address": st.router_address,
        "gateway_url": st.gateway_url,
        "metrics_url": st.metrics_url,
        "uptime_s": round(time.time() - st.started_at),
        "components": comps,
    }


def _component(p: Proc, answering: dict[str, bool], tls, registered, indexed) -> dict:
    """One process's row: alive (ours), healthy (something answers at its address)."""
    up_ = alive(p.pid, p.kind)
    if p.kind in answering:  # etcd, router: asked once above
        answers = answering[p.kind]
    elif p.kind == "engine":
        answers = http_ok(p.address + "/health", tls)
    else:
        answers = bool(p.address) and grpc_healthy(p.address, tls=tls)
    row = {
        "name": p.name,
        "kind": p.kind,
        "pid": p.pid,
        "address": p.address,
        "alive": up_,
        # what answers health at the address: ours (alive), or another process
        "healthy": answers,
        "log": p.log,
    }
    if answers and not up_:  # restarted by hand, say: not ours to stop
        row["stranger"] = (
            f"pid {p.pid} gone; something else answers at {p.address} (not started "
            "by this cluster; `kvctl cluster down` won't stop it)"
        )
    if p.kind == "agent":
        blocks, synced = indexed.get(p.name, (0, False))
        row.update(registered=p.name in registered, indexed_blocks=blocks, synced=synced)
    return row
