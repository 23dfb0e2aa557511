"""The gateway's HTTP API (Starlette): POST /v1/completions and /v1/chat/completions
(streaming SSE or not), GET /v1/models, /health and /metrics.

Per request: authenticate the API key (401), validate the body (400/404/413) before any
work, tokenize (a large prompt on a worker thread), plan (router/gateway/plan.py), pick an
engine (engines.py: 429 with Retry-After when every engine is full), set `cache_salt` from
the tenant and drop the caller's connector parameters (whatever the caller sent), and
forward with aiohttp. The client's answer waits for the engine's head and first body
bytes (vLLM sends a stream's head before its first token): a forward that fails before
them (transport, or a 502/503/504 answer) is retried once on the next choice, and only a
transport failure (or a redirect, not followed) suspends the engine; no first bytes within
request_timeout_s is the request's own 504; any other answer, a 500 included, goes back
byte for byte with the engine's status and content type. Engines are reached through one
shared keep-alive connection pool (upstream.py). The engine's first body bytes mark
prefill done; the end of the answer, or the client going away (watched while the engine
works, too), releases the request and closes the engine's.

The two forwarding routes are plain ASGI callables that `Gateway.__call__` (what uvicorn
serves) reaches without Starlette's middleware, routing, Request and Response objects:
those cost about 20 us of the router's CPU per request (in-process, 20000 calls: 23-25 us
against 2.5 for the same work as a plain ASGI callable), on a host where the gateway's
whole own work is a few hundred. Starlette keeps the other routes and the same two
(their 405 for other methods); streamed answers go out through Starlette's
StreamingResponse, which watches for the client going away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from router.gateway.admission import Admission
from router.gateway.body import BadBody, check_fields, choices, counted, read_json
from router.gateway.config import ApiKeys, GatewayConfig, Grant, ReloadingApiKeys
from router.gateway.engines import EngineSet, EngineState
from router.gateway.metrics import GatewayMetrics
from router.gateway.plan import Plan, Planner
from router.gateway.prompt import BadPrompt, PromptCodec
from router.gateway.upstream import EngineAnswer, Upstream, UpstreamError

__all__ = ["Gateway"]

log = logging.getLogger("kvstore.gateway")

ENGINE_HEADER = "x-kvstore-engine"  # which engine answered: the demo and tests print it
ROUTE_HEADER = "x-kvstore-route"  # where the router priced its blocks (Planner.priced)
_FORWARDED = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat
# Only the gateway talks to an engine's connector (its peer hint): these go from the
# caller's body, at the top level and inside vllm_xargs, which vLLM copies into the same
# place (the request's extra_args). A caller's malformed one fails the request on the
# engine (500), and must not even reach it.
CONNECTOR_FIELDS = ("kv_transfer_params", "ec_transfer_params")
# An engine's answers that mean "not now" rather than "this request failed": the next
# choice may take the request. A 500 is this request's own answer: the caller gets it.
_RETRY_STATUSES = frozenset((502, 503, 504))
# A request body over this many bytes is tokenized on a worker thread: the event loop also
# serves the router's gRPC and follows etcd and the engines' events, and tokenizing a
# 4 MiB prompt held it 0.5-2.6 s (2-core host, load ~4; on a thread the loop went on,
# its longest gap 44 ms). Below it (~2000 words), inline costs the loop at most ~1-2 ms,
# and a bench-sized prompt (128 words: ~0.1-0.3 ms) no thread hop (~0.08 ms).
TOKENIZE_INLINE_BYTES = 8 << 10
# How long the gateway waits on an engine before it watches for the client going away.
WATCH_AFTER_S = 0.05


class HTTPFailure(Exception):
    def __init__(self, status: int, message: str, kind: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


class _Failed(Exception):
    """A forward that failed before any of its answer reached the client, so the next
    choice may take it. `suspend`: the engine itself failed (its transport), not only
    this request: it is skipped for engine_suspend_s."""

    def __init__(self, reason: str, suspend: bool) -> None:
        super().__init__(reason)
        self.suspend = suspend


def strip_connector_fields(body: dict[str, Any]) -> None:
    """Drop the caller's connector parameters (CONNECTOR_FIELDS), top level and in
    vllm_xargs (a vllm_xargs that is not an object the engine refuses by itself)."""
    for name in CONNECTOR_FIELDS:
        body.pop(name, None)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and any(name in xargs for name in CONNECTOR_FIELDS):
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k not in CONNECTOR_FIELDS}


class ClientWatch:
    """Watches for the client going away while the gateway waits on an engine (its head
    and first bytes can take a whole prefill, or a whole answer when not streamed): once
    the request's body is read, the server's receive() returns http.disconnect when the
    connection drops. The waiting task is cancelled then, which closes the engine's
    request (vLLM aborts it) and releases the request at once.

    The watching task starts only once the wait has lasted WATCH_AFTER_S: an engine that
    answers sooner costs a timer (~4 us), not a task started and cancelled (~20-35 us of
    the router's CPU, measured in-process on this 2-core host at load ~4), and a client
    gone is noticed WATCH_AFTER_S late at most."""

    __slots__ = ("gone", "_receive", "_waiter", "_timer", "_task")

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._receive = receive
        self._waiter = asyncio.current_task()
        self._task: asyncio.Future[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if self._waiter is not None:
            self.gone = True
            self._waiter.cancel()

    def stop(self) -> None:
        """From here on the answer's own sending notices a client gone."""
        self._waiter = None
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


_METRICS_ELSEWHERE = (
    "the gateway's metrics are on the router's Prometheus port (metrics_port), not on the "
    "tenants' port; public_metrics: true serves them here too"
)


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """An error as OpenAI's API words it (what its clients parse)."""
    return {"error": {"message": message, "type": kind, "code": status}}


def _error(exc: HTTPFailure) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.kind), exc.status, exc.headers)


