"""The UCX wire: control-message framing, the layout of a chunk's payload messages, and
bringing ucxx up (init, connect). The protocol: node_agent/peer/__init__.py."""

from __future__ import annotations

import asyncio
import ipaddress
import mmap
import os
import struct

import numpy as np

from kvstore import errors
from node_agent.peer.errors import PeerTransportError

ACK = struct.pack("<Q", 0x4B56_4143_4B00_0001)  # "KVACK", version 1
MAX_CONTROL_BYTES = 4 << 20  # FetchRequest / FetchChunk size cap (8192 ids = 128 KiB)
# Largest UCX payload message of large blocks (a run of adjacent blocks is cut in pieces
# of this size): the receiver verifies each piece as soon as it lands, while the next ones
# are still being copied, so only the last piece's verification is left at the end.
MESSAGE_BYTES = 16 << 20
# The last message of a transfer is cut down to about this size (tapered): the receiver
# verifies a message once it has landed, and what it verifies after the last one lands
# is time the wire stands idle.
TAIL_MESSAGE_BYTES = 2 << 20
# Protocol: over UCX, a batch of blocks up to this size travels as ONE payload message
# (the blocks back to back, copied into a staging buffer on both sides); larger blocks
# travel one message per run of blocks back to back in the sender's pool (at most
# MESSAGE_BYTES), zero-copy between pool slots. Each message costs thread
# hand-offs (UCX progress thread, ucxx notifier, event loop: 0.2-0.5 ms per completion on
# an idle host, several ms on a busy one), far more than copying a small block; for
# large blocks the copies would dominate.
# Both ends derive the mode from the namespace's block size, so they always agree.
PACKED_MAX_BLOCK_BYTES = 128 << 10


def packed(block_bytes: int) -> bool:
    """Whether a batch of such blocks travels as one UCX message (PACKED_MAX_BLOCK_BYTES)."""
    return block_bytes <= PACKED_MAX_BLOCK_BYTES


def tapered(runs: list[int], block_bytes: int) -> list[int]:
    """`runs` (blocks per message) with the last one cut in halves, each half its own
    message, down to TAIL_MESSAGE_BYTES (or one block): 8 -> 4, 2, 1, 1 for 2 MiB blocks.
    The receiver verifies each message as it lands while the next ones are still being
    copied; a 16 MiB last message left ~2 ms of verification after the transfer, a
    2 MiB one ~0.2 ms, for three more messages. Any split is valid on the wire (the
    header's runs say it)."""
    if not runs:
        return runs
    out, last = runs[:-1], runs[-1]
    while last > 1 and last * block_bytes > TAIL_MESSAGE_BYTES:
        half = last // 2
        out.append(last - half)
        last = half
    out.append(last)
    return out


def check_runs(runs, count: int) -> list[int]:
    """A chunk header's message layout: empty means one message per block."""
    if not runs:
        return [1] * count
    runs = list(runs)
    if min(runs) < 1 or sum(runs) != count:
        raise PeerTransportError(
            f"malformed chunk from peer: runs {runs[:8]} do not split {count} blocks"
        )
    return runs


def post_control(ep, payload: bytes) -> asyncio.Future:
    """Post a control message (request, chunk header, refusal) as ONE UCX message: a
    4-byte little-endian length, then the bytes, for a receiver's recv_control. (ucxx's
    send_obj/recv_obj take two messages, a size then the body, and every receive
    completion costs thread hand-offs: UCX progress thread, ucxx notifier, event loop.)"""
    frame = np.frombuffer(struct.pack("<I", len(payload)) + payload, dtype=np.uint8)
    return asyncio.ensure_future(ep.send(frame))


def control_buffer() -> np.ndarray:
    """A receive buffer for recv_control, for one endpoint's control messages in turn:
    pages of its own (a private anonymous mapping, untouched until a message comes), not
    the allocator's, and zeroed again after each message. A UCX receive does not say how
    many bytes came, so a message shorter than the length it claims reads zeros past its
    end, never what an earlier message, or another connection's in memory the allocator
    handed out again, left there."""
    mm = mmap.mmap(-1, 4 + MAX_CONTROL_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mm, dtype=np.uint8)


