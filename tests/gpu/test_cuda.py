"""The CUDA paths, on a machine with a GPU (skipped elsewhere): the device pool in GPU
memory, the store's put / get / NVMe spill / promotion through it (the device-agnostic
store tests of test_store.py, run again over a GPU pool), an agent serving from a GPU
pool, and peer transfer into, out of and between GPU pools (payloads land in GPU memory
and are verified there by the device kernel, kvstore/device_hash.py; tests/
test_device_hash.py runs its checks on the GPU too)."""

from __future__ import annotations

import random
import warnings

import pytest
from unit import test_store
import torch
from support.common import (
    TEST_SECRET,
    chain_items,
    free_port,
    make_namespace,
    prompt_tokens,
    store_maker,
)

from kvstore import checksum as cks
from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.errors import DataLoss
from kvstore.tiers.pool import DevicePool, resolve_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The device-agnostic store tests, run again here over a GPU pool (this module's
# make_store). Those that corrupt a slot through raw_view (host pools only) are left out.
test_put_lookup_get_round_trip = test_store.test_put_lookup_get_round_trip
test_get_verifies_the_chain = test_store.test_get_verifies_the_chain
test_spill_to_nvme_and_promote_on_get = test_store.test_spill_to_nvme_and_promote_on_get
test_promotion_keeps_the_pool_prefix_closed = test_store.test_promotion_keeps_the_pool_prefix_closed
test_nvme_capacity_evicts_leaves_from_nvme = test_store.test_nvme_capacity_evicts_leaves_from_nvme
test_prefix_consistency_under_pressure = test_store.test_prefix_consistency_under_pressure
test_parent_with_children_is_never_evicted_before_its_leaves = (
    test_store.test_parent_with_children_is_never_evicted_before_its_leaves
)
test_generation_fencing = test_store.test_generation_fencing
test_flush_while_a_get_is_copying = test_store.test_flush_while_a_get_is_copying
test_payloads_are_copied_not_referenced = test_store.test_payloads_are_copied_not_referenced
test_concurrent_gets_puts_expiry_and_flushes = (
    test_store.test_concurrent_gets_puts_expiry_and_flushes
)

BIG = make_namespace(name="big-cuda", num_layers=32, num_kv_heads=8, head_dim=128)  # 2 MiB


@pytest.fixture
def make_store(tmp_path):
    """conftest's make_store with the pool in GPU memory."""
    yield from store_maker(tmp_path, "cuda:0")


def test_a_gpu_pool_verifies_in_place_writes_with_the_device_kernel(make_store):
    """2 MiB blocks landed in GPU slots (as UCX writes them) are hashed in device memory:
    the same XXH64 as on the host, and a corrupted byte keeps its block out."""
    store = make_store(n_slots=8, slot_bytes=BIG.block_bytes, nvme_bytes=0)
    assert store.pool.is_cuda and store.supports_in_place
    store.open_namespace(BIG)
    root = BIG.root(0, TEST_SECRET)
    ids, items = chain_items(BIG, prompt_tokens(41, 4 * BIG.block_size))
    res = store.reserve(BIG.namespace_id, 0, list(ids), root, root)
    assert all(v.is_cuda for v in res.views)
    for v, it in zip(res.views, items):
        v.copy_(torch.frombuffer(bytearray(it.data), dtype=torch.uint8))
    sums = [cks.checksum(it.data) for it in items]
    assert store.pool.digests(res.views) == sums
    res.views[3][BIG.block_bytes - 1] ^= 0x01
    with pytest.raises(DataLoss):
        store.commit(res, sums)
    assert store.lookup(BIG.namespace_id, 0, list(ids)).matched == 3


def test_a_gpu_where_the_kernel_does_not_build_keeps_copying_writes(monkeypatch):
    """The kernel is compiled when the pool is made; a failure there (a fault injected
    here) leaves the pool taking payloads through put/get only, and says why."""
    from kvstore import device_hash

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(device_hash, "slot_digests", broken)
    pool = DevicePool(2, 4096, "cuda:0")
    assert not pool.in_place and "no compiler" in pool.why_not_in_place
    slot = pool.reserve()
    assert pool.write(slot, bytes(4096)) == cks.checksum(bytes(4096))


def test_auto_picks_the_gpu():
    assert resolve_device("auto") == torch.device("cuda:0")


def test_device_pool_holds_payloads_in_gpu_memory():
    pool = DevicePool(4, 4096, "cuda:0")
    assert pool.is_cuda and pool.tensor.is_cuda
    data = random.Random(7).randbytes(3000)
    slot = pool.reserve()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert pool.write(slot, data) == cks.checksum(data)  # from read-only bytes
    assert not seen, [str(w.message) for w in seen]  # nothing for the agent's log
    pool.commit(slot)
    # The bytes are in GPU memory, and reads copy them back and hash what came back.
    assert bytes(pool.tensor[slot, :3000].cpu().numpy()) == data
    buf = bytearray(3000)
    assert pool.read_into(slot, 3000, buf) == cks.checksum(data) and bytes(buf) == data
    pool.tensor[slot, 5] ^= 0x40  # corrupt one byte on the device
    got, digest = pool.read_bytes(slot, 3000)
    assert digest != cks.checksum(data) and digest == cks.checksum(got)
    view = pool.slot_view(slot, 3000, writable=False)  # for UCX: device memory, in place
    assert view.is_cuda and view.data_ptr() == pool.tensor[slot].data_ptr()


def blocks_for(spec, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, spec.block_bytes), dtype=torch.uint8, generator=g)
    return [r.view(torch_dtype(spec.kv_dtype)).view(block_shape(spec)) for r in raw]


