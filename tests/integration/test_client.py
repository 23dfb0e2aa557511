"""Client library against a real agent: prompt-level fetch/store and usage reporting
(prompt, cache-read, cache-write and uncached tokens), on both transports."""

from __future__ import annotations

import pytest
import torch

from support.common import TEST_SECRET, make_namespace, prompt_tokens

from kvstore.client import KVClient, Usage, blocks_to_kv, kv_to_blocks
from kvstore.client.convert import torch_dtype

SPEC = make_namespace()
LONG = make_namespace(name="long")  # min_prefix_blocks=10 on the agent below
BS = SPEC.block_size


def prompt_kv(spec, tokens: int, seed: int) -> torch.Tensor:
    """(layers, 2, tokens, heads, head_dim) KV for a prompt, as prefill would produce."""
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, 2, tokens, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=g).to(torch_dtype(spec.kv_dtype))


@pytest.fixture
def agent(spawn_agent):
    return spawn_agent(policies={"acme/long": {"min_prefix_blocks": 10}})


def clients(agent):
    """One client per transport: (shared memory, plain gRPC)."""
    for use_shm in (True, False):
        with KVClient(
            agent.address, tenant_secret=TEST_SECRET, use_shm=use_shm, shm_bytes=1 << 20
        ) as c:
            assert c.uses_shm is use_shm
            yield c


def test_usage_for_a_miss_then_a_hit(agent):
    for k, c in enumerate(clients(agent)):
        _usage_checks(c, 100 * k)


def _usage_checks(c: KVClient, seed: int) -> None:
    if True:
        ns = c.open_namespace(SPEC)
        tokens = prompt_tokens(seed + 1, 40)  # two full blocks and an 8-token tail
        kv = prompt_kv(SPEC, 40, seed=1)

        miss = c.fetch(ns, tokens)
        assert (miss.cached_blocks, miss.cached_tokens, len(miss.block_ids)) == (0, 0, 2)
        assert c.store(ns, tokens, kv, cached_blocks=miss.cached_blocks) == Usage(
            prompt_tokens=40, cache_read_tokens=0, cache_write_tokens=32, uncached_tokens=40
        )

        hit = c.fetch(ns, tokens)
        assert hit.cached_tokens == 32
        assert torch.equal(blocks_to_kv(hit.blocks), kv[:, :, :32])
        assert c.store(ns, tokens, kv, cached_blocks=hit.cached_blocks) == Usage(40, 32, 0, 8)

        # The partial tail was not cached: the same 32 tokens then another tail still hit
        # exactly two blocks, and a third full block is a new write.
        longer = tokens[:32] + prompt_tokens(seed + 2, 20)
        kv2 = torch.cat([kv[:, :, :32], prompt_kv(SPEC, 20, seed=2)], dim=2)
        hit = c.fetch(ns, longer)
        assert hit.cached_tokens == 32
        assert c.store(ns, longer, kv2, cached_blocks=hit.cached_blocks) == Usage(52, 32, 16, 20)
        assert c.fetch(ns, longer).cached_tokens == 48

        # A prompt shorter than one block has nothing to cache.
        short = prompt_tokens(seed + 3, 10)
        assert c.fetch(ns, short).cached_tokens == 0
        assert c.store(ns, short, prompt_kv(SPEC, 10, seed=3)) == Usage(10, 0, 0, 10)

        # A list of block tensors works as well as one KV tensor.
        tokens4 = prompt_tokens(seed + 4, 64)
        blocks = kv_to_blocks(prompt_kv(SPEC, 64, seed=4), BS)
        assert c.store(ns, tokens4, blocks).cache_write_tokens == 64


