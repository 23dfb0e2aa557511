"""The agent's counters as peer transfer writes them."""

from __future__ import annotations

from kvstore.store import BlockStore


class Counters:
    """Adds to store.counters (what Stats and the metrics read). Worker threads (store
    steps, copies) count too, so under the store's lock."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store

    def add(self, name: str, n: int = 1) -> None:
        with self._store.lock:
            self._store.counters[name] += n