def _clear(buf: np.ndarray) -> None:
    """Zero a control_buffer after a message, all of it: a receive does not say how many
    bytes came (a frame longer than the length it claims leaves bytes past it). Its pages
    go back to the kernel (they read as zeros again, and a connection kept after a large
    request holds none of it): one madvise over the few pages a message touched."""
    mm = getattr(buf.base, "obj", None)
    if isinstance(mm, mmap.mmap):
        mm.madvise(mmap.MADV_DONTNEED)
    else:  # a buffer of the caller's own (tests)
        buf[:] = 0


async def recv_control(ep, buf: np.ndarray) -> bytes:
    """Receive one post_control message into `buf` (control_buffer); its bytes, after
    which the buffer is zeroed again. A message larger than the buffer fails
    in UCX (truncated); a length that does not fit what a message can hold is a protocol
    error."""
    try:
        await ep.recv(buf)
        n = int.from_bytes(buf[:4].tobytes(), "little")
        if n > buf.nbytes - 4:
            raise PeerTransportError(
                f"peer sent a control message claiming {n} bytes (limit {MAX_CONTROL_BYTES})"
            )
        return buf[4 : 4 + n].tobytes()
    finally:
        _clear(buf)


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise errors.InvalidArgument(f"peer address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


# UCX options of every agent (init_ucx): rendezvous without the fragmented copy-in/out
# variant (see there).
UCX_OPTIONS = {"RNDV_SCHEME": "auto", "PROTOS": "^rndv/am*"}
# How often the request notifier thread looks for a stop request while nothing completes
NOTIFIER_PERIOD_NS = 10**9


def ucx_env(shared_memory: bool) -> dict[str, str]:
    """The UCX_* settings init_ucx runs an agent with (its environment wins over them):
    what a benchmark's ucx_perftest runs with, so that it selects transports and
    protocols as the agents do (loadtest/bench_peer.py)."""
    flag = "y" if shared_memory else "n"
    return {
        "UCX_MM_ERROR_HANDLING": flag,
        "UCX_CMA_MEMORY_INVALIDATE": flag,
        **{f"UCX_{k}": v for k, v in UCX_OPTIONS.items()},
    }


def init_ucx(shared_memory: bool = True, devices: str = ""):
    """Import and initialise ucxx once per process, inside the running event loop (its
    progress thread and request notifier bind to that loop).

    Every endpoint keeps peer-failure handling (a dead peer must fail the transfer, not
    hang or abort this process). UCX only picks transports that can report a failed peer
    for such endpoints, which by default leaves TCP alone even between two processes of
    one host. With `shared_memory`, the shared-memory transports declare that capability
    (they detect a dead peer: tests/integration/test_peer.py kills one mid-transfer) and
    payloads move with one CMA copy straight from the sender's pool slot into the
    receiver's.

    Rendezvous: auto, without the fragmented copy-in/copy-out variant. That is a
    zero-copy put over TCP (written by this process as the bytes arrive, so nothing lands
    after a connection is closed) and a zero-copy *read* from the sender over CMA: the
    receiver's memory is only ever written by the receiver itself, so a peer that wakes up
    after a timeout cannot write into a pool slot reused meanwhile. Environment variables
    (UCX_RNDV_SCHEME, UCX_PROTOS ...) still win, so operators can retune.

    Completed requests reach the event loop through _notify, not ucxx's own notifier
    thread (one thread hand-off less per completion).

    `devices`: UCX_NET_DEVICES (bind.net_devices; the environment's wins), "": every
    device."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if devices:
        os.environ.setdefault("UCX_NET_DEVICES", devices)
    for name in ("UCX_MM_ERROR_HANDLING", "UCX_CMA_MEMORY_INVALIDATE"):
        os.environ.setdefault(name, ucx_env(shared_memory)[name])
    import ucxx

    _lean_notifier()
    try:
        ucxx.init(
            options=dict(UCX_OPTIONS),
            env_takes_precedence=True,
            progress_mode="thread",
            enable_python_future=True,
        )
    except RuntimeError:
        pass  # already initialised in this process
    return ucxx


def _notify(loop, worker, stop) -> None:
    """The request notifier thread ucxx starts (installed by _lean_notifier), leaner than
    its own. UCX's progress thread queues the future of each request it completes and
    signals; this thread wakes (the GIL once), asks the event loop to set the queued
    futures (call_soon_threadsafe) and goes straight back to waiting. ucxx's thread also
    makes a task per wake-up, waits for the loop to have run it and takes the GIL again
    after: a second wake-up of this thread and GIL hand-off per completion. A small
    Prefetch completes about eight requests on the two agents, and where every core is
    busy each hand-off waits for a time slice (docs/benchmarks.md, 2026-12-06 15:35).

    A wait returns Ready once per signal since the last one, so a completion queued
    while a call is on its way is set by that call, and the next one finds nothing left:
    harmless. Stops on any message in `stop` (ucxx's stop_notifier_thread puts one),
    seen within the wait's period."""
    import asyncio

    from ucxx._lib.libucxx import PythonRequestNotifierWaitState as State

    asyncio.set_event_loop(loop)  # the futures made here for the pool belong to that loop
    run = worker.run_request_notifier
    while True:
        worker.populate_python_futures_pool()
        state = worker.wait_request_notifier(period_ns=NOTIFIER_PERIOD_NS)
        if not stop.empty() or state == State.Shutdown:
            break
        if state == State.Ready:
            try:
                loop.call_soon_threadsafe(run)
            except RuntimeError:  # the loop is closed: nobody waits for these any more
                break
    worker.clear_python_futures_pool()  # no reference to the worker outlives the thread


def _lean_notifier() -> None:
    """Have ucxx start _notify as its request notifier thread, with the arguments and
    stop protocol of its own (ucxx internals, 0.52: left as they are when not found)."""
    try:
        from ucxx._lib_async import application_context
    except ImportError:
        return
    if callable(getattr(application_context, "_notifierThread", None)):
        application_context._notifierThread = _notify


def notifier_state(ucxx) -> str:
    """'alive', 'dead' or 'not running': ucxx's request notifier thread, without which no
    UCX request of this process completes (every connect then times out); 'unknown'
    where ucxx's internals (0.52) differ."""
    try:
        thread = ucxx.core._get_ctx().notifier_thread
    except Exception:  # noqa: BLE001 - a private attribute of ucxx
        return "unknown"
    if thread is None:
        return "not running"
    return "alive" if thread.is_alive() else "dead"


def ucx_cuda_support(ucxx) -> bool:
    """Whether this process's UCX context can move CUDA memory (a UCX built with CUDA
    and its CUDA transports loaded). False when it cannot be told."""
    try:
        return bool(ucxx.core._get_ctx().context.cuda_support)
    except Exception:  # noqa: BLE001 - a private attribute of ucxx: absent means "no"
        return False


async def connect_endpoint(ucx, host: str, port: int, timeout: float):
    """ucxx.create_endpoint, minus a race: when the connection is refused before ucxx
    posts its handshake receive, that receive never completes and create_endpoint waits
    out its whole timeout (about half the time here). Same steps, but the endpoint's error
    state is polled meanwhile. Uses ucxx internals (0.52); the public call otherwise."""
    try:
        from ucxx._lib import libucxx as api
        from ucxx._lib_async.endpoint import Endpoint
        from ucxx._lib_async.exchange_peer_info import exchange_peer_info
        from ucxx._lib_async.utils import hash64bits

        ctx = ucx.core._get_ctx()
    except (ImportError, AttributeError):
        return await ucx.create_endpoint(
            host, port, endpoint_error_handling=True, connect_timeout=timeout
        )
    ctx.continuous_ucx_progress()
    raw = api.UCXEndpoint.create(ctx.worker, host, port, True)
    msg_tag = hash64bits("msg_tag", os.urandom(16), raw.handle)
    task = asyncio.ensure_future(
        exchange_peer_info(endpoint=raw, msg_tag=msg_tag, listener=False, connect_timeout=timeout)
    )
    try:
        while not (await asyncio.wait({task}, timeout=0.01))[0]:
            raw.raise_on_error()
        info = task.result()
    except BaseException:
        task.cancel()
        raw.close_blocking(period=10**9, max_attempts=1)
        raise
    return Endpoint(endpoint=raw, ctx=ctx, tags={"msg_send": info["msg_tag"], "msg_recv": msg_tag})
