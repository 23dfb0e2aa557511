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

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from kvstore.config import TLSConfig
from kvstore.telemetry import TRACER, annotate, traced_channel
from kvstore.tls import channel, client_tls
from kvstore.client.convert import (
    block_shape,
    block_tensor,
    blocks_to_kv,
    check_block,
    kv_to_blocks,
    tensor_bytes,
    torch_dtype,
)
from kvstore import lane
from kvstore.client.errors import DeadlineExceeded, KVClientError, StagingGone, from_rpc
from kvstore.client.local_lane import AnswerGone, LaneBroken, LaneChannel, LaneDeadline, Sent
from kvstore.client.results import AgentStats, LookupResult, PinResult, PrefetchResult, PutResult
from kvstore.client.device_staging import DeviceStaging, allocate_device_staging, close_quietly
from kvstore.client.staging import Staging, create_staging
from kvstore.errors import KvError
from kvstore.hashing import hash_chain, pack_ids
from kvstore.namespace import Namespace
from kvstore.v1 import agent_pb2, agent_pb2_grpc, peer_pb2, peer_pb2_grpc
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

MiB = 1 << 20
# Smallest staging area worth having: below it (a tiny /dev/shm) payloads go over gRPC.
STAGING_FLOOR = 16 * MiB
DEFAULT_TIMEOUT_S = 10.0
log = logging.getLogger("kvstore.client")
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


@dataclass(frozen=True, slots=True, eq=False)
class PendingGet:
    """A Get `KVClient.begin_get_staged` sent; `finish_get_staged` reads its answer."""

    ns: NamespaceHandle
    ids: list[bytes]
    parent: bytes | None
    timeout: float | None
    request_id: str
    first_slot: int
    lane: LaneChannel | None  # where it was sent; None: nothing sent, finish makes the call
    sent: Sent | None


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


class _Stale(Exception):
    """This agent process does not know our registration: register again, then retry."""

    def __init__(self, error: KVClientError) -> None:
        super().__init__(error.details())
        self.error = error


