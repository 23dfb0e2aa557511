"""Cluster-level client: ask the router which agent should serve a prompt, then load and
store KV there with a per-agent KVClient.

    cc = ClusterClient("127.0.0.1:50050", token="...", tenant_secret="...")
    ns = cc.open_namespace(spec)
    hit = cc.fetch(ns, prompt_tokens)        # routed; hit.node_id, hit.cached_tokens
    ... prefill prompt_tokens[hit.cached_tokens:] ...
    usage = cc.store(ns, hit, prompt_tokens, kv)   # on the same node; releases the route

`token` is the tenant's bearer token, sent to the router and the agents alike: the router
routes only the tenant's own (and public) namespaces, releases only its own requests, and
lists node addresses only to the cluster identity, so a tenant learns agents from its
routes. Namespaces are opened lazily on each agent the first time a request lands there.
Every call has a deadline (`timeout`, also each agent client's) and
fails with kvstore.client.errors.KVClientError. With the shared-memory path (use_shm) each
agent's KVClient has one staging area, so use one ClusterClient per thread; with
use_shm=False one can be shared.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from dataclasses import dataclass, field

import grpc
import torch

from kvstore.config import TLSConfig
from kvstore.telemetry import TRACER, annotate, traced_channel
from kvstore.tls import channel, client_tls
from kvstore.client import KVClient, NamespaceHandle, PrefixHit, Usage
from kvstore.client.errors import from_rpc
from kvstore.client.results import PrefetchResult
from kvstore.hashing import hash_chain, pack_ids
from kvstore.namespace import Namespace
from kvstore.v1 import common_pb2, router_pb2, router_pb2_grpc
from kvstore.wire import namespace_to_proto

__all__ = ["ClusterClient", "ClusterNamespace", "ClusterHit", "route_tokens"]

MiB = 1 << 20
log = logging.getLogger("kvstore.client")


@dataclass(frozen=True, slots=True)
class ClusterNamespace:
    spec: Namespace
    namespace_id: bytes
    generation: int
    root: bytes
    # per agent address: that agent's handle (filled lazily; shared, guarded by a lock)
    handles: dict[str, NamespaceHandle] = field(default_factory=dict, compare=False)


@dataclass(frozen=True, slots=True)
class ClusterHit:
    node_id: str
    address: str
    request_id: str
    hit: PrefixHit
    route: router_pb2.RouteResponse | None  # None when the caller picked the node
    # The chosen agent's pull of the router's peer blocks (None: no peer hint, or off)
    prefetch: PrefetchResult | None = None

    @property
    def block_ids(self) -> list[bytes]:
        return self.hit.block_ids

    @property
    def cached_blocks(self) -> int:
        return self.hit.cached_blocks

    @property
    def cached_tokens(self) -> int:
        return self.hit.cached_tokens

    @property
    def blocks(self) -> list[torch.Tensor]:
        return self.hit.blocks


@functools.lru_cache(maxsize=1024)
def _spec_msg(spec: Namespace) -> common_pb2.Namespace:
    """Sent with every Route: it proves the namespace is the tenant's to a router that has
    not seen its etcd record yet (a replica, or a moment after the first open)."""
    return namespace_to_proto(spec)


def route_tokens(
    stub: router_pb2_grpc.RouterStub,
    ns: ClusterNamespace,
    tokens,
    request_id: str = "",
    dry_run: bool = False,
    weights: router_pb2.RouteWeights | None = None,
    timeout: float = 5.0,
    metadata=(),
) -> tuple[list[bytes], router_pb2.RouteResponse]:
    """Hash a prompt into block ids (kvstore.hashing), then ask the router. `metadata`:
    the caller's `authorization` (ClusterClient passes its token)."""
    ids = hash_chain(ns.root, tokens, ns.spec.block_size)
    req = router_pb2.RouteRequest(
        namespace_id=ns.namespace_id,
        generation=ns.generation,
        block_ids=pack_ids(ids),
        request_id=request_id,
        dry_run=dry_run,
        weights=weights,
        spec=_spec_msg(ns.spec),
    )
    try:
        return ids, stub.Route(req, timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        raise from_rpc(exc) from None


class ClusterClient:
    def __init__(
        self,
        router_address: str,
        token: str | None = None,
        tenant_secret: str | bytes | None = None,
        use_shm: bool | None = None,
        shm_bytes: int = 64 * MiB,
        timeout: float = 10.0,
        tls: TLSConfig | str | None = None,
    ) -> None:
        """`tls`: mTLS to the router and every agent (KVClient's `tls`)."""
        self.tls = client_tls(tls)
        self.router_address = router_address
        self.token = token
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self.tenant_secret = tenant_secret
        self.timeout = timeout
        self._use_shm = use_shm
        self._shm_bytes = shm_bytes
        self._channel = traced_channel(channel(router_address, self.tls))
        self.router = router_pb2_grpc.RouterStub(self._channel)
        self._clients: dict[str, KVClient] = {}
        self._nodes: dict[str, router_pb2.NodeInfo] = {}  # node id -> addresses (cache)
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- plumbing
    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
        self._channel.close()

    def __enter__(self) -> "ClusterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def agent(self, address: str) -> KVClient:
        """The cached KVClient for one agent."""
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = KVClient(
                    address,
                    self.token,
                    self.tenant_secret,
                    use_shm=self._use_shm,
                    shm_bytes=self._shm_bytes,
                    timeout=self.timeout,
                    tls=self.tls,
                )
                self._clients[address] = client
            return client

    def nodes(self) -> list[router_pb2.NodeInfo]:
        """Every node with its addresses: for the cluster identity (a tenant's token gets
        PERMISSION_DENIED) and development clusters."""
        try:
            nodes = list(
                self.router.ListNodes(
                    router_pb2.ListNodesRequest(), timeout=self.timeout, metadata=self._md
                ).nodes
            )
        except grpc.RpcError as exc:
            raise from_rpc(exc) from None
        with self._lock:
            self._nodes = {n.node_id: n for n in nodes}
        return nodes

    def node(self, node_id: str) -> router_pb2.NodeInfo | None:
        """A node's addresses, from the last ListNodes (asked again for one not seen)."""
        with self._lock:
            info = self._nodes.get(node_id)
        if info is None:
            info = next((n for n in self.nodes() if n.node_id == node_id), None)
        return info

    # --------------------------------------------------------------- namespaces
    def open_namespace(self, spec: Namespace) -> ClusterNamespace:
        """Open on one agent (for the id and generation); others open lazily. The agent is
        the router's pick for the namespace (a dry run of no blocks, which tenants may
        ask for their own namespaces, unlike ListNodes)."""
        req = router_pb2.RouteRequest(
            namespace_id=spec.namespace_id, spec=_spec_msg(spec), dry_run=True
        )
        try:
            address = self.router.Route(req, timeout=self.timeout, metadata=self._md).address
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise from_rpc(exc) from None
            raise RuntimeError(
                f"the router at {self.router_address} knows no agents yet: {exc.details()}"
            ) from None
        first = self.agent(address).open_namespace(spec)
        ns = ClusterNamespace(spec, first.namespace_id, first.generation, first.root)
        ns.handles[address] = first
        return ns

    def handle(self, ns: ClusterNamespace, address: str) -> NamespaceHandle:
        h = ns.handles.get(address)
        if h is None:
            h = self.agent(address).open_namespace(ns.spec)
            if h.generation != ns.generation:
                raise RuntimeError(
                    f"agent {address} has namespace {ns.spec.key} at generation "
                    f"{h.generation}, this handle has {ns.generation}: open it again"
                )
            ns.handles[address] = h
        return h

    # ------------------------------------------------------------------ prompts
    def route(
        self,
        ns: ClusterNamespace,
        tokens,
        request_id: str = "",
        dry_run: bool = False,
        weights: router_pb2.RouteWeights | None = None,
    ):
        """(block ids, RouteResponse) for a prompt."""
        return route_tokens(
            self.router, ns, tokens, request_id, dry_run, weights, self.timeout, self._md
        )

    @TRACER.start_as_current_span("kvstore.cluster.fetch")
    def fetch(
        self,
        ns: ClusterNamespace,
        tokens,
        device: str | torch.device = "cpu",
        address: str | None = None,
        request_id: str = "",
        prefetch: bool = True,
    ) -> ClusterHit:
        """Route the prompt (or use `address`), then load its longest cached prefix from
        that agent. When the router priced fetching part of that prefix from another node
        as cheaper than recomputing it (its peer hint), the chosen agent first pulls those
        blocks from that node (`prefetch=False`: do not; `hit.prefetch` says how it went,
        and blocks that did not arrive are simply not cached). Pass the result to `store`
        (or `release`) when the request is done."""
        if address is None:
            ids, resp = self.route(ns, tokens, request_id)
            node_id, address, rid = resp.node_id, resp.address, resp.request_id
        else:
            ids = hash_chain(ns.root, tokens, ns.spec.block_size)
            resp, node_id, rid = None, "", ""
        client = self.agent(address)
        h = self.handle(ns, address)
        pulled = self._pull_peer_blocks(client, h, ids, resp) if prefetch and resp else None
        once = rid or request_id or uuid.uuid4().hex  # Lookup and Get: one request
        matched = client.lookup(h, ids, request_id=once).matched if ids else 0
        blocks = client.get(h, ids[:matched], device=device, request_id=once) if matched else []
        annotate(
            {
                "kvstore.tenant": ns.spec.tenant,
                "kvstore.node": node_id,
                "kvstore.blocks": len(ids),
                "kvstore.cached_blocks": len(blocks),
                "kvstore.peer_fetched": pulled.fetched if pulled else 0,
            }
        )
        return ClusterHit(
            node_id, address, rid, PrefixHit(ids, blocks, ns.spec.block_size), resp, pulled
        )

    def _pull_peer_blocks(
        self, client: KVClient, h: NamespaceHandle, ids: list[bytes], resp: router_pb2.RouteResponse
    ) -> PrefetchResult | None:
        """Have the chosen agent pull the prefix blocks the router found on the hinted
        peer. A failed call is a shorter prefix (the caller recomputes), not an error."""
        chosen = resp.candidates[0] if resp.candidates else None  # sorted, chosen first
        if not resp.peer_hint or chosen is None or not chosen.peer_blocks:
            return None
        n = min(len(ids), chosen.local_blocks + chosen.peer_blocks)
        if not resp.peer_address:  # the router names the hinted peer's addresses
            return PrefetchResult(
                0, 0, 0, "", f"peer {resp.peer_hint} is not a known node any more"
            )
        try:
            return client.prefetch(
                h,
                ids[:n],
                resp.peer_address,
                resp.peer_transfer_address,
                timeout_ms=int(self.timeout * 1000),
            )
        except grpc.RpcError as exc:
            log.warning(
                "prefetch of %d blocks from %s onto %s failed: %s",
                n,
                resp.peer_hint,
                resp.node_id,
                exc.code().name,
            )
            return PrefetchResult(0, 0, 0, "", f"Prefetch failed: {exc.code().name}")

    @TRACER.start_as_current_span("kvstore.cluster.store")
    def store(
        self,
        ns: ClusterNamespace,
        hit: ClusterHit,
        tokens,
        kv: torch.Tensor | list[torch.Tensor],
        release: bool = True,
    ) -> Usage:
        """Store the prompt's new blocks on the node that served `hit`; then release the
        route (the router stops counting the request as in flight)."""
        try:
            return self.agent(hit.address).store(
                self.handle(ns, hit.address), tokens, kv, cached_blocks=hit.cached_blocks
            )
        finally:
            if release:
                self.release(hit)

    def release(self, hit: ClusterHit | str, prefill_done: bool = False) -> None:
        """The request completed: the router stops counting it on its node. With
        `prefill_done`, only its prefill did (first token out): the router stops counting
        its queued prefill work but keeps the request in flight while it decodes; call
        release again without the flag when it completes."""
        rid = hit if isinstance(hit, str) else hit.request_id
        if rid:
            try:
                self.router.Release(
                    router_pb2.ReleaseRequest(request_id=rid, prefill_done=prefill_done),
                    timeout=self.timeout,
                    metadata=self._md,
                )
            except grpc.RpcError as exc:
                raise from_rpc(exc) from None


class RoutedClient:
    """KVClient's prompt-level `fetch`/`store` signatures over a cluster: each fetch is
    routed, and the following store goes to the node that served it. Lets single-agent
    code (kvstore.integrations.hf.CachedPrefillWorker) run through the router. One
    request at a time per RoutedClient."""

    def __init__(self, cluster: ClusterClient) -> None:
        self.cluster = cluster
        self.last: ClusterHit | None = None

    def fetch(self, ns: ClusterNamespace, tokens, device: str | torch.device = "cpu"):
        self.last = self.cluster.fetch(ns, tokens, device=device)
        return self.last

    def store(self, ns: ClusterNamespace, tokens, kv, cached_blocks: int = 0) -> Usage:
        if self.last is None:
            raise RuntimeError("RoutedClient.store needs a fetch first")
        hit, self.last = self.last, None
        if cached_blocks != hit.cached_blocks:
            raise ValueError(
                f"store says {cached_blocks} cached blocks, the fetch served {hit.cached_blocks}"
            )
        return self.cluster.store(ns, hit, tokens, kv)
