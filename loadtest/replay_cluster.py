"""The local cluster of a trace replay (loadtest/replay.py): start one sized for the
trace, or describe a running one; read agent counters; flush a run's namespaces so the
next policy starts with empty pools."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass

from kvstore.config import TLSConfig
from kvstore.devcluster import ClusterError, ClusterState, UpOptions, up
from kvstore.client import KVClient
from kvstore.client.cluster import ClusterClient
from kvstore.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class Cluster:
    state: ClusterState
    owned: bool  # started by this replay: stop it at the end
    nodes: dict[str, str]  # node id -> gRPC address
    pool_bytes: int  # device pool bytes, all agents
    pool_blocks: int  # device pool slots, all agents (one block per slot)
    nvme_bytes: int
    ucx: dict[str, str]  # node id -> UCX listener of its peer service ("" when UCX is off)


def start_cluster(
    agents: int,
    ws_bytes: int,
    block_bytes: int,
    pool_fraction: float,
    nvme_fraction: float,
    say,
    tls: bool = False,
    router_settings: dict[str, str] | None = None,
) -> ClusterState:
    """`tls`: mTLS on every port (kvctl cluster up --tls); every client of the replay
    then presents the state's client pair (ClusterState.client_tls). `router_settings`:
    RouterConfig fields for the router, as its KVSTORE_ROUTER_<FIELD> variables."""

    def per_agent(fraction: float, floor: int) -> int:
        want = fraction * ws_bytes / agents
        return max(floor, math.ceil(want / block_bytes) * block_bytes) if fraction else 0

    state_dir = tempfile.mkdtemp(prefix="kv-replay-")
    opts = UpOptions(
        agents=agents,
        pool_bytes=str(per_agent(pool_fraction, 64 * block_bytes)),
        slot_bytes=str(block_bytes),
        nvme_bytes=str(per_agent(nvme_fraction, 0)),
        router_log_level="WARNING",
        tls=tls,
    )
    env = {f"KVSTORE_ROUTER_{k.upper()}": v for k, v in (router_settings or {}).items()}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the processes `up` spawns inherit the environment
    try:
        return up(state_dir, opts, say=lambda m: say("  " + m))
    except BaseException:
        shutil.rmtree(state_dir, ignore_errors=True)
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def describe_cluster(state: ClusterState, owned: bool) -> Cluster:
    with ClusterClient(state.router_address, use_shm=False, tls=state.client_tls) as cc:
        infos = cc.nodes()
    if not infos:
        raise ClusterError(f"the router at {state.router_address} knows no agents")
    nodes = {n.node_id: n.address for n in sorted(infos, key=lambda n: n.node_id)}
    ucx = {n.node_id: n.peer_address for n in infos}
    pool = blocks = nvme = 0
    for address in nodes.values():
        with KVClient(address, use_shm=False, tls=state.client_tls) as c:
            for tier in c.stats().tiers:
                if tier.tier == common_pb2.HBM:
                    pool += tier.capacity_bytes
                    blocks += tier.slots_total
                else:
                    nvme += tier.capacity_bytes
    return Cluster(state, owned, nodes, pool, blocks, nvme, ucx)


def agent_counters(cluster: Cluster) -> dict[str, int]:
    total: dict[str, int] = {}
    for address in cluster.nodes.values():
        with KVClient(address, use_shm=False, tls=cluster.state.client_tls) as c:
            for k, v in c.stats().counters.items():
                total[k] = total.get(k, 0) + v
    return total


async def flush_namespaces(
    endpoint: str, targets: list[tuple[str, str]], tls: TLSConfig | None = None
) -> None:
    from kvstore.coord.admin import ControlPlane
    from kvstore.coord.etcd import EtcdClient

    async with EtcdClient(endpoint, timeout=5.0, tls=tls) as etcd:
        cp = ControlPlane(etcd, who="loadtest.replay")
        for tenant, name in targets:
            rep = await cp.flush(tenant, name, timeout_s=60.0)
            if not rep.ok:
                raise ClusterError(
                    f"flush of {tenant}/{name} was not acknowledged by "
                    f"{', '.join(rep.progress.missing)}"
                )
