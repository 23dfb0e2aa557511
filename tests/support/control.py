"""Helpers for test_control.py and test_kvctl.py: raw gRPC calls to real agents, the kvctl
CLI as a subprocess, and a fake etcd member for fault injection."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import subprocess

import grpc
from support.common import PY, ROOT, TEST_SECRET, chain_items, prompt_tokens

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
        return self.stub.OpenNamespace(
            agent_pb2.OpenNamespaceRequest(spec=ns_proto(spec)), timeout=10
        )

    def put_chain(self, spec, seed: int, n_blocks: int, generation: int) -> list[bytes]:
        """Store an n-block prompt at `generation`; returns its block ids."""
        ids, items = chain(spec, seed, n_blocks, generation)
        ref = agent_pb2.NamespaceRef(namespace_id=spec.namespace_id, generation=generation)
        req = agent_pb2.PutRequest(
            ns=ref,
            root=items[0].parent_id,
            blocks=[
                agent_pb2.BlockPut(block_id=it.block_id, parent_id=it.parent_id, data=it.data)
                for it in items
            ],
        )
        self.stub.Put(iter([req]), timeout=10)
        return ids

    def lookup(self, spec, ids: list[bytes], generation: int) -> agent_pb2.LookupResponse:
        ref = agent_pb2.NamespaceRef(namespace_id=spec.namespace_id, generation=generation)
        return self.stub.Lookup(
            agent_pb2.LookupRequest(ns=ref, block_ids=pack_ids(ids)), timeout=10
        )

    def get_count(self, spec, ids: list[bytes], generation: int) -> int:
        ref = agent_pb2.NamespaceRef(namespace_id=spec.namespace_id, generation=generation)
        resp = self.stub.Get(agent_pb2.GetRequest(ns=ref, block_ids=pack_ids(ids)), timeout=10)
        return sum(r.count for r in resp)

    def stats(self, tenant: str = "") -> agent_pb2.StatsResponse:
        return self.stub.Stats(agent_pb2.StatsRequest(tenant=tenant), timeout=10)

    def tenant(self, name: str) -> agent_pb2.TenantStats:
        return next(
            (t for t in self.stats(name).tenants if t.tenant == name),
            agent_pb2.TenantStats(tenant=name),
        )


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


def kvctl(
    *args: str, etcd=None, process: bool = False, timeout: float = 60.0, **env
) -> subprocess.CompletedProcess:
    """Run kvctl with `--etcd` added. In-process by default (kvctl's main(), the code
    `python -m kvstore.cli` runs, without an interpreter start per call); process=True runs
    the real `python -m kvstore.cli`."""
    argv = list(args)
    if etcd is not None:
        argv += ["--etcd", etcd.endpoint if hasattr(etcd, "endpoint") else etcd]
    env = {"KVSTORE_OPERATOR": "test-operator", **env}
    if process:
        full_env = {k: v for k, v in os.environ.items() if k != "KVSTORE_ETCD"}
        return subprocess.run(
            [PY, "-m", "kvstore.cli", *argv],
            cwd=ROOT,
            env={**full_env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    from kvstore.cli.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in [*env, "KVSTORE_ETCD"]}
    os.environ.pop("KVSTORE_ETCD", None)
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse usage errors
                rc = exc.code
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["kvctl", *argv], rc, out.getvalue(), err.getvalue())


def kvctl_json(*args: str, etcd=None, expect_rc: int = 0, **env):
    r = kvctl(*args, "--output", "json", etcd=etcd, **env)
    assert r.returncode == expect_rc, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout)


def with_fake_member(etcd_endpoint: str, node_id: str, fn, ttl: int = 30, keep: bool = True):
    """Fault injection: a node record under a live lease for an agent that does not exist
    (so it never acknowledges anything), held while `fn()` runs in a thread. keep=False:
    the lease is never refreshed, as for a crashed agent, and expires after `ttl`."""
    from kvstore.coord.etcd import EtcdClient, NodeRecord

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


def lagging_watches(client) -> asyncio.Event:
    """Fault injection: every watch of `client` (an EtcdClient) delivers nothing until the
    returned event is set, as a watch stream lagging behind etcd. Its owner then learns of
    a change only by listing. Call it before the owner starts watching."""
    release = asyncio.Event()
    real = client.watch

    async def watch(prefix: str, start_revision: int):
        await release.wait()
        async for batch in real(prefix, start_revision):
            yield batch

    client.watch = watch
    return release
