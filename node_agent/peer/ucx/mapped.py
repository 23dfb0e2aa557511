"""Direct reads through a mapping of the serving agent's host pool (direct.py says what
direct reads are and why they are safe).

A host pool is a memfd sealed against resizing (kvstore.tiers.pool.shared_host_memory).
A chunk header whose blocks all lie in it names its file descriptor in the server
(FetchChunk.direct_fd, direct_base, direct_bytes); the fetcher opens
/proc/<pid>/fd/<fd> read-only and maps the whole pool read-only, once per peer process.
Each block is then one fused pass (kvstore.checksum.copy_with_checksum_many: every word
loaded once, hashed and streamed into the reserved slot from the same register), where
process_vm_readv is a kernel copy and then a second pass to hash: on a 2-core host a
Prefetch's 128 MiB read took 7.6-10.5 ms this way (12.8-17.7 GB/s), against 16-17 ms
before, and process_vm_readv with hashing moved 4.9-6.6 GB/s in a scratch program
(docs/benchmarks.md, 2026-12-04).

Who may: opening another process's /proc/PID/fd/N takes the kernel's ptrace read check
(and the file's mode: the pool's is 0400, its owner's user), and the mapping is
read-only: the server cannot be written to. That check is weaker than process_vm_readv's
(Yama does not restrict it), so an agent keeps its pool in a memfd only where Yama is
absent or at 0 (direct.pool_may_be_mapped), where each process of its user may attach it
anyway. The file must be fully backed (no hole: a read of one could fault, SIGBUS, where
memory is short) and carry F_SEAL_SHRINK (else the server could cut it short under the
reader, with the same fault): a file that is not is refused, and that chunk is read with
process_vm_readv.

A mapping keeps the server's pool memory alive after the server exits: sweep() drops the
mappings whose process no longer holds that file at that descriptor (the fetcher runs it
at every offer, when a new mapping is made, and every SWEEP_S while any is kept), and at
most MAX_MAPPED are kept (8 GPUs, 8 agents a host). The mappings are left out of core
dumps and children (MADV_DONTDUMP, MADV_DONTFORK).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
from dataclasses import dataclass

import numpy as np

from kvstore import checksum as cks
from kvstore import pages
from node_agent.peer.errors import PeerTransportError

log = logging.getLogger("kvstore.agent.peer")
MAX_MAPPED = 16  # peer pools mapped at once; the least recently used goes first
SWEEP_S = 5.0  # how often the fetcher looks for pools of peers gone while it maps any


@dataclass(slots=True)
class _Mapping:
    dev: int
    ino: int
    base: int  # where the server maps it
    array: np.ndarray  # read-only, the whole pool


class PoolMappings:
    """Read-only mappings of the host pools of agents of this host, by (pid, fd); used
    from worker threads (read_into) and the event loop (sweep)."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], _Mapping] = {}
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        return len(self._maps)

    def read_into(
        self, pid: int, fd: int, base: int, size: int, views: list, addrs: list[int], threads: int
    ) -> list[int]:
        """Fill `views` (host slot views) from the blocks at `addrs` in process `pid`'s
        pool (fd `fd`, mapped at `base` for `size` bytes there) and return the XXH64 of
        what landed in each. OSError when the pool cannot be mapped (the caller reads
        with process_vm_readv then); PeerTransportError for a block outside it."""
        arr = self._mapping(pid, fd, base, size)
        srcs = []
        for view, addr in zip(views, addrs):
            off, n = addr - base, view.nbytes
            if off < 0 or off + n > size:
                raise PeerTransportError(
                    f"malformed chunk from peer: a block of {n} bytes at {addr:#x}, "
                    f"outside its pool ({size} bytes at {base:#x})"
                )
            srcs.append(arr[off : off + n])
        return cks.copy_with_checksum_many(views, srcs, threads)

    def _mapping(self, pid: int, fd: int, base: int, size: int) -> np.ndarray:
        path = f"/proc/{pid}/fd/{fd}"
        st = os.stat(path)  # the file behind the descriptor now
        key = (pid, fd)
        with self._lock:
            m = self._maps.pop(key, None)
            if m is not None and (m.dev, m.ino, m.base, m.array.nbytes) == (
                st.st_dev,
                st.st_ino,
                base,
                size,
            ):
                self._maps[key] = m  # most recently used last
                return m.array
        arr, st = _map(path, size)
        with self._lock:
            if self._closed:
                raise OSError("the fetcher is closed")
            self._maps[key] = _Mapping(st.st_dev, st.st_ino, base, arr)
            while len(self._maps) > MAX_MAPPED:
                del self._maps[next(iter(self._maps))]
        self.sweep()
        return arr

    def sweep(self) -> None:
        """Drop the mappings of processes gone, or that hold another file at that
        descriptor now: their pools' memory is freed once nothing maps it."""
        with self._lock:
            keys = list(self._maps.items())
        for key, m in keys:
            try:
                st = os.stat(f"/proc/{key[0]}/fd/{key[1]}")
                same = (st.st_dev, st.st_ino) == (m.dev, m.ino)
            except OSError:
                same = False
            if not same:
                with self._lock:
                    if self._maps.get(key) is m:
                        del self._maps[key]
                log.debug("dropped the mapping of process %d's pool: gone", key[0])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._maps.clear()


def _map(path: str, size: int) -> tuple[np.ndarray, os.stat_result]:
    """Open and map a peer's pool: a regular file of exactly `size` bytes, every one of
    them backed, sealed against shrinking, else OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise OSError(f"{path}: not a pool of {size} bytes ({st.st_size})")
        if st.st_blocks * 512 < size:
            raise OSError(f"{path}: holes in it ({st.st_blocks * 512} of {size} bytes backed)")
        if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise OSError(f"{path}: not sealed against shrinking")
        return pages.map_read_only(fd, size), st
    finally:
        os.close(fd)
