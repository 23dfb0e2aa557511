"""Attacks on the gateway (issue 18, "access before side effects ... gateway" and "mTLS on
every hop"): a caller without a valid API key, a tenant trying to pick another's
cache_salt or talk to the connector, a malformed prompt, a plaintext or foreign client
when TLS is on. Each refusal is checked against what it must leave unchanged: the
engine (what the stand-in received), etcd (read directly), the router's in-flight table
(its Prometheus gauge, on the node the engine serves) and the gateway's metrics. Real
processes: etcd, an agent, the router serving the gateway, stand-in workers."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from support.common import wait_for
from support.gateway import MODEL, SPEC, World, write_word_tokenizer

ACME = {"authorization": "Bearer key-acme"}
GLOBEX = {"authorization": "Bearer key-globex"}


@pytest.fixture
def world(tmp_path, etcd, spawn_agent, start_gateway, start_standin):
    return World(tmp_path, etcd, spawn_agent, start_gateway, start_standin)


def _chat(text: str = "w5 w6 w7 " * 8, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def test_the_in_flight_check_sees_a_held_request(world):
    """The positive control for the checks below: a valid request in flight shows in the
    router's table on agent-0, and is released at the end."""
    done: list[int] = []
    url = world.gw.url + "/v1/chat/completions"
    body = _chat(standin_delay_s=3)
    t = threading.Thread(
        target=lambda: done.append(httpx.post(url, json=body, headers=ACME, timeout=30).status_code)
    )
    t.start()
    wait_for(lambda: world.router_inflight().get("agent-0") == 1, 20, 0.05, what="held")
    t.join()
    assert done == [200]
    wait_for(lambda: world.router_inflight().get("agent-0") == 0, 20, 0.05, what="released")


def test_what_a_tenant_is_told_carries_nothing_of_another_tenants_load(world):
    """The route header says where the router priced the caller's own blocks; requests in
    flight on the engine are other tenants' too, so the header never carries them: with
    globex holding a request, acme is told what it is told on an idle gateway."""
    url = world.gw.url + "/v1/chat/completions"
    quiet = httpx.post(url, json=_chat(), headers=ACME, timeout=30)
    held: list[int] = []
    t = threading.Thread(
        target=lambda: held.append(
            httpx.post(url, json=_chat(standin_delay_s=3), headers=GLOBEX, timeout=30).status_code
        )
    )
    t.start()
    wait_for(lambda: sum(world.router_inflight().values()) == 1, 20, 0.05, what="held")
    busy = httpx.post(url, json=_chat(), headers=ACME, timeout=30)
    t.join()
    assert (quiet.status_code, busy.status_code, held) == (200, 200, [200])
    for r in (quiet, busy):
        fields = dict(kv.split("=") for kv in r.headers["x-kvstore-route"].split())
        assert set(fields) == {"engine", "agent", "peer", "recompute"}, fields
    assert busy.headers["x-kvstore-route"] == quiet.headers["x-kvstore-route"]


def test_the_gateways_metrics_are_not_on_the_tenants_port(world, tmp_path, start_gateway):
    """The gateway's metrics count every tenant's requests (in flight, forwards per
    engine): on the tenants' port /metrics is 404 by default, with or without a key, and
    says where they are; the router's Prometheus port, the operator's, has them.
    public_metrics: true serves them on the tenants' port too (the positive control)."""
    for headers in ({}, ACME):
        r = httpx.get(world.gw.url + "/metrics", headers=headers, timeout=10)
        assert r.status_code == 404, r.text
        assert "router's Prometheus port" in r.json()["error"]["message"]
        assert "kvstore_gateway" not in r.text
    assert httpx.post(world.gw.url + "/v1/chat/completions", json=_chat(), headers=ACME).is_success
    page = world.gateway_metrics()
    assert 'kvstore_gateway_requests_total{code="200",route="/v1/chat/completions"} 1.0' in page
    assert 'kvstore_gateway_forwards_total{engine="w0"} 1.0' in page
    tok = str(write_word_tokenizer(tmp_path / "tok-public"))
    public = start_gateway({MODEL: tok}, {"public_metrics": True})
    r = httpx.get(public.url + "/metrics", timeout=10)
    assert r.status_code == 200 and "kvstore_gateway_inflight 0.0" in r.text, r.text


