"""What the attacker tests (tests/integration/test_attack_*.py) share: the identities of a
cluster that authenticates everyone (tenants acme and globex, the cluster identity that
routers and kvctl hold, the agent identity peers hold), raw stubs that send one of those
tokens, and snapshots of everything a refused call must leave unchanged."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

import grpc
import pytest

from support.common import block_payload

from kvstore.config import TLSConfig
from kvstore.coord.etcd import EtcdClient
from kvstore.hashing import pack_ids
from kvstore.tls import channel
from kvstore.wire import blocks_per_message
from kvstore.v1 import agent_pb2, agent_pb2_grpc, common_pb2, peer_pb2, peer_pb2_grpc

TOKENS = {
    "acme": "acme-token",
    "globex": "globex-token",
    "_cluster": "cluster-token",
    "_agent": "agent-token",
}


def tenants() -> dict:
    return {
        t: {"token_sha256": hashlib.sha256(tok.encode()).hexdigest()} for t, tok in TOKENS.items()
    }


def auth(who: str | None) -> tuple:
    return (("authorization", f"Bearer {TOKENS[who]}"),) if who else ()


def ns_msg(spec) -> common_pb2.Namespace:
    return common_pb2.Namespace(**spec.to_dict())


def ref(spec, generation: int = 0) -> agent_pb2.NamespaceRef:
    return agent_pb2.NamespaceRef(namespace_id=spec.namespace_id, generation=generation)


class As:
    """Raw NodeAgent and Peer stubs of one agent, every call with `who`'s token (over
    mTLS with `tls`)."""

    def __init__(self, address: str, who: str | None, tls: TLSConfig | None = None) -> None:
        self.channel = channel(address, tls)
        self.agent = agent_pb2_grpc.NodeAgentStub(self.channel)
        self.peer = peer_pb2_grpc.PeerStub(self.channel)
        self.md = auth(who)

    def close(self) -> None:
        self.channel.close()

    def call(self, method, request, timeout: float = 30):
        """A unary call, or every message of a server stream."""
        out = method(request, metadata=self.md, timeout=timeout)
        return list(out) if isinstance(out, grpc.Call) else out

    def fetch(self, spec, ids: list[bytes], parent: bytes, generation: int = 0, with_spec=True):
        req = peer_pb2.FetchRequest(
            ns=ref(spec, generation), block_ids=pack_ids(ids), parent_id=parent
        )
        if with_spec:
            req.spec.CopyFrom(ns_msg(spec))
        return self.call(self.peer.FetchBlocks, req)

    def prefetch(self, spec, ids: list[bytes], parent: bytes, peer: str, generation: int = 0):
        req = peer_pb2.PrefetchRequest(
            ns=ref(spec, generation),
            spec=ns_msg(spec),
            block_ids=pack_ids(ids),
            parent_id=parent,
            peer_address=peer,
            timeout_ms=5000,
        )
        return self.call(self.peer.Prefetch, req)


def put_chain(who: "As", spec, ids: list[bytes], root: bytes) -> agent_pb2.PutResponse:
    """Put the chain `ids` (payloads from block_payload) into `spec` as `who`, in messages
    as the client sends them (kvstore.wire.blocks_per_message: a few MiB each, what an
    agent's max_message_bytes takes)."""
    per = blocks_per_message(spec.block_bytes, len(ids))
    reqs = []
    for k, bid in enumerate(ids):
        if k % per == 0:
            reqs.append(agent_pb2.PutRequest(ns=ref(spec), root=root if k == 0 else b""))
        reqs[-1].blocks.add(
            block_id=bid,
            parent_id=ids[k - 1] if k else root,
            data=block_payload(bid, spec.block_bytes),
        )
    return who.call(who.agent.Put, iter(reqs))


def refusal(fn, *args, **kw) -> tuple[grpc.StatusCode, str]:
    """(code, details) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as ei:
        fn(*args, **kw)
    return ei.value.code(), ei.value.details()


def etcd_items(endpoint: str, tls: TLSConfig | None = None) -> dict[str, bytes]:
    """Every key under the cluster's prefix and its value, read from etcd itself."""

    async def main() -> dict[str, bytes]:
        async with EtcdClient(endpoint, tls=tls) as client:
            _, items = await client.list("")
            return {kv.key: kv.value for kv in items}

    return asyncio.run(main())


def etcd_put(endpoint: str, key: str, value: bytes, tls: TLSConfig | None = None) -> None:
    """Write one key under the cluster's prefix, as anyone with etcd access can."""

    async def main() -> None:
        async with EtcdClient(endpoint, tls=tls) as client:
            await client.put(key, value)

    asyncio.run(main())


def etcd_delete(endpoint: str, key: str) -> None:
    """Delete one key under the cluster's prefix."""

    async def main() -> None:
        async with EtcdClient(endpoint) as client:
            await client.delete(key)

    asyncio.run(main())


@dataclass(frozen=True)
class AgentView:
    """What an agent holds and has counted, as the cluster identity sees it."""

    tenants: tuple
    counters: tuple
    tiers: tuple


BACKGROUND = frozenset({"nvme_flushes"})  # agent counters no request moves


def agent_view(address: str) -> AgentView:
    c = As(address, "_cluster")
    try:
        s = c.call(c.agent.Stats, agent_pb2.StatsRequest())
    finally:
        c.close()
    # Node-wide counters that tick without any request are left out (the NVMe tier's
    # flush every nvme_flush_interval_s: a snapshot pair that straddled one differed);
    # every per-request and per-tenant tally is kept.
    counters = tuple(sorted((k, v) for k, v in s.counters.items() if k not in BACKGROUND))
    return AgentView(
        tuple(t.SerializeToString(deterministic=True) for t in s.tenants),
        counters,
        tuple(t.SerializeToString(deterministic=True) for t in s.tiers),
    )


class TokenTrap(grpc.GenericRpcHandler):
    """A gRPC listener an attacker names as a 'peer': it records the authorization each
    call presents and refuses the call (UNAVAILABLE). With `tls`, it serves TLS with that
    pair (an attacker holding a certificate of the cluster's CA)."""

    def __init__(self, tls: TLSConfig | None = None) -> None:
        from concurrent import futures

        self.seen: list[str] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self._server.add_generic_rpc_handlers((self,))
        if tls is None:
            port = self._server.add_insecure_port("127.0.0.1:0")
        else:
            with open(tls.key_file, "rb") as k, open(tls.cert_file, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            port = self._server.add_secure_port("127.0.0.1:0", creds)
        self.address = f"127.0.0.1:{port}"
        self._server.start()

    def close(self) -> None:
        self._server.stop(grace=None)

    def service(self, details):
        def refuse(request, context):
            self.seen.append(dict(context.invocation_metadata()).get("authorization", ""))
            context.abort(grpc.StatusCode.UNAVAILABLE, "trap")

        return grpc.unary_stream_rpc_method_handler(refuse)
