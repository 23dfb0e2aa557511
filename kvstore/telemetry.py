"""Observability shared by the agent and the router: OpenTelemetry metrics served to
Prometheus, tracing exported over OTLP, and the gRPC glue for both.

- `MetricsEndpoint(host, port)`: a MeterProvider whose one reader is a private Prometheus
  registry served over HTTP at http://host:port/metrics. Instrument names are chosen so the
  exposed names are the ones deploy/ (dashboard, alerts) queries.
- `setup_tracing(service, instance, endpoint)`: an SDK TracerProvider exporting to an
  OTLP/gRPC collector, installed as the global provider. Off unless an endpoint is given
  (config `otlp_endpoint`, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / _ENDPOINT); off means
  OpenTelemetry's no-op tracer and nothing exported.
- `RpcTelemetry`: a grpc.aio server interceptor that times every RPC into
  `kvstore_rpc_duration_seconds{method}` and opens a server span that continues the
  caller's W3C trace context from the request metadata.
- `traced_channel(channel)` / `trace_metadata(md)`: the calling side, which adds the
  current trace context (traceparent, tracestate) to outgoing metadata.

Span attributes carry counts, bytes, tiers, tenant and node names: never token text or
token ids (block ids neither: they name prefixes).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from opentelemetry import propagate, trace

from kvstore.config import metrics_bind_host, read_token_file

log = logging.getLogger("kvstore.telemetry")

TRACER = trace.get_tracer("kvstore")
OTLP_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# 50 us .. 30 s: a Lookup is sub-millisecond, a large Get or a peer prefetch takes seconds.
RPC_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
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
)
# RPCs that are long-lived subscriptions: a duration or a span of hours says nothing.
LONG_LIVED = frozenset({"Subscribe", "Watch"})
_OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# Attributes gathered while one server RPC runs (pending_attributes); None when the RPC's
# span is not recording, so annotating costs one ContextVar read.
_pending: ContextVar[dict | None] = ContextVar("kvstore_span_pending", default=None)


class MetricsEndpoint:
    """OpenTelemetry metrics in a Prometheus registry of their own, served over HTTP.

    A private registry (not prometheus_client's global one) keeps two servers in one
    process (tests, the local cluster supervisor) from exposing each other's series.
    With `token`, a scrape must present `Authorization: Bearer <token>` (401 otherwise):
    the page holds every tenant's counts."""

    def __init__(
        self, host: str, port: int, resource: dict[str, str] | None = None, token: str = ""
    ) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import Resource
        from prometheus_client import CollectorRegistry, make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer

        if not 0 < port < 65536:
            raise ValueError(f"metrics port must be in 1..65535, got {port}")
        self.registry = CollectorRegistry(auto_describe=False)
        # No target_info / otel_scope_* labels: the dashboards aggregate by our labels only.
        reader = PrometheusMetricReader(
            disable_target_info=True, scope_info_enabled=False, registry=self.registry
        )
        self.provider = MeterProvider(
            metric_readers=[reader],  # close() shuts it down
            resource=Resource.create(resource or {}),
            shutdown_on_exit=False,
        )
        self.meter = self.provider.get_meter("kvstore")
        app = make_wsgi_app(self.registry)
        if token:
            app = _bearer_only(app, hashlib.sha256(token.encode()).digest())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        slots = _ScrapeSlots(METRICS_MAX_CONNECTIONS)

        class Server(ThreadingWSGIServer):
            address_family = family

            def process_request(self, request, client_address) -> None:
                if not slots.admit(request):  # every one mid-answer: refused
                    self.shutdown_request(request)
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.done(request)

        handler = type("_Handler", (_QuietHandler,), {"slots": slots})  # this port's
        try:
            self._server = make_server(host, port, app, Server, handler_class=handler)
        except OSError as exc:
            self.provider.shutdown()
            raise RuntimeError(f"could not serve metrics on {host}:{port}: {exc}") from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics", daemon=True
        )
        self._thread.start()
        self.host, self.port = host, self._server.server_port
        log.info(
            "metrics at http://%s:%d/metrics%s", host, self.port, " (bearer token)" if token else ""
        )

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        self.provider.shutdown()


# The metrics port's connections (one thread each): at most this many at once, and each
# closed when a read or write waits longer than METRICS_TIMEOUT_S. Before, a connection
# that sent nothing held its thread and descriptor for ever: 500 took an agent from 16
# to 517 threads, still there a minute later, and enough would take every descriptor of
# the process the metrics share with gRPC and RocksDB.
METRICS_MAX_CONNECTIONS = 64
METRICS_TIMEOUT_S = 10.0


