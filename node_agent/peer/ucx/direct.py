"""Direct reads between agents of one host: the fetching agent reads the serving agent's
borrowed pool slots itself, with cross-memory attach (process_vm_readv), in several
threads, each block hashed in pieces as they land (kvstore._native.cma_read_checksum).

Why not UCX for these bytes: UCX's CMA transport does the same kernel copy, but one
message at a time on its one progress thread, and the receiver then hashes each message
on another thread: on a 2-core host a Prefetch of 64 blocks of 2 MiB moved 4.1-4.5 GB/s
that way, where two threads that each read and hash their blocks move 8.3-8.6 GB/s of
the same distinct memory (docs/benchmarks.md). The control messages (request, chunk
headers, acknowledgements) still travel over the UCX connection, which keeps its
certificate handshake and its peer-failure handling.

The safety argument is UCX's CMA one: only the fetcher writes into its own memory (a
serving agent that wakes up late cannot write into a slot reused meanwhile), and every
block is verified against the server's checksum before it is visible, so a read of a
slot the server gave up meanwhile (after a timeout) is a checksum mismatch, not a wrong
block. The server keeps each chunk's blocks borrowed until the fetcher's release
message for that chunk (RELEASE) has come.

Blocks that lie in the serving agent's host pool (a sealed memfd) are read through a
read-only mapping of it instead, one fused copy+hash pass and no kernel copy (mapped.py);
process_vm_readv reads the rest (blocks the server staged from NVMe) and pools that cannot
be mapped.

Both ends must share a kernel and a PID namespace (`host_identity`), and the fetcher
needs the right to ptrace the server (same user, no Yama restriction, or
CAP_SYS_PTRACE): a read the kernel refuses fails that transfer (the Prefetch falls back
to gRPC for the rest) and the fetcher stops offering direct reads to that peer.
"""

from __future__ import annotations

import errno
import functools
import os
import struct

import numpy as np

from kvstore.checksum import ACCEL
from node_agent.peer.errors import PeerTransportError

RELEASE = struct.pack("<Q", 0x4B56_524C_5300_0001)  # "KVRLS", version 1
# errnos that say this peer cannot be read directly (rather than this read failed): the
# fetcher then asks it for payload messages for a while (direct_fetch.NO_DIRECT_S); ESRCH: the
# peer process is gone (it may come back restarted)
REFUSED = frozenset({errno.EPERM, errno.EACCES, errno.ESRCH, errno.ENOSYS})


@functools.cache
def host_identity() -> str:
    """What two agents compare to know that a PID of one names the same process for the
    other: the kernel's boot id and this process's PID namespace. "" where it cannot be
    read, or without the native extension (then no direct reads are offered nor
    accepted)."""
    if ACCEL.module is None or not hasattr(ACCEL.module, "cma_read_checksum"):
        return ""
    if not may_read_peers():
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{pidns}" if boot and pidns else ""


CAP_SYS_PTRACE = 19


def may_read_peers() -> bool:
    """Whether the kernel lets this process read another one of its user (Yama's
    ptrace_scope 0, or none; with 1 or more only CAP_SYS_PTRACE can): else every
    offer would cost a failed transfer first."""
    scope = _yama_scope()
    if scope is None or scope == 0:
        return True
    if scope >= 3:
        return False
    try:
        with open("/proc/self/status") as f:
            caps = next(line.split()[1] for line in f if line.startswith("CapEff:"))
        return bool(int(caps, 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return False


def _yama_scope() -> int | None:
    """Yama's ptrace_scope, None without Yama."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def pool_may_be_mapped() -> bool:
    """Whether this agent may keep its host pool in a memfd that agents of this host can
    map (mapped.py) without exposing it to more processes than can read it already.
    Opening /proc/PID/fd/N takes only the kernel's ptrace *read* check, which Yama does
    not restrict, where process_vm_readv takes the attach check, which it does: with
    Yama at 1 or more, a memfd would let every process of the agent's user (an engine in
    the same container, say) read the pool, which it cannot attach to. So only without
    Yama, or with Yama at 0 (then each of them may attach the agent anyway)."""
    return _yama_scope() in (None, 0)


_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp for a listening socket


def owns_listener(pid: int, port: int) -> bool:
    """Whether process `pid` (a process, not one of its threads) holds the TCP socket
    that listens on `port` in this agent's network namespace: the UCX listener this
    agent connected to. A chunk header names the process to read from, and whoever
    answers a Prefetch's peer address writes that header: a listener of a caller's
    choosing could name any process of the host (another agent, this agent's own
    threads) and have this agent read its memory for the caller, a block at a time,
    into the caller's namespace wherever the caller guessed its checksum. Reading only
    from the process behind the listener reads only what that peer could send anyway.
    False when it cannot be told (no /proc, another network namespace)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            tgid = next((line.split()[1] for line in f if line.startswith("Tgid:")), "")
        if tgid != str(pid):
            return False
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    next(f, None)
                    for line in f:
                        col = line.split()
                        if len(col) > 9 and col[3] == _TCP_LISTEN:
                            if int(col[1].rpartition(":")[2], 16) == port:
                                inodes.add(f"socket:[{col[9]}]")
            except FileNotFoundError:  # no IPv6
                continue
        if not inodes:
            return False
        with os.scandir(f"/proc/{pid}/fd") as fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path) in inodes:
                        return True
                except OSError:  # closed meanwhile
                    continue
    except (OSError, ValueError):
        return False
    return False


def addresses(views: list) -> list[int] | None:
    """The address of each of `views` (host slot views or staging buffers: 1-D uint8
    arrays), or None when any is not host memory (a device tensor, a strided view). One
    native call: ~0.1 us a view where numpy's __array_interface__ costs ~3 (64 views:
    190 us measured). Only called where host_identity() offered direct reads, so with
    the native extension loaded."""
    mod = ACCEL.module
    if mod is None or not all(isinstance(v, np.ndarray) and v.dtype == np.uint8 for v in views):
        return None
    try:
        return mod.buffer_addresses(views)
    except (TypeError, ValueError):  # not C-contiguous
        return None


def read_into(pid: int, views: list, addrs: list[int], threads: int) -> list[int]:
    """Fill `views` (host slot views) from process `pid`'s `addrs` and return each one's
    XXH64. Worker thread (the GIL is released during the reads). PeerTransportError,
    whose `refused` says whether this peer can be read directly at all, when a read
    fails."""
    mod = ACCEL.module
    if mod is None:  # host_identity() offered nothing then: a peer announced direct reads anyway
        raise DirectReadError("direct reads need the native extension")
    try:
        return mod.cma_read_checksum(pid, views, addrs, threads=threads)
    except OSError as exc:
        err = DirectReadError(f"direct read from process {pid}: {exc.strerror or exc}")
        err.refused = exc.errno in REFUSED
        raise err from exc


class DirectReadError(PeerTransportError):
    """A direct read failed; `refused`: the kernel will not let this agent read that
    peer (EPERM, ESRCH ...), as opposed to a failure of this one read."""

    refused = False
