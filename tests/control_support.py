"""Helpers for test_control.py and test_kvctl.py: raw gRPC calls to real agents, the kvctl
CLI as a subprocess, an in-process router (real RouterServer, ClusterFollower and
RouterControl on real etcd), and a fake etcd member for fault injection."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess

import grpc
from conftest import PY, ROOT, TEST_SECRET, chain_items, prompt_tokens

from kvstore.hashing import pack_ids
from kvstore.v1 import agent_pb2, agent_pb2_grpc, common_pb2


def ns_proto(spec) -> common_pb2.Namespace:
    return common_pb2.Namespace(**spec.to_dict())


def agent_cfg(etcd, **kw) -> dict:
    cfg = {"etcd_endpoints": etcd.endpoint, "lease_ttl_s": 2}
    cfg.update(kw)
    return cfg


class AgentClient:
    """Blocking calls to one agent over real gRPC (no client-library logic in between)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = agent_pb2_grpc.NodeAgentStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def open(self, spec) -> agent_pb2.NamespaceInfo:
        return self.stub.OpenNamespace(agent_pb2.OpenNamespaceRequest(spec=ns_proto(spec)),
                                       timeout=10)

    def put_chain(self, spec, seed: int, n_blocks: int, generation: int) -> list[bytes]:
        """Store an n-block prompt at `generation`; returns its block ids."""
        ids, items = chain(spec, seed, n_blocks, generation)
        ref = agent_pb2.NamespaceRef(namespace_id=spec.namespace_id, generation=generation)
        req = agent_pb2.PutRequest(ns=ref, blocks=[
            agent_pb2.BlockPut(block_id=it.block_id, parent_id=it.parent_id, data=it.data)
            for it in items])
        self.stub.Put(iter([req]), timeout=10)
        return ids

    def lookup(self, spec, ids: list[bytes], generation: int) -> agent_pb2.LookupResponse:
        ref = agent_pb2.NamespaceRef(namespace_id=spec.namespace_id, generation=generation)
        return self.stub.Lookup(agent_pb2.LookupRequest(ns=ref, block_ids=pack_ids(ids)),
                                timeout=10)

    def get_count(self, spec, ids: list[bytes], generation: int) -> int:
        ref = agent_pb2.NamespaceRef(namespace_id=spec.namespace_id, generation=generation)
        resp = self.stub.Get(agent_pb2.GetRequest(ns=ref, block_ids=pack_ids(ids)), timeout=10)
        return sum(r.count for r in resp)

    def stats(self, tenant: str = "") -> agent_pb2.StatsResponse:
        return self.stub.Stats(agent_pb2.StatsRequest(tenant=tenant), timeout=10)

    def tenant(self, name: str) -> agent_pb2.TenantStats:
        return next((t for t in self.stats(name).tenants if t.tenant == name),
                    agent_pb2.TenantStats(tenant=name))


def chain(spec, seed: int, n_blocks: int, generation: int):
    tokens = prompt_tokens(seed, n_blocks * spec.block_size)
    return chain_items(spec, tokens, TEST_SECRET, generation)


def status_of(fn, *args, **kw) -> grpc.StatusCode:
    """The status code a call fails with (OK when it succeeds)."""
    try:
        fn(*args, **kw)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def kvctl(*args: str, etcd=None, timeout: float = 60.0, **env) -> subprocess.CompletedProcess:
    cmd = [PY, "-m", "kvctl", *args]
    if etcd is not None:
        cmd += ["--etcd", etcd.endpoint if hasattr(etcd, "endpoint") else etcd]
    full_env = dict(os.environ, KVSTORE_OPERATOR="test-operator", **env)
    full_env.pop("KVSTORE_ETCD", None)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def kvctl_json(*args: str, etcd=None, expect_rc: int = 0, **env):
    r = kvctl(*args, "--output", "json", etcd=etcd, **env)
    assert r.returncode == expect_rc, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout)


class InProcessRouter:
    """A real router (gRPC server, etcd membership follower, agent event streams) plus its
    RouterControl, in the caller's event loop. `route` is what router/server.py's Route
    does once wired: the generation fence, then the routing decision."""

    def __init__(self, etcd_endpoint: str, router_id: str = "r1") -> None:
        self.etcd_endpoint = etcd_endpoint
        self.router_id = router_id
        self.server = None
        self.control = None
        self._etcd = None

    async def start(self) -> "InProcessRouter":
        from cluster.etcd import EtcdClient
        from kvstore.config import RouterConfig
        from router.control import RouterControl
        from router.server import RouterServer
        self.server = RouterServer(RouterConfig(router_id=self.router_id,
                                                listen="127.0.0.1:0",
                                                etcd_endpoints=self.etcd_endpoint))
        await self.server.start()
        self._etcd = EtcdClient(self.etcd_endpoint)
        self.control = RouterControl(self._etcd, self.router_id, core=self.server.core,
                                     lease_ttl_s=2)
        await self.control.start(timeout_s=20)
        return self

    @property
    def core(self):
        return self.server.core

    def route(self, ns_id: bytes, generation: int, ids: list[bytes]):
        self.control.check(ns_id, generation)
        return self.core.route(ns_id, pack_ids(ids), dry_run=True)

    async def wait_synced(self, node_ids: set[str], timeout: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            nodes = self.core.nodes
            if set(nodes) == node_ids and all(nodes[n].synced for n in node_ids):
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"router did not sync {node_ids}: {dict(self.core.nodes)}")

    async def stop(self) -> None:
        if self.control is not None:
            await self.control.stop()
        if self._etcd is not None:
            await self._etcd.close()
        if self.server is not None:
            await self.server.stop(0.1)


def with_fake_member(etcd_endpoint: str, node_id: str, fn, ttl: int = 30,
                     keep: bool = True):
    """Fault injection: a node record under a live lease for an agent that does not exist
    (so it never acknowledges anything), held while `fn()` runs in a thread. keep=False:
    the lease is never refreshed, as for a crashed agent, and expires after `ttl`."""
    from cluster.etcd import EtcdClient, NodeRecord

    async def main():
        async with EtcdClient(etcd_endpoint) as client:
            lease = await client.grant(ttl)
            assert await client.register_node(NodeRecord(node_id, "127.0.0.1:9"), lease)
            try:
                return await asyncio.to_thread(fn)
            finally:
                if keep:
                    await client.revoke(lease)
    return asyncio.run(main())
