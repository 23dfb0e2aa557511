"""The fetching side of direct reads between agents of one host (direct.py): what
UcxFetcher does with a chunk header that names blocks in the peer's memory instead of
announcing payload messages. The protocol: node_agent/peer/__init__.py."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable

import numpy as np

from kvstore import errors
from kvstore.config import PeerConfig
from kvstore.store import BlockStore
from kvstore.store_types import Reservation
from kvstore.v1 import peer_pb2
from node_agent.peer.counters import Counters
from node_agent.peer.errors import PeerTransportError, within
from node_agent.peer.offload import in_thread_owned
from node_agent.peer.sink import BatchSink, Landing
from node_agent.peer.ucx import direct, mapped
from node_agent.peer.ucx.wire import is_ip, packed, split_host_port

log = logging.getLogger("kvstore.agent.peer")
# A peer whose memory the kernel would not let us read is asked for payload messages for
# this long, then offered direct reads again (it may have restarted in our PID namespace).
NO_DIRECT_S = 300.0
# How long a process found at the far end of this agent's connection to a peer address
# stays trusted to be that peer (direct.serves_connection: a few /proc reads, off the loop)
OWNER_CHECKED_S = 60.0


class DirectFetcher:
    """`same_host`: this agent's direct.host_identity, offered to every peer not refused
    lately ("" : never offered). `spawn`: runs a background task, kept referenced."""

    def __init__(
        self,
        store: BlockStore,
        pcfg: PeerConfig,
        counters: Counters,
        same_host: str,
        spawn: Callable[..., asyncio.Future],
    ) -> None:
        self._store = store
        self._pcfg = pcfg
        self._counters = counters
        self._same_host = same_host
        self._spawn = spawn
        # peers whose memory the kernel would not let us read -> until when we do not ask
        self._refused: dict[str, float] = {}
        self._mappings = mapped.PoolMappings()  # peers' pools, mapped read-only
        # peer processes whose pool could not be mapped -> until when we read it with
        # process_vm_readv instead
        self._unmapped: dict[int, float] = {}
        self._sweeper: asyncio.Future | None = None  # _sweep, while pools are mapped
        # (peer address, pid) found at the far end of our connection there -> until when
        self._owners: dict[tuple[str, int], float] = {}

    def offer(self, address: str) -> str:
        """What a FetchRequest to `address` offers in `same_host`."""
        if self._same_host:
            self._mappings.sweep()  # the pools of peers gone are freed
        if self._refused.get(address, 0.0) >= time.monotonic():
            return ""
        return self._same_host

    def close(self) -> None:
        self._mappings.close()
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def _sweep(self) -> None:
        """While any peer pool is mapped: drop those of peers gone every SWEEP_S, so a
        dead agent's pool memory is freed even when no fetch comes."""
        try:
            while len(self._mappings):
                await asyncio.sleep(mapped.SWEEP_S)
                self._mappings.sweep()
                now = time.monotonic()  # (read threads add to _unmapped: a copy first)
                for pid, until in list(self._unmapped.items()):
                    if until < now:
                        self._unmapped.pop(pid, None)
        finally:
            self._sweeper = None

    def check(self, hdr: peer_pb2.FetchChunk, req: peer_pb2.FetchRequest, size: int) -> None:
        """A chunk for direct reads must answer an offer, of large blocks, with an address
        per block."""
        if not req.same_host or packed(size) or len(hdr.addresses) != hdr.count:
            raise PeerTransportError(
                f"malformed chunk from peer: direct reads of {len(hdr.addresses)} addresses "
                f"for {hdr.count} blocks of {size} bytes"
                + ("" if req.same_host else ", not offered")
            )

    async def post(
        self,
        ep,
        address: str,
        sink: BatchSink,
        posted: list[Landing],
        first: int,
        hdr: peer_pb2.FetchChunk,
        ahead: Reservation | None,
        releases: list[asyncio.Future],
    ) -> bool:
        """Reserve the batch's slots (or take `ahead`) and start reading its blocks from the
        peer's memory into them (direct.read_into, in a worker thread), each hashed as it
        lands; the peer's release message for the batch follows once the read is over
        (in chunk order: `releases`). False (the sink knows why) when not one block of it
        can be stored here: then nothing is read."""
        after = posted[-1].res if posted else None
        try:
            if ahead is not None:
                self._store.trim(ahead, hdr.count)
                res = ahead
            elif self._store.pool.free_slots < hdr.count:  # making room may write NVMe
                res = await in_thread_owned(
                    sink.reserve, self._store.abort, first, hdr.count, after
                )
            else:
                res = sink.reserve(first, hdr.count, after)
        except errors.KvError as exc:
            sink.stop_reason = sink.stop_reason or f"not stored here: {exc}"
            return False
        if not res.plan:
            sink.stop_reason = sink.stop_reason or f"not stored here: {res.reason}"
            return False
        if hdr.direct_pid == os.getpid():  # our own memory: other tenants' slots among it
            self._store.abort(res)
            raise PeerTransportError("malformed chunk from peer: direct reads from this process")
        ld = Landing(first, hdr.count, list(hdr.checksums), res, [], [], direct=True)
        views = res.views  # fewer than hdr.count when the pool is short: the rest is a miss
        threads = self._store.copy_threads_for(len(views) * sink.block_bytes)
        addrs = list(hdr.addresses[: len(views)])
        read = asyncio.ensure_future(self._read(address, hdr, views, addrs, threads))
        ld.recvs = asyncio.ensure_future(asyncio.gather(read, return_exceptions=True))
        ld.digests = [asyncio.ensure_future(_digests_of(read))]
        prev = releases[-1] if releases else None
        releases.append(self._spawn(self._release(ep, prev, read)))
        posted.append(ld)
        return True

    async def _read(
        self, address: str, hdr: peer_pb2.FetchChunk, views, addrs, threads: int
    ) -> list[int]:
        pid = hdr.direct_pid
        await self._check_owner(address, pid)
        try:
            if hdr.direct_bytes and self._unmapped.get(pid, 0.0) < time.monotonic():
                got = await asyncio.to_thread(self._read_mapped, hdr, views, addrs, threads)
                if self._sweeper is None and len(self._mappings):
                    self._sweeper = self._spawn(self._sweep())
            else:
                got = await asyncio.to_thread(direct.read_into, pid, views, addrs, threads)
            self._counters.add("peer_blocks_direct", len(views))  # read (not yet verified)
            return got
        except direct.DirectReadError as exc:
            if exc.refused:  # requests to this peer ask for payload messages for a while
                self._refused[address] = time.monotonic() + NO_DIRECT_S
                self._counters.add("peer_direct_refused")
                log.warning(
                    "direct reads from %s refused (%s): its payloads go over UCX messages",
                    address,
                    exc,
                )
            raise

    async def _check_owner(self, address: str, pid: int) -> None:
        """Read only from the process at the far end of this agent's connection to
        `address` (direct.serves_connection). Otherwise the transfer fails and this address
        is not offered direct reads for NO_DIRECT_S."""
        now = time.monotonic()
        if self._owners.get((address, pid), 0.0) >= now:
            return
        host, port = split_host_port(address)
        if await asyncio.to_thread(_serves, pid, host, port):
            if len(self._owners) > 1024:  # peers come and go: forget the expired ones
                self._owners = {k: t for k, t in self._owners.items() if t >= now}
            self._owners[(address, pid)] = now + OWNER_CHECKED_S
            return
        self._refused[address] = now + NO_DIRECT_S
        self._counters.add("peer_direct_not_owner")
        log.warning(
            "peer %s named process %d for direct reads, which is not the far end of this "
            "agent's connection to it: nothing read (its payloads go over UCX messages from "
            "now on)",
            address,
            pid,
        )
        raise PeerTransportError(
            f"direct reads: the peer at {address} named a process that is not the far end "
            "of this agent's connection to it; nothing was read"
        )

    def _read_mapped(self, hdr: peer_pb2.FetchChunk, views, addrs, threads: int) -> list[int]:
        """Worker thread: the chunk through a mapping of the peer's pool (mapped.py), or,
        where that cannot be had, with process_vm_readv (and so for that process's
        chunks for a while: a refusal costs a failed open each time)."""
        pid = hdr.direct_pid
        try:
            got = self._mappings.read_into(
                pid, hdr.direct_fd, hdr.direct_base, hdr.direct_bytes, views, addrs, threads
            )
        except OSError as exc:
            self._unmapped[pid] = time.monotonic() + NO_DIRECT_S
            log.warning(
                "cannot map the pool of peer process %d (%s): reading it with "
                "process_vm_readv instead",
                pid,
                exc,
            )
            return direct.read_into(pid, views, addrs, threads)
        self._counters.add("peer_blocks_mapped", len(views))
        return got

    async def _release(self, ep, prev: asyncio.Future | None, read: asyncio.Future) -> bool:
        """Tell the peer that the batch `read` read is done with, once the batches before
        it were (`prev`); whether that went out. A failed read sends nothing: the transfer
        fails and its connection is aborted (as it is when a send fails: the transfer's
        own waits report it)."""
        if prev is not None and not await prev:
            return False
        await asyncio.wait([read])
        if read.cancelled() or read.exception() is not None:
            return False
        try:
            await within(
                ep.send(np.frombuffer(direct.RELEASE, dtype=np.uint8)),
                time.monotonic() + self._pcfg.io_timeout_s,
                self._pcfg.io_timeout_s,
                "release",
            )
        except Exception as exc:
            log.debug("sending a release failed: %s: %s", type(exc).__name__, exc)
            return False
        return True


def _serves(pid: int, host: str, port: int) -> bool:
    """direct.serves_connection for a peer address (a name: every address it has)."""
    try:
        ips = [host] if is_ip(host) else [str(i[4][0]) for i in socket.getaddrinfo(host, port)]
    except OSError:
        return False
    return direct.serves_connection(pid, ips, port)


async def _digests_of(read: asyncio.Future) -> list[int] | None:
    """The XXH64s a direct read took; None when it failed (the transfer fails on its own)."""
    try:
        return await read
    except Exception:
        return None
