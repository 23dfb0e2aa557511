"""A private temporary directory for a vLLM engine's files, removed when the engine ends.

vLLM makes its ZMQ IPC sockets (`VLLM_RPC_BASE_PATH`, the temporary directory by
default: the API server's and its engine core's, several per engine) and its
torch.distributed file store (`vllm_dist_<hex>`) in the temporary directory, and leaves
them there when its processes are stopped by a signal: tests/integration/
test_vllm_server.py's three engine starts left 21 sockets and 3 file stores in /tmp, and
two `make test` runs and a `make run` 208 files. Given a directory of its own (0700, made by
tempfile.mkdtemp under the caller's TMPDIR), the engine's files are out of other users'
reach and go away with it. Standard library only: it also runs in the vLLM venv
(loadtest/vllm_run.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["engine_env", "engine_tmpdir"]

PREFIX = "kvstore-vllm-"
# A UNIX socket's path holds at most 107 bytes (sockaddr_un), and vLLM names its sockets
# <dir>/<uuid4> (36 characters): a longer directory would stop the engine from starting.
SOCKET_PATH_MAX = 107
UUID_NAME = 36


def fits_sockets(d: str) -> bool:
    """Whether vLLM's IPC sockets can be made in `d` (their paths fit sockaddr_un)."""
    return len(os.fsencode(d)) + 1 + UUID_NAME <= SOCKET_PATH_MAX


@contextmanager
def engine_tmpdir() -> Iterator[str | None]:
    """A fresh directory under the temporary directory, removed with what it holds on exit
    (sockets still open in a live process are only unlinked: their connections go on).
    None where its path would be too long for the engine's sockets (a long TMPDIR): the
    engine then keeps the temporary directory it would have used without us."""
    d = tempfile.mkdtemp(prefix=PREFIX)
    if not fits_sockets(d):
        os.rmdir(d)
        yield None
        return
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def engine_env(d: str | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for an engine whose files go to `d` (engine_tmpdir): TMPDIR, and
    vLLM's IPC socket directory unless the caller chose one (VLLM_RPC_BASE_PATH); None:
    the environment as it is."""
    env = dict(os.environ if environ is None else environ)
    if d is not None:
        env["TMPDIR"] = d
        env.setdefault("VLLM_RPC_BASE_PATH", d)
    return env
