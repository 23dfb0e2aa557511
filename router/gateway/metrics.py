"""The gateway's Prometheus metrics, in their own registry, served at /metrics. Labels
carry engine ids, routes and status codes only: never keys, tenants' prompts or text."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["GatewayMetrics"]


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvstore_gateway_requests",
            "Gateway requests by route and status",
            ["route", "code"],
            registry=r,
        )
        self.forwards = Counter(
            "kvstore_gateway_forwards", "Requests forwarded, per engine", ["engine"], registry=r
        )
        self.retries = Counter(
            "kvstore_gateway_retries", "Forwards retried on the next choice", registry=r
        )
        self.saturated = Counter(
            "kvstore_gateway_saturated",
            "Requests refused with 429 (every engine full)",
            registry=r,
        )
        self.inflight = Gauge(
            "kvstore_gateway_inflight", "Requests in flight through the gateway", registry=r
        )
        self.first_byte = Histogram(
            "kvstore_gateway_first_byte_seconds",
            "From the request's arrival to the engine's first response byte",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )

        self.engine_blocks = Gauge(
            "kvstore_gateway_engine_cached_blocks",
            "Blocks the router has indexed in each engine's own cache (its KV events)",
            ["engine"],
            registry=r,
        )

    def render(self, engine_blocks: dict[str, int] | None = None) -> bytes:
        """`engine_blocks`: engine id -> blocks indexed, read at scrape time."""
        if engine_blocks is not None:
            self.engine_blocks.clear()  # engines that left drop out
            for engine, n in engine_blocks.items():
                self.engine_blocks.labels(engine).set(n)
        return generate_latest(self.registry)
