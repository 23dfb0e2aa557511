"""The agent's metrics and span attributes (wired up by node_agent/server.py).

Per-lookup work on the data path is a few integer additions (`AgentMetrics.lookup` and
`.served`, called by the servicer) plus one histogram record when Prometheus is on.
Everything else is read from the store when Prometheus scrapes (observable instruments):
occupancy per tier and tenant from `store.accounts`, evictions from `store.counters`.

The request figures are the calling tenant's (a reader of another's public namespace
counts its own requests), the occupancy figures the owner's.

Exposed names (deploy/grafana and deploy/prometheus query them):
  kvstore_requests_total{tenant}, kvstore_requests_hit_total{tenant}   request-weighted
  kvstore_lookup_tokens_total{tenant}, kvstore_lookup_hit_tokens_total{tenant}  token-weighted
  kvstore_hit_length_tokens{tenant} (histogram: tokens matched per request)
  kvstore_saved_prefill_tokens_total{tenant} (tokens served by Get)
  kvstore_tier_bytes{tier,tenant}, kvstore_tier_blocks{tier,tenant},
  kvstore_tier_capacity_bytes{tier}, kvstore_evictions_total{tier,reason},
  kvstore_removed_blocks_total{reason}, kvstore_tier_moves_total{to},
  kvstore_nvme_writable (1, or 0 while NVMe writes fail), kvstore_nvme_events_total{event}
  (write_outage, write_recovery, write_refused, flush, quarantined),
  kvstore_fenced_calls_total{call} (lookup, get: answered as misses while the etcd lease
  was not confirmed, kvstore/coord/fence.py; `fenced_lookups` / `fenced_gets` in Stats),
  kvstore_killswitch_calls_total{call} (lookup, get: answered as misses, put: refused,
  while the kill switch was on; `killswitch_lookups` / `_gets` / `_puts` in Stats),
  kvstore_inflight_requests, kvstore_flush_duration_seconds (histogram),
  kvstore_peer_transfer_seconds{transport} (histogram), kvstore_peer_fetched_blocks_total,
  kvstore_rpc_duration_seconds{method} (kvstore/coord/telemetry.RpcTelemetry).
Tokens are counted in whole blocks (block_size tokens each): the agent sees block ids only.
A request is counted once however many Lookups and Gets it made (node_agent/request_tally):
the same tallies feed the Stats RPC, so `kvctl stats` and Prometheus agree.
"""

from __future__ import annotations

import logging
import time

from opentelemetry.metrics import CallbackOptions, Observation

from kvstore.telemetry import RpcTelemetry, ServiceTelemetry, pending_attributes, tracing_enabled
from kvstore.events import Tier
from kvstore.tiers.sealing import Failure
from node_agent.interceptors import current_tenant
from node_agent.request_tally import RequestDelta, RequestLedger

log = logging.getLogger("kvstore.agent")

HIT_TOKEN_BUCKETS = (
    0,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    32768,
    65536,
    131072,
)
FLUSH_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
PEER_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
TIERS = ((Tier.HBM, "hbm"), (Tier.NVME, "nvme"))
# Per-tenant tally slots, in the order of the counters that expose them; the last two (in
# blocks, for the Stats RPC) have no counter of their own.
REQUESTS, REQUESTS_HIT, LOOKUP_TOKENS, HIT_TOKENS, SAVED_TOKENS, ASKED_BLOCKS, HIT_BLOCKS = range(7)
_ROW = 7
_TALLY_COUNTERS = (
    ("kvstore_requests", "Engine requests (each once, whichever calls it made)"),
    ("kvstore_requests_hit", "Requests that matched at least one block"),
    ("kvstore_lookup_tokens", "Tokens in the full blocks looked up"),
    ("kvstore_lookup_hit_tokens", "Tokens in the leading blocks found cached"),
    ("kvstore_saved_prefill_tokens", "Tokens whose KV was served by Get"),
)
# (tier, reason) -> how to read it from store.counters. NVMe quota evictions are counted
# both as evict_nvme and evict_nvme_quota, so capacity ones are the difference.
_EVICTIONS = (
    ("hbm", "capacity", lambda c: c.get("evict_hbm_capacity", 0)),
    ("hbm", "quota", lambda c: c.get("evict_hbm_quota", 0)),
    ("nvme", "capacity", lambda c: c.get("evict_nvme", 0) - c.get("evict_nvme_quota", 0)),
    ("nvme", "quota", lambda c: c.get("evict_nvme_quota", 0)),
)
# event label -> key of RocksTier.counters()
_NVME_EVENTS = (
    ("write_outage", "nvme_write_outages"),
    ("write_recovery", "nvme_write_recoveries"),
    ("write_refused", "nvme_writes_refused"),
    ("flush", "nvme_flushes"),
    ("quarantined", "nvme_quarantined"),
    # encryption at rest: spills refused for want of a key, records that did not open
    ("seal_refused", "nvme_seal_refused"),
    *((f"open_failed_{f.value}", f"nvme_open_failed_{f.value}") for f in Failure),
)
# call label of kvstore_fenced_calls_total; store.counters counts fenced_<call>s
# (kvstore/store_killswitch.py)
_FENCED = ("lookup", "get")
# call label of kvstore_killswitch_calls_total; store.counters counts killswitch_<call>s
_KILLSWITCH = ("lookup", "get", "put")
_REMOVED = (
    ("flush", "blocks_dropped_flush"),
    ("expired", "removed_expired"),
    ("corrupt", "removed_corrupt"),
)


