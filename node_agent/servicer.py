"""Thin gRPC servicer: protobuf <-> domain objects, then the BlockStore does the work.
Errors are KvError subclasses; node_agent/interceptors.py turns them into status codes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvstore import errors, native, store_copy
from kvstore.auth import CLUSTER_TENANT, check_creates, check_namespace, is_reader
from kvstore.events import Tier
from kvstore.hashing import BLOCK_ID_BYTES
from kvstore.store import BlockStore, NsState, PackedIds, PendingPut, PutItem
from kvstore.v1 import agent_pb2, agent_pb2_grpc
from kvstore.wire import (
    blocks_per_message,
    check_id,
    check_request_id,
    namespace_from_proto,
    policy_to_proto,
    tier_to_proto,
    unpack_ids,
)
from node_agent.events import EventHub
from node_agent.interceptors import current_tenant
from node_agent.metrics import AgentMetrics
from node_agent.ns_registry import check_cap
from node_agent.shm import DeviceRegion, ShmRegistry, shm_offer, staging_deadline
from node_agent.stats import build_stats, withhold_occupancy

if TYPE_CHECKING:  # imported by node_agent/server.py only when configured
    from node_agent.control import AgentControl
    from node_agent.local_lane import LocalLane

log = logging.getLogger("kvstore.agent")


# Copies above this many bytes run in a worker thread so the event loop keeps serving.
_OFFLOAD_BYTES = 4 << 20
_GRPC_CHUNK_BLOCKS = 2


def _request_id(request) -> str:
    return check_request_id(request.request_id)


class AgentServicer(agent_pb2_grpc.NodeAgentServicer):
    def __init__(
        self,
        store: BlockStore,
        hub: EventHub,
        shm: ShmRegistry,
        node_id: str,
        max_blocks: int,
        max_namespaces_per_tenant: int = 0,
    ) -> None:
        self.store = store
        self.hub = hub
        self.shm = shm
        self.node_id = node_id
        self.max_blocks = max_blocks
        self.max_namespaces = max_namespaces_per_tenant  # enforced here only without etcd
        self.in_flight = 0
        self.control: AgentControl | None = None  # when etcd is configured
        self.lane: LocalLane | None = None  # when the agent runs one
        self.metrics = AgentMetrics()  # per-tenant tallies for Prometheus, span attributes

    # ------------------------------------------------------------------ helpers
    def _ids(self, packed: bytes, what: str = "block_ids") -> list[bytes]:
        return unpack_ids(packed, self.max_blocks, what)

    def _ns(self, ref: agent_pb2.NamespaceRef, write: bool) -> NsState:
        """The namespace a request names, access decided first: an unknown namespace and
        another tenant's get the same refusal, before generations or blocks are looked at
        (docs/security.md)."""
        check_id(ref.namespace_id, "namespace_id")
        check_namespace(current_tenant.get(), self.store.spec_of(ref.namespace_id), write)
        return self.store.namespace(ref.namespace_id, ref.generation)

    async def _exists(self, spec) -> bool:
        """Whether a namespace is open here or registered in the cluster (etcd)."""
        if self.store.spec_of(spec.namespace_id) is not None:
            return True
        return self.control is not None and await self.control.registered(spec)

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """Around work on the store: counted in `in_flight`, its events published after."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self.hub.publish_pending()

    async def _run(self, nbytes: int, fn, *args):
        with self._counted():
            if nbytes >= _OFFLOAD_BYTES:
                return await self._thread(fn, *args)
            return fn(*args)

    async def _thread(self, fn, *args):
        """fn(*args) on a worker thread. A call cancelled meanwhile (its client gone, a
        deadline) ends at once, but nothing stops the thread: it keeps an `in_flight` count
        of its own until it ends, so the load the router balances by stays in the gauge."""
        fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                self.in_flight += 1
                fut.add_done_callback(self._thread_ended)
            raise

    def _thread_ended(self, fut: asyncio.Future) -> None:
        self.in_flight -= 1
        if not fut.cancelled():
            fut.exception()  # its caller is gone: retrieved here, or asyncio logs it
        self.hub.publish_pending()

    async def _begun_in_thread(self, begin):
        """`begin()` (BlockStore.put_begin) on a worker thread, as _thread. Cancelled
        meanwhile, the put it begins is still ended, once begun (_abandon_off_loop), or
        its reserved slots would never be given back."""
        began = asyncio.ensure_future(asyncio.to_thread(begin))
        try:
            return await asyncio.shield(began)
        except asyncio.CancelledError:
            counted = not began.done()
            if counted:
                self.in_flight += 1

            def end(fut: asyncio.Future) -> None:
                if counted:
                    self._thread_ended(fut)
                if not fut.cancelled() and fut.exception() is None:  # begun: end it
                    _abandon_off_loop(fut.result())

            began.add_done_callback(end)
            raise

    async def _store_put(
        self,
        st: NsState,
        generation: int,
        items: list[PutItem],
        root,
        deadline_ns: int | None = None,
    ) -> tuple[int, int, str]:
        """store.put of a Put's items. A big batch's copy runs in the background on the
        native batch's own threads, waited for on the loop: no worker thread to wake, hand
        the batch to and back (0.1-0.5 ms each way on a 2-core host, per big Put). Its
        plan runs here too, unless it may write NVMe (evicting to make room, with an NVMe
        tier to demote to): that goes to a worker thread first. `deadline_ns`: a Put past
        it is refused before any copy, and a copy out of the caller's staging that ends
        past it stores nothing (BlockStore.put_begin); so does one finished on a worker
        thread after the call was cancelled. (stored, already present, why blocks were
        left out: PendingPut.not_stored)."""
        nbytes = len(items) * st.spec.block_bytes
        if nbytes < _background_bytes():
            gone = threading.Event()

            def put() -> tuple[int, int, str]:
                pending = self.store.put_begin(
                    st.ns_id, generation, items, root, False, deadline_ns
                )
                return (*pending.finish(gone), pending.not_stored)

            with _setting_when_cancelled(gone):
                return await self._run(nbytes, put)
        with self._counted():
            args = (st.ns_id, generation, items, root)
            pending: PendingPut | None
            if self.store.rocks is None:  # no NVMe tier: planning never touches one
                pending = self.store.put_begin(*args, deadline_ns=deadline_ns)
            else:
                pending = self.store.put_begin_if_fits(*args, deadline_ns)
            if pending is None:  # planning may write or read NVMe: not on the loop
                pending = await self._begun_in_thread(
                    functools.partial(self.store.put_begin, *args, deadline_ns=deadline_ns)
                )
            if pending.fileno() is None:
                gone = threading.Event()
                with _setting_when_cancelled(gone):
                    done = await self._thread(pending.finish, gone)
            else:
                await _copied(pending)
                done = pending.finish()
            return (*done, pending.not_stored)

    async def _store_get(
        self,
        st: NsState,
        generation: int,
        ids,
        parent: bytes,
        dst_for,
        deadline_ns: int | None = None,
    ):
        """store.get into shared memory; a big batch's copy out of the pool runs in the
        background like _store_put's, the rest (NVMe reads) on a worker thread. Nothing
        is copied into the caller's staging once `deadline_ns` has passed."""
        nbytes = len(ids) * st.spec.block_bytes
        if nbytes < _background_bytes():
            return await self._run(
                nbytes, self.store.get, st.ns_id, generation, ids, parent, dst_for, deadline_ns
            )
        with self._counted():
            pending = self.store.get_begin(
                st.ns_id, generation, ids, parent, dst_for, True, deadline_ns
            )
            background = pending.fileno() is not None
            if background:
                await _copied(pending)
            if pending.reads_beyond_pool or not background:
                return await self._thread(pending.finish)
            return pending.finish()

    # --------------------------------------------------------------------- RPCs
    async def OpenNamespace(self, request, context):
        if not request.HasField("spec"):
            raise errors.InvalidArgument("OpenNamespace needs a spec")
        spec = namespace_from_proto(request.spec)
        tenant = current_tenant.get()
        # Another tenant may open a public namespace (to read it: Put and Pin still check
        # write access), never a private one; the reserved identities open none.
        if tenant is not None and tenant != spec.tenant and not spec.public:
            raise errors.PermissionDenied(
                f"tenant {tenant!r} may not open namespaces of tenant {spec.tenant!r}"
            )
        check_namespace(tenant, spec, write=False)
        if is_reader(tenant, spec):  # it opens what exists (etcd is read for readers only)
            check_creates(tenant, spec, await self._exists(spec))
        if self.control is not None:  # registers it in etcd, the cap checked there
            st = await self.control.open_namespace(spec)
        else:
            check_cap(
                spec.tenant,
                {s.ns_id for s in self.store.namespaces() if s.tenant == spec.tenant},
                spec.namespace_id,
                self.max_namespaces,
            )
            st = self.store.open_namespace(spec)
        return agent_pb2.NamespaceInfo(
            namespace_id=st.ns_id,
            generation=st.generation,
            block_bytes=spec.block_bytes,
            policy=policy_to_proto(st.policy),
            tenant=spec.tenant,
            name=spec.name,
        )

    async def Lookup(self, request, context):
        st = self._ns(request.ns, write=False)
        rid = _request_id(request)
        ids = PackedIds(request.block_ids)
        if len(ids) > self.max_blocks:
            raise errors.InvalidArgument(
                f"request names {len(ids)} blocks; the limit is {self.max_blocks} per request"
            )
        if request.caller_held > len(ids):
            raise errors.InvalidArgument(
                f"caller_held is {request.caller_held}, more than the {len(ids)} blocks named"
            )
        res = self.store.lookup(st.ns_id, request.ns.generation, ids)
        self.metrics.lookup(st, len(ids), res, rid, request.caller_held)
        return agent_pb2.LookupResponse(
            matched=res.matched, hbm=res.hbm, nvme=res.nvme, generation=res.generation
        )

    async def Get(self, request, context):
        st = self._ns(request.ns, write=False)
        rid = _request_id(request)
        ids = self._ids(request.block_ids)
        if request.parent_id and len(request.parent_id) != 16:
            raise errors.InvalidArgument("parent_id must be empty or 16 bytes")
        if request.HasField("shm"):
            resp = await self._get_shm(st, request, ids)
            self.metrics.get_done(st, rid, len(ids), resp.count)
            yield resp
            return
        parent, total = request.parent_id, 0
        try:
            async for resp in self._get_stream(st, request, ids, parent):
                total += resp.count
                yield resp
        finally:
            self.metrics.get_done(st, rid, len(ids), total)

    async def _get_stream(self, st: NsState, request, ids: list[bytes], parent: bytes):
        per = blocks_per_message(st.spec.block_bytes, _GRPC_CHUNK_BLOCKS)
        for start in range(0, len(ids), per):
            chunk = ids[start : start + per]
            served = await self._run(
                len(chunk) * st.spec.block_bytes,
                self.store.get,
                st.ns_id,
                request.ns.generation,
                chunk,
                parent,
                lambda i, n: None,
            )
            self.metrics.served(st, served)
            if served:
                yield agent_pb2.GetResponse(
                    count=len(served),
                    first_index=start,
                    data=[s.data for s in served],
                    checksums=[s.checksum for s in served],
                    tiers=[tier_to_proto(s.tier) for s in served],
                )
            if len(served) < len(chunk):
                return
            parent = chunk[-1]

    async def _get_shm(self, st: NsState, request, ids: list[bytes]):
        region = self.shm.get(request.shm.region_id, current_tenant.get())
        offsets = list(request.shm.offsets)
        if len(offsets) != len(ids):
            raise errors.InvalidArgument(
                f"shm.offsets has {len(offsets)} entries for {len(ids)} blocks"
            )
        deadline = staging_deadline(request.shm.deadline_ns, request.shm.sent_ns, "shm")
        size = st.spec.block_bytes
        spans = [region.span(off, size) for off in offsets]  # every range checked first
        served = await self._store_get(
            st,
            request.ns.generation,
            ids,
            request.parent_id,
            lambda i, n: spans[i] if n == size else region.span(offsets[i], n),
            deadline,
        )
        self.metrics.served(st, served)
        return agent_pb2.GetResponse(
            count=len(served),
            first_index=0,
            checksums=[s.checksum for s in served],
            tiers=[tier_to_proto(s.tier) for s in served],
        )

    async def Put(self, request_iterator, context):
        st = None
        stored = already = total = 0
        not_stored = ""
        pending: list[PutItem] = []
        async for req in request_iterator:
            if st is None:
                if not req.HasField("ns"):
                    raise errors.InvalidArgument("the first PutRequest must carry ns")
                st = self._ns(req.ns, write=True)
                generation = req.ns.generation
                if req.root and len(req.root) != 16:
                    raise errors.InvalidArgument("root must be empty or 16 bytes")
                root = req.root
                deadline = staging_deadline(
                    req.staging_deadline_ns, req.staging_sent_ns, "staging_deadline_ns"
                )
            total += len(req.blocks) + len(req.chain_ids) // BLOCK_ID_BYTES
            if total > self.max_blocks:
                raise errors.InvalidArgument(f"Put carries more than {self.max_blocks} blocks")
            pending += self._put_items(st, req)
            # The store judges min_prefix_blocks per call: hold the first messages of a
            # stream until the chain is long enough (later ones extend a cached prefix).
            if len(pending) < st.policy.min_prefix_blocks:
                continue
            s, a, why = await self._store_put(st, generation, pending, root, deadline)
            stored, already, pending = stored + s, already + a, []
            not_stored = not_stored or why
        if st is None:
            raise errors.InvalidArgument("empty Put stream")
        if pending:
            s, a, why = await self._store_put(st, generation, pending, root, deadline)
            stored, already = stored + s, already + a
            not_stored = not_stored or why
        return agent_pb2.PutResponse(stored=stored, already_present=already, not_stored=not_stored)

    def _put_items(self, st: NsState, req) -> list[PutItem]:
        if not req.chain_ids and (
            req.chain_parent_id or req.chain_first_offset or req.chain_stride
        ):
            raise errors.InvalidArgument(
                "chain_parent_id, chain_first_offset and chain_stride describe chain_ids, "
                "which is empty"
            )
        if req.chain_ids and (req.blocks or not req.shm_region_id):
            raise errors.InvalidArgument(
                "chain_ids is the shared-memory form of a Put (shm_region_id set) and "
                "replaces blocks: a PutRequest carries one or the other"
            )
        region = (
            self.shm.get(req.shm_region_id, current_tenant.get()) if req.shm_region_id else None
        )
        if region is None:
            return [
                PutItem(b.block_id, b.parent_id, b.data, b.checksum if b.has_checksum else None)
                for b in req.blocks
            ]
        if isinstance(region, DeviceRegion):
            raise errors.InvalidArgument(
                f"region {req.shm_region_id} is device staging, which Gets fill; Put from "
                "host staging"
            )
        if req.chain_ids:
            return self._chain_items(st, req, region)
        size = st.block_bytes
        span = region.span
        return [
            PutItem(
                b.block_id,
                b.parent_id,
                span(b.shm_offset, size),
                b.checksum if b.has_checksum else None,
            )
            for b in req.blocks
        ]

    def _chain_items(self, st: NsState, req, region) -> list[PutItem]:
        """PutRequest.chain_ids: block i the child of block i - 1 (block 0 of
        chain_parent_id), its payload at chain_first_offset + i * chain_stride."""
        ids = self._ids(req.chain_ids, "chain_ids")
        parent = check_id(req.chain_parent_id, "chain_parent_id")
        size = st.block_bytes
        if req.chain_stride < size:
            raise errors.InvalidArgument(
                f"chain_stride {req.chain_stride} is below the namespace's {size}-byte blocks"
            )
        spans = region.spans(req.chain_first_offset, req.chain_stride, size, len(ids))
        return [PutItem(*b) for b in zip(ids, [parent, *ids[:-1]], spans)]

    async def Pin(self, request, context):
        return self._pin(request, True)

    async def Unpin(self, request, context):
        return self._pin(request, False)

    def _pin(self, request, pin: bool):
        st = self._ns(request.ns, write=True)
        n, total = self.store.pin(
            st.ns_id, request.ns.generation, self._ids(request.block_ids), pin
        )
        return agent_pb2.PinResponse(blocks=n, pinned_bytes=total)

    async def LocalLane(self, request, context):
        if self.lane is None:
            return agent_pb2.LocalLaneResponse()
        return agent_pb2.LocalLaneResponse(socket=self.lane.path, lane_id=self.lane.lane_id)

    async def RegisterShm(self, request, context):
        # Only over the local lane, with the memory's descriptor: a name (of a file under
        # /dev/shm, which anyone on the host may name) proves nothing about who holds it.
        offer = shm_offer.get()
        if offer is None:
            raise errors.PermissionDenied(
                "shared memory is registered over the agent's local lane by handing over "
                "its file descriptor (LocalLane names the socket); registering by name is refused"
            )
        if request.device_uuid:  # GPU staging memory (a CUDA VMM allocation's descriptor)
            pool = self.store.pool
            region = self.shm.register_device_fd(
                offer,
                request.size,
                request.device_uuid,
                current_tenant.get(),
                pool.device,
                pool.why_not_in_place,
            )
        else:
            region = await self.shm.register_fd(offer, request.size, current_tenant.get())
        return agent_pb2.RegisterShmResponse(
            region_id=region.region_id,
            local_socket=self.lane.path if self.lane else "",
            chain_puts=True,
        )

    async def UnregisterShm(self, request, context):
        self.shm.unregister(request.region_id, current_tenant.get())
        return agent_pb2.UnregisterShmResponse()

    async def Stats(self, request, context):
        tenant = current_tenant.get()
        if tenant == CLUSTER_TENANT:  # operators and routers see every tenant
            tenant = None
        if tenant is not None and request.tenant and request.tenant != tenant:
            raise errors.PermissionDenied(
                f"tenant {tenant!r} may not read stats of {request.tenant!r}"
            )
        resp = build_stats(
            self.store, self.metrics, self.node_id, request.tenant or tenant, self.in_flight
        )
        resp.native_accel = native.active()  # "python (...)": the slow fallback is in use
        if self.lane is not None and not (request.tenant or tenant):  # node-wide counters
            resp.counters.update(self.lane.counters.as_stats())
        if tenant is not None:
            withhold_occupancy(resp)
        return resp

    async def Subscribe(self, request, context):
        tenant = current_tenant.get()
        if tenant is not None and tenant != CLUSTER_TENANT:
            raise errors.PermissionDenied(
                f"the event stream is for cluster components (tenant {CLUSTER_TENANT!r}) only"
            )
        async for batch in self.hub.subscribe(request.subscriber or context.peer()):
            yield batch


