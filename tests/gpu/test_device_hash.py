"""The device-memory checksum (kvstore/device_hash.py) and the in-place paths of a pool whose
slot views are tensors, as a GPU pool's are: payloads landed by a transport are verified
where they lie, with the same XXH64 the host computes.

On a machine without a GPU the Triton kernel runs under Triton's interpreter on CPU tensors
(slow: the blocks here are a few hundred bytes); on a GPU machine the same tests run the
compiled kernel on the GPU (tools/gpu_check.sh)."""

from __future__ import annotations

import os
import random

import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is defined, on first use

from support.common import TEST_SECRET, chain_items, make_namespace, prompt_tokens  # noqa: E402

from kvstore import checksum as cks  # noqa: E402
from kvstore import device_hash  # noqa: E402
from kvstore.errors import DataLoss, InvalidArgument  # noqa: E402
from kvstore.events import Tier  # noqa: E402
from kvstore.store import BlockStore  # noqa: E402
from kvstore.tiers.pool import DevicePool, SlotStateError  # noqa: E402
from node_agent.peer.staging import runs_of, spans  # noqa: E402

DEVICE = "cuda:0" if GPU else "cpu"
# 1 layer x (K, V) x 2 heads x 4 dims x 4 tokens x fp16: 128-byte blocks
SMALL = make_namespace(name="tiny-blocks", num_layers=1, head_dim=4, block_size=4)
ROOT = SMALL.root(0, TEST_SECRET)


def payload_bytes(view) -> bytes:
    return view.cpu().numpy().tobytes()


def pool_of(n_slots: int, slot_bytes: int) -> DevicePool:
    return DevicePool(n_slots, slot_bytes, DEVICE, tensor_views=not GPU)


def test_the_kernel_is_there():
    assert device_hash.available(torch.device(DEVICE)), device_hash.why_not()


@pytest.mark.parametrize(
    "nbytes", [0, 1, 3, 4, 7, 8, 12, 31, 32, 33, 100, 255, 256, 257, 300, 512, 520, 1100]
)
def test_digests_equal_the_host_xxh64(nbytes):
    """Every part of XXH64: no stripe, stripes in whole unrolled steps (16 a step) and left
    over, 8-byte words, a 4-byte word and single bytes after them."""
    pool = torch.randint(
        0, 256, (5, 1104), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)
    ).to(DEVICE)
    slots = [4, 0, 2, 2]  # any order, repeats allowed
    host = pool.cpu().numpy()
    assert device_hash.slot_digests(pool, slots, nbytes) == [
        cks.checksum(host[s, :nbytes]) for s in slots
    ]


def test_one_flipped_bit_changes_the_digest():
    pool = torch.zeros((2, 264), dtype=torch.uint8, device=DEVICE)
    pool[1, 261] = 1 << 5  # in the tail, past the last whole stripe
    a, b = device_hash.slot_digests(pool, [0, 1], 264)
    assert a == cks.checksum(bytes(264)) and b != a


@pytest.mark.parametrize(
    "bad,why",
    [
        (lambda: torch.zeros((2, 64), dtype=torch.int16, device=DEVICE), "uint8"),
        (lambda: torch.zeros((2, 128), dtype=torch.uint8, device=DEVICE)[:, :64], "contiguous"),
        (lambda: torch.zeros(128, dtype=torch.uint8, device=DEVICE), "2-D"),
        (lambda: torch.zeros((2, 60), dtype=torch.uint8, device=DEVICE), "aligned"),
    ],
)
def test_bad_pools_are_refused(bad, why):
    with pytest.raises(InvalidArgument, match=why):
        device_hash.slot_digests(bad(), [0], 8)


