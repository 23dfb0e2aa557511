"""The gateway's HTTP edge against stand-in OpenAI workers (loadtest/standin_openai.py):
a real router process serving the gateway, real etcd, the real registrar (and, for the
router's view of a request's lifetime, an agent). What vLLM itself does behind the
gateway is tests/integration/test_gateway_vllm.py."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from support.common import wait_for
from support.gateway import World, write_word_tokenizer

MODEL = "tiny"
ACME = {"authorization": "Bearer key-acme"}
GLOBEX = {"authorization": "Bearer key-globex"}


@pytest.fixture
def tokenizer_dir(tmp_path):
    return str(write_word_tokenizer(tmp_path / "tok"))


def _wait_engines(gw, n: int) -> None:
    wait_for(lambda: gw.engines() == n, 30, 0.1, what=f"{n} engines in the gateway")


def _chat(text: str = "w5 w6 w7", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def test_unknown_or_missing_key_is_401_and_nothing_is_forwarded(
    start_gateway, start_standin, tokenizer_dir
):
    gw = start_gateway({MODEL: tokenizer_dir})
    w = start_standin("w0", MODEL)
    _wait_engines(gw, 1)
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "key-acme"}):
        r = httpx.post(gw.url + "/v1/chat/completions", json=_chat(), headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(gw.url + "/v1/models").status_code == 401
    assert w.seen() == []
    assert "key-acme" not in gw.log and "nope" not in gw.log


def test_bad_requests_get_precise_statuses_before_any_forward(
    start_gateway, start_standin, tokenizer_dir
):
    gw = start_gateway({MODEL: tokenizer_dir}, {"max_body_bytes": 4096})
    w = start_standin("w0", MODEL)
    _wait_engines(gw, 1)
    url = gw.url + "/v1/chat/completions"
    cases = [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (json.dumps({"messages": [{"role": "user", "content": "w1"}]}).encode(), 400),
        (json.dumps(_chat() | {"messages": []}).encode(), 400),
        (json.dumps(_chat() | {"messages": ["w1"]}).encode(), 400),
        (json.dumps(_chat(stream="yes")).encode(), 400),
        (json.dumps(_chat() | {"model": "other"}).encode(), 404),
        (json.dumps(_chat("w1 " * 3000)).encode(), 413),
    ]
    for body, status in cases:
        r = httpx.post(url, content=body, headers=ACME | {"content-type": "application/json"})
        assert r.status_code == status, (body[:40], r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(
        gw.url + "/v1/completions", json={"model": MODEL, "prompt": {"a": 1}}, headers=ACME
    )
    assert r.status_code == 400
    assert w.seen() == []


def test_unknown_paths_and_methods_are_openai_style_json_errors(start_gateway, tokenizer_dir):
    """Before the fix these were Starlette's plain text ("Not Found", "Method Not
    Allowed"), unlike the gateway's other errors."""
    gw = start_gateway({MODEL: tokenizer_dir})
    cases = [
        ("GET", "/v1/nope", 404, "not_found_error"),
        ("POST", "/", 404, "not_found_error"),
        ("GET", "/v1/chat/completions", 405, "invalid_request_error"),
        ("DELETE", "/v1/models", 405, "invalid_request_error"),
    ]
    for method, path, status, kind in cases:
        r = httpx.request(method, gw.url + path, headers=ACME)
        assert r.status_code == status and r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert (error["code"], error["type"]) == (status, kind), error
        assert error["message"].startswith(f"{method} {path}: "), error
    r = httpx.get(gw.url + "/v1/completions")
    assert r.headers["allow"] == "POST"


def test_cache_salt_is_the_tenants_whatever_the_caller_sends(
    start_gateway, start_standin, tokenizer_dir
):
    gw = start_gateway({MODEL: tokenizer_dir})
    w = start_standin("w0", MODEL)
    _wait_engines(gw, 1)
    url = gw.url + "/v1/chat/completions"
    evil = {"cache_salt": "globex-salt", "kv_transfer_params": {"kvstore": {"peer_node": "x"}}}
    for headers, extra in ((ACME, {}), (ACME, evil), (GLOBEX, {}), (GLOBEX, evil)):
        r = httpx.post(url, json=_chat(**extra), headers=headers)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvstore-engine"] == "w0"
    seen = w.seen()
    salts = [s["cache_salt"] for s in seen]
    assert salts[0] == salts[1] and salts[2] == salts[3]  # per tenant, not per caller
    assert salts[0] != salts[2] and "globex-salt" not in salts and all(salts)
    assert all(s["kv_transfer_params"] is None for s in seen)


