"""Fault injection: damage the blocks a running agent holds in its host-memory pool, so a
Get finds the checksum mismatch (a block damaged on disk is dropped at recovery instead).

The pool is the agent's one read-write mapping of its memfd (/memfd:kvstore-pool,
kvstore.tiers.pool.shared_host_memory) or, where no memfd could be had, one anonymous
mapping of exactly `pool_bytes` advised for transparent huge pages (host_memory); its
bytes are written through /proc/PID/mem (the test process started the agent, so it may)."""

from __future__ import annotations

import re

_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def pool_mapping(pid: int, pool_bytes: int) -> int:
    """The start address of the agent's pool mapping."""
    found, cur = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = _HEADER.match(line)
            if m:
                start, end = int(m.group(1), 16), int(m.group(2), 16)
                name, rw = m.group(4), m.group(3).startswith("rw")
                if rw and name.startswith("/memfd:kvstore-pool"):
                    found.append(start)
                    cur = None
                else:
                    anon = not name and rw
                    cur = start if anon and end - start == pool_bytes else None
            elif line.startswith("VmFlags:") and cur is not None and " hg" in line:
                found.append(cur)
    assert len(found) == 1, f"{len(found)} mappings look like the pool of {pool_bytes} bytes"
    return found[0]


def corrupt_pool(pid: int, pool_bytes: int, slot_bytes: int) -> int:
    """Flip the first byte of every pool slot of agent `pid`; returns the slots hit."""
    start = pool_mapping(pid, pool_bytes)
    n = pool_bytes // slot_bytes
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        for off in range(0, n * slot_bytes, slot_bytes):
            mem.seek(start + off)
            b = mem.read(1)
            mem.seek(start + off)
            mem.write(bytes([b[0] ^ 0x5A]))
    return n
