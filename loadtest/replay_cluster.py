"""The local cluster of a trace replay (loadtest/replay.py): start one sized for the
trace, or describe a running one; read agent counters; flush a run's namespaces so the
next policy starts with empty pools; read a cached prefix with the tier of each block."""
from __future__ import annotations

import math
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from multiprocessing import shared_memory

import grpc
import numpy as np

from cluster.local import ClusterError, ClusterState, UpOptions, up
from kvstore.client import KVClient, NamespaceHandle
from kvstore.client.cluster import ClusterClient
from kvstore.hashing import pack_ids
from kvstore.v1 import agent_pb2, common_pb2


@dataclass(frozen=True, slots=True)
class Cluster:
    state: ClusterState
    owned: bool  # started by this replay: stop it at the end
    nodes: dict[str, str]  # node id -> gRPC address
    pool_bytes: int  # device pool bytes, all agents
    pool_blocks: int  # device pool slots, all agents (one block per slot)
    nvme_bytes: int
    ucx: dict[str, str]  # node id -> UCX listener of its peer service ("" when UCX is off)


def start_cluster(agents: int, ws_bytes: int, block_bytes: int, pool_fraction: float,
                  nvme_fraction: float, say) -> ClusterState:
    def per_agent(fraction: float, floor: int) -> int:
        want = fraction * ws_bytes / agents
        return max(floor, math.ceil(want / block_bytes) * block_bytes) if fraction else 0

    state_dir = tempfile.mkdtemp(prefix="kv-replay-")
    opts = UpOptions(agents=agents, pool_bytes=str(per_agent(pool_fraction, 64 * block_bytes)),
                     slot_bytes=str(block_bytes),
                     nvme_bytes=str(per_agent(nvme_fraction, 0)), router_log_level="WARNING")
    try:
        return up(state_dir, opts, say=lambda m: say("  " + m))
    except BaseException:
        shutil.rmtree(state_dir, ignore_errors=True)
        raise


def describe_cluster(state: ClusterState, owned: bool) -> Cluster:
    with ClusterClient(state.router_address, use_shm=False) as cc:
        infos = cc.nodes()
    if not infos:
        raise ClusterError(f"the router at {state.router_address} knows no agents")
    nodes = {n.node_id: n.address for n in sorted(infos, key=lambda n: n.node_id)}
    ucx = {n.node_id: n.peer_address for n in infos}
    pool = blocks = nvme = 0
    for address in nodes.values():
        with KVClient(address, use_shm=False) as c:
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
        with KVClient(address, use_shm=False) as c:
            for k, v in c.stats().counters.items():
                total[k] = total.get(k, 0) + v
    return total


async def flush_namespaces(endpoint: str, targets: list[tuple[str, str]]) -> None:
    from cluster.control import ControlPlane
    from cluster.etcd import EtcdClient
    async with EtcdClient(endpoint, timeout=5.0) as etcd:
        cp = ControlPlane(etcd, who="loadtest.replay")
        for tenant, name in targets:
            rep = await cp.flush(tenant, name, timeout_s=60.0)
            if not rep.ok:
                raise ClusterError(f"flush of {tenant}/{name} was not acknowledged by "
                                   f"{', '.join(rep.progress.missing)}")


class TieredReader:
    """Get through a shared-memory region this harness registers with one agent, so that
    the tier each block was served from (GetResponse.tiers) is known per request:
    KVClient.get returns only the blocks. One reader per thread and agent (the region is
    reused by every call); the payloads land in the region and are copied out into a
    buffer the caller owns, as KVClient.get copies them into tensors."""

    def __init__(self, agent: KVClient, nbytes: int) -> None:
        self._agent = agent
        name = f"kvreplay-{os.getpid()}-{secrets.token_hex(6)}"
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        self._buf = np.ndarray((nbytes,), dtype=np.uint8, buffer=self._shm.buf)
        self._buf.fill(0)  # fault the pages in now, not during the first transfer
        try:
            self.region_id = agent.stub.RegisterShm(
                agent_pb2.RegisterShmRequest(name=name, size=nbytes)).region_id
        except BaseException:
            self._release_shm()
            raise

    def get(self, ns: NamespaceHandle, ids: list[bytes]) -> tuple[np.ndarray, list[int]]:
        """(payload bytes of the verified leading run of `ids`, the tier of each block)."""
        bb = ns.block_bytes
        cap = self._buf.size // bb
        out = np.empty(len(ids) * bb, dtype=np.uint8)
        tiers: list[int] = []
        for start in range(0, len(ids), cap):
            chunk = ids[start: start + cap]
            req = agent_pb2.GetRequest(
                ns=ns.ref, block_ids=pack_ids(chunk),
                parent_id=ns.root if start == 0 else ids[start - 1],
                shm=agent_pb2.ShmTarget(region_id=self.region_id,
                                        offsets=[i * bb for i in range(len(chunk))]))
            n = 0
            for resp in self._agent.stub.Get(req):
                n += resp.count
                tiers.extend(resp.tiers)
            out[start * bb: (start + n) * bb] = self._buf[: n * bb]
            if n < len(chunk):
                break
        return out[: len(tiers) * bb], tiers

    def close(self) -> None:
        try:
            self._agent.stub.UnregisterShm(
                agent_pb2.UnregisterShmRequest(region_id=self.region_id))
        except grpc.RpcError:
            pass  # the agent is gone: nothing of ours left to unmap there
        self._release_shm()

    def _release_shm(self) -> None:
        self._buf = None
        self._shm.close()
        self._shm.unlink()
