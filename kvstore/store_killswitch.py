"""The store's side of the global kill switch (etcd `killswitch`, applied by
node_agent/control.py): while it is on, every lookup and get misses and every write is
refused; nothing is dropped, so turning it off serves what was held before."""

from __future__ import annotations

from collections import Counter

from kvstore.errors import FailedPrecondition
from kvstore.store_types import LookupResult, NsState


class KillSwitch:
    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        self.on = False

    def lookup_miss(self, st: NsState, n: int) -> LookupResult:
        """A miss, counted as one so hit rates show what callers saw (node-wide; per
        tenant, requests are counted once at the agent's edge: node_agent/request_tally.py)."""
        self.counters["lookups"] += 1
        self.counters["lookup_blocks"] += n
        self.counters["killswitch_lookups"] += 1
        return LookupResult(0, 0, 0, st.generation)

    def get_miss(self) -> None:
        self.counters["killswitch_gets"] += 1

    def refuse_write(self, message: str) -> FailedPrecondition:
        """Count a refused write; the caller raises what this returns."""
        self.counters["killswitch_puts"] += 1
        return FailedPrecondition(message)