def _held(gw, url: str, body: dict) -> tuple[threading.Thread, list[httpx.Response]]:
    """acme's request of `body` (held by the stand-in) on a thread, returned once it is
    in flight by the gateway's gauge; its answer lands in the list."""
    held: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: held.append(httpx.post(url, json=body, headers=ACME, timeout=30))
    )
    t.start()
    wait_for(
        lambda: "kvstore_gateway_inflight 1.0" in gw.metrics(),
        20,
        0.05,
        what="one request in flight",
    )
    return t, held


def test_every_engine_saturated_is_429_with_retry_after(
    start_gateway, start_standin, tokenizer_dir
):
    gw = start_gateway({MODEL: tokenizer_dir}, {"max_inflight_per_engine": 1, "retry_after_s": 3})
    start_standin("w0", MODEL)
    _wait_engines(gw, 1)
    url = gw.url + "/v1/chat/completions"
    t, held = _held(gw, url, _chat(standin_delay_s=4))
    r = httpx.post(url, json=_chat(), headers=GLOBEX)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "3"
    t.join()
    assert held[0].status_code == 200
    assert httpx.post(url, json=_chat(), headers=GLOBEX).status_code == 200  # released


def test_n_choices_count_as_n_against_the_engines_and_the_tenants_caps(
    start_gateway, start_standin, tokenizer_dir
):
    """A request's n choices (or best_of) weigh on an engine like n requests, and now
    count so: both caps counted a request once whatever its n, and one tenant within
    its cap (8) put 8 x 16 sequences on one engine (cap 16) in a probe, where vLLM's API
    server stopped answering /health and every tenant got 503 for two minutes."""
    gw = start_gateway(
        {MODEL: tokenizer_dir}, {"max_inflight_per_engine": 4, "max_inflight_per_tenant": 3}
    )
    start_standin("w0", MODEL)
    _wait_engines(gw, 1)
    url = gw.url + "/v1/chat/completions"
    t, held = _held(gw, url, _chat(n=2, standin_delay_s=6))
    try:
        # acme: 2 of its 3 in flight, as one request of n=2. One more fits; two do not,
        # refused once the body says so (the request itself was admitted as one).
        r = httpx.post(url, json=_chat(n=2), headers=ACME)
        assert r.status_code == 429, r.text
        assert "cap of 3 requests in flight" in r.text, r.text
        assert "this one asks 2 choices, counted as 2" in r.text, r.text
        # The engine: 2 of its 4 taken. Two more sequences fit; three do not.
        for extra in ({"n": 3}, {"best_of": 3}):
            r = httpx.post(url, json=_chat(**extra), headers=GLOBEX)
            assert r.status_code == 429, r.text
            assert "for a request of 3 choices (counted as 3)" in r.text, r.text
        r = httpx.post(url, json=_chat(n=2), headers=GLOBEX)
        assert r.status_code == 200, r.text
        r = httpx.post(url, json=_chat(), headers=ACME)
        assert r.status_code == 200, r.text
    finally:
        t.join()
    assert held[0].status_code == 200, held[0].text
    # A request refused once its choices were counted (tokenizing: an id out of the
    # vocabulary) gives them back with it.
    r = httpx.post(url, json={"model": MODEL, "prompt": [10**9], "n": 3}, headers=ACME)
    assert r.status_code == 400, r.text
    # Everything given back by its weight: a request asking more than either cap runs
    # alone, counted as the whole cap.
    r = httpx.post(url, json=_chat(n=6), headers=ACME)
    assert r.status_code == 200, r.text
    assert "kvstore_gateway_inflight 0.0" in gw.metrics()


def test_streaming_answer_is_the_engines_bytes(start_gateway, start_standin, tokenizer_dir):
    gw = start_gateway({MODEL: tokenizer_dir})
    w = start_standin("w0", MODEL)
    _wait_engines(gw, 1)
    for path, body in (
        ("/v1/chat/completions", _chat(stream=True, standin_chunks=7)),
        ("/v1/completions", {"model": MODEL, "prompt": "w3 w4", "stream": True}),
        ("/v1/completions", {"model": MODEL, "prompt": [3, 4, 5]}),
    ):
        via = httpx.post(gw.url + path, json=body, headers=ACME)
        direct = httpx.post(w.url + path, json=body)
        assert via.status_code == direct.status_code == 200
        assert via.content == direct.content
        assert via.headers["content-type"] == direct.headers["content-type"]


