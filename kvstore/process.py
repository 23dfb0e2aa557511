"""Run a server process until SIGTERM/SIGINT: shared by the agent and the router."""
from __future__ import annotations

import asyncio
import os
import signal


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
