"""Fault injection for an agent process started with this directory first on its
PYTHONPATH (tests/support/hold_mapping.py): the mapping of a shared-memory region of
exactly $KVSTORE_FAULT_HOLD_MAP_BYTES bytes stalls until the file
$KVSTORE_FAULT_HOLD_MAP_DIR/release exists, and says it has begun by creating
$KVSTORE_FAULT_HOLD_MAP_DIR/entered: a region whose populated mapping takes as long as
the test wants (seconds for gigabytes on a real host), without gigabytes."""

from __future__ import annotations

import os
import time

_DIR = os.environ.get("KVSTORE_FAULT_HOLD_MAP_DIR", "")
_SIZE = int(os.environ.get("KVSTORE_FAULT_HOLD_MAP_BYTES", "0") or 0)

if _DIR and _SIZE:
    from kvstore import pages

    _map_shared = pages.map_shared

    def _held_map_shared(fd: int, size: int):
        if size == _SIZE:
            open(os.path.join(_DIR, "entered"), "w").close()
            while not os.path.exists(os.path.join(_DIR, "release")):
                time.sleep(0.01)
        return _map_shared(fd, size)

    pages.map_shared = _held_map_shared  # before node_agent.shm imports it