def test_a_killed_engine_costs_one_retry_and_drops_out(start_gateway, start_standin, tokenizer_dir):
    gw = start_gateway({MODEL: tokenizer_dir}, {"policy": "round_robin"})
    a = start_standin("w0", MODEL)
    start_standin("w1", MODEL)
    _wait_engines(gw, 2)
    url = gw.url + "/v1/chat/completions"
    a.kill()
    answered = []
    for i in range(6):  # round robin: the dead one is chosen at once
        r = httpx.post(url, json=_chat(f"w{i + 10}", stream=bool(i % 2)), headers=ACME)
        assert r.status_code == 200, r.text
        answered.append(r.headers["x-kvstore-engine"])
    assert set(answered) == {"w1"}
    metrics = gw.metrics()
    assert "kvstore_gateway_retries_total 1.0" in metrics
    _wait_engines(gw, 1)  # the registrar saw /health fail and revoked the lease


def test_one_tenants_slow_answer_is_its_own_504_not_every_engines_suspension(
    start_gateway, start_standin, tokenizer_dir
):
    """An answer (not streamed) that sends nothing for request_timeout_s used to count as
    the engine's transport failing: the engine was suspended and the request sent again
    to the next, which was suspended in turn, so one tenant's slow requests left the
    others 503 "no engine serves" (a probe, 2026-12-07). Now it is the request's own
    504, sent nowhere else, and the other tenant is served at once."""
    gw = start_gateway(
        {MODEL: tokenizer_dir},
        {"policy": "round_robin", "request_timeout_s": 1, "engine_suspend_s": 30},
    )
    workers = [start_standin("w0", MODEL), start_standin("w1", MODEL)]
    _wait_engines(gw, 2)
    url = gw.url + "/v1/chat/completions"
    r = httpx.post(url, json=_chat(standin_delay_s=3), headers=ACME, timeout=30)
    assert r.status_code == 504, r.text
    assert "request_timeout_s" in r.json()["error"]["message"]
    assert sum(len(w.seen()) for w in workers) == 1  # not retried elsewhere
    for i in range(4):  # round robin: both engines, neither suspended
        other = httpx.post(url, json=_chat(f"w{i + 20}"), headers=GLOBEX, timeout=30)
        assert other.status_code == 200, other.text
    assert sorted(len(w.seen()) for w in workers) == [2, 3]  # 5 requests, both engines
    assert "kvstore_gateway_retries_total 0.0" in gw.metrics()


def test_an_engines_redirect_is_not_followed(start_gateway, start_standin, tokenizer_dir):
    """An engine's 3xx sent the tenant's prompt wherever its Location said, http://
    included, past allow_plaintext_engines (a probe, 2026-12-07). Now it is not followed:
    the engine counts as failing (suspended), the lone engine leaves nothing to try next
    (502), and nothing reaches the Location."""
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0.5)
    gw = start_gateway({MODEL: tokenizer_dir}, {"engine_suspend_s": 30})
    start_standin("w0", MODEL)
    _wait_engines(gw, 1)
    where = f"http://127.0.0.1:{trap.getsockname()[1]}/v1/chat/completions"
    try:
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json=_chat(standin_location=where),
            headers=ACME,
            timeout=30,
        )
        assert r.status_code == 502, r.text
        with pytest.raises(TimeoutError):
            trap.accept()[0].close()  # nobody came
    finally:
        trap.close()
    assert "redirect" in gw.log