def test_bad_lengths_and_slots_are_refused():
    pool = torch.zeros((2, 64), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(InvalidArgument, match="do not fit"):
        device_hash.slot_digests(pool, [0], 65)
    with pytest.raises(InvalidArgument, match="out of range"):
        device_hash.slot_digests(pool, [2], 8)
    assert device_hash.slot_digests(pool, [], 8) == []


COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kvstore import _xxh64_kernel as K, device_hash
sig = {"w64": "*i64", "w32": "*i32", "w8": "*u8", "slots": "*i64", "out": "*i64",
       "slot_words": sys.argv[2], "nbytes": sys.argv[2], "UNROLL": "constexpr"}
k = compile(ASTSource(K.xxh64_slots, sig, constexprs={"UNROLL": device_hash.UNROLL}),
            target=GPUTarget("cuda", int(sys.argv[1]), 32), options={"num_warps": 1})
print(k.metadata.num_warps, len(k.asm["cubin"]))
"""


@pytest.mark.parametrize("arch,ints", [(80, "i32"), (90, "i32"), (90, "i64")])
def test_the_kernel_compiles_for_cuda_gpus(arch, ints):
    """The interpreter checks what the kernel computes; this checks that triton compiles it
    for real GPUs (A100, H100/H200) down to a cubin, here without one (ptxas comes with
    triton), with 32- and 64-bit sizes. In a subprocess: this one runs the interpreter."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9 warns when it is unset
    r = subprocess.run(
        [sys.executable, "-c", COMPILE, str(arch), ints],
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    warps, cubin = map(int, r.stdout.split())
    assert warps == 1 and cubin > 0


# --------------------------------------------------------- a pool with tensor slot views
def make_store(n_slots: int = 8) -> BlockStore:
    store = BlockStore(pool_of(n_slots, SMALL.block_bytes), None)
    store.open_namespace(SMALL)
    return store


def prompt(seed: int, n: int):
    ids, items = chain_items(SMALL, prompt_tokens(seed, n * SMALL.block_size))
    return list(ids), items


def fill(res, items) -> list[int]:
    """What UCX does into device memory: the payloads land in the slot views."""
    for view, it in zip(res.views, items):
        view.copy_(torch.frombuffer(bytearray(it.data), dtype=torch.uint8))
    return [cks.checksum(it.data) for it in items]


def get(store, ids) -> list[bytes]:
    bufs = []
    store.get(SMALL.namespace_id, 0, ids, ROOT, lambda i, n: bufs.append(bytearray(n)) or bufs[-1])
    return [bytes(b) for b in bufs]


def test_in_place_writes_are_verified_where_they_landed():
    store = make_store()
    assert store.supports_in_place and store.pool.in_place
    ids, items = prompt(1, 4)
    res = store.reserve(SMALL.namespace_id, 0, ids, ROOT, ROOT)
    assert all(isinstance(v, torch.Tensor) and v.device == store.pool.device for v in res.views)
    sums = fill(res, items)
    assert store.pool.digests(res.views) == sums
    assert store.commit(res, sums) == 4
    assert get(store, ids) == [it.data for it in items]


def test_a_payload_corrupted_in_device_memory_is_not_stored():
    store = make_store()
    ids, items = prompt(2, 4)
    res = store.reserve(SMALL.namespace_id, 0, ids, ROOT, ROOT)
    sums = fill(res, items)
    res.views[2][17] ^= 0x10  # a torn write on the wire
    with pytest.raises(DataLoss):
        store.commit(res, sums)
    assert get(store, ids) == [it.data for it in items[:2]]
    assert store.pool.free_slots == store.pool.n_slots - 2


def test_a_verifying_borrow_hashes_the_slots_in_device_memory():
    store = make_store()
    ids, items = prompt(3, 3)
    assert store.put(SMALL.namespace_id, 0, items) == (3, 0)
    b = store.borrow(SMALL.namespace_id, 0, ids, ROOT)
    assert [payload_bytes(v) for v in b.views] == [it.data for it in items]
    slot = b.metas[1].slot
    store.release(b)
    store.pool.tensor[slot, 5] ^= 0x01
    b = store.borrow(SMALL.namespace_id, 0, ids, ROOT)
    assert len(b) == 1 and store.counters["corrupt_dropped"] == 1
    store.release(b)


def test_runs_and_spans_of_tensor_slot_views():
    """Slots reserved one after another lie back to back: one UCX message per run, a
    tensor over the run's slots (device memory that UCX registers)."""
    store = make_store(n_slots=8)
    ids, items = prompt(4, 5)
    res = store.reserve(SMALL.namespace_id, 0, ids, ROOT, ROOT)
    size = SMALL.block_bytes
    views = res.views
    assert runs_of(views, size) == [5] and runs_of(views, size, cap=2) == [2, 2, 1]
    fill(res, items)
    msgs = spans(views, [2, 2, 1], size)
    assert [m.numel() for m in msgs] == [2 * size, 2 * size, size]
    assert b"".join(payload_bytes(m) for m in msgs) == b"".join(it.data for it in items)
    assert spans([views[0], views[2]], [2], size) is None  # not back to back
    store.abort(res)


# ------------------------------------------- Gets into device staging (tensor destinations)
def get_into_staging(store, ids, staging: torch.Tensor) -> list:
    """A Get as the agent runs one into a client's device staging area: each block's
    destination is a span of one uint8 tensor on the pool's device."""
    size = SMALL.block_bytes
    return store.get(
        SMALL.namespace_id, 0, ids, ROOT, lambda i, n: staging[i * size : i * size + n]
    )


def test_a_get_into_device_staging_copies_verified_blocks_on_the_device():
    store = make_store()
    ids, items = prompt(6, 5)
    assert store.put(SMALL.namespace_id, 0, items) == (5, 0)
    staging = torch.zeros(8 * SMALL.block_bytes, dtype=torch.uint8, device=DEVICE)
    served = get_into_staging(store, ids, staging)
    assert [s.block_id for s in served] == ids
    assert [s.checksum for s in served] == [cks.checksum(it.data) for it in items]
    assert payload_bytes(staging[: 5 * SMALL.block_bytes]) == b"".join(it.data for it in items)
    assert payload_bytes(staging[5 * SMALL.block_bytes :]) == bytes(3 * SMALL.block_bytes)


def test_a_block_corrupted_in_the_pool_is_not_served_into_device_staging():
    store = make_store()
    ids, items = prompt(7, 4)
    store.put(SMALL.namespace_id, 0, items)
    meta = store.namespace(SMALL.namespace_id, 0).blocks[ids[2]]
    store.pool.tensor[meta.slot, 3] ^= 0x40
    staging = torch.zeros(4 * SMALL.block_bytes, dtype=torch.uint8, device=DEVICE)
    served = get_into_staging(store, ids, staging)
    assert len(served) == 2 and store.counters["corrupt_dropped"] == 1
    assert store.lookup(SMALL.namespace_id, 0, ids).matched == 2  # dropped, never served


def test_device_staging_destinations_are_checked_before_any_copy():
    pool = pool_of(2, 64)
    slot = pool.reserve()
    pool.write(slot, bytes(range(64)))
    pool.commit(slot)
    with pytest.raises(InvalidArgument, match="needs room"):
        pool.read_tensors([slot], [64], [torch.zeros(32, dtype=torch.uint8, device=DEVICE)])
    free = pool.reserve()
    dst = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(SlotStateError):
        pool.read_tensors([slot, free], [64, 64], [dst, dst.clone()])
    assert payload_bytes(dst) == bytes(64)  # nothing copied before the refusal
    assert pool.read_into(slot, 64, dst) == cks.checksum(bytes(range(64)))
    assert payload_bytes(dst) == bytes(range(64))


def test_a_host_pool_without_tensor_views_refuses_tensor_destinations():
    pool = DevicePool(2, 64, "cpu")
    slot = pool.reserve()
    pool.write(slot, bytes(64))
    pool.commit(slot)
    with pytest.raises(InvalidArgument, match="tensor destinations"):
        pool.read_tensors([slot], [64], [torch.zeros(64, dtype=torch.uint8)])


def test_an_nvme_block_reaches_device_staging_through_the_host(tmp_path):
    """A block only on NVMe is read into host memory, verified, copied into its staging
    span, and promoted into the pool as on any Get."""
    from kvstore.tiers.rocks import RocksTier

    rocks = RocksTier(str(tmp_path / "r"), 1 << 20)
    store = BlockStore(pool_of(4, SMALL.block_bytes), rocks)
    try:
        store.open_namespace(SMALL)
        ids, items = prompt(8, 4)
        store.put(SMALL.namespace_id, 0, items)
        store.put(SMALL.namespace_id, 0, prompt(9, 4)[1])  # a 4-slot pool: the first spills
        assert store.namespace(SMALL.namespace_id, 0).blocks[ids[0]].slot < 0
        staging = torch.zeros(4 * SMALL.block_bytes, dtype=torch.uint8, device=DEVICE)
        served = get_into_staging(store, ids, staging)
        assert [s.tier for s in served] == [Tier.NVME] * 4
        assert payload_bytes(staging) == b"".join(it.data for it in items)
        assert store.counters["promotions"] == 4
    finally:
        rocks.close()


def test_a_pool_without_the_kernel_keeps_copying_writes(monkeypatch):
    """No triton: a device pool takes payloads only through put/get (staged on the host)."""
    monkeypatch.setattr(device_hash, "available", lambda device: False)
    pool = pool_of(2, 64)
    assert not pool.in_place and not BlockStore(pool, None).supports_in_place
    assert "no device hash" in pool.why_not_in_place
    slot = pool.reserve()
    with pytest.raises(InvalidArgument, match="cannot verify payloads in place"):
        pool.slot_view(slot, 64, writable=True)
    data = random.Random(5).randbytes(64)
    assert pool.write(slot, data) == cks.checksum(data)


def test_the_benchmark_verifies_and_reports(capsys):
    """loadtest/bench_device_hash.py in a tiny configuration: on a GPU it checks the
    kernel's digests against the host's before timing; without one, host figures only."""
    import json

    from loadtest import bench_device_hash

    assert bench_device_hash.main(["--blocks", "2", "--block-bytes", "4096", "--reps", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["host_xxh64_gbps"] > 0 and out["host_memcpy_gbps"] > 0
    if GPU:
        assert out["device_hash_gbps"] > 0 and out["limit_gbps"] > 0 and out["h2d_gbps"] > 0
    else:
        assert out["device"] == "cpu" and out["device_hash_gbps"] is None
