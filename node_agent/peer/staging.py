"""Shared pieces of peer transfer (node_agent/peer/serve.py, peer_fetch.py, peer_grpc.py):
tuning, errors, staging buffers, bounded awaits, access rules."""
from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import os
import struct
import time
from dataclasses import dataclass, fields

import numpy as np

from kvstore import errors
from kvstore.config import AgentConfig
from kvstore.namespace import Namespace
from kvstore.store import BlockStore, NsState
from kvstore.v1 import common_pb2
from node_agent.servicer import CLUSTER_TENANT

ACK = struct.pack("<Q", 0x4B56_4143_4B00_0001)  # "KVACK", version 1
MAX_CONTROL_BYTES = 4 << 20  # FetchRequest / FetchChunk size cap (8192 ids = 128 KiB)
OFFLOAD_BYTES = 1 << 20  # store copies at least this large run in a worker thread
GRPC_CHUNK_BYTES = 16 << 20  # payload per gRPC chunk: larger messages only add copy time
# Largest UCX payload message of large blocks (a run of adjacent blocks is cut in pieces
# of this size): the receiver verifies each piece as soon as it lands, while the next ones
# are still being copied, so only the last piece's verification is left at the end.
MESSAGE_BYTES = 16 << 20
# Protocol: over UCX, a batch of blocks up to this size travels as ONE payload message
# (the blocks back to back, copied into a staging buffer on both sides); larger blocks
# travel one message per run of blocks back to back in the sender's pool (at most
# MESSAGE_BYTES), zero-copy between pool slots. Each message costs thread
# hand-offs (UCX progress thread, ucxx notifier, event loop: 0.2-0.5 ms per completion on
# an idle host, several ms on a busy one), far more than copying a small block; for
# large blocks the copies would dominate.
# Both ends derive the mode from the namespace's block size, so they always agree.
PACKED_MAX_BLOCK_BYTES = 128 << 10
# gRPC status names that mean "the peer will not serve this", not "the transport broke".
REFUSALS = ("NOT_FOUND", "FAILED_PRECONDITION", "PERMISSION_DENIED", "INVALID_ARGUMENT",
            "UNAUTHENTICATED")


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """Transfer tuning. Defaults suit 2 MiB blocks on a 1-25 GB/s link as well as the
    few-KiB blocks of small models."""

    # Payload bytes per chunk (blocks per chunk: batch_bytes // block size, at least 1 and
    # at most max_batch_blocks): 64 blocks of 2 MiB, 256 of 8 KiB. Sized by bytes, not
    # blocks, so that small blocks do not pay a header and a round of awaits every few KiB.
    # Large blocks: between two chunks the receiver's copies stop for a round of thread
    # hand-offs (it must read the next header before it can post the receives), while the
    # messages of one chunk (MESSAGE_BYTES each) are received back to back and verified
    # as they land. 64 blocks of 2 MiB on this 2-core host: 16 MiB chunks ~1.9 GB/s,
    # 64 MiB ~2.8, 128 MiB ~3.2.
    batch_bytes: int = 128 << 20
    staging_sets: int = 3  # chunk buffers per transfer and side: >= 2 chunks in flight
    io_timeout_s: float = 10.0  # bound on any single network wait
    connect_timeout_s: float = 5.0
    prefetch_timeout_s: float = 30.0  # default bound on a whole Prefetch call
    idle_endpoint_s: float = 60.0  # a server closes a peer connection idle this long
    max_batch_blocks: int = 256  # cap on a requested batch (staging memory)
    max_transfers: int = 4  # concurrent transfers per direction (staging memory, CPU)
    # On one host, let UCX move payloads through shared memory (CMA reads, shared-memory
    # control messages) while it still detects a dead peer; False keeps them on TCP.
    shared_memory: bool = True
    # Payloads straight from B's pool slots into A's (where the pool can verify them in
    # place: host memory, or GPU memory with the device hash and a UCX built with CUDA).
    # False: through host staging copies on both sides (what a GPU pool does otherwise).
    in_place: bool = True

    @classmethod
    def from_env(cls, environ=os.environ) -> "PeerConfig":
        """Defaults, overridden by KVSTORE_PEER_<FIELD> variables (operators, benchmarks)."""
        kw = {}
        defaults = cls()
        for f in fields(cls):
            raw = environ.get(f"KVSTORE_PEER_{f.name.upper()}")
            if raw is None:
                continue
            kind = type(getattr(defaults, f.name))
            try:
                kw[f.name] = raw.strip().lower() in ("1", "true", "yes", "on") \
                    if kind is bool else kind(raw)
            except ValueError:
                raise ValueError(f"KVSTORE_PEER_{f.name.upper()}={raw!r} is not a "
                                 f"{kind.__name__}") from None
        return cls(**kw)

    def batch_for(self, block_bytes: int) -> int:
        """Blocks per chunk for blocks of `block_bytes`."""
        return max(1, min(self.batch_bytes // max(block_bytes, 1), self.max_batch_blocks))

    def __post_init__(self) -> None:
        if self.max_transfers < 1:
            raise ValueError("max_transfers must be >= 1")
        if self.batch_bytes <= 0:
            raise ValueError("batch_bytes must be > 0")
        if self.max_batch_blocks < 1:
            raise ValueError("max_batch_blocks must be >= 1")
        if self.staging_sets < 3:
            raise ValueError("staging_sets must be >= 3 (one being read, one on the wire, "
                             "one being written)")
        for name in ("io_timeout_s", "connect_timeout_s", "prefetch_timeout_s",
                     "idle_endpoint_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


class PeerTransportError(errors.Unavailable):
    """The transfer broke (connection, timeout, protocol): another transport may work."""


class PeerRefused(errors.KvError):
    """The peer answered but will not serve (unknown namespace, generation, access)."""


@dataclass(frozen=True, slots=True)
class PeerRef:
    grpc_address: str  # host:port of the peer's gRPC server ('' : none)
    ucx_address: str  # host:port of the peer's UCX listener ('' : none)


# --------------------------------------------------------------------------- staging
class StagingPool:
    """Reusable block buffers, carved in sets from one array each so UCX registers the
    memory once and its registration cache keeps it. A set's pages are only touched by
    the payloads that really pass through it (blocks served from NVMe, receives into
    fragmented slots); idle sets are kept up to `max_idle_bytes` in all."""

    def __init__(self, max_idle_bytes: int = 512 << 20) -> None:
        self._idle: dict[tuple[int, int], list[list[np.ndarray]]] = {}
        self._max_idle = max_idle_bytes
        self._idle_bytes = 0

    def take(self, n: int, nbytes: int) -> list[np.ndarray]:
        idle = self._idle.get((n, nbytes))
        if idle:
            self._idle_bytes -= n * nbytes
            return idle.pop()
        arena = np.empty(n * nbytes, dtype=np.uint8)
        return [arena[i * nbytes:(i + 1) * nbytes] for i in range(n)]

    def give(self, bufs: list[np.ndarray]) -> None:
        size = len(bufs) * bufs[0].nbytes
        if self._idle_bytes + size <= self._max_idle:
            self._idle.setdefault((len(bufs), bufs[0].nbytes), []).append(bufs)
            self._idle_bytes += size

    def lease(self, n_sets: int, batch: int, nbytes: int) -> "StagingLease":
        return StagingLease(self, [self.take(batch, nbytes) for _ in range(n_sets)])


class StagingLease:
    """The buffer sets of one transfer, used round-robin (`lease[k]` for batch k). They go
    back to the pool only while `clean`: a failed transfer may leave a UCX receive, a send
    or a worker-thread copy still touching them, and such sets are dropped instead."""

    def __init__(self, pool: StagingPool, sets: list[list[np.ndarray]]) -> None:
        self.pool = pool
        self.sets = sets
        self.clean = True

    def __getitem__(self, k: int) -> list[np.ndarray]:
        return self.sets[k % len(self.sets)]

    def release(self) -> None:
        if self.clean:
            for s in self.sets:
                self.pool.give(s)
        self.sets = []


# ---------------------------------------------------------------------- helpers
def packed(block_bytes: int) -> bool:
    """Whether a batch of such blocks travels as one UCX message (PACKED_MAX_BLOCK_BYTES)."""
    return block_bytes <= PACKED_MAX_BLOCK_BYTES


def contiguous(bufs: list[np.ndarray], n: int) -> np.ndarray:
    """The first n buffers of a staging set as one array: StagingPool.take carves a set
    in order from one arena, so they lie back to back."""
    return bufs[0].base[:n * bufs[0].nbytes]


def _where(buf) -> tuple[int, bool]:
    """(address, one byte per element) of a slot view or staging buffer: a 1-D uint8 host
    array, or a 1-D uint8 torch tensor (device pools' slot views)."""
    if isinstance(buf, np.ndarray):
        return buf.__array_interface__["data"][0], buf.strides == (1,)
    return buf.data_ptr(), tuple(buf.stride()) == (1,)


def runs_of(bufs: list, size: int, cap: int = 0) -> list[int]:
    """Lengths of the runs of `bufs` (1-D uint8 arrays or tensors of at least `size`
    bytes) that lie back to back in memory: each next one starting `size` bytes after the
    previous; at most `cap` buffers each when cap > 0. Pool slots reserved or filled one
    after another usually do, and such a run travels over UCX as one message (one
    completion, one round of thread hand-offs) instead of one each."""
    runs: list[int] = []
    prev = None
    for b in bufs:
        addr, dense = _where(b)
        if prev is not None and addr == prev + size and dense and \
                (cap <= 0 or runs[-1] < cap):
            runs[-1] += 1
        else:
            runs.append(1)
        prev = addr
    return runs


def spans(bufs: list, runs: list[int], size: int) -> list | None:
    """One array (tensor, for tensors) per run over `size` bytes of each of its buffers,
    or None when some run's buffers do not lie back to back (runs_of decides). A span
    covers memory that belongs to the run's own buffers, which the caller keeps referenced
    while the span is in use."""
    out: list = []
    i = 0
    for r in runs:
        part = bufs[i:i + r]
        if runs_of(part, size) != [r] or not _where(part[0])[1]:
            return None
        first = part[0]
        if r == 1:
            out.append(first[:size])
        elif isinstance(first, np.ndarray):
            out.append(np.lib.stride_tricks.as_strided(
                first, shape=(r * size,), strides=(1,), writeable=first.flags.writeable))
        else:  # a tensor: the same storage, r slots long
            out.append(first.as_strided((r * size,), (1,)))
        i += r
    return out


def check_runs(runs, count: int) -> list[int]:
    """A chunk header's message layout: empty means one message per block."""
    if not runs:
        return [1] * count
    runs = list(runs)
    if min(runs) < 1 or sum(runs) != count:
        raise PeerTransportError(f"malformed chunk from peer: runs {runs[:8]} do not split "
                                 f"{count} blocks")
    return runs


def present_prefix(store: BlockStore, ns_id: bytes, generation: int, ids: list[bytes],
                   parent_id: bytes, start: int = 0) -> int:
    """How many of ids[start:] continue a chain held here. Unlike store.lookup this counts
    no lookup in the hit-rate statistics: it is bookkeeping, not a request."""
    with store.lock:
        try:
            st = store.namespace(ns_id, generation)
        except errors.KvError:
            return 0
        prev = ids[start - 1] if start else parent_id
        n = 0
        for bid in ids[start:]:
            m = st.blocks.get(bid)
            if m is None or (prev and m.parent_id != prev):
                break
            n += 1
            prev = bid
        return n


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise errors.InvalidArgument(f"peer address {address!r} is not host:port")
    return host.strip("[]"), int(port)


async def within(aw, deadline: float, io_timeout: float, what: str):
    """Await `aw` for at most io_timeout and never past the deadline."""
    left = min(io_timeout, deadline - time.monotonic())
    if left <= 0:
        if asyncio.iscoroutine(aw):
            aw.close()
        elif isinstance(aw, asyncio.Future):
            aw.cancel()
        raise PeerTransportError(f"deadline passed before {what}")
    try:
        return await asyncio.wait_for(aw, left)
    except asyncio.TimeoutError:
        raise PeerTransportError(f"timed out after {left:.1f}s waiting for {what}") from None


class TokenTable:
    """Tenant of an `authorization` value, for the UCX path (gRPC goes through the edge
    interceptor). Same rule as the interceptor: SHA-256 of the bearer token."""

    def __init__(self, cfg: AgentConfig) -> None:
        self._by_hash = {tc.token_sha256.lower(): t for t, tc in cfg.tenants.items()
                         if tc.token_sha256}
        self._allow_unauth = cfg.allow_unauthenticated

    def tenant(self, authorization: str) -> str | None:
        if not authorization:
            if self._allow_unauth:
                return None
            raise errors.Unauthenticated("peer request without authorization")
        if not authorization.startswith("Bearer "):
            raise errors.Unauthenticated("authorization must be 'Bearer <token>'")
        digest = hashlib.sha256(authorization[7:].strip().encode()).hexdigest()
        tenant = self._by_hash.get(digest)
        if tenant is None:
            raise errors.Unauthenticated("unknown token")
        return tenant


def check_peer_access(tenant: str | None, st: NsState, write: bool) -> None:
    """Owners and cluster components (routers, peers) may move a namespace's blocks;
    other tenants may only read public namespaces."""
    if tenant is None or tenant == CLUSTER_TENANT or tenant == st.tenant:
        return
    if st.spec.public and not write:
        return
    raise errors.PermissionDenied(f"tenant {tenant!r} may not {'write' if write else 'read'} "
                                  f"namespaces of tenant {st.tenant!r}")


def post_control(ep, payload: bytes) -> asyncio.Future:
    """Post a control message (request, chunk header, refusal) as ONE UCX message: a
    4-byte little-endian length, then the bytes, for a receiver's recv_control. (ucxx's
    send_obj/recv_obj take two messages, a size then the body, and every receive
    completion costs thread hand-offs: UCX progress thread, ucxx notifier, event loop.)"""
    frame = np.frombuffer(struct.pack("<I", len(payload)) + payload, dtype=np.uint8)
    return asyncio.ensure_future(ep.send(frame))


def control_buffer() -> np.ndarray:
    """A receive buffer for recv_control, for one endpoint's control messages in turn
    (only the bytes a message brings are ever touched)."""
    return np.empty(4 + MAX_CONTROL_BYTES, dtype=np.uint8)


async def recv_control(ep, buf: np.ndarray) -> bytes:
    """Receive one post_control message into `buf` (control_buffer); its bytes. A message
    larger than the buffer fails in UCX (truncated); a length that does not fit what a
    message can hold is a protocol error."""
    buf[:4] = 0
    await ep.recv(buf)
    n = int.from_bytes(buf[:4].tobytes(), "little")
    if n > buf.nbytes - 4:
        raise PeerTransportError(f"peer sent a control message claiming {n} bytes (limit "
                                 f"{MAX_CONTROL_BYTES})")
    return buf[4:4 + n].tobytes()


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def init_ucx(shared_memory: bool = True):
    """Import and initialise ucxx once per process, inside the running event loop (its
    progress thread and request notifier bind to that loop).

    Every endpoint keeps peer-failure handling (a dead peer must fail the transfer, not
    hang or abort this process). UCX only picks transports that can report a failed peer
    for such endpoints, which by default leaves TCP alone even between two processes of
    one host. With `shared_memory`, the shared-memory transports declare that capability
    (they detect a dead peer: tests/integration/test_peer.py kills one mid-transfer) and payloads move
    with one CMA copy straight from the sender's pool slot into the receiver's.

    Rendezvous: auto, without the fragmented copy-in/copy-out variant. That is a
    zero-copy put over TCP (written by this process as the bytes arrive, so nothing lands
    after a connection is closed) and a zero-copy *read* from the sender over CMA: the
    receiver's memory is only ever written by the receiver itself, so a peer that wakes up
    after a timeout cannot write into a pool slot reused meanwhile. Environment variables
    (UCX_RNDV_SCHEME, UCX_PROTOS ...) still win, so operators can retune."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    flag = "y" if shared_memory else "n"
    os.environ.setdefault("UCX_MM_ERROR_HANDLING", flag)
    os.environ.setdefault("UCX_CMA_MEMORY_INVALIDATE", flag)
    import ucxx
    try:
        ucxx.init(options={"RNDV_SCHEME": "auto", "PROTOS": "^rndv/am*"},
                  env_takes_precedence=True, progress_mode="thread",
                  enable_python_future=True)
    except RuntimeError:
        pass  # already initialised in this process
    return ucxx


def ucx_cuda_support(ucxx) -> bool:
    """Whether this process's UCX context can move CUDA memory (a UCX built with CUDA
    and its CUDA transports loaded). False when it cannot be told."""
    try:
        return bool(ucxx.core._get_ctx().context.cuda_support)
    except Exception:  # noqa: BLE001 - a private attribute of ucxx: absent means "no"
        return False


def namespace_to_proto(spec: Namespace) -> common_pb2.Namespace:
    return common_pb2.Namespace(**spec.to_dict())
