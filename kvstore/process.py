"""Run a server process until SIGTERM/SIGINT: shared by the agent and the router."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal

from kvstore import heap
from kvstore.config import TLSConfig
from kvstore.errors import StartupError
from kvstore.tls import TLSFilesError, add_port

log = logging.getLogger("kvstore.process")


def log_level(text: str) -> str:
    """An argparse type for --log-level: a logging level name, any case (a bad one made
    logging.basicConfig raise "Unknown level" as a traceback once the process started)."""
    level = text.strip().upper()
    if level == "NOTSET" or level not in logging.getLevelNamesMapping():
        raise argparse.ArgumentTypeError(
            f"unknown log level {text!r}: one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
        )
    return level


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def configure_logging(level: str) -> None:
    """--log-level for kvstore's own loggers ("kvstore.*"); the libraries underneath log
    INFO and above whatever it says. At DEBUG grpc logged a line per call about its event
    loop and each cancelled stream (an etcd watch closed) as a traceback, burying the
    routing terms DEBUG is there for, and a log read for tracebacks found grpc's."""
    wanted = logging.getLevelNamesMapping()[level]
    logging.basicConfig(level=max(wanted, logging.INFO), format=LOG_FORMAT)
    logging.getLogger("kvstore").setLevel(wanted)


def seconds(low: float, high: float):
    """An argparse type: a number of seconds from `low` to `high` (0, negative, NaN or
    infinite values made a timeout fire at once or a loop spin at full CPU, reported as
    something else or not at all)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not low <= value <= high:  # NaN fails both
            raise argparse.ArgumentTypeError(
                f"must be a number of seconds from {low:g} to {high:g}, got {text!r}"
            )
        return value

    return parse


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


def check_ready_file(path: str | None, what: str = "--ready-file") -> None:
    """StartupError unless `path` can be written once serving (its directory exists and
    is writable): checked before anything starts, not found out after the listeners are
    up (the process then held its ports and served no one)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise StartupError(f"{what} {path} is a directory; name a file in one")
    if not os.path.isdir(folder):
        raise StartupError(f"{what} {path}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise StartupError(f"{what} {path}: directory {folder} is not writable")


async def run_until_signalled(
    server, ready_file: str | None = None, return_freed: bool = False
) -> None:
    """`server` has async start()/stop() and an `address`; stop on SIGTERM or SIGINT.
    `return_freed`: give what bursts leave free in the allocator back to the kernel
    (return_freed_memory): the router's bursts (connections, requests) are transient;
    an agent's heap holds the copy path's buffers for reuse, and a trim would make its
    next transfer fault them in again."""
    check_ready_file(ready_file)
    await server.start()
    freeze_startup_objects()
    if ready_file:
        try:
            write_ready_file(ready_file, server.address)
        except OSError as exc:
            await server.stop()
            raise StartupError(f"cannot write --ready-file {ready_file}: {exc}") from exc
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    returning = asyncio.create_task(return_freed_memory()) if return_freed else None
    await stop.wait()
    if returning is not None:
        returning.cancel()
    await server.stop()


# return_freed_memory: how often it looks, and how much must be free before it trims
TRIM_EVERY_S = 10.0
TRIM_ABOVE = 64 << 20


async def return_freed_memory(every_s: float = TRIM_EVERY_S, above: int = TRIM_ABOVE) -> None:
    """Give back to the kernel what a burst left free in the allocator (kvstore/heap.py):
    every `every_s` it asks how much is free, and trims once that has grown by `above`
    since the last trim (what was trimmed stays free in the allocator's count until
    reused; reuse lowers the mark). Both calls run off the event loop: walking the free
    lists took 0.01 ms after 3,000 TLS connections were freed, but 23 ms with 100,000
    scattered free chunks, and the trim 103 ms for 700 MiB (scratch heaps, 2026-12-07),
    each holding an arena's lock meanwhile (a malloc on the loop may wait)."""
    loop = asyncio.get_running_loop()
    mark = 0  # free bytes after the last trim
    while True:
        await asyncio.sleep(every_s)
        free = await loop.run_in_executor(None, heap.free_held)
        mark = min(mark, free)
        if free - mark < above:
            continue
        returned = await loop.run_in_executor(None, heap.trim)
        mark = free
        if returned >= 1 << 20:
            log.info("gave %d MiB of freed memory back to the system", returned >> 20)


def freeze_startup_objects() -> None:
    """Leave the objects made while starting (modules, the store's and the servers'
    structures: about 200,000 in an agent) out of every later garbage collection.

    Python's full collections traverse every tracked object on the event loop: an agent
    storing 90,000 8 KiB blocks paused 127.5 ms for one; with its start-up objects frozen,
    16.5 ms (docs/benchmarks.md, 2026-12-06 13:33). Objects made later, the blocks'
    records among them, are collected as before; frozen ones are freed as ever when their
    last reference goes, only a cycle among them is never reclaimed."""
    gc.collect()
    gc.freeze()