def same_bytes(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)) for x, y in zip(a, b)
    )


def test_agent_on_a_gpu_pool_round_trips_tensors_from_and_to_the_gpu(spawn_agent):
    agent = spawn_agent(device="cuda:0", slot_bytes="2MiB", pool_bytes="64MiB", nvme_bytes="64MiB")
    with KVClient(agent.address, tenant_secret=TEST_SECRET) as c:
        assert c.stats().device.startswith("cuda")
        ns = c.open_namespace(BIG)
        ids = c.block_ids(ns, prompt_tokens(31, 12 * BIG.block_size))
        blocks = [b.cuda() for b in blocks_for(BIG, 12, 31)]  # what a model's prefill holds
        assert c.put(ns, ids, blocks).stored == 12
        got = c.get(ns, ids, device="cuda:0")
        assert all(t.is_cuda for t in got) and same_bytes(got, blocks)
        # 12 blocks of 2 MiB in a 64 MiB pool (32 slots), then 4 more prompts of 10: blocks
        # spill from GPU memory to NVMe, and the first 12 still read back intact.
        for seed in range(32, 36):
            more = c.block_ids(ns, prompt_tokens(seed, 10 * BIG.block_size))
            assert c.put(ns, more, blocks_for(BIG, 10, seed)).stored == 10
        assert dict(c.stats().counters)["demotions"] > 0
        assert same_bytes(c.get(ns, ids), blocks)


@pytest.mark.parametrize(
    "gpu", ["a", "b", "ab"], ids=["into-gpu-pool", "out-of-gpu-pool", "between-gpu-pools"]
)
def test_peer_transfer_into_and_out_of_a_gpu_pool(spawn_agent, gpu):
    mem = dict(slot_bytes="2MiB", pool_bytes="128MiB", nvme_bytes=0)
    b_port, a_port = free_port(), free_port()
    b = spawn_agent(peer_port=b_port, device="cuda:0" if "b" in gpu else "cpu", **mem)
    a = spawn_agent(peer_port=a_port, device="cuda:0" if "a" in gpu else "cpu", **mem)
    with (
        KVClient(b.address, tenant_secret=TEST_SECRET) as cb,
        KVClient(a.address, tenant_secret=TEST_SECRET, use_shm=False) as ca,
    ):
        nb = cb.open_namespace(BIG)
        ids = cb.block_ids(nb, prompt_tokens(33, 40 * BIG.block_size))
        blocks = blocks_for(BIG, 40, 33)
        assert cb.put(nb, ids, blocks).stored == 40
        na = ca.open_namespace(BIG)
        r = ca.prefetch(na, ids, b.address, f"127.0.0.1:{b_port}")
        assert (r.present, r.fetched, r.stopped) == (40, 40, ""), r
        # ucx where ucxx is installed, else the gRPC fallback
        assert r.transport in ("ucx", "grpc"), r.transport
        assert same_bytes(ca.get(na, ids), blocks)
        counters = dict(ca.stats().counters)
        print(
            f"transport {r.transport}, A's counters: "
            f"{ {k: v for k, v in counters.items() if k.startswith('peer_')} }"
        )
        if r.transport == "ucx":  # straight into A's slots (GPU memory on a GPU pool)
            assert counters["peer_blocks_in_place"] == 40, counters


