"""DevicePool: explicit slot state machine, two-phase writes, capacity, checksums."""

from __future__ import annotations

import random

import pytest

from kvstore import checksum as cks
from kvstore.errors import InvalidArgument
from kvstore.tiers.pool import DevicePool, SlotState, SlotStateError, resolve_device


def _pool(n: int = 4, size: int = 1024) -> DevicePool:
    return DevicePool(n, size, "cpu")


def test_reserve_until_full_then_none():
    pool = _pool(4)
    slots = [pool.reserve() for _ in range(4)]
    assert sorted(slots) == [0, 1, 2, 3]
    assert all(pool.state(s) == SlotState.RESERVED for s in slots)
    assert pool.free_slots == 0
    assert pool.reserve() is None
    pool.abort(slots[2])
    assert pool.free_slots == 1
    assert pool.reserve() == slots[2]


def test_write_commit_read_round_trip_with_checksum():
    pool = _pool()
    data = random.Random(1).randbytes(700)
    slot = pool.reserve()
    digest = pool.write(slot, data)
    assert digest == cks.checksum(data)
    pool.commit(slot)
    assert pool.state(slot) == SlotState.OCCUPIED
    buf = bytearray(700)
    assert pool.read_into(slot, 700, buf) == digest
    assert bytes(buf) == data
    got, d2 = pool.read_bytes(slot, 700)
    assert got == data and d2 == digest
    # A flipped byte in the slot changes what a read reports.
    pool.raw_view(slot)[5] ^= 0x40
    assert pool.read_bytes(slot, 700)[1] != digest


def test_two_phase_abort_returns_the_slot():
    pool = _pool(1)
    slot = pool.reserve()
    pool.write(slot, b"x" * 10)
    pool.abort(slot)
    assert pool.state(slot) == SlotState.FREE and pool.free_slots == 1
    assert pool.reserve() == slot


def test_release_returns_an_occupied_slot():
    pool = _pool(1)
    slot = pool.reserve()
    pool.commit(slot)
    pool.release(slot)
    assert pool.state(slot) == SlotState.FREE and pool.free_slots == 1


def _slot_in(pool: DevicePool, state: SlotState) -> int:
    slot = pool.reserve()
    if state == SlotState.FREE:
        pool.abort(slot)
    elif state == SlotState.OCCUPIED:
        pool.commit(slot)
    assert pool.state(slot) == state
    return slot


LEGAL = {
    (SlotState.RESERVED, "commit"),
    (SlotState.RESERVED, "abort"),
    (SlotState.OCCUPIED, "release"),
}


@pytest.mark.parametrize("state", list(SlotState))
@pytest.mark.parametrize("op", ["commit", "abort", "release"])
def test_illegal_transitions_raise(state, op):
    pool = _pool(2)
    slot = _slot_in(pool, state)
    free_before = pool.free_slots
    if (state, op) in LEGAL:
        getattr(pool, op)(slot)
        assert pool.state(slot) == (SlotState.OCCUPIED if op == "commit" else SlotState.FREE)
        return
    with pytest.raises(SlotStateError, match="illegal transition"):
        getattr(pool, op)(slot)
    # A refused transition changes nothing: no double entry in the free list.
    assert pool.state(slot) == state and pool.free_slots == free_before


def test_double_release_never_hands_a_slot_out_twice():
    pool = _pool(2)
    slot = _slot_in(pool, SlotState.OCCUPIED)
    pool.release(slot)
    with pytest.raises(SlotStateError):
        pool.release(slot)
    got = {pool.reserve(), pool.reserve()}
    assert got == {0, 1} and pool.reserve() is None


def test_read_and_write_need_the_right_state():
    pool = _pool()
    slot = pool.reserve()
    with pytest.raises(SlotStateError):
        pool.read_into(slot, 4, bytearray(4))
    pool.commit(slot)
    with pytest.raises(SlotStateError):
        pool.write(slot, b"abcd")


def test_sizes_are_checked():
    pool = _pool(2, 64)
    slot = pool.reserve()
    with pytest.raises(InvalidArgument, match="does not fit"):
        pool.write(slot, b"x" * 65)
    with pytest.raises(InvalidArgument):
        DevicePool(0, 64, "cpu")
    with pytest.raises(InvalidArgument):
        DevicePool(4, 0, "cpu")
    assert pool.capacity_bytes == 128


def test_resolve_device():
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(InvalidArgument, match="only cuda:N and cpu"):
        resolve_device("meta")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument, match="CUDA is not available"):
            resolve_device("cuda:0")
        assert resolve_device("auto").type == "cpu"


def test_a_cuda_device_beyond_the_hosts_count_is_refused(monkeypatch):
    """On a host with one GPU (injected: CPU-only hosts have none), cuda:3 is refused by
    the pool itself, as the agent's start check refuses it; cuda:0 is taken."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidArgument, match=r"'cuda:3': this host has 1 CUDA device"):
        resolve_device("cuda:3")
    assert resolve_device("cuda:0") == torch.device("cuda:0")