class _ScrapeSlots:
    """The metrics port's open connections, at most `cap`: one over it takes the place
    of the connection waiting longest for its request (shut down: its read ends and its
    thread with it), as the gateway's connection limits do, so silent connections cannot
    keep a scraper out; only when every one is mid-answer is the newcomer closed."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._open = 0
        self._waiting: dict[socket.socket, None] = {}  # no request read yet, oldest first

    def admit(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._open >= self.cap:
                if not self._waiting:
                    return False
                oldest = next(iter(self._waiting))
                del self._waiting[oldest]
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            self._open += 1
            self._waiting[sock] = None
            return True

    def serving(self, sock: socket.socket) -> None:
        with self._lock:
            self._waiting.pop(sock, None)

    def done(self, sock: socket.socket) -> None:
        with self._lock:
            self._waiting.pop(sock, None)
            self._open -= 1


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_TIMEOUT_S  # on every read and write of the connection
    slots: _ScrapeSlots | None = None  # the port's (MetricsEndpoint's subclass)

    def log_message(self, format: str, *args) -> None:  # no line per scrape on stderr
        pass

    def handle(self) -> None:
        # A connection that timed out or was shut down to make room ends here, quietly
        # (socketserver would print a traceback per connection).
        with contextlib.suppress(OSError):
            super().handle()

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if self.slots is not None:
            self.slots.serving(self.connection)
        return parsed


def _bearer_only(app, token_sha256: bytes):
    """`app` for requests presenting the bearer token (its SHA-256 compared in constant
    time); 401 for any other."""

    def guarded(environ, start_response):
        scheme, _, credential = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        presented = hashlib.sha256(credential.strip().encode()).digest()
        if scheme.lower() == "bearer" and hmac.compare_digest(presented, token_sha256):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="metrics"')],
        )
        return [b"this metrics page needs its bearer token (metrics_token_file)\n"]

    return guarded


def otlp_endpoint(configured: str = "") -> str:
    """The OTLP trace endpoint in force: the config field, else the standard env vars."""
    if configured:
        return configured
    return next((os.environ[k] for k in OTLP_ENV if os.environ.get(k)), "")


def tracing_enabled() -> bool:
    """True once an SDK (recording) tracer provider is the global one."""
    return not isinstance(
        trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
    )


def setup_tracing(service: str, instance: str, endpoint: str = ""):
    """Install a TracerProvider exporting to OTLP/gRPC at `endpoint` (or the env's);
    returns it (shut it down at exit to flush), or None when tracing stays off."""
    endpoint = otlp_endpoint(endpoint)
    if not endpoint:
        return None
    if tracing_enabled():  # the embedding process configured tracing itself: keep it
        log.info("a tracer provider is already installed; not replacing it")
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(
        resource=Resource.create(  # the server's stop() shuts it down
            {"service.name": service, "service.instance.id": instance}
        ),
        shutdown_on_exit=False,
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    log.info("exporting traces to %s", endpoint)
    return provider


# ------------------------------------------------------------------ server side
def pending_attributes() -> dict | None:
    """The attributes the current server RPC's span will get when it ends (update it in
    place), or None when there is no recording span: check once, annotate in bulk."""
    return _pending.get()


# Called with (the request, or None when the call sent more than one message, response,
# seconds) after a unary response: how an agent or router turns an RPC into domain
# metrics and span attributes. (The shared edge serves unary methods as request streams,
# kvstore/grpc_edge.py: their one message is taken from the stream as it is read.)
Observer = Callable[[object, object, float], None]


class _Taken:
    """A request stream as the handler reads it, keeping its message while it sent one."""

    __slots__ = ("_it", "message", "count")

    def __init__(self, requests) -> None:
        self._it, self.message, self.count = aiter(requests), None, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        msg = await anext(self._it)
        self.count += 1
        self.message = msg if self.count == 1 else None
        return msg


class _Md:
    """TextMap getter over gRPC invocation metadata (a sequence of key/value pairs)."""

    @staticmethod
    def get(carrier, key):
        return [v for k, v in carrier if k == key] or None

    @staticmethod
    def keys(carrier):
        return [k for k, _ in carrier]


class ServiceTelemetry:
    """Tracing and, with `cfg.metrics_port`, a Prometheus endpoint for one server process
    (agent or router); subclasses add their metrics on `meter` (None when metrics are
    off) and their RPC interceptor."""

    def __init__(self, cfg, service: str, instance: str) -> None:
        self.tracer_provider = setup_tracing(service, instance, cfg.otlp_endpoint)
        self.endpoint: MetricsEndpoint | None = None
        self.meter = None
        if cfg.metrics_port:
            self.endpoint = MetricsEndpoint(
                metrics_bind_host(cfg.metrics_host, cfg.listen),
                cfg.metrics_port,
                {"service.name": service, "service.instance.id": instance},
                read_token_file("metrics_token_file", cfg.metrics_token_file),
            )
            self.meter = self.endpoint.meter

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()  # flushes spans still batched
            self.tracer_provider = None


class RpcTelemetry(grpc.aio.ServerInterceptor):
    """Times and traces every RPC but health checks and long-lived subscriptions.
    Put it first in the server's interceptor list so it also covers authentication."""

    def __init__(
        self,
        meter=None,
        attributes: dict | None = None,
        observers: dict[str, Observer] | None = None,
    ) -> None:
        self._hist = (
            None
            if meter is None
            else meter.create_histogram(
                "kvstore_rpc_duration_seconds",
                unit="s",
                description="Server time per RPC",
                explicit_bucket_boundaries_advisory=RPC_BUCKETS,
            )
        )
        self._attrs = dict(attributes or {})
        self._observers = dict(observers or {})
        self._labels: dict[str, dict[str, str]] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        name = details.method.rsplit("/", 1)[-1]
        if handler is None or name in LONG_LIVED or details.method.startswith(_OPEN_SERVICES):
            return handler
        labels = self._labels.get(name)
        if labels is None:
            labels = self._labels[name] = {"method": name}
        rpc = _Rpc(
            self,
            details.method,
            labels,
            details.invocation_metadata or (),
            self._observers.get(name),
        )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                rpc.unary(handler.unary_unary, True),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                rpc.stream(handler.unary_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                rpc.unary(handler.stream_unary, False),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            rpc.stream(handler.stream_stream),
            handler.request_deserializer,
            handler.response_serializer,
        )


