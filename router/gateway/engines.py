"""The engines the gateway forwards to: followed from etcd (engines/<id>, under their
registrar's lease), with what the gateway itself knows of each: requests in flight
through it and a short suspension after a failed forward (the lease outlives a dead
engine by up to its TTL; the gateway should not keep choosing it meanwhile).

Choosing is pure over this state: `pick` takes the router's ranked candidate engines
(from RouterCore.route_engines, the one cost function: each engine's own cache, its node's
agent, a peer, recompute, load) and returns the cheapest one that is live and below its
in-flight cap; round robin and rendezvous hashing are the baselines the benchmark
compares against.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.coord.engines import EngineRecord, EngineRecordReader
from kvstore.coord.etcd import KeyValue, WatchEvent
from router.gateway.body import counted

__all__ = ["EngineSet", "EngineState", "Pick"]

log = logging.getLogger("kvstore.gateway")


@dataclass(slots=True)
class EngineState:
    record: EngineRecord
    inflight: int = 0
    suspended_until: float = 0.0


@dataclass(frozen=True, slots=True)
class Pick:
    """The outcome of choosing: an engine, or why there is none."""

    engine: EngineState | None
    saturated: bool = False  # engines serve the model, every one at its cap
    known: bool = True  # some engine serves the model at all


@dataclass(slots=True)
class EngineSet:
    max_inflight: int
    suspend_s: float
    clock: Callable[[], float] = time.monotonic
    # How records are decoded and, with the engine record key, verified (kvstore/coord/
    # engines.py): the gateway forwards prompts only to engines whose record verifies.
    records: EngineRecordReader = field(default_factory=EngineRecordReader)
    engines: dict[str, EngineState] = field(default_factory=dict)
    _rr: itertools.count = field(default_factory=itertools.count)
    # A gateway serving HTTPS forwards prompts to https:// engines only (GatewayConfig
    # allow_plaintext_engines): an http:// record is left out, logged once per engine
    # and address, and `on_refused` called for each one refused (the metric).
    refuse_plaintext: bool = False
    on_refused: Callable[[], None] = lambda: None
    _warned: set[tuple[str, str]] = field(default_factory=set)

    # ------------------------------------------------------------ from etcd
    def reset(self, items: list[KeyValue]) -> None:
        self.records.reset(items, self.engines, self.upsert, self.remove)

    def apply(self, events: list[WatchEvent]) -> None:
        self.records.apply(events, self.upsert, self.remove)

    def upsert(self, rec: EngineRecord) -> None:
        if self.refuse_plaintext and not rec.url.startswith("https://"):
            self._refuse(rec)
            return
        st = self.engines.get(rec.engine_id)
        if st is None:
            self.engines[rec.engine_id] = EngineState(rec)
            log.info("engine %s joined: %s on node %s", rec.engine_id, rec.url, rec.node_id)
        else:
            if st.record.url != rec.url:
                st.suspended_until = 0.0  # restarted elsewhere: give it a chance at once
            st.record = rec

    def _refuse(self, rec: EngineRecord) -> None:
        self.on_refused()
        if (rec.engine_id, rec.url) not in self._warned:
            self._warned.add((rec.engine_id, rec.url))
            log.warning(
                "engine %s left out: its URL %s is not https:// and this gateway serves TLS "
                "(prompts would cross the network in plaintext; allow_plaintext_engines: "
                "true admits it)",
                rec.engine_id,
                rec.url,
            )
        self.remove(rec.engine_id)  # a record rewritten from https:// to http://

    def remove(self, engine_id: str) -> None:
        if self.engines.pop(engine_id, None) is not None:
            log.info("engine %s left", engine_id)

    # ------------------------------------------------------------ load
    def weight(self, sequences: int) -> int:
        """What a request asking `sequences` at once counts against an engine's
        max_inflight (body.counted)."""
        return counted(sequences, self.max_inflight)

    def acquire(self, st: EngineState, sequences: int = 1) -> None:
        st.inflight += self.weight(sequences)

    def release(self, st: EngineState, sequences: int = 1) -> None:
        st.inflight = max(0, st.inflight - self.weight(sequences))

    def suspend(self, st: EngineState) -> None:
        st.suspended_until = self.clock() + self.suspend_s

    # ------------------------------------------------------------ choosing
    def serving(self, model: str) -> list[EngineState]:
        return sorted(
            (s for s in self.engines.values() if model in s.record.models),
            key=lambda s: s.record.engine_id,
        )

    def _eligible(
        self, model: str, exclude: set[str], sequences: int
    ) -> tuple[list[EngineState], Pick | None]:
        all_ = self.serving(model)
        if not all_:
            return [], Pick(None, known=False)
        now = self.clock()
        live = [s for s in all_ if s.record.engine_id not in exclude and s.suspended_until <= now]
        need = self.weight(sequences)
        free = [s for s in live if s.inflight + need <= self.max_inflight]
        if not free:
            return [], Pick(None, saturated=bool(live))
        return free, None

    def pick(
        self,
        model: str,
        policy: str,
        ranked_engines: Sequence[str] = (),
        key: bytes = b"",
        exclude: set[str] | None = None,
        sequences: int = 1,
    ) -> Pick:
        """`ranked_engines`: the router's candidate engine ids, cheapest first (policy
        "cache"); `key`: what "hash" hashes (the prompt's first block id); `sequences`:
        what the request asks at once (n choices weigh like n requests: `weight`)."""
        free, none = self._eligible(model, exclude or set(), sequences)
        if none is not None:
            return none
        if policy == "round_robin":
            return Pick(free[next(self._rr) % len(free)])
        if policy == "hash":  # rendezvous hashing: stable while the engine set is
            return Pick(max(free, key=lambda s: _rank(key, s.record.engine_id)))
        by_id = {s.record.engine_id: s for s in free}
        for engine_id in ranked_engines:
            if engine_id in by_id:
                return Pick(by_id[engine_id])
        # Unpriced (no chain ids, or the router does not follow these engines yet): by load.
        return Pick(min(free, key=lambda s: s.inflight))  # stable: free is sorted by id

    def namespace_of(self, model: str) -> EngineRecord | None:
        """The record whose namespace names the model's chain ids (engines of one model
        share it unless their configurations differ; then the others route by load)."""
        for s in self.serving(model):
            if s.record.namespace and s.record.block_size:
                return s.record
        return None


def _rank(key: bytes, engine_id: str) -> bytes:
    return hashlib.blake2b(key + engine_id.encode(), digest_size=8).digest()