class AgentMetrics:
    """Per-tenant lookup and Get tallies kept by the servicer, exported on scrape."""

    def __init__(self, ledger: RequestLedger | None = None) -> None:
        self._tally: dict[str, list[int]] = {}
        self._hit_length = None  # histogram, once exported
        self._labels: dict[str, dict[str, str]] = {}
        self.ledger = ledger or RequestLedger()

    def _row(self, tenant: str) -> list[int]:
        row = self._tally.get(tenant)
        if row is None:
            self._labels[tenant] = {"tenant": tenant}  # first: a scrape may run between
            row = self._tally[tenant] = [0] * _ROW
        return row

    @staticmethod
    def _caller(st) -> str:
        """Whose request it is: the caller's tenant (a reader of another tenant's public
        namespace counts in its own rates and ledger, not the owner's: its lookups
        rewrote the owner's hit rates and pushed the owner's request ids out), or the
        namespace's where calls are unauthenticated."""
        return current_tenant.get() or st.tenant

    def _count(self, st, d: RequestDelta) -> None:
        if d.requests == 0 and d.hit_blocks == 0:
            return
        bs = st.spec.block_size
        tenant = self._caller(st)
        row = self._row(tenant)
        row[REQUESTS] += d.requests
        row[REQUESTS_HIT] += d.hits
        row[LOOKUP_TOKENS] += d.asked_blocks * bs
        row[HIT_TOKENS] += d.hit_blocks * bs
        row[ASKED_BLOCKS] += d.asked_blocks
        row[HIT_BLOCKS] += d.hit_blocks
        if d.first and self._hit_length is not None:
            self._hit_length.record(d.hit_blocks * bs, self._labels[tenant])

    def lookup(self, st, n_blocks: int, res, request_id: str = "", caller_held: int = 0) -> None:
        """One Lookup of `n_blocks` ids in namespace `st` answered with `res`; the caller
        held the leading `caller_held` itself (request_tally.RequestLedger.lookup)."""
        self._count(
            st,
            self.ledger.lookup(self._caller(st), request_id, n_blocks, res.matched, caller_held),
        )
        attrs = pending_attributes()
        if attrs is not None:
            attrs.update(
                {
                    "kvstore.tenant": st.tenant,
                    "kvstore.namespace": st.spec.name,
                    "kvstore.blocks": n_blocks,
                    "kvstore.matched_blocks": res.matched,
                    "kvstore.hbm_blocks": res.hbm,
                    "kvstore.nvme_blocks": res.nvme,
                }
            )

    def get_done(self, st, request_id: str, n_blocks: int, n_served: int) -> None:
        """A Get of `n_blocks` ids ended having served `n_served` (counts the request when
        no earlier call of it did)."""
        self._count(st, self.ledger.get(self._caller(st), request_id, n_blocks, n_served))

    def served(self, st, served) -> None:
        """Blocks a Get served (called per chunk of a streamed Get)."""
        if not served:
            return
        self._row(self._caller(st))[SAVED_TOKENS] += len(served) * st.spec.block_size
        attrs = pending_attributes()
        if attrs is not None:
            hbm = sum(1 for s in served if s.tier == Tier.HBM)
            attrs["kvstore.tenant"] = st.tenant
            attrs["kvstore.namespace"] = st.spec.name
            for key, n in (
                ("kvstore.blocks", len(served)),
                ("kvstore.hbm_blocks", hbm),
                ("kvstore.nvme_blocks", len(served) - hbm),
                ("kvstore.bytes", len(served) * st.spec.block_bytes),
            ):
                attrs[key] = attrs.get(key, 0) + n

    def tally(self, tenant: str) -> tuple[int, ...]:
        """(requests, requests hit, lookup tokens, hit tokens, saved tokens, asked blocks,
        hit blocks) so far."""
        return tuple(self._tally.get(tenant, [0] * _ROW))

    def tenants(self) -> list[str]:
        return list(self._tally)

    # ------------------------------------------------------------------ export
    def export(self, meter, store, servicer) -> None:
        """Register every agent instrument with `meter` (once)."""
        for i, (name, desc) in enumerate(_TALLY_COUNTERS):
            meter.create_observable_counter(name, [self._tally_callback(i)], description=desc)
        self._hit_length = meter.create_histogram(
            "kvstore_hit_length_tokens",
            description="Tokens matched per lookup",
            explicit_bucket_boundaries_advisory=HIT_TOKEN_BUCKETS,
        )
        _StoreGauges(store, servicer).register(meter)

    def _tally_callback(self, i: int):
        def callback(options: CallbackOptions):
            # list() of a dict is one C call under the GIL: safe against the event loop
            # adding a tenant meanwhile.
            rows = list(self._tally.items())
            return [Observation(row[i], self._labels[t]) for t, row in rows]

        return callback


