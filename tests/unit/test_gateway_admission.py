"""One tenant's large prompts cannot take the gateway's tokenizing from the others: a
tenant's request counts against max_inflight_per_tenant from before its body is parsed
(before, only once forwarded: its prompts being tokenized counted nowhere), and large
prompts are tokenized on a small pool, max_tokenizing_per_tenant of one tenant at a time.
A real Gateway in-process with the real word tokenizer, called as uvicorn calls it, no
engine registered (a prompt tokenized and planned is answered 503). acme's tokenizations
are held in progress (a prompt starting with the word HOLD waits on the tokenizing thread
until the test releases it): the schedule is the test's, no timing is asserted."""

from __future__ import annotations

import asyncio
import json
import threading

from loadtest.vllm_model import write_word_tokenizer
from router.gateway.app import TOKENIZE_INLINE_BYTES, Gateway
from router.gateway.config import ApiKeys, GatewayConfig
from router.gateway.engines import EngineSet
from router.gateway.plan import Planner
from router.gateway.prompt import PromptCodec
from router.routing import RouterCore
from router.scoring import Weights


class HeldCodec:
    """The real codec; a prompt starting with HOLD is tokenized once `release` is set."""

    def __init__(self, codec: PromptCodec) -> None:
        self.codec = codec
        self.release = threading.Event()
        self.held = 0  # tokenizations waiting on `release` now

    def completion_ids(self, prompt):
        if isinstance(prompt, str) and prompt.startswith("HOLD"):
            self.held += 1
            self.release.wait(120)
            self.held -= 1
        return self.codec.completion_ids(prompt)

    def __getattr__(self, name):
        return getattr(self.codec, name)


async def _post(gateway: Gateway, key: str, prompt: str) -> int:
    raw = json.dumps({"model": "tiny", "prompt": prompt}).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"authorization", b"Bearer " + key.encode())],
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await gateway(scope, receive, send)
    return sent[0]["status"]


async def _until(pred, what: str) -> None:
    for _ in range(12_000):  # a hang guard, not a timing: each turn yields to the loop
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def test_another_tenant_is_served_while_one_tenants_tokenizing_fills_its_admission(tmp_path):
    codec = HeldCodec(PromptCodec.load(str(write_word_tokenizer(tmp_path / "tok"))))
    cfg = GatewayConfig(max_prompt_tokens=50_000, max_body_bytes=1 << 20, max_inflight_per_tenant=4)
    gateway = Gateway(
        cfg,
        Planner(RouterCore(Weights()), {}, b"salt-key"),
        EngineSet(16, 5.0),
        {"tiny": codec},  # type: ignore[dict-item]
        ApiKeys({"key-acme": "acme", "key-globex": "globex"}),
    )
    big = "w5 " * (TOKENIZE_INLINE_BYTES // 3 + 100)  # over the inline size: on the pool

    async def main() -> None:
        try:
            await scenario()
        finally:
            codec.release.set()  # a failed check leaves no thread held

    async def scenario() -> None:
        acme = [asyncio.ensure_future(_post(gateway, "key-acme", "HOLD " + big)) for _ in range(8)]
        await _until(lambda: codec.held == 1, "acme's first prompt being tokenized")
        # acme has 4 requests admitted (1 tokenizing, 3 waiting their turn): the other 4
        # are refused before their bodies are even parsed.
        await _until(lambda: sum(t.done() for t in acme) == 4, "acme's requests over its cap")
        assert sorted(t.result() for t in acme if t.done()) == [429] * 4
        # globex's large prompt is tokenized and planned meanwhile (no engine: 503), and
        # its small one inline.
        assert await _post(gateway, "key-globex", big) == 503
        assert await _post(gateway, "key-globex", "w5 w6") == 503
        assert codec.held == 1 and sum(t.done() for t in acme) == 4  # acme's still held
        codec.release.set()
        assert sorted(await asyncio.gather(*acme)) == [429] * 4 + [503] * 4
        assert not gateway.admission.preparing and not gateway.tenant_inflight
        await gateway.close()

    asyncio.run(main())