async def _no_route(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such path: 404; another method: 405, with its Allow
    header) in the same JSON as the gateway's other errors, not Starlette's plain text."""
    http = cast(HTTPException, exc)  # registered for HTTPException only
    kind = "not_found_error" if http.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {http.detail}"
    body = error_body(http.status_code, message, kind)
    return JSONResponse(body, http.status_code, dict(http.headers or {}))


def _header(scope: Scope, name: bytes) -> str:
    """The first `name` header of the request (lower case, as the server gives them), as
    Starlette's Headers.get reads it; "" when absent."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return ""


class Answer:
    """A whole (not streamed) answer as two ASGI messages: what Starlette's Response
    sends, without building one per request."""

    __slots__ = ("status_code", "_start", "_body")

    def __init__(self, content: bytes, status_code: int, headers: list[tuple[bytes, bytes]]):
        self.status_code = status_code
        if status_code >= 200 and status_code not in (204, 304):  # as Starlette's Response
            headers.append((b"content-length", b"%d" % len(content)))
        self._start: Message = {
            "type": "http.response.start",
            "status": status_code,
            "headers": headers,
        }
        self._body: Message = {"type": "http.response.body", "body": content}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(self._start)
        await send(self._body)


class _Plain:
    """An ASGI callable that Starlette mounts as it is (a function or method it would
    call with a Request)."""

    __slots__ = ("_app",)

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