class _StoreGauges:
    """Scrape-time reads of the store: occupancy, capacity, evictions, in-flight."""

    def __init__(self, store, servicer) -> None:
        self.store = store
        self.servicer = servicer

    def register(self, meter) -> None:
        meter.create_observable_gauge(
            "kvstore_tier_bytes",
            [self.tier_bytes],
            unit="By",
            description="Bytes held per tier and tenant",
        )
        meter.create_observable_gauge(
            "kvstore_tier_blocks", [self.tier_blocks], description="Blocks held per tier and tenant"
        )
        meter.create_observable_gauge(
            "kvstore_tier_capacity_bytes",
            [self.capacity],
            unit="By",
            description="Capacity per tier",
        )
        meter.create_observable_counter(
            "kvstore_evictions", [self.evictions], description="Blocks evicted per tier and reason"
        )
        meter.create_observable_counter(
            "kvstore_removed_blocks",
            [self.removed],
            description="Blocks dropped by flush, expiry, corruption",
        )
        meter.create_observable_counter(
            "kvstore_tier_moves",
            [self.moves],
            description="Promotions (to=hbm), demotions (to=nvme)",
        )
        meter.create_observable_gauge(
            "kvstore_nvme_writable",
            [self.nvme_writable],
            description="1 while the NVMe tier takes writes",
        )
        meter.create_observable_counter(
            "kvstore_nvme_events",
            [self.nvme_events],
            description="NVMe tier write outages, recoveries, refused writes, flushes, quarantines",
        )
        meter.create_observable_counter(
            "kvstore_fenced_calls",
            [self.fenced],
            description="Lookups and Gets answered as misses while the etcd lease was not "
            "confirmed (the lease fence)",
        )
        meter.create_observable_counter(
            "kvstore_killswitch_calls",
            [self.killswitch],
            description="Lookups and Gets answered as misses, Puts refused, while the kill "
            "switch was on",
        )
        meter.create_observable_gauge(
            "kvstore_inflight_requests", [self.inflight], description="Data-path copies in progress"
        )

    def _per_tenant(self, read) -> list[Observation]:
        with self.store.lock:
            acc = self.store.accounts
            return [
                Observation(read(acc, t, tier), {"tier": name, "tenant": t})
                for t in acc.tenants()
                for tier, name in TIERS
            ]

    def tier_bytes(self, options: CallbackOptions):
        return self._per_tenant(lambda acc, t, tier: acc.used(t, tier))

    def tier_blocks(self, options: CallbackOptions):
        return self._per_tenant(lambda acc, t, tier: acc.blocks(t, tier))

    def capacity(self, options: CallbackOptions):
        out = [Observation(self.store.pool.capacity_bytes, {"tier": "hbm"})]
        if self.store.rocks is not None:
            out.append(Observation(self.store.rocks.capacity_bytes, {"tier": "nvme"}))
        return out

    def _counters(self) -> dict[str, int]:
        with self.store.lock:
            return dict(self.store.counters)

    def evictions(self, options: CallbackOptions):
        c = self._counters()
        return [
            Observation(read(c), {"tier": tier, "reason": reason})
            for tier, reason, read in _EVICTIONS
        ]

    def removed(self, options: CallbackOptions):
        c = self._counters()
        return [Observation(c.get(key, 0), {"reason": reason}) for reason, key in _REMOVED]

    def moves(self, options: CallbackOptions):
        c = self._counters()
        return [
            Observation(c.get("promotions", 0), {"to": "hbm"}),
            Observation(c.get("demotions", 0), {"to": "nvme"}),
        ]

    def fenced(self, options: CallbackOptions):
        c = self._counters()
        return [Observation(c.get(f"fenced_{call}s", 0), {"call": call}) for call in _FENCED]

    def killswitch(self, options: CallbackOptions):
        c = self._counters()
        return [
            Observation(c.get(f"killswitch_{call}s", 0), {"call": call}) for call in _KILLSWITCH
        ]

    def nvme_writable(self, options: CallbackOptions):
        rocks = self.store.rocks
        return [] if rocks is None else [Observation(int(rocks.health.writable))]

    def nvme_events(self, options: CallbackOptions):
        rocks = self.store.rocks
        if rocks is None:
            return []
        with self.store.lock:
            c = rocks.counters()
        return [Observation(c[key], {"event": event}) for event, key in _NVME_EVENTS]

    def inflight(self, options: CallbackOptions):
        return [Observation(self.servicer.in_flight)]