# ------------------------------------------------- device staging: no host memory on a load
def test_a_gpu_client_loads_from_a_gpu_pool_through_device_staging(spawn_agent):
    """The agent's pool and the client on one GPU: the client lends staging memory on the
    GPU (a CUDA VMM allocation's descriptor over the local lane), Gets are copied pool ->
    staging on the GPU and verified there, and the client reads them in device memory."""
    agent = spawn_agent(device="cuda:0", slot_bytes="2MiB", pool_bytes="64MiB", nvme_bytes=0)
    with KVClient(agent.address, tenant_secret=TEST_SECRET) as c:
        assert c.attach_device_staging("cuda:0", 32 << 20) == ""
        assert c.uses_device_staging
        ns = c.open_namespace(BIG)
        assert c.device_staging_capacity(ns) == 16
        ids = c.block_ids(ns, prompt_tokens(51, 20 * BIG.block_size))
        blocks = blocks_for(BIG, 20, 51)
        assert c.put(ns, ids, blocks).stored == 20
        got = c.get_device_staged_tensor(ns, ids[:16])
        assert got.is_cuda and got.shape == (16, *block_shape(BIG))
        assert same_bytes(list(got.unbind(0)), blocks[:16])
        tail = c.get_device_staged_tensor(ns, ids[16:], ids[15])  # a chunk after the first
        assert same_bytes(list(tail.unbind(0)), blocks[16:])
        # More than the area holds is refused before anything is asked.
        with pytest.raises(ValueError, match="at most 16 blocks"):
            c.get_device_staged_tensor(ns, ids)


def test_a_gpu_client_of_a_host_pool_agent_keeps_host_staging(spawn_agent):
    agent = spawn_agent(device="cpu", slot_bytes="2MiB", pool_bytes="64MiB", nvme_bytes=0)
    with KVClient(agent.address, tenant_secret=TEST_SECRET) as c:
        why = c.attach_device_staging("cuda:0", 32 << 20)
        assert "pool is in host memory" in why and not c.uses_device_staging
        ns = c.open_namespace(BIG)
        ids = c.block_ids(ns, prompt_tokens(52, 4 * BIG.block_size))
        blocks = blocks_for(BIG, 4, 52)
        assert c.put(ns, ids, blocks).stored == 4
        assert same_bytes(list(c.get_staged_tensor(ns, ids).unbind(0)), blocks)


def test_the_vllm_layout_loads_from_device_staging_on_the_gpu(spawn_agent):
    """What the vLLM connector's worker does on a GPU engine: the blocks the agent copied
    into device staging are scattered into a flash-attention paged cache on the same GPU
    (no .to() copy: already there) and read back by gather, unchanged."""
    from kvstore.integrations.vllm_layout import PagedLayout

    agent = spawn_agent(device="cuda:0", slot_bytes="2MiB", pool_bytes="64MiB", nvme_bytes=0)
    with KVClient(agent.address, tenant_secret=TEST_SECRET) as c:
        assert c.attach_device_staging("cuda:0", 32 << 20) == ""
        ns = c.open_namespace(BIG)
        ids = c.block_ids(ns, prompt_tokens(53, 6 * BIG.block_size))
        blocks = blocks_for(BIG, 6, 53)
        c.put(ns, ids, blocks)
        dtype = torch_dtype(BIG.kv_dtype)
        shape = (2, 32, BIG.block_size, BIG.num_kv_heads, BIG.head_dim)
        caches = [torch.zeros(shape, dtype=dtype, device="cuda:0") for _ in range(BIG.num_layers)]
        layout = PagedLayout.detect(caches, BIG.block_size, BIG.num_kv_heads, BIG.head_dim)
        staged = c.get_device_staged_tensor(ns, ids)
        layout.scatter([9, 3, 4, 5, 20, 21], staged)
        out = torch.empty((6, *block_shape(BIG)), dtype=dtype, device="cuda:0")
        layout.gather([9, 3, 4, 5, 20, 21], out)
        assert same_bytes(list(out.unbind(0)), blocks)
