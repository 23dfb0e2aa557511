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
import ipaddress
import os
import sys
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


_TCP_ESTABLISHED = "01"  # the state column of /proc/net/tcp{,6}


def _proc_address(ip: str, port: int) -> set[str]:
    """How /proc/net/tcp{,6} write `ip`:`port` (each 32-bit word of the address in host
    byte order, in hex): the IPv4 form and its IPv4-mapped IPv6 form, or the IPv6 form."""

    def words(raw: bytes) -> str:
        return "".join(
            f"{int.from_bytes(raw[k : k + 4], sys.byteorder):08X}" for k in range(0, len(raw), 4)
        )

    addr = ipaddress.ip_address(ip)
    forms = {words(addr.packed)}
    if addr.version == 4:
        forms.add(words(ipaddress.IPv6Address(f"::ffff:{ip}").packed))
    return {f"{f}:{port:04X}" for f in forms}


def _sockets(pid: str) -> set[str]:
    """The socket inodes process `pid` ("self" for this one) holds."""
    out = set()
    with os.scandir(f"/proc/{pid}/fd") as fds:
        for fd in fds:
            try:
                link = os.readlink(fd.path)
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    return out


def serves_connection(pid: int, ips: list[str], port: int) -> bool:
    """Whether process `pid` (a process, not one of its threads) holds the far end of one
    of this process's TCP connections to `ips` (the peer address's addresses) at `port`:
    the UCX connection whose answer named `pid`. Whoever answers a Prefetch's peer
    address writes the chunk header that names the process to read, so a listener of a
    caller's choosing could name any process of the host (another agent, one of this
    agent's own threads) and have this agent read its memory for the caller into the
    caller's namespace, a block wherever the caller guessed its checksum. Reading only
    from the process at the other end of this agent's own connection reads only what that
    peer could send anyway (a listener on the same port at another address, or a
    process that merely listens on that port, does not pass). Both ends of a connection
    between two processes of one network namespace are in /proc/net/tcp; False when it
    cannot be told (no /proc, another network namespace)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            tgid = next((line.split()[1] for line in f if line.startswith("Tgid:")), "")
        if tgid != str(pid):
            return False
        far = set().union(*(_proc_address(ip, port) for ip in ips))
        rows = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    next(f, None)
                    rows += [c for c in (line.split() for line in f) if len(c) > 9]
            except FileNotFoundError:  # no IPv6
                continue
        mine = _sockets("self")
        # this process's ends of its established connections to that address
        near = {
            (c[1], c[2]) for c in rows if c[3] == _TCP_ESTABLISHED and c[2] in far and c[9] in mine
        }
        # the other ends of those connections: accepted there, pointing back here
        theirs = {c[9] for c in rows if c[3] == _TCP_ESTABLISHED and (c[2], c[1]) in near}
        return bool(theirs) and not theirs.isdisjoint(_sockets(str(pid)))
    except (OSError, ValueError):
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
