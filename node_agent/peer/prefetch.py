"""Peer.Prefetch: make the leading blocks of a prompt present here, pulling the missing
ones from a peer. Blocks a concurrent call already transfers are waited for (claims.py);
this call's own runs go over the first transport that reaches the peer, and whatever is
left over the next one (the transports, in order of preference, come from the
composition root: node_agent/peer/service.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore import errors
from kvstore.config import PeerConfig
from kvstore.hashing import pack_ids
from kvstore.pullcost import PullCostEstimator
from kvstore.store import BlockStore, NsState
from kvstore.v1 import agent_pb2, peer_pb2
from kvstore.wire import check_host_port, namespace_to_proto
from node_agent.peer.claims import ClaimRun, Claims
from node_agent.peer.counters import Counters
from node_agent.peer.credential import PeerCredential
from node_agent.peer.errors import PeerRefused, PeerTransportError, PeerUnreachable, within
from node_agent.peer.requests import PeerRequests
from node_agent.peer.sink import BatchSink, present_prefix
from node_agent.peer.staging import StagingPool
from node_agent.peer.transport import PeerRef, Transport

log = logging.getLogger("kvstore.agent.peer")

# Peers whose connections a pull has opened, remembered to leave their first pull out of
# the pull-cost fit; past this many (more than a cluster's nodes) the memory starts over.
MAX_PEERS_REMEMBERED = 4096


@dataclass(slots=True, eq=False)
class FetchJob:
    """One Prefetch call: what it pulls from whom until when, and how that went."""

    st: NsState
    generation: int
    ids: list[bytes]
    parent_id: bytes
    peer: PeerRef
    deadline: float
    authorization: str  # what the peer is shown: the agent's, or the caller's (credential.py)
    fetched: int = 0
    waited: int = 0
    used: list[str] = field(default_factory=list)  # transports tried, in order
    stopped: str = ""
    mine: dict[int, asyncio.Future] = field(default_factory=dict)  # index -> claim


class Prefetcher:
    """The fetching side of one agent: Prefetch calls, over `transports` in order."""

    def __init__(
        self,
        store: BlockStore,
        requests: PeerRequests,
        staging: StagingPool,
        pcfg: PeerConfig,
        counters: Counters,
        transports: Sequence[Transport],
        published=lambda: None,
        credential: PeerCredential | None = None,
    ) -> None:
        self._store = store
        self._requests = requests
        self._staging = staging
        self._pcfg = pcfg
        self._counters = counters
        self._transports = list(transports)
        self._published = published  # ship the store's pending events (event loop)
        self._credential = credential or PeerCredential("")  # which token a pull presents
        self._claims = Claims()
        # What pulls cost here, measured (published in the node record for the router).
        self.pull_cost = PullCostEstimator()
        # Peers pulled from before. The first pull from a peer also opens the connections
        # to it (UCX endpoint, gRPC channel: 0.2-2 s measured), a cost no later pull pays:
        # in the fit it priced every pull out, and with no pulls nothing corrected it.
        self._connected: set[PeerRef] = set()
        # Concurrent transfers pulled, all transports together: each holds staging sets.
        self._slots = asyncio.Semaphore(pcfg.max_transfers)

    async def prefetch(
        self,
        req: peer_pb2.PrefetchRequest,
        tenant: str | None,
        authorization: str,
        time_left: float | None,
    ) -> peer_pb2.PrefetchResponse:
        """Make the leading blocks of `req.block_ids` present here, pulling the missing
        ones from the peer. Never raises for transfer trouble: that is a shorter result."""
        for address, what in ((req.peer_address, "peer_address"),
                              (req.peer_ucx_address, "peer_ucx_address")):  # fmt: skip
            if address:
                check_host_port(address, what)
        spec = req.spec if req.HasField("spec") else None
        st = await self._requests.namespace(req.ns, spec, tenant, write=True)
        gen = req.ns.generation
        ids = self._requests.ids(req.block_ids)
        self._requests.parent(req.parent_id)
        if ids and not (req.peer_address or req.peer_ucx_address):
            raise errors.InvalidArgument("Prefetch needs peer_address or peer_ucx_address")
        budget = req.timeout_ms / 1000 if req.timeout_ms else self._pcfg.prefetch_timeout_s
        if time_left is not None:
            budget = min(budget, time_left)
        peer = PeerRef(req.peer_address, req.peer_ucx_address)
        auth = self._credential.for_pull(peer, authorization)
        t0 = time.monotonic()
        job = FetchJob(st, gen, ids, req.parent_id, peer, t0 + budget, auth)
        await self._run(job)
        if job.fetched:  # a call that only found or waited for blocks is no pull
            self._timed(peer, job.fetched * st.spec.block_bytes, time.monotonic() - t0)
        present = present_prefix(self._store, st.ns_id, gen, ids, req.parent_id)
        stopped = "" if present == len(ids) else (job.stopped or "blocks left after fetch")
        if stopped:
            log.info(
                "prefetch of %d blocks from %s stopped at %d: %s",
                len(ids),
                peer.ucx_address or peer.grpc_address,
                present,
                stopped,
            )
        return peer_pb2.PrefetchResponse(
            present=present,
            fetched=job.fetched,
            waited=job.waited,
            transport="+".join(job.used),
            stopped=stopped,
        )

    def _timed(self, peer: PeerRef, nbytes: int, seconds: float) -> None:
        """A pull's time goes into the fit, but for the first from each peer (it connected)."""
        if peer in self._connected:
            self.pull_cost.add(nbytes, seconds)
            return
        if len(self._connected) >= MAX_PEERS_REMEMBERED:  # callers name the peers: bounded
            self._connected.clear()
        self._connected.add(peer)

    async def _run(self, job: FetchJob) -> None:
        start = present_prefix(self._store, job.st.ns_id, job.generation, job.ids, job.parent_id)
        if start == len(job.ids):
            return
        runs = self._claims.claim(job.st, job.generation, job.ids, start)
        for run in runs:
            if run.mine:
                job.mine.update(zip(range(run.start, run.end), run.futures))
        try:
            for run in runs:
                ok = await (
                    self._transfer(job, run.start, run.end) if run.mine else self._wait(job, run)
                )
                if not ok:
                    break
        finally:
            self._claims.release(job.st, job.generation, job.ids, job.mine)

    async def _wait(self, job: FetchJob, run: ClaimRun) -> bool:
        left = job.deadline - time.monotonic()
        try:
            async with asyncio.timeout(max(left, 0.001)):
                done = await asyncio.gather(*(asyncio.shield(f) for f in run.futures))
        except asyncio.TimeoutError:
            job.stopped = "deadline passed waiting for a concurrent fetch of these blocks"
            return False
        if not all(done):
            job.stopped = "a concurrent fetch of these blocks did not get them"
            return False
        job.waited += run.end - run.start
        self._counters.add("peer_dedup_blocks", run.end - run.start)
        return True

    @staticmethod
    def _request(
        job: FetchJob, ids: list[bytes], parent: bytes, batch: int
    ) -> peer_pb2.FetchRequest:
        return peer_pb2.FetchRequest(
            ns=agent_pb2.NamespaceRef(namespace_id=job.st.ns_id, generation=job.generation),
            spec=namespace_to_proto(job.st.spec),
            block_ids=pack_ids(ids),
            parent_id=parent,
            batch_blocks=batch,
        )

    @staticmethod
    def _on_stored(job: FetchJob, offset: int):
        def on_stored(first: int, n: int) -> None:
            for i in range(offset + first, offset + first + n):
                fut = job.mine.get(i)
                if fut is not None and not fut.done():
                    fut.set_result(True)

        return on_stored

    async def _transfer(self, job: FetchJob, s: int, e: int) -> bool:
        """Pull ids[s:e] (this call's claims) over the transports in turn: a later one
        takes over where the previous one stopped, while blocks are missing, nothing
        refused them, the peer may hold more, and time is left."""
        parent = job.ids[s - 1] if s else job.parent_id
        sink = BatchSink(
            self._store,
            self._staging,
            self._counters,
            self._published,
            job.st,
            job.generation,
            job.ids[s:e],
            parent,
            job.parent_id,
            self._on_stored(job, s),
        )
        # The store refuses chains shorter than min_prefix_blocks per put: the first
        # batch must be at least that long.
        size = job.st.spec.block_bytes
        batch = max(
            self._pcfg.batch_for(size),
            min(job.st.policy.min_prefix_blocks, self._pcfg.max_batch_blocks),
        )
        tried = False
        for transport in self._transports:
            address = transport.address_of(job.peer)
            if not address:
                continue
            if tried and (
                sink.stored >= e - s
                or sink.stop_reason
                or sink.remote_done
                or time.monotonic() >= job.deadline
            ):
                break
            tried = True
            await self._attempt(job, transport, address, sink, transport.chunk_blocks(size, batch))
        job.fetched += sink.stored
        if sink.stored == e - s:
            return True
        job.stopped = (
            sink.stop_reason
            or job.stopped
            or (
                f"the peer holds only {s + sink.stored} of the blocks"
                if sink.remote_done
                else "transfer incomplete"
            )
        )
        return False

    async def _attempt(
        self, job: FetchJob, transport: Transport, address: str, sink: BatchSink, batch: int
    ) -> None:
        want = sink.begin()
        job.used.append(transport.name)
        self._counters.add(f"peer_fetch_{transport.name}")
        try:
            await within(
                self._slots.acquire(),
                job.deadline,
                job.deadline - time.monotonic(),
                "a free transfer slot",
            )
        except PeerTransportError as exc:
            job.stopped = f"{transport.name}: {exc}"
            return
        try:
            req = self._request(job, want.ids, want.parent_id, batch)
            await transport.fetch(address, req, sink, batch, job.deadline, job.authorization)
        except PeerRefused as exc:
            sink.stop_reason = str(exc)
        except PeerTransportError as exc:
            self._counters.add(f"peer_{transport.name}_failures")
            job.stopped = (
                f"{transport.name}: {exc.public if isinstance(exc, PeerUnreachable) else exc}"
            )
            # The last chunk's header may have come before its payloads failed: what the
            # peer announced did not arrive, so the next transport may still get it.
            sink.remote_done = False
            log.warning(
                "%s fetch of %d blocks from %s failed after %d: %s",
                transport.name,
                len(sink.ids),
                address,
                sink.stored,
                exc,
            )
        finally:
            self._slots.release()
