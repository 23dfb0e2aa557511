"""Client library for inference workers.

    client = KVClient("127.0.0.1:50051", token="...", tenant_secret="...")
    ns = client.open_namespace(spec)            # validates, returns ids and generation
    hit = client.fetch(ns, prompt_tokens)       # longest cached prefix as KV tensors
    ... prefill prompt_tokens[hit.cached_tokens:] ...
    usage = client.store(ns, prompt_tokens, kv, cached_blocks=hit.blocks)

Block tensors are shaped (layers, 2 [K, V], block_size, kv_heads, head_dim) in the
namespace's KV dtype. When the agent runs on the same host, payloads move through a
shared-memory staging region and gRPC carries only control; otherwise they stream over
gRPC. On the same host the hot calls (Lookup, Get, Put) also skip gRPC's per-call cost:
they go over the agent's local lane, a Unix socket carrying the same messages
(kvstore/lane.py), and fall back to gRPC if it breaks. `usage` reports prompt,
cache-read, cache-write and uncached tokens per request.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory

import grpc
import numpy as np
import torch

from kvstore.telemetry import TRACER, annotate, traced_channel
from kvstore.client.convert import (block_shape, block_tensor, blocks_to_kv, check_block,
                                    kv_to_blocks, tensor_bytes, torch_dtype)
from kvstore import lane
from kvstore.client.local_lane import LaneBroken, LaneChannel
from kvstore.hashing import hash_chain, pack_ids
from kvstore.namespace import Namespace
from kvstore.v1 import agent_pb2, agent_pb2_grpc, common_pb2, peer_pb2, peer_pb2_grpc

__all__ = ["KVClient", "Blocks", "NamespaceHandle", "PrefixHit", "Usage", "kv_to_blocks",
           "blocks_to_kv", "torch_dtype"]

MiB = 1 << 20
_GRPC_PUT_BLOCKS = 8
_COPY_OUT_BYTES = 4 * MiB


@dataclass(frozen=True, slots=True)
class NamespaceHandle:
    spec: Namespace
    namespace_id: bytes
    generation: int
    root: bytes
    block_bytes: int
    min_prefix_blocks: int

    @property
    def ref(self) -> agent_pb2.NamespaceRef:
        return agent_pb2.NamespaceRef(namespace_id=self.namespace_id, generation=self.generation)


@dataclass(frozen=True, slots=True)
class Usage:
    """Per request, the way providers report it; cache_write counts newly stored tokens."""

    prompt_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    uncached_tokens: int


@dataclass(frozen=True, slots=True)
class Blocks:
    """The verified leading run of a Get, and the tier each block was served from."""

    blocks: list[torch.Tensor]
    tiers: list[int]  # kvstore.events.Tier values, one per block


@dataclass(frozen=True, slots=True)
class PrefixHit:
    block_ids: list[bytes]  # ids of every full block of the prompt
    blocks: list[torch.Tensor]  # the cached leading blocks, in order
    block_size: int

    @property
    def cached_blocks(self) -> int:
        return len(self.blocks)

    @property
    def cached_tokens(self) -> int:
        return len(self.blocks) * self.block_size


class KVClient:
    def __init__(self, address: str, token: str | None = None,
                 tenant_secret: str | bytes | None = None, use_shm: bool | None = None,
                 shm_bytes: int = 256 * MiB, max_message_bytes: int = 64 * MiB,
                 local_lane: bool = True) -> None:
        self.address = address
        self.tenant_secret = tenant_secret
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self.channel = traced_channel(grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]))
        self.stub = agent_pb2_grpc.NodeAgentStub(self.channel)
        self.peer_stub = peer_pb2_grpc.PeerStub(self.channel)
        self._shm: shared_memory.SharedMemory | None = None
        self._staging: np.ndarray | None = None
        self._region_id = 0
        self._lane: LaneChannel | None = None
        self._staging_cache: dict[tuple, torch.Tensor] = {}
        self.local_socket = ""  # the agent's local-lane socket, when it offered one
        if use_shm is not False:
            self._try_shm(shm_bytes, required=bool(use_shm), lane_ok=local_lane)

    # ---------------------------------------------------------------- plumbing
    def _try_shm(self, size: int, required: bool, lane_ok: bool) -> None:
        name = f"kvstore-{os.getpid()}-{secrets.token_hex(6)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        arr = np.ndarray((size,), dtype=np.uint8, buffer=shm.buf)
        arr.fill(0)  # fault the pages in now, not during the first transfer
        try:
            resp = self.stub.RegisterShm(agent_pb2.RegisterShmRequest(name=name, size=size),
                                         metadata=self._md)
        except grpc.RpcError as exc:
            del arr
            shm.close()
            shm.unlink()
            if required or exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            return
        self._shm, self._staging, self._region_id = shm, arr, resp.region_id
        self.local_socket = resp.local_socket
        if lane_ok and resp.local_socket:
            try:  # the agent mapped our region, so it is on this host: its socket is too
                self._lane = LaneChannel(resp.local_socket, self._md)
            except OSError:
                pass  # e.g. /dev/shm shared but the socket not: stay on gRPC

    @property
    def uses_shm(self) -> bool:
        return self._shm is not None

    @property
    def uses_local_lane(self) -> bool:
        return self._lane is not None

    def _call(self, method: int, request, response_type, grpc_call):
        """Over the local lane when there is one, else (or once it broke) over gRPC."""
        if self._lane is not None:
            try:
                return self._lane.call(method, request, response_type)
            except LaneBroken:
                self._lane = None  # e.g. the agent restarted; calls are idempotent
        return grpc_call(request, metadata=self._md)

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
            self._lane = None
        if self._shm is not None:
            try:
                self.stub.UnregisterShm(
                    agent_pb2.UnregisterShmRequest(region_id=self._region_id), metadata=self._md)
            except grpc.RpcError:
                pass
            self._staging = None
            self._staging_cache.clear()
            self._shm.close()
            self._shm.unlink()
            self._shm = None
        self.channel.close()

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------- namespaces
    def open_namespace(self, spec: Namespace) -> NamespaceHandle:
        msg = common_pb2.Namespace(**spec.to_dict())
        info = self.stub.OpenNamespace(agent_pb2.OpenNamespaceRequest(spec=msg),
                                       metadata=self._md)
        return NamespaceHandle(spec, info.namespace_id, info.generation,
                               spec.root(info.generation, self.tenant_secret),
                               info.block_bytes, info.policy.min_prefix_blocks or 1)

    def block_ids(self, ns: NamespaceHandle, tokens) -> list[bytes]:
        return hash_chain(ns.root, tokens, ns.spec.block_size)

    # ------------------------------------------------------------------ blocks
    def lookup(self, ns: NamespaceHandle, ids: list[bytes]) -> agent_pb2.LookupResponse:
        req = agent_pb2.LookupRequest(ns=ns.ref, block_ids=pack_ids(ids))
        return self._call(lane.LOOKUP, req, agent_pb2.LookupResponse, self.stub.Lookup)

    def staging_capacity(self, ns: NamespaceHandle) -> int:
        return 0 if self._staging is None else self._staging.size // ns.block_bytes

    def staging_views(self, ns: NamespaceHandle, n: int) -> list[torch.Tensor]:
        """Block tensors over the shared-memory staging area: write KV here (e.g. the
        device-to-host copy of prefill output) and `put_staged` stores it without
        another copy on this side."""
        if n > self.staging_capacity(ns):
            raise ValueError(f"staging holds {self.staging_capacity(ns)} blocks, asked for {n}")
        return list(self._staging_blocks(ns)[:n].unbind(0))

    def _staging_blocks(self, ns: NamespaceHandle) -> torch.Tensor:
        """The staging area as (capacity, *block shape) in the namespace's dtype; one view
        per layout, made once (a frombuffer per block costs ~20 us, per Get of hundreds)."""
        key = (ns.spec.kv_dtype, block_shape(ns.spec))
        t = self._staging_cache.get(key)
        if t is None:
            cap = self.staging_capacity(ns)
            flat = torch.frombuffer(self._staging, dtype=torch.uint8,
                                    count=cap * ns.block_bytes)
            t = flat.view(torch_dtype(ns.spec.kv_dtype)).view(cap, *key[1])
            self._staging_cache[key] = t
        return t

    def get_views(self, ns: NamespaceHandle, ids: list[bytes],
                  parent: bytes | None = None) -> list[torch.Tensor]:
        """Leading present blocks as views over the staging area (zero-copy; valid until
        the next call on this client). Needs the shared-memory path."""
        return self.get_views_tiered(ns, ids, parent).blocks

    def get_views_tiered(self, ns: NamespaceHandle, ids: list[bytes],
                         parent: bytes | None = None) -> "Blocks":
        """get_views, with the tier each block was served from."""
        if self._staging is None:
            raise RuntimeError("get_views needs the same-host shared-memory path")
        cap = self.staging_capacity(ns)
        if len(ids) > cap:
            raise ValueError(f"get_views takes at most {cap} blocks at once")
        resp = self._get_staged(ns, ids, ns.root if parent is None else parent)
        return Blocks(self.staging_views(ns, resp.count), list(resp.tiers))

    def _get_staged(self, ns: NamespaceHandle, ids: list[bytes],
                    parent: bytes) -> agent_pb2.GetResponse:
        """Get into staging slots 0..len(ids) (the caller checked the capacity)."""
        offsets = range(0, len(ids) * ns.block_bytes, ns.block_bytes)
        req = agent_pb2.GetRequest(ns=ns.ref, block_ids=pack_ids(ids), parent_id=parent,
                                   shm=agent_pb2.ShmTarget(region_id=self._region_id,
                                                           offsets=offsets))
        return self._call(lane.GET, req, agent_pb2.GetResponse, self._get_one)

    def _get_one(self, req: agent_pb2.GetRequest, metadata) -> agent_pb2.GetResponse:
        """A shared-memory Get over gRPC, its responses folded into one."""
        out = agent_pb2.GetResponse()
        for r in self.stub.Get(req, metadata=metadata):
            out.count += r.count
            out.tiers.extend(r.tiers)
        return out

    def get(self, ns: NamespaceHandle, ids: list[bytes], parent: bytes | None = None,
            device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """Leading present blocks as tensors owned by the caller (on `device`)."""
        return self.get_tiered(ns, ids, parent, device).blocks

    def get_tiered(self, ns: NamespaceHandle, ids: list[bytes], parent: bytes | None = None,
                   device: str | torch.device = "cpu") -> "Blocks":
        """`get`, with the tier each block was served from (kvstore.events.Tier: HBM for
        the device pool, NVME for a block read from RocksDB and promoted)."""
        parent = ns.root if parent is None else parent
        out = Blocks([], [])
        if self._staging is not None:
            cap = self.staging_capacity(ns)
            for start in range(0, len(ids), cap):
                chunk = ids[start: start + cap]
                resp = self._get_staged(ns, chunk, parent if start == 0 else ids[start - 1])
                # Copy out in pieces of up to 4 MiB, the blocks views of them: one copy
                # per block costs ~20 us each on small blocks, and one huge buffer is
                # freshly mapped (page faults) on every call.
                stage = self._staging_blocks(ns)
                per = max(1, _COPY_OUT_BYTES // ns.block_bytes)
                for i in range(0, resp.count, per):
                    piece = stage[i: min(i + per, resp.count)].to(device, copy=True)
                    out.blocks.extend(piece.unbind(0))
                out.tiers.extend(resp.tiers)
                if resp.count < len(chunk):
                    break
            return out
        req = agent_pb2.GetRequest(ns=ns.ref, block_ids=pack_ids(ids), parent_id=parent)
        for resp in self.stub.Get(req, metadata=self._md):
            for data in resp.data:
                out.blocks.append(block_tensor(ns.spec, bytearray(data)).to(device))
            out.tiers.extend(resp.tiers)
        return out

    def put_staged(self, ns: NamespaceHandle, ids: list[bytes], parent: bytes | None = None,
                   first_slot: int = 0) -> agent_pb2.PutResponse:
        """Store blocks already written into staging slots first_slot.. (same host)."""
        parent = ns.root if parent is None else parent
        blocks = []
        for i, bid in enumerate(ids):
            blocks.append(agent_pb2.BlockPut(block_id=bid, parent_id=parent,
                                             shm_offset=(first_slot + i) * ns.block_bytes))
            parent = bid
        req = agent_pb2.PutRequest(ns=ns.ref, shm_region_id=self._region_id, blocks=blocks,
                                   root=ns.root)
        return self._call(lane.PUT, req, agent_pb2.PutResponse,
                          lambda r, metadata: self.stub.Put(iter([r]), metadata=metadata))

    def put(self, ns: NamespaceHandle, ids: list[bytes], blocks: list[torch.Tensor],
            parent: bytes | None = None) -> agent_pb2.PutResponse:
        """Store blocks (block i is the child of block i-1; block 0 of `parent`, the chain
        root by default). Idempotent: blocks already present are skipped."""
        if len(ids) != len(blocks):
            raise ValueError(f"{len(ids)} ids for {len(blocks)} blocks")
        for i, b in enumerate(blocks):
            check_block(ns.spec, b, i)
        parent = ns.root if parent is None else parent
        if not ids:
            return agent_pb2.PutResponse()
        if self._staging is not None:
            stored = already = 0
            cap = self.staging_capacity(ns)
            for start in range(0, len(ids), cap):
                views = self.staging_views(ns, min(cap, len(ids) - start))
                for v, b in zip(views, blocks[start: start + cap]):
                    v.copy_(b.reshape(v.shape))
                r = self.put_staged(ns, ids[start: start + cap],
                                    parent if start == 0 else ids[start - 1])
                stored += r.stored
                already += r.already_present
            return agent_pb2.PutResponse(stored=stored, already_present=already)
        return self.stub.Put(self._grpc_put_stream(ns, ids, blocks, parent), metadata=self._md)

    def _grpc_put_stream(self, ns, ids, blocks, parent):
        for start in range(0, len(ids), _GRPC_PUT_BLOCKS):
            msg = agent_pb2.PutRequest(ns=ns.ref, root=ns.root if start == 0 else b"")
            for bid, blk in zip(ids[start: start + _GRPC_PUT_BLOCKS],
                                blocks[start: start + _GRPC_PUT_BLOCKS]):
                msg.blocks.append(agent_pb2.BlockPut(block_id=bid, parent_id=parent,
                                                     data=tensor_bytes(blk, ns.block_bytes)))
                parent = bid
            yield msg

    def pin(self, ns: NamespaceHandle, ids: list[bytes], pin: bool = True):
        req = agent_pb2.PinRequest(ns=ns.ref, block_ids=pack_ids(ids))
        fn = self.stub.Pin if pin else self.stub.Unpin
        return fn(req, metadata=self._md)

    def stats(self, tenant: str = "") -> agent_pb2.StatsResponse:
        return self.stub.Stats(agent_pb2.StatsRequest(tenant=tenant), metadata=self._md)

    def prefetch(self, ns: NamespaceHandle, ids: list[bytes], peer_address: str,
                 peer_ucx_address: str = "", parent: bytes | None = None,
                 timeout_ms: int = 0) -> peer_pb2.PrefetchResponse:
        """Have this agent pull the leading blocks of `ids` it lacks from another agent:
        `peer_address` is that agent's gRPC host:port, `peer_ucx_address` its UCX
        listener (tried first when given; the router's ListNodes has both). The blocks
        arrive verified and are then served by get like any others. Transfer trouble
        (peer gone, frozen, refusing) is a shorter answer, not an error: `present` says
        how many leading blocks of `ids` this agent now holds, `fetched` how many moved,
        `transport` over what, `stopped` why it ended early ('' when all arrived).
        `timeout_ms` bounds the whole call (0: the agent's default, 30 s)."""
        req = peer_pb2.PrefetchRequest(
            ns=ns.ref, spec=common_pb2.Namespace(**ns.spec.to_dict()),
            block_ids=pack_ids(ids), parent_id=ns.root if parent is None else parent,
            peer_address=peer_address, peer_ucx_address=peer_ucx_address,
            timeout_ms=timeout_ms)
        return self.peer_stub.Prefetch(req, metadata=self._md,
                                       timeout=(timeout_ms or 30_000) / 1000 + 10)

    # ------------------------------------------------------------ prompt level
    @TRACER.start_as_current_span("kvstore.client.fetch")
    def fetch(self, ns: NamespaceHandle, tokens, device: str | torch.device = "cpu") -> PrefixHit:
        """The longest cached prefix of `tokens` on this node, as block tensors."""
        ids = self.block_ids(ns, tokens)
        matched = self.lookup(ns, ids).matched if ids else 0
        blocks = self.get(ns, ids[:matched], device=device) if matched else []
        annotate({"kvstore.tenant": ns.spec.tenant, "kvstore.blocks": len(ids),
                  "kvstore.cached_blocks": len(blocks)})
        return PrefixHit(ids, blocks, ns.spec.block_size)

    @TRACER.start_as_current_span("kvstore.client.store")
    def store(self, ns: NamespaceHandle, tokens, kv: torch.Tensor | list[torch.Tensor],
              cached_blocks: int = 0) -> Usage:
        """Store the full blocks of `tokens` past the first `cached_blocks` and report
        usage. `kv` is the prompt's KV (layers, 2, tokens, heads, head_dim) or a list of
        block tensors covering at least the full blocks."""
        ids = self.block_ids(ns, tokens)
        blocks = kv_to_blocks(kv, ns.spec.block_size) if isinstance(kv, torch.Tensor) else kv
        new_ids = ids[cached_blocks:]
        written = 0
        if new_ids and len(ids) >= ns.min_prefix_blocks:
            parent = ids[cached_blocks - 1] if cached_blocks else ns.root
            r = self.put(ns, new_ids, blocks[cached_blocks: len(ids)], parent)
            written = r.stored
        annotate({"kvstore.tenant": ns.spec.tenant, "kvstore.blocks": len(ids),
                  "kvstore.cached_blocks": cached_blocks, "kvstore.stored_blocks": written})
        n = len(tokens)
        read = cached_blocks * ns.spec.block_size
        return Usage(n, read, written * ns.spec.block_size, n - read)
