"""Plain regression tests for the bugs the property-based tests of the BlockStore found
(test_store_props.py, test_store_props_threads.py), each minimized to its few steps."""

from __future__ import annotations

import numpy as np
from support.common import TEST_SECRET
from support.store import NB, SPEC, check_invariants, get, lookup, policy, prompt, put

from kvstore import checksum as cks
from kvstore.events import Tier

NS = SPEC.namespace_id
ROOT = SPEC.root(0, TEST_SECRET)


class _HookPool:
    """Fault injection: runs `hook(slot)` once, inside the first read_into, that is in the
    middle of a get's copy (outside the store's lock)."""

    def __init__(self, pool, hook) -> None:
        self._pool, self._hook = pool, hook

    def _run_hook(self, slot) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook(slot)

    def read_into(self, slot, nbytes, dst):
        self._run_hook(slot)
        return self._pool.read_into(slot, nbytes, dst)

    def read_many(self, slots, sizes, dsts, threads=1):
        if slots:
            self._run_hook(slots[0])
        return self._pool.read_many(slots, sizes, dsts, threads)

    def __getattr__(self, name):
        return getattr(self._pool, name)


def fill(res, items) -> list[int]:
    for view, it in zip(res.views, items):
        view[:] = np.frombuffer(it.data, dtype=np.uint8)
    return [cks.checksum(it.data) for it in items]


def test_a_block_whose_parent_was_demoted_meanwhile_does_not_enter_the_pool(make_store):
    """Reserve [b0, b1]; meanwhile a put stores b0, and pool pressure demotes it (a pool
    leaf: b1 is not visible yet). Committing the reservation finds b0 present (raced) and
    must not put b1 in the pool under a parent that is only on NVMe: the pool would not be
    prefix-closed, and lookups binary-search on that."""
    store = make_store(n_slots=4)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 2)
    res = store.reserve(NS, 0, ids, ROOT, ROOT)
    sums = fill(res, items)
    assert put(store, items[:1]) == (1, 0)
    put(store, prompt(2, 2)[1])  # takes the last free slot and demotes b0
    assert lookup(store, ids[:1]) == (1, 0, 1)
    store.commit(res, sums)
    check_invariants(store)
    matched, hbm, _ = lookup(store, ids)
    assert hbm == 0
    assert get(store, ids[:matched])[1] == [it.data for it in items[:matched]]


def test_open_reservations_count_against_the_tenants_quota(make_store):
    """Reserved slots are not in the tenant's accounts until commit: two reservations of
    three blocks each fitted a four-block quota one by one, and their commits held six."""
    store = make_store(n_slots=10)
    store.open_namespace(SPEC)
    store.set_tenant_limits(SPEC.tenant, 4 * NB, None)
    (a, items_a), (b, items_b) = prompt(1, 3), prompt(2, 3)
    first = store.reserve(NS, 0, a, ROOT, ROOT)
    second = store.reserve(NS, 0, b, ROOT, ROOT)
    assert len(first) + len(second) == 4
    assert second.reason == "pool or quota full"
    store.commit(first, fill(first, items_a))
    store.commit(second, fill(second, items_b[: len(second)]))
    assert store.accounts.used(SPEC.tenant, Tier.HBM) == 4 * NB
    check_invariants(store)


def test_a_put_counts_the_tenants_open_reservations(make_store):
    store = make_store(n_slots=10)
    store.open_namespace(SPEC)
    store.set_tenant_limits(SPEC.tenant, 4 * NB, None)
    ids, items = prompt(1, 3)
    res = store.reserve(NS, 0, ids, ROOT, ROOT)
    assert put(store, prompt(2, 3)[1]) == (1, 0)  # room for one more block, not three
    store.commit(res, fill(res, items))
    assert store.accounts.used(SPEC.tenant, Tier.HBM) == 4 * NB
    check_invariants(store)


def test_a_corrupt_read_does_not_drop_the_block_put_again_meanwhile(make_store):
    """A get copying a slot that went bad drops the block when it finds the mismatch: the
    block it read, not whatever holds that id by then. Here another reader found the
    corruption first, and the block was put again (good, in another slot) while the first
    get was still copying the bad one."""
    store = make_store(n_slots=8, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 1)
    put(store, items)
    base = store.pool

    def meanwhile(slot):
        base.raw_view(slot)[0] ^= 1
        assert get(store, ids)[0] == []  # found corrupt and dropped
        assert put(store, items) == (1, 0)

    store.pool = _HookPool(base, meanwhile)
    assert get(store, ids)[0] == []  # this copy was bad: a miss
    store.pool = base
    assert lookup(store, ids) == (1, 1, 0)
    assert get(store, ids)[1] == [items[0].data]
    assert store.counters["corrupt_dropped"] == 1
    check_invariants(store)


def test_a_put_says_why_blocks_were_left_out(make_store):
    """PendingPut.not_stored (PutResponse.not_stored): an orphan, a chain shorter than
    min_prefix_blocks, a quota with no room for the rest; "" when nothing is left out."""

    def why(store, items) -> tuple[int, int, str]:
        pending = store.put_begin(NS, 0, items, ROOT, False)
        return (*pending.finish(), pending.not_stored)

    store = make_store(n_slots=10)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 5)
    stored, _, reason = why(store, items[2:])  # blocks 2..4: block 1 is not held
    assert stored == 0
    assert reason.startswith(f"block 0: its parent {ids[1].hex()[:12]} is not held here")
    assert why(store, items[:3]) == (3, 0, "")
    store.set_tenant_limits(SPEC.tenant, 4 * NB, None)
    stored, already, reason = why(store, items)  # room for one more block, not two
    assert (stored, already) == (1, 3)
    assert reason == (
        f"the pool has no room for block 4 within tenant {SPEC.tenant}'s quota: the "
        "1 new blocks before it stored, not the rest"
    )
    check_invariants(store)


def test_a_put_below_min_prefix_says_so(make_store):
    store = make_store(policy_for=policy(min_prefix_blocks=3))
    store.open_namespace(SPEC)
    pending = store.put_begin(NS, 0, prompt(1, 2)[1], ROOT, False)
    assert pending.finish() == (0, 0)
    assert "2 blocks deep, shorter than namespace" in pending.not_stored
    assert "min_prefix_blocks (3): nothing stored" in pending.not_stored
