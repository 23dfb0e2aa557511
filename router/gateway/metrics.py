"""The gateway's Prometheus metrics, in their own registry: on the router's Prometheus
port (metrics_port, the operator's) and, with public_metrics, at the gateway's /metrics.
Labels carry engine ids, routes, status codes and reasons only: never keys, client
addresses, tenants' prompts or text; the counts are every tenant's, so they are not on
the tenants' port by default."""

from __future__ import annotations

from collections.abc import Callable

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
        # Client connections closed to keep within max_connections or
        # max_connections_per_client (`limit`): `reason` idle (nothing of a request
        # received: a keep-alive connection between requests, or one silent since it
        # opened) or incomplete_request (its head or body still arriving; answered 503).
        self.connections_shed = Counter(
            "kvstore_gateway_connections_shed",
            "Client connections closed to make room for a new one, by limit and reason",
            ["limit", "reason"],
            registry=r,
        )
        # Client connections closed because they read nothing of an answer for
        # send_timeout_s while the gateway had more to send.
        self.clients_stalled = Counter(
            "kvstore_gateway_clients_stalled",
            "Client connections closed for reading nothing of an answer for send_timeout_s",
            registry=r,
        )
        # Requests refused with 503 because every connection counted against the limit
        # (`reason`: max_connections or max_connections_per_client) had a request in flight.
        self.connections_refused = Counter(
            "kvstore_gateway_connections_refused",
            "Requests refused with 503 at a connection limit, by limit",
            ["reason"],
            registry=r,
        )
        # Engine records left out: `reason` plaintext (an http:// URL while the gateway
        # serves HTTPS; GatewayConfig.allow_plaintext_engines).
        self.engines_refused = Counter(
            "kvstore_gateway_engines_refused",
            "Engine records left out, by reason",
            ["reason"],
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

    def collector(self, engine_blocks: Callable[[], dict[str, int]]) -> "_Page":
        """The page as a collector for another registry (the router's metrics port):
        `engine_blocks` is read at each scrape, from that server's thread."""
        return _Page(self, engine_blocks)

    def refresh(self, engine_blocks: dict[str, int]) -> None:
        self.engine_blocks.clear()  # engines that left drop out
        for engine, n in engine_blocks.items():
            self.engine_blocks.labels(engine).set(n)

    def render(self, engine_blocks: dict[str, int] | None = None) -> bytes:
        """`engine_blocks`: engine id -> blocks indexed, read at scrape time."""
        if engine_blocks is not None:
            self.refresh(engine_blocks)
        return generate_latest(self.registry)


class _Page:
    def __init__(self, metrics: GatewayMetrics, engine_blocks: Callable[[], dict[str, int]]):
        self.metrics, self.engine_blocks = metrics, engine_blocks

    def collect(self):
        self.metrics.refresh(self.engine_blocks())
        return self.metrics.registry.collect()