class Forwarded(StreamingResponse):
    """The engine's streamed answer; `closer` runs however the stream ends (done, the
    client gone, an error), so the request is always released."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        closer: Callable[[], Awaitable[None]],
        status_code: int,
        headers: dict[str, str],
    ) -> None:
        super().__init__(chunks, status_code, headers=headers)
        self._closer = closer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._closer()


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        planner: Planner,
        engines: EngineSet,
        codecs: dict[str, PromptCodec],
        keys: ApiKeys | ReloadingApiKeys,
        metrics: GatewayMetrics | None = None,
        upstream: Upstream | None = None,
    ) -> None:
        self.cfg, self.planner, self.engines = cfg, planner, engines
        self.codecs, self.keys = codecs, keys
        self.metrics = metrics or GatewayMetrics()
        self.http = upstream or Upstream(cfg.connect_timeout_s, cfg.request_timeout_s)
        self.tenant_inflight: Counter[str] = Counter()  # requests forwarded, not yet released
        self.admission = Admission(cfg.tokenize_threads, cfg.max_tokenizing_per_tenant)
        forwarding = _Plain(self.forwarding)
        self.routes = Starlette(
            routes=[
                Route("/v1/completions", forwarding, methods=["POST"]),
                Route("/v1/chat/completions", forwarding, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_page, methods=["GET"]),
            ],
            exception_handlers={HTTPException: _no_route},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app the server runs: a POST to a forwarding route goes straight to it,
        anything else through Starlette."""
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in _FORWARDED:
            await self.forwarding(scope, receive, send)
        else:
            await self.routes(scope, receive, send)

    async def close(self) -> None:
        await self.http.aclose()
        self.admission.close()

    # ------------------------------------------------------------ plain routes
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "engines": len(self.engines.engines)})

    async def metrics_page(self, request: Request) -> Response:
        if not self.cfg.public_metrics:
            return _error(HTTPFailure(404, _METRICS_ELSEWHERE, "not_found"))
        page = self.metrics.render(self.planner.engine_blocks())
        return Response(page, media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        try:
            grant = self._grant(request.headers.get("authorization", ""))
        except HTTPFailure as exc:
            return _error(exc)
        served = sorted(
            {m for s in self.engines.engines.values() for m in s.record.models if grant.allows(m)}
        )
        data = [{"id": m, "object": "model", "owned_by": "kvstore"} for m in served]
        return JSONResponse({"object": "list", "data": data})

    # ------------------------------------------------------------ validation
    def _grant(self, auth: str) -> Grant:
        """The API key's grant: its tenant, and the models it may use (checked once the
        body names one)."""
        scheme, _, key = auth.partition(" ")
        grant = self.keys.grant(key.strip()) if scheme.lower() == "bearer" else None
        if grant is None:
            raise HTTPFailure(401, "missing or unknown API key", "authentication_error")
        return grant

    async def _body(
        self, scope: Scope, receive: Receive, tenant: str
    ) -> tuple[dict[str, Any], int] | None:
        """The request's JSON object and its size in bytes; None when the client went away
        before sending it."""
        limit = self.cfg.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HTTPFailure(413, f"body over {limit} bytes", "invalid_request_error")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise HTTPFailure(413, f"body over {limit} bytes", "invalid_request_error")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:  # a big body is read off the loop, as it is tokenized (~50 ns per JSON value)
            body = (
                read_json(raw)
                if size <= TOKENIZE_INLINE_BYTES
                else await self.admission.run(tenant, lambda: read_json(raw))
            )
            return body, size
        except BadBody as exc:
            raise HTTPFailure(400, str(exc), "invalid_request_error") from None

    def _codec(self, body: dict[str, Any]) -> tuple[str, PromptCodec]:
        """The model and its codec, and the fields checked, before admission."""
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise HTTPFailure(400, "model is required", "invalid_request_error")
        codec = self.codecs.get(model)
        if codec is None:
            raise HTTPFailure(404, f"model {model!r} is not served here", "not_found_error")
        try:
            check_fields(body, self.cfg.max_choices, self.cfg.caller_priority)
        except BadBody as exc:
            raise HTTPFailure(400, str(exc), "invalid_request_error") from None
        return model, codec

    async def _tokens(
        self, body: dict[str, Any], codec: PromptCodec, chat: bool, size: int, tenant: str
    ) -> list[int]:
        if chat:
            gen = bool(body.get("add_generation_prompt", True))
            messages = body.get("messages")
            work = lambda: codec.chat_ids(messages, gen)  # noqa: E731
        else:
            prompt = body.get("prompt")
            work = lambda: codec.completion_ids(prompt)  # noqa: E731
        try:
            if size <= TOKENIZE_INLINE_BYTES:
                ids = work()
            else:
                ids = await self.admission.run(tenant, work)
        except BadPrompt as exc:
            raise HTTPFailure(400, str(exc), "invalid_request_error") from None
        if not ids:
            raise HTTPFailure(400, "the prompt has no tokens", "invalid_request_error")
        if len(ids) > self.cfg.max_prompt_tokens:
            raise HTTPFailure(
                400, f"prompt over {self.cfg.max_prompt_tokens} tokens", "invalid_request_error"
            )
        return ids

    # ------------------------------------------------------------ the proxy
    async def forwarding(self, scope: Scope, receive: Receive, send: Send) -> None:
        """POST /v1/completions and /v1/chat/completions (plain ASGI)."""
        path = scope["path"]
        resp = await self._serve(scope, receive, path, _FORWARDED[path])
        if resp is not None:
            await resp(scope, receive, send)

    async def _serve(
        self, scope: Scope, receive: Receive, path: str, chat: bool
    ) -> Answer | Response | None:
        t0 = time.perf_counter()
        try:
            grant = self._grant(_header(scope, b"authorization"))
            tenant = grant.tenant
            # Before the body is parsed or its prompt tokenized, and counted from here
            # (router/gateway/admission.py).
            self._admit(tenant)
            with self.admission.prepare(tenant) as prepared:
                read = await self._body(scope, receive, tenant)
                if read is None:
                    return None  # nothing to answer: the client is gone
                body, size = read
                self._permit(grant, body.get("model"))
                model, codec = self._codec(body)
                sequences = choices(body)
                # Its other choices count from here too, before its prompt is tokenized.
                more = self._tenant_weight(sequences) - 1
                if more:
                    self._admit(tenant, more, sequences)
                    prepared(more)
                ids = await self._tokens(body, codec, chat, size, tenant)
                plan = self.planner.plan(self.engines.namespace_of(model), ids, tenant, model)
                plan = dataclasses.replace(plan, weight=sequences)
            # Server-side, always: a caller must not pick (or probe) another's salt, nor
            # talk to the connector directly.
            body["cache_salt"] = plan.salt
            strip_connector_fields(body)
            resp = await self._forward(path, model, body, plan, t0, receive)
        except HTTPFailure as exc:
            self.metrics.requests.labels(path, str(exc.status)).inc()
            if exc.status == 429:
                self.metrics.saturated.inc()
            return _error(exc)
        if resp is None:
            return None  # the client went away while the engine worked
        self.metrics.requests.labels(path, str(resp.status_code)).inc()
        return resp

    def _permit(self, grant: Grant, model: Any) -> None:
        """Before tokenizing: a key limited to some models asks for another (403)."""
        if isinstance(model, str) and model and not grant.allows(model):
            raise HTTPFailure(403, f"this API key may not use model {model!r}", "permission_error")

    def _admit(self, tenant: str, more: int = 1, sequences: int = 1) -> None:
        """Room for `more` of the tenant's in-flight cap: 1 as a request arrives, before
        its body is read; then its other choices (`sequences` in all), once it is."""
        cap = self.cfg.max_inflight_per_tenant
        if cap and self.tenant_inflight[tenant] + self.admission.preparing[tenant] + more > cap:
            asks = f"; this one asks {sequences} choices, counted as {more + 1}"
            raise HTTPFailure(
                429,
                f"this API key's tenant is at its cap of {cap} requests in flight (a request "
                f"of n choices counts as n{asks if sequences > 1 else ''}); retry later",
                "rate_limit_error",
                {"Retry-After": str(self.cfg.retry_after_s)},
            )

    def _tenant_weight(self, sequences: int) -> int:
        """What a request of `sequences` choices counts against max_inflight_per_tenant
        (body.counted)."""
        return counted(sequences, self.cfg.max_inflight_per_tenant)

    def _choose(self, model: str, plan: Plan, tried: set[str]) -> EngineState:
        pick = self.engines.pick(
            model, self.cfg.policy, plan.engines, plan.first_block, tried, plan.weight
        )
        if pick.engine is not None:
            return pick.engine
        if pick.saturated:
            raise HTTPFailure(
                429,
                "every engine serving this model is at its in-flight limit"
                + (
                    f" for a request of {plan.weight} choices (counted as "
                    f"{self.engines.weight(plan.weight)})"
                    if plan.weight > 1
                    else ""
                )
                + "; retry later",
                "rate_limit_error",
                {"Retry-After": str(self.cfg.retry_after_s)},
            )
        if tried:
            raise HTTPFailure(502, "the engines chosen failed before answering", "api_error")
        raise HTTPFailure(503, f"no engine serves {model!r} now", "api_error")

    def _request_body(self, body: dict[str, Any], plan: Plan, st: EngineState) -> bytes:
        hint = self.planner.peer_hint(plan, st.record.engine_id)
        if hint is not None:
            # The connector starts pulling before prefill (kv_transfer_params reach it).
            body = dict(body, kv_transfer_params=hint)
        return json.dumps(body).encode()

    async def _forward(
        self, path: str, model: str, body: dict, plan: Plan, t0: float, receive: Receive
    ) -> Answer | Response | None:
        """To the plan's first free engine, and once more to the next one when that fails
        before any of its answer reached the client; None when the client went away
        meanwhile (the engine's request closed, the request released)."""
        tried: set[str] = set()
        watch: ClientWatch | None = None
        try:
            while True:
                st = self._choose(model, plan, tried)
                watch = watch or ClientWatch(receive)
                try:
                    return await self._attempt(path, body, plan, st, t0, bool(tried))
                except _Failed as failure:
                    self._failed(st, plan, failure, tried)
        except asyncio.CancelledError:
            if watch is None or not watch.gone:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the watch's cancel, not the server's
            return None
        finally:
            if watch is not None:
                watch.stop()

    def _failed(self, st: EngineState, plan: Plan, failure: _Failed, tried: set[str]) -> None:
        if failure.suspend:
            self.engines.suspend(st)
        log.warning(
            "engine %s failed request %s before answering (%s)",
            st.record.engine_id,
            plan.request_id,
            failure,
        )
        if tried:  # once: a second failure is the client's answer
            raise HTTPFailure(502, "the engines chosen failed before answering", "api_error")
        tried.add(st.record.engine_id)
        self.metrics.retries.inc()

    async def _attempt(
        self, path: str, body: dict, plan: Plan, st: EngineState, t0: float, last: bool
    ) -> Answer | Response:
        """One forward to `st`, held until its answer can be committed to: the engine's
        head and its first body bytes (the whole body when not streamed). _Failed: none
        of it reached the client; `last`: a 502/503/504 is the client's answer then. The
        request is released whatever is raised, the client gone included."""
        self._hold(st, plan)
        # No x-request-id of ours: vLLM would name its answer after it, and the
        # answer must be what the engine says to this request as sent.
        content = self._request_body(body, plan, st)
        upstream: EngineAnswer | None = None
        try:
            try:
                upstream = await self.http.post(st.record.url + path, content)
                if upstream.status_code in _RETRY_STATUSES and not last:
                    raise _Failed(f"HTTP {upstream.status_code}", suspend=False)
                if 300 <= upstream.status_code < 400:  # not followed (upstream.py)
                    raise _Failed(f"HTTP {upstream.status_code}, a redirect", suspend=True)
                streamed = upstream.content_type.startswith("text/event-stream")
                first = await (upstream.first_chunk() if streamed else upstream.aread())
            except UpstreamError as exc:
                if exc.read_timeout:
                    # The engine took the request and is still at it (a long answer, not
                    # streamed): this request's own answer, like a 500. Suspending the
                    # engine and retrying let one tenant's slow requests take every engine
                    # from the others (503), and ran the request twice. A hung engine
                    # fails its registrar's health check instead.
                    log.warning(
                        "engine %s sent nothing of request %s's answer for %g s "
                        "(request_timeout_s): 504",
                        st.record.engine_id,
                        plan.request_id,
                        self.cfg.request_timeout_s,
                    )
                    raise HTTPFailure(
                        504,
                        f"the engine sent nothing for {self.cfg.request_timeout_s:g} s "
                        "(request_timeout_s); ask for fewer tokens, or stream the answer",
                        "timeout_error",
                    ) from None
                raise _Failed(str(exc), suspend=True) from None
        except BaseException:
            if upstream is not None:
                await upstream.aclose()  # before its end: drops the connection, aborts it
            self._done(st, plan)
            raise
        self._first_byte(plan, t0)
        self.metrics.forwards.labels(st.record.engine_id).inc()
        if streamed:
            return self._streamed(upstream, st, plan, first)
        await upstream.aclose()
        self._done(st, plan)
        return self._whole(upstream, st, plan, first)

    def _hold(self, st: EngineState, plan: Plan) -> None:
        self.engines.acquire(st, plan.weight)
        self.planner.hold(plan, st.record)
        self.metrics.inflight.inc()
        self.tenant_inflight[plan.tenant] += self._tenant_weight(plan.weight)

    def _done(self, st: EngineState, plan: Plan) -> None:
        self.engines.release(st, plan.weight)
        self.planner.release(plan)
        self.metrics.inflight.dec()
        self.tenant_inflight[plan.tenant] -= self._tenant_weight(plan.weight)
        if self.tenant_inflight[plan.tenant] <= 0:
            del self.tenant_inflight[plan.tenant]

    def _whole(self, upstream: EngineAnswer, st: EngineState, plan: Plan, content: bytes) -> Answer:
        engine_id = st.record.engine_id
        head = [
            (ENGINE_HEADER.encode(), engine_id.encode("latin-1")),
            (ROUTE_HEADER.encode(), self.planner.priced(plan, engine_id).encode("latin-1")),
            (b"content-type", upstream.content_type.encode("latin-1")),
        ]
        return Answer(content, upstream.status_code, head)

    def _streamed(
        self, upstream: EngineAnswer, st: EngineState, plan: Plan, first: bytes
    ) -> Forwarded:
        """The engine's stream from its first bytes (already read) on; released however
        it ends."""

        async def close() -> None:
            await upstream.aclose()  # a client gone aborts the engine's request too
            self._done(st, plan)

        async def chunks() -> AsyncIterator[bytes]:
            if first:
                yield first
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except UpstreamError as exc:  # mid-stream: the bytes sent cannot be retried
                log.warning(
                    "engine %s broke off request %s: %s", st.record.engine_id, plan.request_id, exc
                )

        engine_id = st.record.engine_id
        headers = {
            ENGINE_HEADER: engine_id,
            ROUTE_HEADER: self.planner.priced(plan, engine_id),
            "content-type": upstream.content_type,
        }
        return Forwarded(chunks(), close, upstream.status_code, headers)

    def _first_byte(self, plan: Plan, t0: float) -> None:
        self.planner.prefill_done(plan)
        self.metrics.first_byte.observe(time.perf_counter() - t0)