def _background_bytes() -> int:
    """Batches from this size copy in the background (BatchCopier.write_start): smaller
    ones go through _run as a whole (inline, or one hand-off to a worker thread)."""
    return max(_OFFLOAD_BYTES, store_copy.PARALLEL_MIN_BYTES)


def _abandon_off_loop(pending) -> None:
    """End a put or get whose call was cancelled (PendingPut / PendingGet.abandon: it
    waits for the copy threads) on a worker thread, the loop serving on meanwhile; on
    this thread where the loop takes no more work (it is closing)."""

    def logged(fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.error("a put or get cancelled mid-copy ended badly", exc_info=fut.exception())

    try:
        asyncio.get_running_loop().run_in_executor(None, pending.abandon).add_done_callback(logged)
    except RuntimeError:  # the executor is shut down
        try:
            pending.abandon()
        except Exception:  # noqa: BLE001 - nobody is left to tell but the log
            log.exception("a put or get cancelled mid-copy ended badly")


@contextlib.contextmanager
def _setting_when_cancelled(gone: threading.Event) -> Iterator[None]:
    """Around awaiting a put a worker thread finishes: cancelled meanwhile (the agent gave
    up on the call: a lane frame that timed out, a server stopping), `gone` is set, and
    the put, once its copy is over, stores nothing (PendingPut.finish): the caller is
    told its call failed once this call ends, and may write its staging again."""
    try:
        yield
    except asyncio.CancelledError:
        gone.set()
        raise


async def _copied(pending) -> None:
    """Wait until a background copy (PendingPut / PendingGet) is done. Cancelled
    meanwhile (the client went away, a deadline), the call ends at once and the put or
    get is ended on a worker thread once its copy is over (_abandon_off_loop): its
    slots and buffers are not free to reuse before."""
    loop = asyncio.get_running_loop()
    fd = pending.fileno()
    done: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, ready)
    try:
        try:
            await done
        finally:
            loop.remove_reader(fd)  # before the descriptor is closed (finish, abandon)
    except BaseException:
        _abandon_off_loop(pending)
        raise


__all__ = ["AgentServicer", "Tier"]
