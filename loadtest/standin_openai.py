"""A stand-in OpenAI worker (Starlette + uvicorn): canned answers at once, so that what a
benchmark measures in front of it is the gateway (loadtest/bench_gateway.py), and so the
gateway's tests can see what it forwarded (GET /seen) and make a worker fail.

    python -m loadtest.standin_openai --port 0 --ready-file F [--name w0] [--fail-status 500]
        [--ssl-certfile C --ssl-keyfile K [--ssl-ca-certs CA]]   # HTTPS, vLLM's flags

With --ssl-ca-certs, clients must present a certificate from that CA (vLLM's
`--ssl-ca-certs` with `--ssl-cert-reqs 2`).

A request may carry, for the tests:
- `"standin_delay_s": x`: wait that long before answering (to hold requests in flight);
  the wait ends when the client goes away, as vLLM aborts a request whose client left,
  and /seen marks the request `"gone": true`;
- `"standin_chunks": n`: SSE chunks (default 4);
- `"standin_status": s`: answer HTTP s with an error body (a request the engine fails);
- `"standin_gate": tag`: a streamed answer's head goes out at once, as vLLM's does, then
  it waits for `POST /step/{tag}` before its first chunk and again before the rest;
- `"standin_die_after_head": [names]`: the workers named send the answer's head and
  exit at once (an engine that dies before its first token).
As vLLM does, a `kv_transfer_params` (top level, else in `vllm_xargs`) that is not an
object fails the request with 500: vLLM's connector reads it as one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def make_app(name: str, fail_status: int = 0) -> Starlette:
    seen: list[dict] = []
    gates: dict[str, asyncio.Semaphore] = {}

    def gate(tag: str) -> asyncio.Semaphore:
        return gates.setdefault(tag, asyncio.Semaphore(0))

    async def complete(request: Request) -> Response:
        body = await request.json()
        entry = {
            "path": request.url.path,
            "model": body.get("model"),
            "cache_salt": body.get("cache_salt"),
            "kv_transfer_params": body.get("kv_transfer_params"),
            "ec_transfer_params": body.get("ec_transfer_params"),
            "vllm_xargs": body.get("vllm_xargs"),
            "n": body.get("n"),
            "priority": body.get("priority"),
        }
        seen.append(entry)
        if fail_status:
            return JSONResponse({"error": {"message": "stand-in failure"}}, fail_status)
        if body.get("standin_location"):  # an engine redirecting (the gateway must not follow)
            return Response(b"", 307, headers={"location": str(body["standin_location"])})
        status = int(body.get("standin_status", 0)) or _vllm_refusal(body)
        if status:
            return JSONResponse({"error": {"message": f"stand-in: HTTP {status}"}}, status)
        if await _client_left(request, float(body.get("standin_delay_s", 0))):
            entry["gone"] = True
            return Response(b"")
        n = int(body.get("standin_chunks", 4))
        if body.get("stream"):
            tag = body.get("standin_gate")
            dies = name in body.get("standin_die_after_head", ())
            chunks = _sse(name, n, gate(tag) if tag else None, dies)
            return StreamingResponse(chunks, media_type="text/event-stream")
        text = " ".join(f"{name}-{i}" for i in range(n))
        usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
        return JSONResponse(
            {
                "id": "cmpl-standin",
                "object": "text_completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": usage,
            }
        )

    async def step(request: Request) -> Response:
        gate(request.path_params["tag"]).release()
        return Response(b"")

    async def seen_page(request: Request) -> Response:
        return JSONResponse(seen)

    async def health(request: Request) -> Response:
        return Response(b"")

    return Starlette(
        routes=[
            Route("/v1/completions", complete, methods=["POST"]),
            Route("/v1/chat/completions", complete, methods=["POST"]),
            Route("/step/{tag}", step, methods=["POST"]),
            Route("/seen", seen_page),
            Route("/health", health),
        ]
    )


def _vllm_refusal(body: dict) -> int:
    """What vLLM answers for the request's kv_transfer_params: 400 when the top-level one
    or vllm_xargs is not an object (its request validation); else it hands the top-level
    one, or vllm_xargs' when that is absent, to its KV connector, which reads it as an
    object: anything else fails the request with 500."""
    top, xargs = body.get("kv_transfer_params"), body.get("vllm_xargs")
    if (top is not None and not isinstance(top, dict)) or (
        xargs is not None and not isinstance(xargs, dict)
    ):
        return 400
    params = top or (xargs or {}).get("kv_transfer_params")
    return 500 if params is not None and not isinstance(params, dict) else 0


async def _client_left(request: Request, delay: float) -> bool:
    """Wait `delay` seconds, or less when the client goes away (True then): what vLLM's
    with_cancellation does for its routes."""
    if delay <= 0:
        return False

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    done, _ = await asyncio.wait({watch}, timeout=delay)
    watch.cancel()
    return bool(done)


async def _sse(
    name: str, n: int, gate: asyncio.Semaphore | None = None, dies: bool = False
) -> AsyncIterator[bytes]:
    if dies:  # the head is written: the engine dies before its first token
        await asyncio.sleep(0.1)
        os._exit(1)
    for i in range(n):
        if gate is not None and i in (0, 1):
            await gate.acquire()
        chunk = {"id": "cmpl-standin", "choices": [{"index": 0, "text": f"{name}-{i} "}]}
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ready-file", required=True, help="gets host:port once listening")
    ap.add_argument("--name", default="standin")
    ap.add_argument("--fail-status", type=int, default=0)
    ap.add_argument("--ssl-certfile", default=None)
    ap.add_argument("--ssl-keyfile", default=None)
    ap.add_argument("--ssl-ca-certs", default=None)
    a = ap.parse_args()
    tls: dict = {}
    if a.ssl_certfile:
        tls = {"ssl_certfile": a.ssl_certfile, "ssl_keyfile": a.ssl_keyfile}
    if a.ssl_ca_certs:
        tls |= {"ssl_ca_certs": a.ssl_ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    # IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only for TCP sockets.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((a.host, a.port))
    app = make_app(a.name, a.fail_status)
    cfg = uvicorn.Config(app, log_level="warning", access_log=False, **tls)
    server = uvicorn.Server(cfg)
    host, port = sock.getsockname()[:2]

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        tmp = a.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{host}:{port}\n")
        os.replace(tmp, a.ready_file)
        await task

    asyncio.run(serve())


if __name__ == "__main__":
    main()
