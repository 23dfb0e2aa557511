"""The router's metrics and span attributes (wired up by router/server.py).

Routing decisions are observed from the Route RPC's response (RpcTelemetry observer), so
the routing code stays free of instrumentation; index and load gauges are read from
RouterCore when Prometheus scrapes.

Exposed names:
  kvstore_router_decisions_total{node}   routes answered (dry runs excluded)
  kvstore_router_matched_blocks          histogram: prefix blocks already on the chosen node
  kvstore_router_peer_blocks             histogram: blocks it can fetch from a peer
  kvstore_router_recompute_blocks        histogram: blocks nobody holds
  kvstore_router_cost                    histogram: the chosen node's cost
  kvstore_router_indexed_blocks{node}, kvstore_router_inflight{node},
  kvstore_router_nodes{state},
  kvstore_router_engine_inflight{engine},
  kvstore_router_engine_queued_blocks{engine}  gauges read from RouterCore (the engine
                                         gauges: every tenant's requests, for operators)
  kvstore_router_engine_events_dropped_total{engine}  KV event frames dropped as noise
  kvstore_router_engine_resyncs_total{engine}         times an engine's entries were
                                         cleared to start over (router/engine_events.py)
  kvstore_router_fenced_routes_total     routes answered by load only while the etcd lease
                                         was not confirmed (the lease fence,
                                         kvstore/coord/fence.py)
  kvstore_router_engine_records_refused_total{reader} engines/ records taken for no engine
                                         because they do not verify under the engine record
                                         key (reader: router, the KV-event subscriber;
                                         gateway, its forwards)
  kvstore_router_engine_records_unsigned{reader} engines/ records taken now without a
                                         signature (engine_record_unsigned: accept)
  kvstore_rpc_duration_seconds{method}   (kvstore/coord/telemetry.RpcTelemetry)
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.metrics import CallbackOptions, Observation

from kvstore.coord.engines import EngineRecordReader

from kvstore.telemetry import RpcTelemetry, ServiceTelemetry, pending_attributes, tracing_enabled

BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
COST_BUCKETS = (0, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 50000)


class RouterMetrics:
    def __init__(self, meter, core, records: Mapping[str, EngineRecordReader] = {}) -> None:
        self.core = core
        self.records = records
        self._decisions = meter.create_counter(
            "kvstore_router_decisions", description="Routing decisions per chosen node"
        )
        self._terms = {
            name: meter.create_histogram(
                f"kvstore_router_{name}",
                description=desc,
                explicit_bucket_boundaries_advisory=buckets,
            )
            for name, desc, buckets in (
                ("matched_blocks", "Prefix blocks already on the chosen node", BLOCK_BUCKETS),
                ("peer_blocks", "Blocks the chosen node can fetch from a peer", BLOCK_BUCKETS),
                ("recompute_blocks", "Blocks the chosen node recomputes", BLOCK_BUCKETS),
                ("cost", "Cost of the chosen node", COST_BUCKETS),
            )
        }
        self._labels: dict[str, dict[str, str]] = {}
        meter.create_observable_gauge(
            "kvstore_router_indexed_blocks",
            [self._indexed],
            description="Blocks the index holds per node",
        )
        meter.create_observable_gauge(
            "kvstore_router_inflight",
            [self._inflight],
            description="Routed requests not yet released",
        )
        meter.create_observable_gauge(
            "kvstore_router_nodes", [self._nodes], description="Known nodes, synced or not"
        )
        meter.create_observable_gauge(
            "kvstore_router_engine_inflight",
            [self._engine_inflight],
            description="Requests routed or forwarded to the engine, not yet released",
        )
        meter.create_observable_gauge(
            "kvstore_router_engine_queued_blocks",
            [self._engine_queued],
            description="Prefill work of the engine's requests before their first token",
        )

        meter.create_observable_counter(
            "kvstore_router_engine_events_dropped",
            [self._engine_dropped],
            description="KV event frames dropped as noise (undecodable, out of sequence, "
            "not the engine's by its replay socket, or past the resync budget)",
        )
        meter.create_observable_counter(
            "kvstore_router_engine_resyncs",
            [self._engine_resyncs],
            description="Times the index of an engine's cache was cleared to start over",
        )

        meter.create_observable_counter(
            "kvstore_router_fenced_routes",
            [self._fenced_routes],
            description="Routes answered by load only while the etcd lease was not confirmed",
        )
        meter.create_observable_counter(
            "kvstore_router_engine_records_refused",
            [self._records_refused],
            description="Engine records in etcd ignored because they do not verify under "
            "the engine record key (forged, copied and changed, or unsigned)",
        )
        meter.create_observable_gauge(
            "kvstore_router_engine_records_unsigned",
            [self._records_unsigned],
            description="Engine records in etcd taken without a signature "
            "(engine_record_unsigned: accept); 0 before setting refuse",
        )

    def decision(self, chosen) -> None:
        """Count one routing decision; `chosen` is the winning Candidate."""
        labels = self._labels.get(chosen.node_id)
        if labels is None:
            labels = self._labels[chosen.node_id] = {"node": chosen.node_id}
        self._decisions.add(1, labels)
        for name, value in (
            ("matched_blocks", chosen.local_blocks),
            ("peer_blocks", chosen.peer_blocks),
            ("recompute_blocks", chosen.recompute_blocks),
            ("cost", chosen.cost),
        ):
            self._terms[name].record(value)

    # Scrape-time reads: list() snapshots the dicts in one step against the event loop.
    def _indexed(self, options: CallbackOptions):
        return [
            Observation(self.core.index.node_blocks(n)[0], {"node": n})
            for n in list(self.core.nodes)
        ]

    def _inflight(self, options: CallbackOptions):
        return [
            Observation(self.core.inflight.count(n), {"node": n}) for n in list(self.core.nodes)
        ]

    def _engine_inflight(self, options: CallbackOptions):
        board = self.core.engines
        return [Observation(board.load(e)[0], {"engine": e}) for e in list(board.engines)]

    def _engine_queued(self, options: CallbackOptions):
        board = self.core.engines
        return [Observation(board.load(e)[1], {"engine": e}) for e in list(board.engines)]

    def _engine_streams(self):
        for e, st in list(self.core.engines.engines.items()):
            if st.stream is not None:
                yield e, st.stream

    def _engine_dropped(self, options: CallbackOptions):
        return [Observation(s.dropped, {"engine": e}) for e, s in self._engine_streams()]

    def _engine_resyncs(self, options: CallbackOptions):
        return [Observation(s.resyncs, {"engine": e}) for e, s in self._engine_streams()]

    def _fenced_routes(self, options: CallbackOptions):
        return [Observation(self.core.fenced_routes)]

    def _records_refused(self, options: CallbackOptions):
        return [Observation(r.refused, {"reader": n}) for n, r in self.records.items()]

    def _records_unsigned(self, options: CallbackOptions):
        return [Observation(r.unsigned, {"reader": n}) for n, r in self.records.items()]

    def _nodes(self, options: CallbackOptions):
        states = [st.synced for st in list(self.core.nodes.values())]
        return [
            Observation(sum(states), {"state": "synced"}),
            Observation(len(states) - sum(states), {"state": "syncing"}),
        ]


class RouterTelemetry(ServiceTelemetry):
    """Prometheus endpoint, tracing and the RPC interceptor for one RouterServer; with
    metrics_port 0 and no OTLP endpoint nothing is installed."""

    def __init__(self, cfg, core, records: Mapping[str, EngineRecordReader] = {}) -> None:
        super().__init__(cfg, "kvstore-router", cfg.router_id)
        meter = self.meter
        self.metrics = RouterMetrics(meter, core, records) if meter is not None else None
        self.interceptors: list = []
        if meter is not None or tracing_enabled():
            # Route's decision terms are observed by the servicer (observe_route) before
            # it withholds the load terms from a tenant's answer (router/server.py)
            self.interceptors.append(RpcTelemetry(meter, {"kvstore.router": cfg.router_id}))

    def observe_route(self, request, response) -> None:
        """A Route's decision (the whole RouteResponse, load terms included) in the
        metrics and, inside the call's span, as its attributes."""
        if not response.candidates:
            return
        chosen = response.candidates[0]
        if self.metrics is not None and not request.dry_run:
            self.metrics.decision(chosen)
        attrs = pending_attributes()
        if attrs is not None:  # the decision's terms, as STYLE asks: visible in traces
            attrs.update(
                {
                    "kvstore.node": chosen.node_id,
                    "kvstore.blocks": len(request.block_ids) // 16,
                    "kvstore.matched_blocks": chosen.local_blocks,
                    "kvstore.peer_blocks": chosen.peer_blocks,
                    "kvstore.peer_node": chosen.peer_node_id,
                    "kvstore.recompute_blocks": chosen.recompute_blocks,
                    "kvstore.in_flight": chosen.in_flight,
                    "kvstore.cost": chosen.cost,
                    "kvstore.candidates": len(response.candidates),
                    "kvstore.dry_run": request.dry_run,
                }
            )
