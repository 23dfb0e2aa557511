"""Where the gateway tokenizes a prompt: a large one on a worker thread, so the router's
event loop (which also serves gRPC and follows etcd and the engines' events) goes on
meanwhile; a small one inline, as the per-request fast path wants. A real Gateway
in-process, called as uvicorn calls it, with no engine registered (its answer is 503, or
400 for a prompt over max_prompt_tokens); "the loop went on" is seen as another task
having run while the request was served, which an inline call cannot allow."""

from __future__ import annotations

import asyncio
import json

import pytest

from loadtest.vllm_model import write_word_tokenizer
from router.gateway.app import TOKENIZE_INLINE_BYTES, Gateway
from router.gateway.config import ApiKeys, GatewayConfig
from router.gateway.engines import EngineSet
from router.gateway.plan import Planner
from router.gateway.prompt import PromptCodec
from router.routing import RouterCore
from router.scoring import Weights


@pytest.fixture
def gateway(tmp_path) -> Gateway:
    codec = PromptCodec.load(str(write_word_tokenizer(tmp_path / "tok")))
    planner = Planner(RouterCore(Weights()), {}, b"salt-key")
    cfg = GatewayConfig(max_prompt_tokens=50_000, max_body_bytes=1 << 20)
    return Gateway(cfg, planner, EngineSet(16, 5.0), {"tiny": codec}, ApiKeys({"k": "acme"}))


async def _serve(gateway: Gateway, body: dict) -> tuple[int, int]:
    """(status, turns another task got) for one POST /v1/chat/completions."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"authorization", b"Bearer k"), (b"content-length", b"%d" % len(raw))],
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    turns = 0

    async def other_work() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    other = asyncio.ensure_future(other_work())
    await asyncio.sleep(0)  # started, at its first await
    before = turns
    await gateway(scope, receive, send)
    during = turns - before
    other.cancel()
    await gateway.close()
    return sent[0]["status"], during


def _chat(words: int) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "w5 " * words}]}


def test_a_large_prompt_is_tokenized_off_the_event_loop(gateway):
    body = _chat(TOKENIZE_INLINE_BYTES // 3 + 100)
    assert len(json.dumps(body)) > TOKENIZE_INLINE_BYTES
    status, turns = asyncio.run(_serve(gateway, body))
    assert status == 503  # tokenized, planned, no engine to forward to
    assert turns > 0


def test_a_small_prompt_is_tokenized_inline(gateway):
    status, turns = asyncio.run(_serve(gateway, _chat(128)))
    assert (status, turns) == (503, 0)  # the whole refusal in one turn of the loop


def test_a_large_prompt_over_the_token_cap_is_refused_from_the_thread(gateway):
    status, turns = asyncio.run(_serve(gateway, _chat(60_000)))
    assert status == 400 and turns > 0