def test_no_engine_left_is_503_and_models_lists_the_registered(
    start_gateway, start_standin, tokenizer_dir
):
    gw = start_gateway({MODEL: tokenizer_dir})
    r = httpx.post(gw.url + "/v1/chat/completions", json=_chat(), headers=ACME)
    assert r.status_code == 503
    start_standin("w0", MODEL)
    _wait_engines(gw, 1)
    models = httpx.get(gw.url + "/v1/models", headers=ACME).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_an_engine_whose_connector_wrote_no_namespace_is_named_not_registered(
    start_gateway, start_standin, tokenizer_dir, tmp_path
):
    """A connector that refused its configuration writes no namespace file: the registrar
    says so in its log, once, and registers the engine when the file appears."""
    gw = start_gateway({MODEL: tokenizer_dir})
    ns_file = tmp_path / "late-ns.json"
    e = start_standin("e0", MODEL, registrar_args=["--namespace-file", str(ns_file)])
    log = e.workdir / "registrar.log"
    wait_for(lambda: "has not written its namespace" in log.read_text(), 30, what="the warning")
    assert str(ns_file) in log.read_text() and "kvstore connector disabled" in log.read_text()
    assert gw.engines() == 0
    ns_file.write_text(json.dumps({}))
    _wait_engines(gw, 1)
    assert log.read_text().count("has not written its namespace") == 1
    assert "registered" in log.read_text().split("has not written its namespace")[1]
    assert "/health" not in log.read_text().replace("answers /health", "")  # no line per check


def test_an_engine_that_dies_after_its_head_costs_one_retry(
    start_gateway, start_standin, tokenizer_dir
):
    """vLLM sends a stream's head before its first token. Before the fix the gateway
    committed to the engine at its head: an engine dying before its first chunk left the
    client an empty 200. Now the client's answer waits for the engine's first bytes, and
    a failure before them goes to the next choice."""
    gw = start_gateway({MODEL: tokenizer_dir}, {"policy": "round_robin"})
    dying = start_standin("w0", MODEL)
    w1 = start_standin("w1", MODEL)
    _wait_engines(gw, 2)
    body = _chat(stream=True, standin_die_after_head=["w0"])
    direct = httpx.post(w1.url + "/v1/chat/completions", json=body)
    assert direct.status_code == 200 and len(direct.content) > 100
    for _ in range(2):  # round robin: w0 is one of the first two choices
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=ACME)
        assert r.status_code == 200, r.text
        assert (r.headers["x-kvstore-engine"], r.content) == ("w1", direct.content)
    assert dying.worker is not None and dying.worker.wait(10) != 0  # it died mid-answer
    assert "kvstore_gateway_retries_total 1.0" in gw.metrics()


@pytest.fixture
def world(tmp_path, etcd, spawn_agent, start_gateway, start_standin):
    return World(tmp_path, etcd, spawn_agent, start_gateway, start_standin)


def test_a_streamed_answer_is_prefilled_at_its_first_chunk_and_released_at_its_end(world):
    """The router's load terms for a streamed request, through its three stages: queued
    prefill work until the engine's first chunk, in flight (decoding) until the end, then
    nothing. Read where an operator reads them, the router's gauges for the engine (and
    for its node) and the gateway's; a tenant's answers carry none of it
    (test_attack_gateway). The stand-in streams when told (POST /step/TAG)."""
    url = world.gw.url + "/v1/chat/completions"

    def step() -> None:
        assert httpx.post(world.w.url + "/step/s1").status_code == 200

    first = threading.Event()
    got: list[bytes] = []

    def stream() -> None:
        body = _chat("w5 w6 w7 " * 8, stream=True, standin_gate="s1")
        with httpx.stream("POST", url, json=body, headers=ACME, timeout=60) as r:
            chunks = r.iter_raw()
            got.append(next(chunks))
            first.set()
            got.append(b"".join(chunks))

    assert world.engine_load("w0") == (0, 0)
    t = threading.Thread(target=stream)
    t.start()
    try:
        wait_for(lambda: world.router_inflight()["agent-0"] == 1, 20, 0.05, what="held")
        in_flight, queued = world.engine_load("w0")
        assert in_flight == 1 and queued > 0, (in_flight, queued)
        assert not first.is_set()  # the client has nothing before the engine's first chunk
        step()  # the first chunk: prefill done
        assert first.wait(20)
        assert world.engine_load("w0") == (1, 0)
        assert world.router_inflight()["agent-0"] == 1 and world.gateway_inflight() == 1
        step()  # the rest, and the end
        t.join(20)
    finally:
        for _ in range(2):
            step()  # a stream still waiting ends
        t.join(20)
    assert got[0].startswith(b"data: ") and got[1].endswith(b"data: [DONE]\n\n")
    wait_for(
        lambda: world.router_inflight()["agent-0"] == 0 and world.gateway_inflight() == 0,
        20,
        0.05,
        what="the stream released",
    )
    assert world.engine_load("w0") == (0, 0)
