"""Run a server process until SIGTERM/SIGINT: shared by the agent and the router."""

from __future__ import annotations

import asyncio
import os
import signal

from kvstore.config import TLSConfig
from kvstore.tls import TLSFilesError, add_port


class StartupError(Exception):
    """A server cannot start for a reason the operator must fix (the message says which);
    the process entry points print it as one line and exit 1, without a traceback."""


def bind_port(server, address: str, tls: TLSConfig | None = None) -> int:
    """`server.add_insecure_port(address)` (mTLS with `tls` on: kvstore/tls.py), with
    grpc's RuntimeError (port taken, address not on this host) and unreadable TLS files
    turned into a StartupError that names the address or the file."""
    why: RuntimeError | None
    try:
        port = add_port(server, address, tls or TLSConfig())
    except TLSFilesError as exc:
        raise StartupError(str(exc)) from exc
    except RuntimeError as exc:
        port, why = 0, exc
    else:
        why = None
    if not port:
        raise StartupError(
            f"cannot listen on {address}: the port is in use or the address "
            "is not on this host (choose another listen address or stop the "
            "process holding it)"
        ) from why
    return port


def write_ready_file(path: str, address: str) -> None:
    """Atomically publish the bound address (supervisors and tests wait for this file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(address + "\n")
    os.replace(tmp, path)


async def run_until_signalled(server, ready_file: str | None = None) -> None:
    """`server` has async start()/stop() and an `address`; stop on SIGTERM or SIGINT."""
    await server.start()
    if ready_file:
        write_ready_file(ready_file, server.address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
