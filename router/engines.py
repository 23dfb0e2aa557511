"""The serving engines the router knows (etcd engines/, kvstore/coord/engines.py), what
their own caches hold (router/engine_index.py, fed from their KV events) and the routing
decision among them (router/engine_scoring.py). Pure, no I/O: router/engine_feed.py feeds
it; RouterCore owns one (`core.engines`) so the decision sees the agents' index too.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from kvstore import errors
from kvstore.coord.engines import EngineRecord
from kvstore.hashing import BLOCK_ID_BYTES
from kvstore.namespace import Namespace
from router.engine_events import ChainRoots, EngineCache, EngineStream
from router.engine_index import EngineIndex
from router.engine_scoring import DEFAULT_LOCAL_PRICE, EngineLoad, EngineScore, score_engines
from router.scoring import Pricing, Weights

log = logging.getLogger("kvstore.router")


@dataclass(frozen=True, slots=True)
class EngineDecision:
    request_id: str
    total_blocks: int
    scores: list[EngineScore]  # cheapest first

    @property
    def chosen(self) -> EngineScore:
        return self.scores[0]


@dataclass(slots=True)
class EngineState:
    record: EngineRecord
    stream: EngineStream | None  # None: no events endpoint, or no chain ids computable


class EngineBoard:
    def __init__(
        self,
        tenant_secrets: dict[str, str] | None = None,
        generation_of: Callable[[bytes], int] = lambda ns_id: 0,
        local_price: float = DEFAULT_LOCAL_PRICE,
    ) -> None:
        self.index = EngineIndex()
        self.engines: dict[str, EngineState] = {}
        self.local_price = local_price
        self._secrets = dict(tenant_secrets or {})
        self._generation_of = generation_of
        self._inflight: dict[str, tuple[str, float]] = {}  # request -> (engine, work)
        self._count: dict[str, int] = {}
        self._work: dict[str, float] = {}

    # ------------------------------------------------------------ membership
    def upsert(self, rec: EngineRecord) -> bool:
        """Add or refresh an engine; True when its event stream must (re)start (new, or
        moved endpoint / namespace: a re-registration resyncs, as for agents)."""
        old = self.engines.get(rec.engine_id)
        if old is not None and _same_stream(old.record, rec):
            old.record = rec
            return False
        if old is not None:
            self.index.clear_engine(rec.engine_id)
        self.index.add_engine(rec.engine_id)
        self.engines[rec.engine_id] = EngineState(rec, self._stream(rec))
        return True

    def _stream(self, rec: EngineRecord) -> EngineStream | None:
        if not rec.kv_events_endpoint:
            return None
        try:
            spec = Namespace.from_dict(rec.namespace)
        except (ValueError, TypeError) as exc:
            log.warning(
                "engine %s: namespace unusable (%s): its cache is not indexed", rec.engine_id, exc
            )
            return None
        block_size = rec.block_size or spec.block_size
        if block_size != spec.block_size:
            log.warning(
                "engine %s: block_size %d disagrees with its namespace's %d",
                rec.engine_id,
                block_size,
                spec.block_size,
            )
            return None
        secret = self._secrets.get(spec.tenant)
        if secret is None and not spec.public:
            log.warning(
                "engine %s: no secret for tenant %r (tenant_secret_files): cache not indexed",
                rec.engine_id,
                spec.tenant,
            )
            return None
        roots = ChainRoots(spec, secret, self._generation_of)
        return EngineStream(
            EngineCache(rec.engine_id, block_size, roots, self.index),
            verifiable=bool(rec.kv_events_replay_endpoint),
        )

    def remove(self, engine_id: str) -> None:
        if self.engines.pop(engine_id, None) is not None:
            n = self.index.drop_engine(engine_id)
            for rid in [r for r, (e, _) in self._inflight.items() if e == engine_id]:
                self.release(rid)
            log.info("engine %s left; dropped %d cache entries", engine_id, n)

    # ------------------------------------------------------------- in flight
    def hold(self, request_id: str, engine_id: str, work: float) -> None:
        """Count `request_id` in flight on `engine_id` with `work` blocks of prefill, until
        `release`: what a non-dry-run `route` does for its choice, and what the gateway
        does for the engine it forwarded to (the first free one of a dry-run ranking)."""
        self.release(request_id)  # a retried id moves
        self._inflight[request_id] = (engine_id, work)
        self._count[engine_id] = self._count.get(engine_id, 0) + 1
        self._work[engine_id] = self._work.get(engine_id, 0.0) + work

    def release(self, request_id: str) -> bool:
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return False
        engine, work = entry
        self._count[engine] -= 1
        self._work[engine] -= work
        if self._count[engine] <= 0:
            del self._count[engine], self._work[engine]
        return True

    def prefill_done(self, request_id: str) -> bool:
        entry = self._inflight.get(request_id)
        if entry is None:
            return False
        engine, work = entry
        self._inflight[request_id] = (engine, 0.0)
        self._work[engine] = max(0.0, self._work[engine] - work)
        return True

    def load(self, engine_id: str) -> tuple[int, float]:
        """Requests in flight on the engine itself, and their prefill work still queued
        (blocks): the operator's view (router metrics), never a tenant's."""
        return self._count.get(engine_id, 0), self._work.get(engine_id, 0.0)

    def _loads(self, model: str) -> list[EngineLoad]:
        """Each engine serving `model` with the requests in flight and the prefill work
        queued where it computes: on its device, whichever engine queued them, when it
        shares one (two engines on one GPU, or on one host's CPU cores); else its own.
        Moving a request between engines of one device does not shorten its queue, it
        only costs their caches."""
        on_device: dict[str, tuple[int, float]] = {}
        for e, st in self.engines.items():
            if st.record.device:
                n, w = on_device.get(st.record.device, (0, 0.0))
                on_device[st.record.device] = (
                    n + self._count.get(e, 0),
                    w + self._work.get(e, 0.0),
                )
        loads = []
        for e, st in self.engines.items():
            if model and model not in st.record.models:
                continue
            dev = st.record.device
            n, w = on_device[dev] if dev else (self._count.get(e, 0), self._work.get(e, 0.0))
            loads.append(EngineLoad(e, st.record.node_id, n, w))
        return loads

    # --------------------------------------------------------------- routing
    def route(
        self,
        packed_ids: bytes,
        node_prefix: dict[str, int],
        weights: Weights,
        pricing: Pricing,
        model: str = "",
        request_id: str = "",
        dry_run: bool = False,
        use_cache: bool = True,
    ) -> EngineDecision:
        """Price every engine serving `model` ("" any) for the prompt `packed_ids` (chain
        ids); `node_prefix` is the agents' index answer for the same ids."""
        if len(packed_ids) % BLOCK_ID_BYTES:
            raise errors.InvalidArgument(
                f"block_ids is {len(packed_ids)} bytes, not a multiple of {BLOCK_ID_BYTES}"
            )
        loads = self._loads(model)
        if not loads:
            raise errors.Unavailable(
                f"no engine serving {model!r} is registered" if model else "no engine is registered"
            )
        total = len(packed_ids) // BLOCK_ID_BYTES
        own = self.index.prefix_lengths(packed_ids) if use_cache else {}
        scores = score_engines(
            total, own, node_prefix if use_cache else {}, loads, weights, pricing, self.local_price
        )
        rid = request_id or secrets.token_hex(16)
        if not dry_run:
            c = scores[0]
            self.hold(rid, c.engine_id, c.work)
        if log.isEnabledFor(logging.DEBUG):
            c = scores[0]
            log.debug("route-engine %s blocks=%d -> %s %s", rid, total, c.engine_id, c.terms())
        return EngineDecision(rid, total, scores)


def _same_stream(a: EngineRecord, b: EngineRecord) -> bool:
    return (
        a.kv_events_endpoint == b.kv_events_endpoint
        and a.kv_events_replay_endpoint == b.kv_events_replay_endpoint
        and a.namespace == b.namespace
        and a.block_size == b.block_size
    )