class _Rpc:
    """One intercepted call: its span (when tracing) and its timing."""

    __slots__ = ("owner", "full_method", "labels", "metadata", "observer")

    def __init__(
        self,
        owner: RpcTelemetry,
        full_method: str,
        labels: dict,
        metadata,
        observer: Observer | None,
    ) -> None:
        self.owner, self.full_method, self.labels = owner, full_method, labels
        self.metadata, self.observer = metadata, observer

    @contextlib.contextmanager
    def _span(self):
        if not tracing_enabled():
            yield
            return
        parent = propagate.extract(self.metadata, getter=_Md)
        with TRACER.start_as_current_span(
            self.full_method,
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes=self.owner._attrs,
        ) as span:
            pending = {} if span.is_recording() else None
            token = _pending.set(pending)
            try:
                yield
            finally:
                _pending.reset(token)
                if pending:
                    span.set_attributes(pending)

    def _record(self, t0: float) -> None:
        if self.owner._hist is not None:
            self.owner._hist.record(time.perf_counter() - t0, self.labels)

    def _observe(self, request, response, t0: float) -> None:
        if self.observer is None:
            return
        try:
            self.observer(request, response, time.perf_counter() - t0)
        except Exception:  # a metrics bug must never fail the RPC it describes
            log.exception("metrics observer for %s failed", self.full_method)

    def unary(self, fn, unary_request: bool):
        async def handler(request, context):
            t0 = time.perf_counter()
            taken = None
            if not unary_request and self.observer is not None:
                request = taken = _Taken(request)
            try:
                with self._span():
                    response = await fn(request, context)
                    if self.observer is not None and response is not None:
                        seen = request if taken is None else taken.message
                        self._observe(seen, response, t0)
                    return response
            finally:
                self._record(t0)

        return handler

    def stream(self, fn):
        async def handler(request, context):
            t0 = time.perf_counter()
            try:
                with self._span():
                    async for item in fn(request, context):
                        yield item
            finally:
                self._record(t0)

        return handler


# ------------------------------------------------------------------ client side
def trace_metadata(metadata=None):
    """`metadata` plus the current trace context; unchanged when no span is active."""
    if not trace.get_current_span().get_span_context().is_valid:
        return metadata
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(metadata or ()) + tuple(carrier.items())


def annotate(attrs: dict) -> None:
    """Set attributes on the caller's current span (client side), if it records."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attrs)


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: tuple | None
    credentials: object
    wait_for_ready: bool | None
    compression: object


class _ContextInjector(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the caller's trace context to every call; the calls stay plain gRPC calls
    (a server stream is still a Call with cancel(), unlike wrapping it in a span)."""

    @staticmethod
    def _details(d):
        md = trace_metadata(d.metadata)
        if md is d.metadata:
            return d
        return _CallDetails(
            d.method,
            d.timeout,
            md,
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def traced_channel(channel: grpc.Channel) -> grpc.Channel:
    """A synchronous channel whose calls carry the caller's trace context."""
    return grpc.intercept_channel(channel, _ContextInjector())
