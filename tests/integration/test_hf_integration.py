"""A real transformer's output must not change when its prompt prefix KV comes from kvstore.

The model is a seeded random-weight Llama (2 layers, hidden 128, 4 heads, 2 KV heads,
vocab 1000) built from a config: nothing is downloaded. Blocks travel through a real
node agent process, over the shared-memory path and over plain gRPC.

Tolerance: logits computed on top of a loaded prefix are compared with a cache-free
prefill using atol=1e-5, rtol=1e-4 in float32. Bit equality is not promised: running
attention and the projections over the suffix only can change the CPU kernels'
reduction order (measured max abs difference: 0 to ~5e-7). Greedy tokens must match
exactly.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvstore.client import KVClient, NamespaceHandle
from kvstore.client.convert import kv_to_blocks
from kvstore.errors import InvalidArgument
from kvstore.integrations.hf import (
    CachedPrefillWorker,
    cache_to_kv,
    kv_to_cache,
    namespace_for_model,
    reference_greedy,
    reference_logits,
)
from loadtest.model import build_tiny_llama, measure_prefill

BS = 16
SECRET = "acme-secret"
REVISIONS = dict(
    model_name="tiny-llama",
    model_revision="r1",
    tokenizer_id="tiny-tok",
    tokenizer_revision="r1",
    prompt_template_version="v1",
)
ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def model():
    return build_tiny_llama(seed=0)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


SYSTEM = prompt(1, 3 * BS)  # a shared 3-block prefix
PROMPT_A = SYSTEM + prompt(2, 21)  # 69 tokens: 4 full blocks
PROMPT_B = SYSTEM + prompt(3, 30)  # 78 tokens: shares 3 blocks with A


def ns_for(model, **overrides):
    return namespace_for_model(model, "acme", "chat", BS, **{**REVISIONS, **overrides})


def start_agent(spawn_agent, spec):
    # One slot per block payload: 2 x layers x kv_heads x head_dim x dtype bytes x 16.
    return spawn_agent(slot_bytes=spec.block_bytes, pool_bytes=256 * spec.block_bytes)


@contextlib.contextmanager
def count_positions(model):
    """Counts the token positions the model runs on (hook on the embedding layer)."""
    seen: list[int] = []
    handle = model.get_input_embeddings().register_forward_pre_hook(
        lambda _mod, args: seen.append(args[0].shape[-1])
    )
    try:
        yield seen
    finally:
        handle.remove()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ------------------------------------------------------------------- no agent needed
def test_cache_layout_round_trip(model):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([PROMPT_A]), use_cache=True)
    kv = cache_to_kv(out.cache)
    assert kv.shape == (2, 2, len(PROMPT_A), 2, 32)
    layer1 = out.cache.layers[1]
    # kv[layer, K/V, token, head, :] is cache[layer].keys/values[0, head, token, :]
    assert torch.equal(kv[1, 0, 5, 1], layer1.keys[0, 1, 5])
    assert torch.equal(kv[1, 1, 40, 0], layer1.values[0, 0, 40])
    back = kv_to_cache(kv)
    assert back.get_seq_length() == len(PROMPT_A)
    assert torch.equal(cache_to_kv(back), kv)
    with torch.no_grad():
        two = model(input_ids=torch.tensor([PROMPT_A, PROMPT_A]), use_cache=True).cache
    with pytest.raises(ValueError, match="one sequence, cache has batch 2"):
        cache_to_kv(two)
    with pytest.raises(ValueError, match="layers, 2, tokens"):
        kv_to_cache(kv[:, 0])


def test_namespace_from_model_config():
    model = build_tiny_llama(seed=0)
    spec = ns_for(model)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 32)
    assert (spec.kv_dtype, spec.attention_impl) == ("float32", "sdpa")
    assert (spec.rope_type, spec.rope_theta, spec.rope_scaling) == ("default", 10000.0, "none")
    assert (spec.adapter_id, spec.tp_size) == ("none", 1)
    scaled = build_tiny_llama(seed=0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    s2 = ns_for(scaled)
    assert (s2.rope_type, s2.rope_scaling) == ("linear", '{"factor":2.0}')
    assert s2.namespace_id != spec.namespace_id
    assert ns_for(model.to(torch.bfloat16)).kv_dtype == "bfloat16"
    with pytest.raises(InvalidArgument, match="model_revision"):
        namespace_for_model(
            build_tiny_llama(0),
            "acme",
            "chat",
            BS,
            **{k: v for k, v in REVISIONS.items() if k != "model_revision"},
        )
    with pytest.raises(ValueError, match="num_layers"):
        ns_for(model, num_layers=3)


def test_worker_refuses_namespace_of_another_model(model):
    other = ns_for(build_tiny_llama(seed=0, layers=3))
    handle = NamespaceHandle(other, other.namespace_id, 0, b"\0" * 16, other.block_bytes, 1)
    with pytest.raises(ValueError, match="num_layers: namespace 3, model 2"):
        CachedPrefillWorker(model, client=None, ns=handle)


def test_prefill_calibration(model):
    cal = measure_prefill(model, [8, 32], repeats=1, warmup=0)
    assert cal.lengths == (8, 32) and 0 < cal.seconds[0] <= cal.seconds[1]
    assert cal.prefill_seconds(32) == cal.seconds[1]
    assert cal.suffix_seconds(8, 32) == pytest.approx(cal.seconds[1] - cal.seconds[0])
    assert cal.prefill_seconds(4) == pytest.approx(cal.seconds[0] / 2)  # through (0, 0)
    assert cal.tokens_per_s(32) == pytest.approx(32 / cal.seconds[1])
    assert type(cal).from_dict(cal.to_dict()) == cal


# ----------------------------------------------------------------- against an agent
@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "grpc"])
def test_cached_prefill_matches_uncached(model, spawn_agent, use_shm):
    spec = ns_for(model)
    agent = start_agent(spawn_agent, spec)
    with KVClient(agent.address, tenant_secret=SECRET, use_shm=use_shm) as client:
        assert client.uses_shm is use_shm
        worker = CachedPrefillWorker(model, client, client.open_namespace(spec))
        with count_positions(model) as seen:
            first = worker.prefill(PROMPT_A)
        assert seen == [len(PROMPT_A)]
        assert (first.usage.cache_read_tokens, first.usage.cache_write_tokens) == (0, 4 * BS)

        with count_positions(model) as seen:
            second = worker.prefill(PROMPT_B)
        assert second.usage.cache_read_tokens == 3 * BS
        assert seen == [len(PROMPT_B) - 3 * BS] and second.computed_tokens == seen[0]
        ref = reference_logits(model, PROMPT_B)[3 * BS :]
        torch.testing.assert_close(second.logits, ref, atol=ATOL, rtol=RTOL)
        print(
            f"max abs logits diff ({'shm' if use_shm else 'grpc'}): "
            f"{max_diff(second.logits, ref):.3g}"
        )

        tokens, usage = worker.generate_greedy(PROMPT_B, 8)
        assert usage.cache_read_tokens == 4 * BS  # B's 4th block was stored by `second`
        assert tokens == reference_greedy(model, PROMPT_B, 8)

        # Every token in cached full blocks: all but the last token's KV is reused.
        whole = PROMPT_A[: 4 * BS]
        with count_positions(model) as seen:
            full = worker.prefill(whole)
        assert seen == [1] and full.usage.cache_read_tokens == 4 * BS - 1
        torch.testing.assert_close(
            full.last_logits, reference_logits(model, whole)[-1], atol=ATOL, rtol=RTOL
        )


def test_other_model_revision_gets_no_hit(model, spawn_agent):
    spec = ns_for(model)
    agent = start_agent(spawn_agent, spec)
    with KVClient(agent.address, tenant_secret=SECRET) as client:
        CachedPrefillWorker(model, client, client.open_namespace(spec)).prefill(PROMPT_A)
        other = CachedPrefillWorker(
            model, client, client.open_namespace(ns_for(model, model_revision="r2"))
        )
        with count_positions(model) as seen:
            res = other.prefill(PROMPT_A)
        assert res.usage.cache_read_tokens == 0 and seen == [len(PROMPT_A)]
        again = CachedPrefillWorker(model, client, client.open_namespace(spec))
        assert again.prefill(PROMPT_A).usage.cache_read_tokens == 4 * BS


def test_sampled_verification_catches_poisoned_blocks(model, spawn_agent):
    spec = ns_for(model)
    agent = start_agent(spawn_agent, spec)
    with KVClient(agent.address, tenant_secret=SECRET) as client:
        honest = CachedPrefillWorker(model, client, client.open_namespace(spec), verify_prob=1.0)
        honest.prefill(PROMPT_A)
        assert honest.prefill(PROMPT_B).verified is True
        assert (honest.verify_checks, honest.verify_mismatches) == (1, 0)
        print(f"verification max abs logits diff (honest): {honest.verify_max_abs_diff:.3g}")

        # Poison a fresh namespace: KV of another prompt stored under PROMPT_A's block
        # ids. The agent checksums what it is given, so the blocks pass integrity checks.
        poisoned = client.open_namespace(ns_for(model, prompt_template_version="v2"))
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prompt(9, 3 * BS)]), use_cache=True)
        ids = client.block_ids(poisoned, PROMPT_A)[:3]
        assert client.put(poisoned, ids, kv_to_blocks(cache_to_kv(out.cache), BS)).stored == 3

        checker = CachedPrefillWorker(model, client, poisoned, verify_prob=1.0)
        res = checker.prefill(PROMPT_A)
        ref = reference_logits(model, PROMPT_A)
        assert res.usage.cache_read_tokens == 3 * BS
        assert (checker.verify_checks, checker.verify_mismatches) == (1, 1)
        assert res.verified is False
        torch.testing.assert_close(res.logits, ref[3 * BS :], atol=ATOL, rtol=RTOL)  # clean
        print(f"verification max abs logits diff (poisoned): {checker.verify_max_abs_diff:.3g}")

        # Without verification the poison reaches the output: the check is what saved it.
        blind = CachedPrefillWorker(model, client, poisoned)
        served = blind.prefill(PROMPT_A)
        assert served.prefix_tokens > 0
        assert max_diff(served.logits, ref[served.prefix_tokens :]) > 1e-2


def test_verification_sampling_is_seeded(model, spawn_agent):
    spec = ns_for(model)
    agent = start_agent(spawn_agent, spec)
    with KVClient(agent.address, tenant_secret=SECRET) as client:
        handle = client.open_namespace(spec)
        CachedPrefillWorker(model, client, handle).prefill(PROMPT_A)
        runs = []
        for _ in range(2):
            w = CachedPrefillWorker(model, client, handle, verify_prob=0.5, verify_seed=7)
            runs.append([w.prefill(PROMPT_B[: 3 * BS + k]).verified for k in range(1, 9)])
            assert w.verify_mismatches == 0
        assert runs[0] == runs[1]
        assert set(runs[0]) == {True, None}  # some sampled, some not


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_kv_round_trip(spawn_agent, dtype):
    model = build_tiny_llama(seed=0, dtype=dtype)
    spec = ns_for(model)
    agent = start_agent(spawn_agent, spec)
    with KVClient(agent.address, tenant_secret=SECRET) as client:
        worker = CachedPrefillWorker(model, client, client.open_namespace(spec))
        worker.prefill(PROMPT_A)
        res = worker.prefill(PROMPT_B)
        assert res.usage.cache_read_tokens == 3 * BS
        ref = reference_logits(model, PROMPT_B)[3 * BS :]
        torch.testing.assert_close(res.logits, ref, atol=1e-2, rtol=1e-2)
        print(f"max abs logits diff ({dtype}): {max_diff(res.logits, ref):.3g}")
        assert worker.generate_greedy(PROMPT_B, 8)[0] == reference_greedy(model, PROMPT_B, 8)


# ------------------------------------------------------- through the router, two agents
def test_cached_prefill_through_router_across_two_agents(model, spawn_agent, etcd, start_router):
    """Prefixes stored through the router on two agents: every later request is routed to
    the node holding its prefix, and logits and greedy tokens still equal a cache-free
    run."""
    from support.cluster import agent_config, spawn_many
    from support.common import wait_for

    from kvstore.client.cluster import ClusterClient, RoutedClient

    spec = ns_for(model)
    spawn_many(
        spawn_agent,
        2,
        **agent_config(etcd, slot_bytes=spec.block_bytes, pool_bytes=256 * spec.block_bytes),
    )
    router = start_router()
    router.wait_nodes({"agent-0": 0, "agent-1": 0})
    other = SYSTEM[:BS] + prompt(9, 3 * BS)  # shares one block with A and B
    with ClusterClient(router.address, tenant_secret=SECRET, use_shm=False) as cc:
        client = RoutedClient(cc)
        worker = CachedPrefillWorker(model, client, cc.open_namespace(spec))
        first = worker.prefill(PROMPT_A)
        assert first.usage.cache_read_tokens == 0
        holder_id = wait_for(
            lambda: next((k for k, n in router.nodes().items() if n.indexed_blocks == 4), None),
            20,
            what="the router to index prompt A's 4 blocks",
        )
        hit_b = cc.fetch(cc.open_namespace(spec), PROMPT_B)
        cc.release(hit_b)
        assert hit_b.node_id == holder_id and hit_b.cached_blocks == 3
        second = worker.prefill(PROMPT_B)
        assert second.usage.cache_read_tokens == 3 * BS
        torch.testing.assert_close(
            second.logits, reference_logits(model, PROMPT_B)[3 * BS :], atol=ATOL, rtol=RTOL
        )
        tokens, _ = worker.generate_greedy(PROMPT_B, 8)
        assert tokens == reference_greedy(model, PROMPT_B, 8)
        third = worker.prefill(other)
        torch.testing.assert_close(
            third.last_logits, reference_logits(model, other)[-1], atol=ATOL, rtol=RTOL
        )
