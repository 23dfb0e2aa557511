"""The client's shared-memory staging area, sized to what the shared-memory filesystem can
really hold.

A POSIX shared-memory file is sparse: creating a 256 MiB one on a 64 MiB /dev/shm (the
default in a container) succeeds, and the process dies of SIGBUS when it first touches a
page past what the filesystem can back. So the pages are reserved up front with
posix_fallocate, which fails cleanly (ENOSPC) instead; a smaller area is tried next, and
below `floor` the client goes without one (payloads over gRPC), saying so once.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
from multiprocessing import shared_memory

log = logging.getLogger("kvstore.client")
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory


def _reserve(shm: shared_memory.SharedMemory) -> bool:
    """Back every page of `shm` now; False when the filesystem cannot hold it."""
    path = os.path.join(SHM_DIR, shm.name.lstrip("/"))
    if not hasattr(os, "posix_fallocate") or not os.path.exists(path):
        return True  # no way to reserve here (not Linux): nothing smaller would be safer
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, shm.size)
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            return False
        raise
    finally:
        os.close(fd)


def create_staging(size: int, floor: int) -> shared_memory.SharedMemory | None:
    """A shared-memory area of `size` bytes, or the largest power-of-two fraction of it
    down to `floor` that the filesystem can back; None when not even `floor` fits."""
    want = size
    while size >= floor:
        shm = shared_memory.SharedMemory(
            name=f"kvstore-{os.getpid()}-{secrets.token_hex(6)}", create=True, size=size
        )
        if _reserve(shm):
            if size < want:
                log.warning(
                    "shared memory holds less than the %d MiB staging area asked for: "
                    "using %d MiB (raise the size of %s, e.g. docker/podman "
                    "--shm-size)",
                    want >> 20,
                    size >> 20,
                    SHM_DIR,
                )
            return shm
        shm.close()
        shm.unlink()
        size //= 2
    log.warning(
        "shared memory cannot hold even a %d MiB staging area (%s is too small or "
        "full): payloads go over gRPC, slower (raise its size, e.g. --shm-size)",
        floor >> 20,
        SHM_DIR,
    )
    return None