def test_requests_without_a_valid_key_change_nothing(world):
    before = world.state()
    big = json.dumps(_chat("w9 " * 200_000)).encode()  # over max_body_bytes as well
    attempts = [
        ("/v1/chat/completions", {}, json.dumps(_chat()).encode()),
        (
            "/v1/chat/completions",
            {"authorization": "Bearer key-nope"},
            json.dumps(_chat()).encode(),
        ),
        ("/v1/chat/completions", {"authorization": "key-acme"}, json.dumps(_chat()).encode()),
        ("/v1/chat/completions", {"authorization": "Basic key-acme"}, json.dumps(_chat()).encode()),
        ("/v1/completions", {"authorization": "Bearer key-nope"}, big),
        ("/v1/completions", {"authorization": "Bearer  x"}, b"{not json"),
    ]
    for path, headers, body in attempts:
        r = httpx.post(world.gw.url + path, content=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert (
        httpx.get(world.gw.url + "/v1/models", headers={"authorization": "Bearer x"}).status_code
        == 401
    )
    assert world.state() == before  # no forward, no etcd write, nothing in flight
    page = world.gateway_metrics()
    assert "key-nope" not in page and "key-acme" not in page
    assert "kvstore_gateway_inflight 0.0" in page
    assert "key-nope" not in world.gw.log


def test_token_ids_the_tokenizer_cannot_make_are_400_before_any_work(world):
    """Before the fix an id outside int32 reached the chain hashing and came back as a
    500 with a traceback in the router's log."""
    before = world.state()
    for ids in ([2**40] * 20, [2**31] * 20, [-1] * 20, [1000] * 20):
        r = httpx.post(
            world.gw.url + "/v1/completions",
            json={"model": MODEL, "prompt": ids},
            headers=ACME,
            timeout=30,
        )
        assert r.status_code == 400, (ids[0], r.text)
        assert "token ids must be between 0 and 999" in r.json()["error"]["message"]
    assert world.state() == before
    assert "Exception in ASGI application" not in world.gw.log  # uvicorn's line for a 500


def test_a_request_for_more_choices_than_max_choices_is_400_before_any_work(world):
    """One request with n=256 would weigh on the engine like 256 requests while the
    tenant's in-flight cap counts one: past max_choices (16) it is refused before the
    engine sees it, as is an n that is not a whole number >= 1."""
    url = world.gw.url + "/v1/chat/completions"
    before = world.state()
    for extra, said in (
        ({"n": 17}, "n over 16 (the gateway's max_choices)"),
        ({"best_of": 256}, "best_of over 16"),
        ({"n": 0}, "n must be a whole number >= 1"),
        ({"n": "8"}, "n must be a whole number >= 1"),
        ({"n": True}, "n must be a whole number >= 1"),
    ):
        r = httpx.post(url, json=_chat(**extra), headers=ACME, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        assert said in r.json()["error"]["message"], r.text
    assert world.state() == before
    r = httpx.post(url, json=_chat(n=16), headers=ACME, timeout=30)  # the positive control
    assert r.status_code == 200, r.text
    assert world.w.seen()[-1]["n"] == 16


def test_a_caller_cannot_move_its_requests_ahead_of_other_tenants(world, tmp_path, start_gateway):
    """vLLM serves a lower `priority` first under its priority scheduling, and the
    engines are shared: a caller's priority other than 0 is 400 before any work, as is
    one vLLM would refuse. 0 (vLLM's default) passes. With caller_priority the caller's
    reaches the engine (the positive control: a second gateway on the same engine)."""
    url = world.gw.url + "/v1/chat/completions"
    before = world.state()
    for priority, said in (
        (-1, "priority is not taken from callers here"),
        (2**40, "priority is not taken from callers here"),
        (2**63, "priority must be a whole number (64-bit)"),
        ("-1", "priority must be a whole number (64-bit)"),
        (True, "priority must be a whole number (64-bit)"),
        (0.5, "priority must be a whole number (64-bit)"),
        (None, "priority must be a whole number (64-bit)"),  # vLLM's is an int, never null
    ):
        r = httpx.post(url, json=_chat(priority=priority), headers=ACME, timeout=30)
        assert r.status_code == 400, (priority, r.text)
        assert said in r.json()["error"]["message"], r.text
    assert world.state() == before
    r = httpx.post(url, json=_chat(priority=0), headers=ACME, timeout=30)
    assert r.status_code == 200, r.text
    assert world.w.seen()[-1]["priority"] == 0
    tok = str(write_word_tokenizer(tmp_path / "tok-priority"))
    trusted = start_gateway({MODEL: tok}, {"caller_priority": True})
    wait_for(lambda: trusted.engines() == 1, 30, 0.1, what="the engine in the second gateway")
    r = httpx.post(
        trusted.url + "/v1/chat/completions", json=_chat(priority=-7), headers=ACME, timeout=30
    )
    assert r.status_code == 200, r.text
    assert world.w.seen()[-1]["priority"] == -7


def test_a_tenant_cannot_choose_the_salt_nor_talk_to_the_connector(world):
    evil = {"cache_salt": "guessed", "kv_transfer_params": {"kvstore": {"peer_node": "x"}}}
    for headers in (ACME, GLOBEX):
        for stream in (False, True):
            for prompt in ("w3 w4 " * 20, list(range(3, 60))):
                body = {"model": MODEL, "prompt": prompt, "stream": stream, **evil}
                r = httpx.post(world.gw.url + "/v1/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
    seen = world.w.seen()
    assert len(seen) == 8
    acme, globex = {s["cache_salt"] for s in seen[:4]}, {s["cache_salt"] for s in seen[4:]}
    assert len(acme) == len(globex) == 1 and acme != globex and "guessed" not in acme | globex
    assert all(s["kv_transfer_params"] is None for s in seen)


def test_declared_oversize_bodies_are_refused_before_reading(world):
    """A body declared over max_body_bytes is 413 for a tenant (401 without a key) before
    the gateway reads it: the client sends the headers only."""
    import socket

    host, port = world.gw.address.rsplit(":", 1)
    for auth, status in ((b"Bearer key-acme", b"413"), (b"Bearer key-nope", b"401")):
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"authorization: " + auth + b"\r\ncontent-length: 1000000000\r\n\r\n"
            )
            head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 " + status), head[:80]
    assert world.w.seen() == []


@pytest.fixture
def tls_world(tmp_path, etcd, spawn_agent, start_gateway, start_standin, pki):
    import ssl

    ctx = ssl.create_default_context(cafile=pki.server.ca_file)
    ctx.load_cert_chain(pki.client.cert_file, pki.client.key_file)
    router = {"tls": {**pki.section()["tls"], "etcd": False}}
    return World(
        tmp_path,
        etcd,
        spawn_agent,
        start_gateway,
        start_standin,
        router=router,
        config={"require_client_cert": True, "allow_plaintext_engines": True},
        http={"verify": ctx},
    )


def test_plaintext_and_foreign_clients_are_refused_when_tls_is_on(tls_world, pki):
    import ssl

    w = tls_world
    before = w.state()
    body = _chat()
    with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the HTTPS port
        httpx.post("http://" + w.gw.address + "/v1/chat/completions", json=body, headers=ACME)
    no_cert = ssl.create_default_context(cafile=pki.server.ca_file)
    stranger = ssl.create_default_context(cafile=pki.server.ca_file)
    stranger.load_cert_chain(pki.stranger.cert_file, pki.stranger.key_file)
    for ctx in (no_cert, stranger):
        with pytest.raises(httpx.HTTPError):
            with httpx.Client(verify=ctx) as c:
                c.post(w.gw.url + "/v1/chat/completions", json=body, headers=ACME)
    assert w.state() == before
    with httpx.Client(**w.gw.http) as c:  # the cluster's client pair gets through
        assert c.post(w.gw.url + "/v1/chat/completions", json=body, headers=ACME).status_code == 200


def test_a_tenant_at_its_in_flight_cap_gets_429_and_others_are_served(
    tmp_path, etcd, spawn_agent, start_gateway, start_standin
):
    w = World(
        tmp_path,
        etcd,
        spawn_agent,
        start_gateway,
        start_standin,
        config={"max_inflight_per_tenant": 1, "retry_after_s": 2},
    )
    url = w.gw.url + "/v1/chat/completions"
    held: list[int] = []
    t = threading.Thread(
        target=lambda: held.append(
            httpx.post(url, json=_chat(standin_delay_s=4), headers=ACME, timeout=30).status_code
        )
    )
    t.start()
    wait_for(lambda: w.router_inflight().get("agent-0") == 1, 20, 0.05, what="acme's request held")
    r = httpx.post(url, json=_chat(), headers=ACME)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "2" and r.json()["error"]["type"] == "rate_limit_error"
    assert httpx.post(url, json=_chat(), headers=GLOBEX).status_code == 200  # not starved
    t.join()
    assert held == [200]
    assert httpx.post(url, json=_chat(), headers=ACME).status_code == 200  # released
    assert len(w.w.seen()) == 3  # the refused one reached no engine


def test_a_key_limited_to_other_models_is_403_before_any_work(
    tmp_path, etcd, start_gateway, start_standin
):
    from support.gateway import KEYS

    tok = str(write_word_tokenizer(tmp_path / "tok"))
    keys = KEYS | {"key-limited": {"tenant": "acme", "models": ["other"]}}
    gw = start_gateway({MODEL: tok}, keys=keys)
    w = start_standin("w0", MODEL)
    wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the engine in the gateway")
    limited = {"authorization": "Bearer key-limited"}
    for path, body in (
        ("/v1/chat/completions", _chat()),
        ("/v1/completions", {"model": MODEL, "prompt": "w5"}),
    ):
        r = httpx.post(gw.url + path, json=body, headers=limited)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["type"] == "permission_error"
    assert httpx.get(gw.url + "/v1/models", headers=limited).json()["data"] == []
    assert [m["id"] for m in httpx.get(gw.url + "/v1/models", headers=ACME).json()["data"]] == [
        MODEL
    ]
    assert w.seen() == []
    assert (
        httpx.post(gw.url + "/v1/chat/completions", json=_chat(), headers=ACME).status_code == 200
    )


def test_a_revoked_key_is_refused_without_a_restart(world):
    """Editing the api_keys_file revokes a leaked key (and adds one) while the gateway
    runs; a file that no longer loads keeps the keys in force instead of locking every
    tenant out, and says so in the log."""
    url = world.gw.url + "/v1/chat/completions"
    keys = world.gw.workdir / "keys.json"

    def status(key: str) -> int:
        return httpx.post(url, json=_chat(), headers={"authorization": f"Bearer {key}"},
                          timeout=30).status_code  # fmt: skip

    assert (status("key-acme"), status("key-globex"), status("key-new")) == (200, 200, 401)
    keys.write_text(json.dumps({"key-acme": "acme", "key-new": "globex"}))
    wait_for(lambda: status("key-globex") == 401, 20, 0.2, what="the revoked key refused")
    assert (status("key-acme"), status("key-new")) == (200, 200)
    keys.write_text('{"key-acme": ')  # half written
    wait_for(lambda: status("key-acme") == 200 and "does not load; keeping the keys in force"
             in world.gw.log, 20, 0.2, what="the bad file logged")  # fmt: skip
    assert (status("key-acme"), status("key-new"), status("key-globex")) == (200, 200, 401)


def test_a_tenant_cannot_reach_the_connector_through_vllm_xargs(world):
    """vLLM copies vllm_xargs into the request's extra_args, where its connector reads
    kv_transfer_params: before the fix one request with a malformed one ("boom") failed
    on every engine (500 from real vLLM engines; the stand-in answers as they do) and,
    through the suspension that followed, denied every tenant for engine_suspend_s."""
    url = world.gw.url + "/v1/chat/completions"
    xargs = {"kv_transfer_params": "boom", "ec_transfer_params": "boom", "note": "kept"}
    evil = {"vllm_xargs": xargs, "ec_transfer_params": {"kvstore": {"peer": "x"}}}
    for stream in (False, True):
        r = httpx.post(url, json=_chat(stream=stream, **evil), headers=GLOBEX)
        assert r.status_code == 200, r.text
    assert httpx.post(url, json=_chat(), headers=ACME).status_code == 200
    seen = world.w.seen()
    assert [s["vllm_xargs"] for s in seen] == [{"note": "kept"}] * 2 + [None]
    assert all(s["kv_transfer_params"] is None and s["ec_transfer_params"] is None for s in seen)


def test_a_request_an_engine_fails_is_its_callers_answer_and_suspends_no_engine(
    world, start_standin
):
    """A tenant can make an engine fail its own request. Before the fix any 5xx suspended
    the engine and was retried on the next: one request from globex, both engines 500,
    and acme got 503 for engine_suspend_s. Now a 500 goes back to its caller unchanged,
    not retried; a 502/503/504 ("not now") is retried once on the next choice; neither
    suspends an engine."""
    w1 = start_standin("w1", MODEL, namespace=SPEC.to_dict(), node="agent-0")
    wait_for(lambda: world.gw.engines() == 2, 30, 0.1, what="two engines in the gateway")
    url = world.gw.url + "/v1/chat/completions"
    for status, forwards in ((500, 1), (503, 2)):
        before = len(world.w.seen()) + len(w1.seen())
        poison = _chat(standin_status=status)
        direct = httpx.post(world.w.url + "/v1/chat/completions", json=poison)
        r = httpx.post(url, json=poison, headers=GLOBEX)
        assert (r.status_code, r.content) == (status, direct.content)
        assert len(world.w.seen()) + len(w1.seen()) == before + 1 + forwards
        for headers in (ACME, GLOBEX):  # at once: no engine suspended
            assert httpx.post(url, json=_chat(), headers=headers).status_code == 200
    assert "kvstore_gateway_retries_total 1.0" in world.gateway_metrics()  # the 503's


def test_a_client_that_leaves_before_the_engine_answers_is_released_at_once(world):
    """Before the fix the gateway noticed a client gone only once the engine answered: the
    request stayed in flight (gateway and router) and the engine went on with it. Now the
    gateway watches the client while it waits and closes the engine's request, which the
    engine sees (the stand-in marks it gone, as vLLM aborts it)."""
    url = world.gw.url + "/v1/chat/completions"
    for stream in (False, True):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url, json=_chat(stream=stream, standin_delay_s=6), headers=ACME, timeout=1)
        wait_for(lambda: world.w.seen()[-1].get("gone"), 20, 0.05, what="the engine told")
        wait_for(
            lambda: world.gateway_inflight() == 0 and world.router_inflight()["agent-0"] == 0,
            20,
            0.05,
            what="the request released",
        )
    assert httpx.post(url, json=_chat(), headers=ACME).status_code == 200


def _raw(body: str) -> bytes:
    return body.encode("utf-8", "surrogatepass")


def test_malformed_bodies_are_400_with_a_precise_message_before_any_work(world):
    """Before the fix each of these was a 500 with a traceback in the router's log (a lone
    surrogate reached the tokenizer, deep nesting overflowed the JSON decoder's
    recursion), a misleading "body is not JSON" (a 5000-digit number), or reached the
    engine unchecked (max_tokens, a non-finite temperature re-sent as NaN/Infinity,
    content that is neither text nor content parts)."""
    chat, completions = "/v1/chat/completions", "/v1/completions"
    tiny = '{"model": "tiny", '
    user = '"messages": [{"role": "user", "content": "w5 w6"}]'
    deep = 3000
    cases = [
        (chat, tiny + '"messages": [{"role": "user", "content": "w5 \\ud800"}]}',
         "messages[0].content is not valid Unicode"),
        (completions, tiny + '"prompt": "w1 \udc80"}', "prompt is not valid Unicode"),
        (chat, tiny + '"messages": [{"role": "\\ud800", "content": "w5"}]}',
         "messages[0].role is not valid Unicode"),
        (chat, tiny + user + ', "user": "\\udfff"}', "user is not valid Unicode"),
        (chat, tiny + '"x": ' + "[" * deep + "]" * deep + "}", "nested deeper than 64"),
        (completions, tiny + '"prompt": ' + "[" * 990 + '"w1"' + "]" * 990 + "}",
         "nested deeper than 64"),
        (completions, tiny + '"prompt": ' + "[" * 80 + '"w1"' + "]" * 80 + "}",
         "nested deeper than 64"),
        (completions, tiny + '"prompt": [["w1"]]}', "prompt must be one string"),
        (chat, tiny + user + ', "max_tokens": ' + "9" * 5000 + "}", "a number over 4300 digits"),
        (chat, tiny + user + ', "max_tokens": 1000000000000000000000000000000}',
         "max_tokens over 2147483647"),
        (chat, tiny + user + ', "max_tokens": -5}', "max_tokens must be a whole number >= 0"),
        (chat, tiny + user + ', "max_tokens": "lots"}', "max_tokens must be a whole number"),
        (chat, tiny + user + ', "max_tokens": 16.5}', "max_tokens must be a whole number"),
        (chat, tiny + user + ', "max_tokens": true}', "max_tokens must be a whole number"),
        (chat, tiny + user + ', "max_completion_tokens": -1}',
         "max_completion_tokens must be a whole number >= 0"),
        (chat, tiny + user + ', "temperature": NaN}', "NaN and Infinity are not JSON"),
        (chat, tiny + user + ', "temperature": -Infinity}', "NaN and Infinity are not JSON"),
        (chat, tiny + user + ', "temperature": 1e999}', "too large a number"),
        (chat, tiny + user + ', "temperature": "hot"}', "temperature must be a number"),
        (chat, tiny + '"messages": [{"role": "user", "content": 5}]}',
         "messages[0].content must be a string or a list of content parts"),
        (chat, tiny + '"messages": [{"role": "user", "content": null}]}',
         "messages[0].content must be a string or a list of content parts"),
        (chat, tiny + '"messages": [{"role": "user", "content": {"text": "w5"}}]}',
         "messages[0].content must be a string or a list of content parts"),
        (chat, tiny + '"messages": [{"role": "user", "content": ["w5"]}]}',
         "messages[0].content[0] must be a content part"),
    ]  # fmt: skip
    before = world.state()
    wrong = []
    for path, body, said in cases:
        r = httpx.post(
            world.gw.url + path,
            content=_raw(body),
            headers=ACME | {"content-type": "application/json"},
            timeout=30,
        )
        error = r.json().get("error", {}) if "json" in r.headers["content-type"] else {}
        if r.status_code != 400 or said not in error.get("message", ""):
            wrong.append((body[:70], said, r.status_code, r.text[:120]))
        elif error["type"] != "invalid_request_error":
            wrong.append((body[:70], said, r.status_code, error))
    assert not wrong, "\n".join(map(repr, wrong))
    assert world.state() == before
    log = world.gw.log
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]
    # The positive control: the shapes OpenAI allows still reach the engine.
    fine = [
        _chat(max_tokens=16, max_completion_tokens=0, temperature=0.5, top_p=1),
        {"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "w5 w6 🙂"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            {"role": "assistant"},
        ]},
        _chat("w5 \U0001f642 w6 \ud55c"),  # sent as a surrogate pair's escapes, Hangul
    ]  # fmt: skip
    for body in fine:
        raw = json.dumps(body).encode()  # ensure_ascii: 🙂 as "\\ud83d\\ude42"
        r = httpx.post(world.gw.url + "/v1/chat/completions", content=raw, headers=ACME, timeout=30)
        assert r.status_code == 200, (body, r.text)
    assert [s["path"] for s in world.w.seen()] == ["/v1/chat/completions"] * len(fine)
