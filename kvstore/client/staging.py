"""The client's shared-memory staging area: anonymous memory (a memfd) that the client
hands to its agent by file descriptor over the local lane, never by a name.

Why a memfd: a file under /dev/shm is visible to, and nameable by, every process on the
host, so an agent mapping "the region named X" cannot know who holds it. A memfd has no
name; only a process given its descriptor can map it. It is sealed against shrinking
(F_SEAL_SHRINK), which the agent requires: memory that could shrink under its mapping
would fault it (SIGBUS) mid-copy.

Its pages are reserved up front with posix_fallocate, which fails cleanly (ENOSPC,
ENOMEM) where memory is short instead of killing the process with SIGBUS when it first
touches a page that cannot be backed; a smaller area is tried next, and below `floor` the
client goes without one (payloads over gRPC), saying so once. The mapping is then
populated (MAP_POPULATE: page-table entries for pages that exist already, no new memory),
so the first write into it takes no page faults (512 per 2 MiB block on 4 KiB pages), at
a 2 MiB-aligned address with huge pages asked for (kvstore/pages.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from dataclasses import dataclass

import numpy as np

from kvstore.pages import sealed_memfd

log = logging.getLogger("kvstore.client")
_NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)


@dataclass(slots=True, eq=False)
class Staging:
    fd: int  # the memfd, kept open: it is handed over again after an agent restart
    array: np.ndarray  # uint8 over the whole area (kvstore.pages.map_shared)
    size: int

    def close(self) -> None:
        # The mapping goes with the array's last view: now, unless a tensor still views it.
        self.array = np.empty(0, dtype=np.uint8)
        os.close(self.fd)


def _memfd(size: int) -> Staging | None:
    """A sealed memfd of `size` bytes with every page backed; None when it cannot be."""
    try:
        fd, array = sealed_memfd("kvstore-staging", size, fcntl.F_SEAL_SHRINK)
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            return None
        raise
    return Staging(fd, array, size)


def create_staging(size: int, floor: int) -> Staging | None:
    """A staging area of `size` bytes, or the largest power-of-two fraction of it down to
    `floor` that memory can back; None when not even `floor` fits (or no memfd here)."""
    if not hasattr(os, "memfd_create"):
        log.warning("no memfd_create on this platform: payloads go over gRPC")
        return None
    want = size
    while size >= floor:
        staging = _memfd(size)
        if staging is not None:
            if size < want:
                log.warning(
                    "memory holds less than the %d MiB staging area asked for: using %d MiB",
                    want >> 20,
                    size >> 20,
                )
            return staging
        size //= 2
    log.warning(
        "memory cannot back even a %d MiB staging area: payloads go over gRPC, slower",
        floor >> 20,
    )
    return None