class AgentTelemetry(ServiceTelemetry):
    """Prometheus endpoint (cfg.metrics_port), tracing (cfg.otlp_endpoint or the OTEL_*
    env) and the RPC interceptor for one AgentServer. With both off: nothing is installed
    and the data path pays only the servicer's tallies."""

    def __init__(self, agent) -> None:
        cfg = agent.cfg
        super().__init__(cfg, "kvstore-agent", cfg.node_id)
        self.agent = agent
        self._flush = self._peer = self._peer_blocks = None
        meter = self.meter
        if meter is not None:
            agent.servicer.metrics.export(meter, agent.store, agent.servicer)
            self._flush = meter.create_histogram(
                "kvstore_flush_duration_seconds",
                unit="s",
                description="Time to put a flushed namespace generation in force here",
                explicit_bucket_boundaries_advisory=FLUSH_BUCKETS,
            )
            self._peer = meter.create_histogram(
                "kvstore_peer_transfer_seconds",
                unit="s",
                description="Prefetch time for blocks pulled from a peer",
                explicit_bucket_boundaries_advisory=PEER_BUCKETS,
            )
            self._peer_blocks = meter.create_counter(
                "kvstore_peer_fetched_blocks", description="Blocks pulled from peers"
            )
        self.interceptors: list = []
        if meter is not None or tracing_enabled():
            self.interceptors.append(
                RpcTelemetry(
                    meter,
                    {"kvstore.node": cfg.node_id},
                    {"Put": _observe_put, "Prefetch": self._observe_prefetch},
                )
            )

    def _observe_prefetch(self, request, response, seconds: float) -> None:
        attrs = pending_attributes()
        if attrs is not None:
            attrs.update(
                {
                    "kvstore.blocks": len(request.block_ids) // 16,
                    "kvstore.present_blocks": response.present,
                    "kvstore.fetched_blocks": response.fetched,
                    "kvstore.waited_blocks": response.waited,
                    "kvstore.transport": response.transport,
                    "kvstore.stopped": response.stopped,
                }
            )
        if self._peer is not None and self._peer_blocks is not None and response.transport:
            labels = {"transport": response.transport}
            self._peer.record(seconds, labels)
            self._peer_blocks.add(response.fetched, labels)

    def watch_generations(self, control) -> None:
        """Time each flush this agent applies: wraps `control.on_generation`, the one
        place a new namespace generation is put in force here (node_agent/control.py)."""
        if self._flush is None:
            return
        apply, store, hist = control.on_generation, self.agent.store, self._flush

        async def timed(ns_id: bytes, tenant: str, generation: int) -> int:
            st = next((s for s in store.namespaces() if s.ns_id == ns_id), None)
            before = st.generation if st is not None else generation
            t0 = time.perf_counter()
            dropped = await apply(ns_id, tenant, generation)
            # Only a namespace held here at an older generation is a flush to apply; the
            # start-up catch-up of unchanged generations is not.
            if st is not None and before < generation and st.generation == generation:
                hist.record(time.perf_counter() - t0)
            return dropped

        control.on_generation = timed


def _observe_put(request, response, seconds: float) -> None:
    attrs = pending_attributes()
    if attrs is not None:
        attrs["kvstore.stored_blocks"] = response.stored
        attrs["kvstore.already_present_blocks"] = response.already_present