class KVClient:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        tenant_secret: str | bytes | None = None,
        use_shm: bool | None = None,
        shm_bytes: int = 256 * MiB,
        max_message_bytes: int = 64 * MiB,
        local_lane: bool = True,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: TLSConfig | str | None = None,
    ) -> None:
        """`timeout`: the deadline of each RPC, in seconds (methods that take a
        `timeout` override it per call). `tls`: mTLS to the agent, a TLSConfig (CA,
        client certificate, key) or a directory holding ca.crt, client.crt and
        client.key (what `kvctl cluster up --tls` writes under <state>/tls)."""
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.address = address
        self.tenant_secret = tenant_secret
        self.timeout = timeout
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self.tls = client_tls(tls)
        self.channel = traced_channel(
            channel(
                address,
                self.tls,
                [
                    ("grpc.max_send_message_length", max_message_bytes),
                    ("grpc.max_receive_message_length", max_message_bytes),
                ],
            )
        )
        self.stub = agent_pb2_grpc.NodeAgentStub(self.channel)
        self.peer_stub = peer_pb2_grpc.PeerStub(self.channel)
        self._shm: Staging | None = None
        self._staging: np.ndarray | None = None
        self._region_id = 0
        self._chain_puts = False  # the agent takes PutRequest.chain_ids (RegisterShm says)
        # The lane connection our region was registered over (it lives as long as this
        # connection); data calls use it too unless local_lane=False.
        self._lane: LaneChannel | None = None
        self._lane_ok = local_lane
        self._stale = False  # the lane broke or timed out: register again before a call
        self._staging_gone = ""  # why the agent refused our staging again, once it has
        self._session_lock = threading.Lock()
        self.reregistrations = 0  # times this client registered again (agent restarts)
        self._staging_cache: dict[tuple, torch.Tensor] = {}
        self._device: DeviceStaging | None = None  # attach_device_staging
        self._slot_view_cache: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.local_socket = ""  # the agent's local-lane socket, when it offered one
        if use_shm is not False:
            self._try_shm(shm_bytes, required=bool(use_shm))

    # ---------------------------------------------------------------- plumbing
    def _try_shm(self, size: int, required: bool) -> None:
        shm = create_staging(size, min(size, STAGING_FLOOR))
        if shm is None:
            if required:
                raise KVClientError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"shared memory cannot hold a staging area of {size} bytes",
                )
            return
        arr = shm.array  # populated: no page faults during the first transfer
        self._shm, self._staging = shm, arr
        try:
            self._register(time.monotonic() + self.timeout)
        except KVClientError as exc:
            self._shm, self._staging = None, None
            del arr
            shm.close()
            if required or exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.info("no shared memory with agent %s: %s", self.address, exc.details())
            return

    def _register(self, deadline: float) -> None:
        """Register our region with the agent (again, after a restart): connect to its
        local lane and hand over the staging memory's descriptor. FAILED_PRECONDITION
        when there is no lane to reach (another host, no lane, refused)."""
        shm = self._shm
        if shm is None:
            raise RuntimeError("register needs the shared-memory staging area")
        try:
            where = self._grpc(self.stub.LocalLane, agent_pb2.LocalLaneRequest(), deadline)
        except KVClientError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # an agent from before lanes
                raise
            where = agent_pb2.LocalLaneResponse()
        if not where.socket:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "the agent runs no local lane")
        try:
            ch = LaneChannel(
                where.socket, self._md, max(0.01, deadline - time.monotonic()), where.lane_id
            )
        except (OSError, KVClientError) as exc:  # another host, or the lane refused us
            raise KVClientError(
                grpc.StatusCode.FAILED_PRECONDITION, f"local lane {where.socket}: {exc}"
            ) from None
        try:
            resp = ch.call(
                lane.REGISTER,
                agent_pb2.RegisterShmRequest(size=shm.size),
                agent_pb2.RegisterShmResponse,
                deadline - time.monotonic(),
                fds=(shm.fd,),
            )
        except KVClientError as exc:
            ch.close()
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the agent's caps on lane
                # connections and registered bytes: no shared memory, payloads over gRPC
                raise KVClientError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"local lane {where.socket}: {exc.details()}",
                ) from None
            raise
        except LaneBroken as exc:  # the agent went away mid-registration
            ch.close()
            raise KVClientError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        self._region_id, self.local_socket, self._lane = resp.region_id, where.socket, ch
        self._chain_puts = resp.chain_puts
        if self._device is not None:  # after an agent restart: lend it again
            self._device.region_id = self._register_device(self._device, deadline)
        self._stale = False

    def _register_device(self, dev: DeviceStaging, deadline: float) -> int:
        """Lend device staging `dev` to the agent over our lane connection (it lives as
        long as that connection); its region id."""
        if self._lane is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "no local lane to the agent")
        fd = dev.export_fd()
        try:
            resp = self._lane.call(
                lane.REGISTER,
                agent_pb2.RegisterShmRequest(size=dev.size, device_uuid=dev.uuid),
                agent_pb2.RegisterShmResponse,
                deadline - time.monotonic(),
                fds=(fd,),
            )
        except LaneBroken as exc:
            raise KVClientError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        finally:
            close_quietly(fd)
        return resp.region_id

    def attach_device_staging(
        self, device: torch.device | str, nbytes: int, timeout: float | None = None
    ) -> str:
        """Lend the agent `nbytes` of staging memory on GPU `device`, so that
        `get_device_staged_tensor` serves blocks there, copied from the agent's pool on
        that GPU device to device. Returns '' once attached, else why not (no CUDA, no
        local lane, the agent's pool in host memory or on another GPU): host staging
        still serves, as before."""
        if self._device is not None:
            return ""
        if not self.uses_local_lane:
            return "no local lane to the agent (another host, or local_lane=False)"
        try:
            dev = allocate_device_staging(device, nbytes)
        except KvError as exc:  # no CUDA or driver, not a CUDA device, no size
            return str(exc)
        try:
            dev.region_id = self._register_device(dev, self._deadline(timeout))
        except KVClientError as exc:
            dev.close()
            if exc.code() in (
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.INVALID_ARGUMENT,
            ):
                return exc.details() or exc.code().name
            raise
        self._device = dev
        return ""

    @property
    def uses_device_staging(self) -> bool:
        return self._device is not None

    def _reregister(self, deadline: float) -> None:
        """The agent lost our registration (it restarted) or the lane broke: close the
        old connection (the agent drops the region with it), then register again. When
        the agent refuses (FAILED_PRECONDITION: one of its caps, or no lane any more),
        give the staging area up and go on over gRPC, as a client refused at start does."""
        with self._session_lock:
            self._drop_lane()
            self._stale = True  # until registered: a failure here is tried again next call
            try:
                self._register(deadline)
            except KVClientError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                self._give_up_staging(exc.details())
                return
            self.reregistrations += 1
        log.info(
            "registered again with agent %s (region %d, lane %s)",
            self.address,
            self._region_id,
            "on" if self.uses_local_lane else "off",
        )

    def _give_up_staging(self, why: str) -> None:
        log.warning(
            "agent %s refused our shared memory again (%s): payloads go over gRPC from now on",
            self.address,
            why,
        )
        self._staging_gone = why
        self._stale = False
        self._region_id = 0
        self._close_staging()

    def _need_staging(self, what: str) -> None:
        if self._staging is None:
            if self._staging_gone:
                raise StagingGone(f"{what}: no shared memory any more ({self._staging_gone})")
            raise RuntimeError(f"{what} needs the same-host shared-memory path")

    def _drop_lane(self) -> None:
        if self._lane is not None:
            self._lane.close()
            self._lane = None

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _grpc(self, fn, request, deadline: float):
        """One unary (or client-streaming) stub call by `deadline`, errors as ours."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"{self.address}: the deadline passed before the call")
        try:
            return fn(request, metadata=self._md, timeout=left)
        except grpc.RpcError as exc:
            raise from_rpc(exc) from None

    @property
    def uses_shm(self) -> bool:
        return self._shm is not None

    @property
    def uses_local_lane(self) -> bool:
        return self._lane is not None and self._lane_ok

    def _call(self, method: int, build, response_type, grpc_call, timeout: float | None = None):
        """`build(deadline)`'s request over the local lane when there is one, else over
        gRPC; once more after registering again when the agent lost our registration
        (calls are idempotent). `build` runs per attempt: the region id may change.
        `deadline`: the call's, on time.monotonic()'s clock."""
        deadline = self._deadline(timeout)
        if self._stale and self._shm is not None:
            self._reregister(deadline)
        try:
            return self._attempt(method, build(deadline), response_type, grpc_call, deadline)
        except _Stale:
            self._reregister(deadline)
        try:
            return self._attempt(method, build(deadline), response_type, grpc_call, deadline)
        except _Stale as exc:
            raise exc.error from None

    def _attempt(self, method: int, request, response_type, grpc_call, deadline: float):
        lane_ch = self._lane if self._lane_ok else None
        if lane_ch is not None:
            with self._lane_errors():
                return lane_ch.call(method, request, response_type, deadline - time.monotonic())
        try:
            return self._grpc(grpc_call, request, deadline)
        except KVClientError as exc:
            if exc.unknown_region and self._shm is not None:
                raise _Stale(exc) from None
            raise

    @contextmanager
    def _lane_errors(self) -> Iterator[None]:
        """A lane call's failures as the client handles them: _Stale (register again and
        retry) for a broken lane or an agent that lost our region."""
        try:
            yield
        except AnswerGone:
            raise
        except LaneBroken as exc:  # e.g. the agent restarted
            self._drop_lane()
            raise _Stale(KVClientError(grpc.StatusCode.UNAVAILABLE, str(exc))) from None
        except DeadlineExceeded as exc:
            if not isinstance(exc, LaneDeadline):  # no answer came: out of step
                self._drop_lane()  # reconnect on the next call
                self._stale = True
            raise
        except KVClientError as exc:
            if exc.unknown_region:
                raise _Stale(exc) from None
            raise

    def close(self) -> None:
        self._drop_lane()  # the agent drops our regions with the connection
        self._close_staging()
        self.channel.close()

    def _close_staging(self) -> None:
        if self._device is not None:
            self._device.close()
            self._device = None
        if self._shm is not None:
            self._staging = None
            self._staging_cache.clear()
            self._slot_view_cache.clear()
            self._shm.close()
            self._shm = None

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
