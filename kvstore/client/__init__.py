"""Client library for inference workers.

    client = KVClient("127.0.0.1:50051", token="...", tenant_secret="...")
    ns = client.open_namespace(spec)            # validates, returns ids and generation
    hit = client.fetch(ns, prompt_tokens)       # longest cached prefix as KV tensors
    ... prefill prompt_tokens[hit.cached_tokens:] ...
    usage = client.store(ns, prompt_tokens, kv, cached_blocks=hit.cached_blocks)

Block tensors are shaped (layers, 2 [K, V], block_size, kv_heads, head_dim) in the
namespace's KV dtype. When the agent runs on the same host, payloads move through a
shared-memory staging region and gRPC carries only control; otherwise they stream over
gRPC. On the same host the hot calls (Lookup, Get, Put) also skip gRPC's per-call cost:
they go over the agent's local lane, a Unix socket carrying the same messages
(kvstore/lane.py), and register again if it breaks. `usage` reports prompt,
cache-read, cache-write and uncached tokens per request.

Every call has a deadline (`timeout`, 10 s by default; most methods take a per-call
`timeout` that bounds each RPC they make) and fails with the client's own error type,
kvstore.client.errors.KVClientError (a grpc.RpcError: same code() and details()), or its
DeadlineExceeded: a frozen agent never hangs a caller. When the agent restarts on the
same address, a same-host client notices (its region is unknown to the new process, or
the lane's connection broke), registers its shared-memory region and the local lane
again, and retries the call once; callers see nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import grpc
import torch

from kvstore import lane
from kvstore.client.convert import (
    block_shape,
    block_tensor,
    blocks_to_kv,
    check_block,
    kv_to_blocks,
    tensor_bytes,
    torch_dtype,
)
from kvstore.client.errors import DeadlineExceeded, KVClientError, StagingGone, from_rpc
from kvstore.client.handles import Blocks, NamespaceHandle, PendingGet, PrefixHit, Usage
from kvstore.client.local_lane import AnswerGone
from kvstore.client.results import AgentStats, LookupResult, PinResult, PrefetchResult, PutResult
from kvstore.client.session import MiB, AgentSession, _Stale
from kvstore.hashing import hash_chain, pack_ids
from kvstore.namespace import Namespace
from kvstore.telemetry import TRACER, annotate
from kvstore.v1 import agent_pb2, peer_pb2
from kvstore.wire import blocks_per_message, namespace_to_proto

__all__ = [
    "KVClient",
    "Blocks",
    "NamespaceHandle",
    "PendingGet",
    "PrefixHit",
    "Usage",
    "kv_to_blocks",
    "blocks_to_kv",
    "torch_dtype",
    "KVClientError",
    "DeadlineExceeded",
]

_GRPC_PUT_BLOCKS = 8
_COPY_OUT_BYTES = 4 * MiB


class KVClient(AgentSession):
    """The calls an inference worker makes on one agent. Construction, the staging area,
    the local lane and how a call reaches the agent: AgentSession (session.py)."""

    # --------------------------------------------------------------- namespaces
    def open_namespace(self, spec: Namespace, timeout: float | None = None) -> NamespaceHandle:
        info = self._grpc(
            self.stub.OpenNamespace,
            agent_pb2.OpenNamespaceRequest(spec=namespace_to_proto(spec)),
            self._deadline(timeout),
        )
        return NamespaceHandle(
            spec,
            info.namespace_id,
            info.generation,
            spec.root(info.generation, self.tenant_secret),
            info.block_bytes,
            info.policy.min_prefix_blocks or 1,
        )

    def block_ids(self, ns: NamespaceHandle, tokens) -> list[bytes]:
        return hash_chain(ns.root, tokens, ns.spec.block_size)

    # ------------------------------------------------------------------ blocks
    def lookup(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        timeout: float | None = None,
        request_id: str = "",
        caller_held: int = 0,
    ) -> LookupResult:
        """How many leading blocks of `ids` the agent holds. `request_id` names the engine
        request this serves: the agent counts each request once in its hit rates, however
        many Lookups and Gets name it (without one, each Lookup is a request).
        `caller_held`: leading blocks the caller holds in a cache of its own (an engine's
        prefix cache), left out of those hit rates."""
        req = agent_pb2.LookupRequest(
            ns=ns.ref, block_ids=pack_ids(ids), request_id=request_id, caller_held=caller_held
        )
        return LookupResult.from_proto(
            self._call(
                lane.LOOKUP, lambda _: req, agent_pb2.LookupResponse, self.stub.Lookup, timeout
            )
        )

    def staging_capacity(self, ns: NamespaceHandle) -> int:
        return 0 if self._staging is None else self._staging.size // ns.block_bytes

    def staging_views(self, ns: NamespaceHandle, n: int) -> list[torch.Tensor]:
        """Block tensors over the shared-memory staging area: write KV here (e.g. the
        device-to-host copy of prefill output) and `put_staged` stores it without
        another copy on this side."""
        if n > self.staging_capacity(ns):
            raise ValueError(f"staging holds {self.staging_capacity(ns)} blocks, asked for {n}")
        return list(self._slot_views(ns)[:n])

    def _slot_views(self, ns: NamespaceHandle) -> tuple[torch.Tensor, ...]:
        """One tensor per staging slot, made once per layout: unbinding them per call cost
        ~3 us a block (~0.18 ms of a 64-block get_views, inside the caller's Get)."""
        key = (ns.spec.kv_dtype, block_shape(ns.spec))
        views = self._slot_view_cache.get(key)
        if views is None:
            views = self._slot_view_cache[key] = tuple(self._staging_blocks(ns).unbind(0))
        return views

    def _staging_blocks(self, ns: NamespaceHandle) -> torch.Tensor:
        """The staging area as (capacity, *block shape) in the namespace's dtype; one view
        per layout, made once (a frombuffer per block costs ~20 us, per Get of hundreds)."""
        return _blocks_view(
            self._staging_cache,
            ns,
            self.staging_capacity(ns),
            lambda n: torch.frombuffer(self._staging, dtype=torch.uint8, count=n),
        )

    def get_views(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        parent: bytes | None = None,
        timeout: float | None = None,
        request_id: str = "",
    ) -> list[torch.Tensor]:
        """Leading present blocks as views over the staging area (zero-copy; valid until
        the next call on this client). Needs the shared-memory path. `request_id`: as in
        `lookup` (a Get naming a request no Lookup counted counts it)."""
        return self.get_views_tiered(ns, ids, parent, timeout, request_id).blocks

    def get_views_tiered(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        parent: bytes | None = None,
        timeout: float | None = None,
        request_id: str = "",
    ) -> "Blocks":
        """get_views, with the tier each block was served from."""
        resp = self._get_staged("get_views", ns, ids, parent, timeout, request_id)
        return Blocks(self.staging_views(ns, resp.count), list(resp.tiers))

    def get_staged_tensor(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        parent: bytes | None = None,
        timeout: float | None = None,
        request_id: str = "",
        first_slot: int = 0,
    ) -> torch.Tensor:
        """get_views as one (n, *block shape) tensor over the staging area: zero-copy,
        valid until a later call on this client writes over those slots; n leading
        blocks were served. One tensor, so a caller copies all of them out in one
        operation. `first_slot`: the staging slot (in blocks) the first block lands in,
        so that Gets into disjoint slots can be held at once."""
        resp = self._get_staged(
            "get_staged_tensor", ns, ids, parent, timeout, request_id, first_slot
        )
        return self._staging_blocks(ns)[first_slot : first_slot + resp.count]

    def begin_get_staged(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        parent: bytes | None = None,
        timeout: float | None = None,
        request_id: str = "",
        first_slot: int = 0,
    ) -> PendingGet:
        """get_staged_tensor in two halves: the Get goes out now over the local lane and
        `finish_get_staged` reads its answer (by the same deadline), so the agent copies
        and verifies the blocks while the caller does something else. Several may be
        begun (into disjoint slots) and finished in order. Any other call on this client
        in between, or finishing a later one first, reads and drops that answer: finish
        then makes the Get again. Without a lane, or when sending fails, nothing is sent
        now and finish makes the whole call (registering again first where needed)."""
        build = self._get_request("begin_get_staged", ns, ids, parent, request_id, first_slot)
        lane_ch = self._lane if self._lane_ok and not self._stale else None
        sent = None
        if lane_ch is not None:
            try:
                with self._lane_errors():
                    wait = self._timeout_of(timeout)
                    sent = lane_ch.start(lane.GET, build(time.monotonic() + wait), wait)
            except (_Stale, KVClientError, AnswerGone):
                lane_ch = None
        return PendingGet(ns, ids, parent, timeout, request_id, first_slot, lane_ch, sent)

    def finish_get_staged(self, p: PendingGet) -> torch.Tensor:
        """The answer to `begin_get_staged`: what get_staged_tensor would have returned."""
        if p.lane is not None and p.sent is not None and p.lane is self._lane:
            try:
                with self._lane_errors():
                    resp = p.lane.finish(p.sent, agent_pb2.GetResponse)
                return self._staging_blocks(p.ns)[p.first_slot : p.first_slot + resp.count]
            except AnswerGone:
                pass
            except _Stale:
                self._stale = True  # the Get below registers again first
        return self.get_staged_tensor(p.ns, p.ids, p.parent, p.timeout, p.request_id, p.first_slot)

    def _timeout_of(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def device_staging_capacity(self, ns: NamespaceHandle) -> int:
        return 0 if self._device is None else self._device.size // ns.block_bytes

    def get_device_staged_tensor(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        parent: bytes | None = None,
        timeout: float | None = None,
        request_id: str = "",
    ) -> torch.Tensor:
        """get_staged_tensor into the device staging area (attach_device_staging): one
        (n, *block shape) tensor on its GPU, valid until the next call on this client;
        n leading blocks were served, each verified on the GPU by the agent."""
        dev = self._device
        if dev is None:
            raise RuntimeError("get_device_staged_tensor needs attach_device_staging first")
        resp = self._get_staged(
            "get_device_staged_tensor", ns, ids, parent, timeout, request_id, device=True
        )
        cap = self.device_staging_capacity(ns)
        return _blocks_view(dev.views, ns, cap, lambda n: dev.tensor[:n])[: resp.count]

    def _get_staged(
        self,
        what: str,
        ns: NamespaceHandle,
        ids: list[bytes],
        parent: bytes | None,
        timeout: float | None = None,
        request_id: str = "",
        first_slot: int = 0,
        device: bool = False,
    ) -> agent_pb2.GetResponse:
        """Get into staging slots first_slot..first_slot + len(ids) (of the device staging
        area with `device`), for the zero-copy call `what`."""
        return self._call(
            lane.GET,
            self._get_request(what, ns, ids, parent, request_id, first_slot, device),
            agent_pb2.GetResponse,
            self._get_one,
            timeout,
        )

    def _get_request(
        self,
        what: str,
        ns: NamespaceHandle,
        ids: list[bytes],
        parent: bytes | None,
        request_id: str,
        first_slot: int,
        device: bool = False,
    ) -> Callable[[float], agent_pb2.GetRequest]:
        """The builder of a Get into staging slots first_slot.. (of the device staging area
        with `device`) for the zero-copy call `what`: it needs the shared-memory path and
        those slots within the staging area."""
        self._need_staging(what)
        cap = self.device_staging_capacity(ns) if device else self.staging_capacity(ns)
        if first_slot < 0 or first_slot + len(ids) > cap:
            raise ValueError(
                f"{what} takes at most {cap} blocks at once, slots {first_slot}.. asked for "
                f"{len(ids)}"
            )
        parent = ns.root if parent is None else parent
        start = first_slot * ns.block_bytes
        offsets = range(start, start + len(ids) * ns.block_bytes, ns.block_bytes)
        packed = pack_ids(ids)

        # Built per attempt: the region id changes when the client registers again (or
        # the staging area is gone, refused by the agent).
        def build(deadline: float) -> agent_pb2.GetRequest:
            self._need_staging(what)
            until, sent = staging_times(deadline)
            return agent_pb2.GetRequest(
                ns=ns.ref,
                block_ids=packed,
                parent_id=parent,
                shm=agent_pb2.ShmTarget(
                    region_id=(
                        self._device.region_id if device and self._device else self._region_id
                    ),
                    offsets=offsets,
                    deadline_ns=until,
                    sent_ns=sent,
                ),
                request_id=request_id,
            )

        return build

    def _get_one(
        self, req: agent_pb2.GetRequest, metadata, timeout: float
    ) -> agent_pb2.GetResponse:
        """A shared-memory Get over gRPC, its responses folded into one."""
        out = agent_pb2.GetResponse()
        for r in self.stub.Get(req, metadata=metadata, timeout=timeout):
            out.count += r.count
            out.tiers.extend(r.tiers)
        return out

    def get(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        parent: bytes | None = None,
        device: str | torch.device = "cpu",
        timeout: float | None = None,
        request_id: str = "",
    ) -> list[torch.Tensor]:
        """Leading present blocks as tensors owned by the caller (on `device`).
        `request_id`: as in `lookup`."""
        return self.get_tiered(ns, ids, parent, device, timeout, request_id).blocks

    def get_tiered(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        parent: bytes | None = None,
        device: str | torch.device = "cpu",
        timeout: float | None = None,
        request_id: str = "",
    ) -> "Blocks":
        """`get`, with the tier each block was served from (kvstore.events.Tier: HBM for
        the device pool, NVME for a block read from RocksDB and promoted)."""
        parent = ns.root if parent is None else parent
        if self._staging is not None:
            try:
                return self._get_tiered_staged(ns, ids, parent, device, timeout, request_id)
            except StagingGone:
                pass  # given up mid-call: the whole Get again, over gRPC
        out = Blocks([], [])
        req = agent_pb2.GetRequest(
            ns=ns.ref, block_ids=pack_ids(ids), parent_id=parent, request_id=request_id
        )
        try:
            for resp in self.stub.Get(
                req, metadata=self._md, timeout=self.timeout if timeout is None else timeout
            ):
                for data in resp.data:
                    out.blocks.append(block_tensor(ns.spec, bytearray(data)).to(device))
                out.tiers.extend(resp.tiers)
        except grpc.RpcError as exc:
            raise from_rpc(exc) from None
        return out

    def _get_tiered_staged(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        parent: bytes,
        device: str | torch.device,
        timeout: float | None,
        request_id: str,
    ) -> "Blocks":
        """get_tiered through the staging area, copied out of it."""
        out = Blocks([], [])
        cap = self.staging_capacity(ns)
        for start in range(0, len(ids), cap):
            chunk = ids[start : start + cap]
            resp = self._get_staged(
                "get",
                ns,
                chunk,
                parent if start == 0 else ids[start - 1],
                timeout,
                request_id,
            )
            # Copy out in pieces of up to 4 MiB, the blocks views of them: one copy
            # per block costs ~20 us each on small blocks, and one huge buffer is
            # freshly mapped (page faults) on every call.
            stage = self._staging_blocks(ns)
            per = max(1, _COPY_OUT_BYTES // ns.block_bytes)
            for i in range(0, resp.count, per):
                piece = stage[i : min(i + per, resp.count)].to(device, copy=True)
                out.blocks.extend(piece.unbind(0))
            out.tiers.extend(resp.tiers)
            if resp.count < len(chunk):
                break
        return out

    def put_staged(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        parent: bytes | None = None,
        first_slot: int = 0,
        timeout: float | None = None,
    ) -> PutResult:
        """Store blocks already written into staging slots first_slot.. (same host)."""
        if not ids:
            return PutResult(0, 0)
        first = ns.root if parent is None else parent

        def build(deadline: float) -> agent_pb2.PutRequest:
            self._need_staging("put_staged")
            size = ns.block_bytes
            until, sent = staging_times(deadline)
            if self._chain_puts:  # one packed field: no BlockPut per block to build, parse
                return agent_pb2.PutRequest(
                    ns=ns.ref,
                    shm_region_id=self._region_id,
                    root=ns.root,
                    chain_ids=pack_ids(ids),
                    chain_parent_id=first,
                    chain_first_offset=first_slot * size,
                    chain_stride=size,
                    staging_deadline_ns=until,
                    staging_sent_ns=sent,
                )
            req = agent_pb2.PutRequest(
                ns=ns.ref,
                shm_region_id=self._region_id,
                root=ns.root,
                staging_deadline_ns=until,
                staging_sent_ns=sent,
            )
            # blocks.add builds each message in place; a list of BlockPut handed to the
            # constructor is copied message by message (about twice the time, 64 blocks)
            add, prev = req.blocks.add, first
            for i, bid in enumerate(ids, first_slot):
                add(block_id=bid, parent_id=prev, shm_offset=i * size)
                prev = bid
            return req

        return PutResult.from_proto(
            self._call(
                lane.PUT,
                build,
                agent_pb2.PutResponse,
                lambda r, metadata, timeout: self.stub.Put(
                    iter([r]), metadata=metadata, timeout=timeout
                ),
                timeout,
            )
        )

    def put(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        blocks: list[torch.Tensor],
        parent: bytes | None = None,
        timeout: float | None = None,
    ) -> PutResult:
        """Store blocks (block i is the child of block i-1; block 0 of `parent`, the chain
        root by default). Idempotent: blocks already present are skipped."""
        if len(ids) != len(blocks):
            raise ValueError(f"{len(ids)} ids for {len(blocks)} blocks")
        for i, b in enumerate(blocks):
            check_block(ns.spec, b, i)
        parent = ns.root if parent is None else parent
        if not ids:
            return PutResult(0, 0)
        if self._staging is not None:
            try:
                return self._put_through_staging(ns, ids, blocks, parent, timeout)
            except StagingGone:
                pass  # given up mid-call: the whole Put again (idempotent), over gRPC
        return PutResult.from_proto(
            self._grpc(
                self.stub.Put,
                self._grpc_put_stream(ns, ids, blocks, parent),
                self._deadline(timeout),
            )
        )

    def _put_through_staging(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        blocks: list[torch.Tensor],
        parent: bytes,
        timeout: float | None,
    ) -> PutResult:
        stored = already = 0
        not_stored = ""
        cap = self.staging_capacity(ns)
        for start in range(0, len(ids), cap):
            views = self.staging_views(ns, min(cap, len(ids) - start))
            for v, b in zip(views, blocks[start : start + cap]):
                v.copy_(b.reshape(v.shape))
            r = self.put_staged(
                ns,
                ids[start : start + cap],
                parent if start == 0 else ids[start - 1],
                timeout=timeout,
            )
            stored += r.stored
            already += r.already_present
            not_stored = not_stored or r.not_stored
        return PutResult(stored, already, not_stored)

    def _grpc_put_stream(self, ns, ids, blocks, parent):
        # Messages of at most MESSAGE_PAYLOAD_BYTES (or one block): agents receive a few
        # MiB per message (AgentConfig.max_message_bytes), not 8 blocks of any size.
        per = blocks_per_message(ns.block_bytes, _GRPC_PUT_BLOCKS)
        for start in range(0, len(ids), per):
            msg = agent_pb2.PutRequest(ns=ns.ref, root=ns.root if start == 0 else b"")
            for bid, blk in zip(ids[start : start + per], blocks[start : start + per]):
                msg.blocks.append(
                    agent_pb2.BlockPut(
                        block_id=bid, parent_id=parent, data=tensor_bytes(blk, ns.block_bytes)
                    )
                )
                parent = bid
            yield msg

    def pin(
        self, ns: NamespaceHandle, ids: list[bytes], pin: bool = True, timeout: float | None = None
    ) -> PinResult:
        req = agent_pb2.PinRequest(ns=ns.ref, block_ids=pack_ids(ids))
        return PinResult.from_proto(
            self._grpc(self.stub.Pin if pin else self.stub.Unpin, req, self._deadline(timeout))
        )

    def stats(self, tenant: str = "", timeout: float | None = None) -> AgentStats:
        return AgentStats.from_proto(
            self._grpc(
                self.stub.Stats, agent_pb2.StatsRequest(tenant=tenant), self._deadline(timeout)
            )
        )

    def prefetch(
        self,
        ns: NamespaceHandle,
        ids: list[bytes],
        peer_address: str,
        peer_ucx_address: str = "",
        parent: bytes | None = None,
        timeout_ms: int = 0,
    ) -> PrefetchResult:
        """Have this agent pull the leading blocks of `ids` it lacks from another agent:
        `peer_address` is that agent's gRPC host:port, `peer_ucx_address` its UCX
        listener (tried first when given; the router's ListNodes has both). The blocks
        arrive verified and are then served by get like any others. Transfer trouble
        (peer gone, frozen, refusing) is a shorter answer, not an error: `present` says
        how many leading blocks of `ids` this agent now holds, `fetched` how many moved,
        `transport` over what, `stopped` why it ended early ('' when all arrived).
        `timeout_ms` bounds the whole call (0: the agent's default, 30 s)."""
        req = peer_pb2.PrefetchRequest(
            ns=ns.ref,
            spec=namespace_to_proto(ns.spec),
            block_ids=pack_ids(ids),
            parent_id=ns.root if parent is None else parent,
            peer_address=peer_address,
            peer_ucx_address=peer_ucx_address,
            timeout_ms=timeout_ms,
        )
        return PrefetchResult.from_proto(
            self._grpc(
                self.peer_stub.Prefetch, req, self._deadline((timeout_ms or 30_000) / 1000 + 10)
            )
        )

    # ------------------------------------------------------------ prompt level
    @TRACER.start_as_current_span("kvstore.client.fetch")
    def fetch(
        self,
        ns: NamespaceHandle,
        tokens,
        device: str | torch.device = "cpu",
        timeout: float | None = None,
    ) -> PrefixHit:
        """The longest cached prefix of `tokens` on this node, as block tensors
        (`timeout` bounds each of its calls)."""
        ids = self.block_ids(ns, tokens)
        rid = uuid.uuid4().hex  # its Lookup and Get count as one request
        matched = self.lookup(ns, ids, timeout, rid).matched if ids else 0
        blocks = (
            self.get(ns, ids[:matched], device=device, timeout=timeout, request_id=rid)
            if matched
            else []
        )
        annotate(
            {
                "kvstore.tenant": ns.spec.tenant,
                "kvstore.blocks": len(ids),
                "kvstore.cached_blocks": len(blocks),
            }
        )
        return PrefixHit(ids, blocks, ns.spec.block_size)

    @TRACER.start_as_current_span("kvstore.client.store")
    def store(
        self,
        ns: NamespaceHandle,
        tokens,
        kv: torch.Tensor | list[torch.Tensor],
        cached_blocks: int = 0,
        timeout: float | None = None,
    ) -> Usage:
        """Store the full blocks of `tokens` past the first `cached_blocks` and report
        usage. `kv` is the prompt's KV (layers, 2, tokens, heads, head_dim) or a list of
        block tensors covering at least the full blocks."""
        ids = self.block_ids(ns, tokens)
        blocks = kv_to_blocks(kv, ns.spec.block_size) if isinstance(kv, torch.Tensor) else kv
        new_ids = ids[cached_blocks:]
        written = 0
        if new_ids and len(ids) >= ns.min_prefix_blocks:
            parent = ids[cached_blocks - 1] if cached_blocks else ns.root
            r = self.put(ns, new_ids, blocks[cached_blocks : len(ids)], parent, timeout)
            written = r.stored
        annotate(
            {
                "kvstore.tenant": ns.spec.tenant,
                "kvstore.blocks": len(ids),
                "kvstore.cached_blocks": cached_blocks,
                "kvstore.stored_blocks": written,
            }
        )
        n = len(tokens)
        read = cached_blocks * ns.spec.block_size
        return Usage(n, read, written * ns.spec.block_size, n - read)


def _blocks_view(cache: dict, ns: NamespaceHandle, cap: int, flat) -> torch.Tensor:
    """A staging area as (cap, *block shape) in the namespace's dtype, from `flat(nbytes)`
    (its first nbytes as uint8); one view per layout, kept in `cache` (a frombuffer per
    block costs ~20 us, per Get of hundreds)."""
    key = (ns.spec.kv_dtype, block_shape(ns.spec))
    t = cache.get(key)
    if t is None:
        t = flat(cap * ns.block_bytes).view(torch_dtype(ns.spec.kv_dtype)).view(cap, *key[1])
        cache[key] = t
    return t


def staging_times(deadline: float) -> tuple[int, int]:
    """A staging call's deadline (time.monotonic()'s clock, seconds) and the time it is
    sent, in ns of CLOCK_MONOTONIC (PutRequest.staging_deadline_ns / ShmTarget): the
    agent stores nothing from, and copies nothing into, staging past the deadline, after
    which this client's caller is told the call failed and may use that staging again."""
    until = int(deadline * 1e9)
    return until, min(time.monotonic_ns(), until)
