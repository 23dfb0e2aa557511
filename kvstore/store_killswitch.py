"""The store's serving gate: the global kill switch (etcd `killswitch`, applied by
node_agent/control.py) and the lease fence (kvstore/coord/fence.py, installed by
node_agent/server.py as `fence`). While either holds, every lookup and get misses (peers
are served nothing); the kill switch also refuses writes. Nothing is dropped, so lifting
either serves what was held before (after a fence, only once the generations in etcd are
in force again)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvstore.errors import FailedPrecondition
from kvstore.store_types import LookupResult, NsState


# What this gate counts (node-wide). Present from the start, at 0: a node-wide Stats
# always carries them, so `kvctl stats` tells "none yet" from "not shown to this caller".
COUNTERS = (
    "killswitch_lookups",
    "killswitch_gets",
    "killswitch_puts",
    "fenced_lookups",
    "fenced_gets",
)


class KillSwitch:
    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        for name in COUNTERS:
            counters[name] += 0
        self.on = False
        # True while this member cannot be sure its etcd lease is alive (None: no etcd).
        self.fence: Callable[[], bool] | None = None

    def refuses_hits(self) -> str:
        """Why no hit may be served now: 'killswitch', 'fenced', or '' (serve)."""
        if self.on:
            return "killswitch"
        if self.fence is not None and self.fence():
            return "fenced"
        return ""

    def lookup_miss(self, st: NsState, n: int, why: str = "killswitch") -> LookupResult:
        """A miss, counted as one so hit rates show what callers saw (node-wide; per
        tenant, requests are counted once at the agent's edge: node_agent/request_tally.py)."""
        self.counters["lookups"] += 1
        self.counters["lookup_blocks"] += n
        self.counters[f"{why}_lookups"] += 1
        return LookupResult(0, 0, 0, st.generation)

    def get_miss(self, why: str = "killswitch") -> None:
        self.counters[f"{why}_gets"] += 1

    def refuse_write(self, message: str) -> FailedPrecondition:
        """Count a refused write; the caller raises what this returns."""
        self.counters["killswitch_puts"] += 1
        return FailedPrecondition(message)
