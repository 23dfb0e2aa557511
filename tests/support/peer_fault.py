"""Fault injector for tests/integration/test_peer.py: a UCX listener that speaks the peer
protocol of node_agent/peer/ over real ucxx, serving the payloads in a .npy file (row i
answers the i-th requested block), and misbehaves on purpose:

- corrupt: flips one byte of block 11 after computing its checksum;
- die: sends a first chunk of at most 8 blocks, then exits without closing anything;
- direct-corrupt: offered direct reads (same host), announces its blocks for the fetcher
  to read from its memory (node_agent/peer/ucx/direct.py), block 11 flipped after its
  checksum was taken;
- direct-gone: announces direct reads from a process that does not exist (it does not
  hold this listener: the fetcher reads nothing); a later connection that offers none is
  served with payload messages;
- direct-other: announces direct reads of its rows at the addresses in $FAKE_OTHER_ADDRS
  (comma-separated) of process $FAKE_OTHER_PID, another process of the host (an agent
  holding those bytes): what a listener a caller named would answer to have the fetcher
  read another process's memory for it;
- mapped-corrupt: direct reads of blocks kept in a sealed memfd, announced for mapping
  (node_agent/peer/ucx/mapped.py) as an agent's host pool is, block 11 flipped after its
  checksum was taken;
- mapped-unsealed: the same, from a memfd not sealed against shrinking (the fetcher must
  not map it: it reads those blocks with process_vm_readv instead);
- mapped-outside: the same, but the pool announced starts at its last block: the blocks
  before it are outside it (a malformed chunk: the transfer fails, the Prefetch falls back
  to gRPC).

Usage: python tests/support/peer_fault.py MODE DATA.npy PORT_FILE
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import sys

import numpy as np

from kvstore import checksum as cks
from node_agent.peer.ucx.direct import RELEASE, host_identity
from node_agent.peer.ucx.wire import init_ucx
from kvstore.v1 import peer_pb2

CORRUPT_INDEX = 11
DIE_BATCH = 8
PACKED_MAX_BLOCK_BYTES = 128 << 10  # node_agent/peer/ucx/wire.py (not imported: see below)


async def serve(mode: str, data: np.ndarray, port_file: str) -> None:
    # No agent import (it would pull in torch and cost seconds per test), only the
    # agents' own UCX settings: two processes of one host only connect when they
    # agree on which transports may carry peer endpoints.
    ucx = init_ucx()
    done = asyncio.Event()

    async def handler(ep) -> None:
        # Control messages: one UCX message each, a 4-byte little-endian length and then
        # the bytes (node_agent/peer/ucx/wire.post_control / recv_control).
        buf = np.zeros(1 << 20, dtype=np.uint8)
        await asyncio.wait_for(ep.recv(buf), 10)
        n_req = int.from_bytes(buf[:4].tobytes(), "little")
        req = peer_pb2.FetchRequest.FromString(buf[4 : 4 + n_req].tobytes())
        n = len(req.block_ids) // 16
        batch = req.batch_blocks or 8
        if mode == "die":
            batch = min(batch, DIE_BATCH)  # a legal (smaller) chunk that is not the last
        pack = data.shape[1] <= PACKED_MAX_BLOCK_BYTES
        direct = mode.startswith(("direct", "mapped")) and not pack
        direct = direct and req.same_host == host_identity()
        held = []  # rows the fetcher reads directly: alive until the connection ends
        pool = mapped_pool(mode, data) if mode.startswith("mapped") else None
        for start in range(0, n, batch):
            if pool is not None:  # views of the memfd, where the fetcher maps them
                rows = [pool[1][i] for i in range(start, min(n, start + batch))]
            else:
                rows = [data[i].copy() for i in range(start, min(n, start + batch))]
            sums = [cks.checksum(r) for r in rows]
            if mode.endswith("corrupt") and start <= CORRUPT_INDEX < start + len(rows):
                rows[CORRUPT_INDEX - start][100] ^= 0xFF
            last = start + len(rows) >= n
            hdr = peer_pb2.FetchChunk(first_index=start, count=len(rows), checksums=sums, done=last)
            if direct:
                held.extend(rows)
                hdr.direct_pid = gone_pid() if mode == "direct-gone" else os.getpid()
                if mode == "direct-other":
                    hdr.direct_pid = int(os.environ["FAKE_OTHER_PID"])
                    other = [int(a) for a in os.environ["FAKE_OTHER_ADDRS"].split(",")]
                    hdr.addresses.extend(other[start : start + len(rows)])
                else:
                    hdr.addresses.extend(r.ctypes.data for r in rows)
                if pool is not None:
                    fd, arr = pool
                    hdr.direct_fd, hdr.direct_bytes = fd, arr.nbytes
                    # outside: the pool announced starts at its last block
                    shift = arr.nbytes - data.shape[1] if mode == "mapped-outside" else 0
                    hdr.direct_base = arr.ctypes.data + shift
            raw = hdr.SerializeToString()
            frame = np.frombuffer(len(raw).to_bytes(4, "little") + raw, dtype=np.uint8)
            await asyncio.wait_for(ep.send(frame), 10)
            if direct:  # the fetcher reads the rows, then releases them
                release = np.empty(len(RELEASE), dtype=np.uint8)
                await asyncio.wait_for(ep.recv(release), 10)
                assert release.tobytes() == RELEASE
            elif pack:  # small blocks: the whole batch as one message
                await asyncio.wait_for(ep.send(np.concatenate(rows)), 10)
            else:
                await asyncio.wait_for(asyncio.gather(*(ep.send(r) for r in rows)), 10)
            if mode == "die":
                os._exit(3)  # mid-transfer, no goodbye
        ack = np.empty(8, dtype=np.uint8)
        await asyncio.wait_for(ep.recv(ack), 10)
        await ep.close()
        done.set()

    listener = ucx.create_listener(handler, port=0)
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(listener.port))
    os.replace(tmp, port_file)
    try:
        await asyncio.wait_for(done.wait(), 60)
    finally:
        listener.close()
        ucx.stop_notifier_thread()


def mapped_pool(mode: str, data: np.ndarray) -> tuple[int, np.ndarray]:
    """The rows in a memfd as an agent's host pool keeps its slots (sealed against
    resizing, but for mapped-unsealed): (fd, rows)."""
    seals = 0 if mode == "mapped-unsealed" else fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    size = data.nbytes
    fd = os.memfd_create("kvstore-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    arr = np.frombuffer(mmap.mmap(fd, size, flags=mmap.MAP_SHARED), dtype=np.uint8)
    arr[:] = data.reshape(-1)
    return fd, arr.reshape(data.shape)


def gone_pid() -> int:
    """A PID no process has: PIDs stay below pid_max."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


def main() -> None:
    mode, path, port_file = sys.argv[1:4]
    if mode not in (
        "corrupt",
        "die",
        "direct-corrupt",
        "direct-gone",
        "direct-other",
        "mapped-corrupt",
        "mapped-unsealed",
        "mapped-outside",
    ):
        raise SystemExit(f"unknown mode {mode!r}")
    asyncio.run(serve(mode, np.load(path), port_file))


if __name__ == "__main__":
    main()