def test_min_prefix_blocks_over_either_transport(agent):
    for k, c in enumerate(clients(agent)):
        ns = c.open_namespace(LONG)
        assert ns.min_prefix_blocks == 10
        short = prompt_tokens(100 * k + 1, 9 * BS)
        assert c.store(ns, short, prompt_kv(LONG, 9 * BS, seed=1)).cache_write_tokens == 0
        # put says why, over either transport (the staging lane and gRPC)
        put = c.put(ns, c.block_ids(ns, short), kv_to_blocks(prompt_kv(LONG, 9 * BS, seed=1), BS))
        assert (put.stored, put.already_present) == (0, 0)
        assert "9 blocks deep, shorter than namespace" in put.not_stored
        assert c.fetch(ns, short).cached_tokens == 0
        # 12 blocks: more than one gRPC message, every block is kept.
        long = prompt_tokens(100 * k + 2, 12 * BS)
        kv = prompt_kv(LONG, 12 * BS, seed=2)
        assert c.store(ns, long, kv).cache_write_tokens == 12 * BS
        hit = c.fetch(ns, long)
        assert hit.cached_tokens == 12 * BS
        assert torch.equal(blocks_to_kv(hit.blocks), kv)


def test_put_refuses_blocks_of_the_wrong_dtype_or_shape(agent):
    for k, c in enumerate(clients(agent)):
        ns = c.open_namespace(SPEC)
        tokens = prompt_tokens(100 * k + 1, BS)
        ids = c.block_ids(ns, tokens)
        good = kv_to_blocks(prompt_kv(SPEC, BS, seed=1), BS)
        with pytest.raises(ValueError, match="dtype"):
            c.put(ns, ids, [good[0].float()])
        with pytest.raises(ValueError, match="shape"):
            c.put(ns, ids, [good[0].reshape(-1)[:100]])
        with pytest.raises(ValueError, match="ids for"):
            c.put(ns, ids, good + good)
        assert c.fetch(ns, tokens).cached_tokens == 0
        assert c.put(ns, ids, good).stored == 1
    with KVClient(agent.address, use_shm=False) as c:  # no tenant secret
        with pytest.raises(ValueError, match="secret"):
            c.open_namespace(SPEC)
        pub = c.open_namespace(make_namespace(name="docs", public=True))
        assert pub.root == make_namespace(name="docs", public=True).root(0, None)


def test_staging_views_of_two_layouts_on_one_client(agent):
    """Each namespace's views over the staging area have its own shape and dtype, lie over
    the same memory, and get_views returns what was stored, whichever layout came before."""
    wide = make_namespace(name="wide", num_kv_heads=SPEC.num_kv_heads * 2, kv_dtype="float32")
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as c:
        ns_a, ns_b = c.open_namespace(SPEC), c.open_namespace(wide)
        a_blocks = kv_to_blocks(prompt_kv(SPEC, 2 * BS, seed=3), BS)
        b_blocks = kv_to_blocks(prompt_kv(wide, 2 * BS, seed=4), BS)
        ids_a = c.block_ids(ns_a, prompt_tokens(7, 2 * BS))
        ids_b = c.block_ids(ns_b, prompt_tokens(8, 2 * BS))
        assert c.put(ns_a, ids_a, a_blocks).stored == 2
        assert c.put(ns_b, ids_b, b_blocks).stored == 2
        for _ in range(2):  # the second time from views made before
            got_a = c.get_views(ns_a, ids_a)
            assert [v.shape for v in got_a] == [b.shape for b in a_blocks]
            assert all(torch.equal(v, b) for v, b in zip(got_a, a_blocks))
            got_b = c.get_views(ns_b, ids_b)
            assert [(v.shape, v.dtype) for v in got_b] == [(b.shape, b.dtype) for b in b_blocks]
            assert all(torch.equal(v, b) for v, b in zip(got_b, b_blocks))
        assert got_a[0].data_ptr() == got_b[0].data_ptr() == c.staging_views(ns_a, 1)[0].data_ptr()
        assert got_a[1].data_ptr() == got_a[0].data_ptr() + ns_a.block_bytes
        # A view written by the caller is what put_staged stores.
        ids_c = c.block_ids(ns_a, prompt_tokens(9, BS))
        c.staging_views(ns_a, 1)[0].copy_(a_blocks[1])
        assert c.put_staged(ns_a, ids_c).stored == 1
        assert torch.equal(c.get(ns_a, ids_c)[0], a_blocks[1])
