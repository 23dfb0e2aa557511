"""BlockStore in-process, on a real CPU DevicePool and a real RocksDB in tmp_path: round
trip, chain checks, tiers, prefix consistency, policies, generations, events, threads.
Restart recovery and corruption are in test_store_recovery.py."""

from __future__ import annotations

import pytest
from support.common import (
    TEST_SECRET,
    ManualClock,
    block_payload,
    chain_items,
    make_namespace,
    prompt_tokens,
)
from support.store import (
    BS,
    NB,
    SPEC,
    check_invariants,
    demote_all,
    events_of,
    get,
    lookup,
    policy,
    prompt,
    put,
)

from kvstore.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StaleGeneration,
)
from kvstore.events import EventKind, Tier
from kvstore.store import BlockStore, PutItem
from kvstore.tiers.pool import DevicePool


# ------------------------------------------------------------------ round trip
def test_put_lookup_get_round_trip(make_store):
    store = make_store()
    store.open_namespace(SPEC)
    ids, items = prompt(1, 5, extra_tokens=7)
    assert len(ids) == 5  # the partial tail block has no id
    assert put(store, items) == (5, 0)
    assert lookup(store, ids) == (5, 5, 0)
    assert lookup(store, ids[:2]) == (2, 2, 0)
    served, data = get(store, ids)
    assert [s.block_id for s in served] == ids
    assert all(s.tier == Tier.HBM for s in served)
    assert data == [it.data for it in items]
    assert store.counters["put_already_present"] == 0
    assert put(store, items) == (0, 5)  # idempotent
    assert store.counters["put_already_present"] == 5  # re-sent blocks are counted
    other_ids, _ = prompt(2, 3)
    assert lookup(store, other_ids) == (0, 0, 0)
    check_invariants(store)


def test_unknown_namespace_and_bad_items(make_store):
    store = make_store(n_slots=4)
    with pytest.raises(NotFound, match="OpenNamespace"):
        store.lookup(SPEC.namespace_id, 0, [])
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    short = PutItem(ids[0], items[0].parent_id, b"x" * (NB - 1))
    with pytest.raises(InvalidArgument, match=f"{NB - 1} bytes"):
        put(store, [short])
    with pytest.raises(InvalidArgument, match="16 bytes"):
        put(store, [PutItem(b"abc", items[0].parent_id, items[0].data)])
    bad = PutItem(items[1].block_id, items[1].parent_id, items[1].data, checksum=12345)
    with pytest.raises(DataLoss, match="checksum"):
        put(store, [items[0], bad, items[2]])
    # The block before the bad one is kept, nothing after it, and no slot leaks.
    assert lookup(store, ids) == (1, 1, 0)
    check_invariants(store)
    big = make_namespace(head_dim=4096)
    with pytest.raises(InvalidArgument, match="pool slots"):
        store.open_namespace(big)


def test_get_verifies_the_chain(make_store):
    store = make_store()
    store.open_namespace(SPEC)
    a_ids, a_items = prompt(1, 3)
    b_ids, b_items = prompt(2, 3)
    put(store, a_items)
    put(store, b_items)
    served, _ = get(store, a_ids, parent=b"\x07" * 16)  # wrong chain root
    assert served == []
    served, data = get(store, a_ids[1:], parent=a_ids[0])
    assert [s.block_id for s in served] == a_ids[1:]
    assert data == [it.data for it in a_items[1:]]
    # A present block whose stored parent is not the previous id is not served.
    served, _ = get(store, [a_ids[0], b_ids[1], b_ids[2]])
    assert [s.block_id for s in served] == [a_ids[0]]
    assert store.counters["chain_mismatch"] >= 2


# ---------------------------------------------------------------- tiers
def test_spill_to_nvme_and_promote_on_get(make_store):
    store = make_store(n_slots=4)
    store.open_namespace(SPEC)
    a_ids, a_items = prompt(1, 4)
    b_ids, b_items = prompt(2, 4)
    put(store, a_items)
    events_of(store)
    assert put(store, b_items) == (4, 0)
    assert lookup(store, a_ids) == (4, 0, 4)
    assert lookup(store, b_ids) == (4, 4, 0)
    assert store.counters["demotions"] == 4
    demoted = events_of(store, EventKind.TIER_CHANGED)
    assert {e.block_ids[0] for e in demoted} == set(a_ids)
    assert all(e.tier == Tier.NVME for e in demoted)
    check_invariants(store)
    served, data = get(store, a_ids)
    assert [s.tier for s in served] == [Tier.NVME] * 4
    assert data == [it.data for it in a_items]
    assert lookup(store, a_ids) == (4, 4, 0)  # promoted
    assert lookup(store, b_ids) == (4, 0, 4)  # and B made room for it
    assert store.counters["promotions"] == 4
    promoted = [e for e in events_of(store, EventKind.TIER_CHANGED) if e.tier == Tier.HBM]
    assert [b for e in promoted for b in e.block_ids] == a_ids
    served, data = get(store, a_ids)
    assert [s.tier for s in served] == [Tier.HBM] * 4 and data == [it.data for it in a_items]
    check_invariants(store)


def test_promotion_keeps_the_pool_prefix_closed(make_store):
    """Promoting a block must not demote its own parent to make room."""
    store = make_store(n_slots=2)
    store.open_namespace(SPEC)
    a_ids, a_items = prompt(1, 2)
    put(store, a_items)
    put(store, prompt(2, 1)[1])  # demotes a_ids[1]; a_ids[0] is now the oldest pool leaf
    assert lookup(store, a_ids) == (2, 1, 1)
    served, data = get(store, a_ids[1:], parent=a_ids[0])
    assert data == [a_items[1].data]
    check_invariants(store)
    assert lookup(store, a_ids) == (2, 2, 0)


def test_non_persist_namespace_drops_instead_of_spilling(make_store):
    store = make_store(n_slots=4, policy_for=policy(persist=False))
    store.open_namespace(SPEC)
    a_ids, a_items = prompt(1, 4)
    b_ids, b_items = prompt(2, 4)
    put(store, a_items)
    events_of(store)
    assert put(store, b_items) == (4, 0)
    assert lookup(store, a_ids) == (0, 0, 0)
    assert lookup(store, b_ids) == (4, 4, 0)
    assert store.counters["demotions"] == 0
    assert store.counters["evict_hbm_capacity"] == 4
    removed = [b for e in events_of(store, EventKind.REMOVED) for b in e.block_ids]
    assert sorted(removed) == sorted(a_ids)
    assert sum(1 for _ in store.rocks.scan()) == 0
    check_invariants(store)


def test_nvme_capacity_evicts_leaves_from_nvme(make_store):
    store = make_store(n_slots=2, nvme_bytes=3 * NB)
    store.open_namespace(SPEC)
    chains = [prompt(seed, 2) for seed in range(5)]
    for _, items in chains:
        put(store, items)
        check_invariants(store)
    assert store.nvme_used <= 3 * NB
    assert store.counters["evict_nvme"] > 0
    assert lookup(store, chains[-1][0]) == (2, 2, 0)


def test_prefix_consistency_under_pressure(make_store):
    """Branching chains, more blocks than both tiers hold: after every operation each block
    still has its parent, the pool is prefix-closed and every counter agrees."""
    store = make_store(n_slots=6, nvme_bytes=8 * NB)
    store.open_namespace(SPEC)
    base = prompt_tokens(7, 3 * BS)  # a shared 3-block prefix
    prompts = [base + prompt_tokens(100 + i, (1 + i % 3) * BS) for i in range(12)]
    for i, toks in enumerate(prompts):
        ids, items = chain_items(SPEC, toks)
        put(store, items)
        check_invariants(store)
        if i % 3 == 2:  # re-read an older prompt: promotions under pressure
            old_ids, old_items = chain_items(SPEC, prompts[i - 2])
            n = lookup(store, old_ids)[0]
            served, data = get(store, old_ids)
            assert len(served) == n
            assert data == [it.data for it in old_items[:n]]
            check_invariants(store)
    # A chain longer than the pool in one put: the leading blocks that fit are stored.
    ids, items = prompt(999, 10)
    stored, _ = put(store, items)
    assert 0 < stored <= store.pool.n_slots
    assert lookup(store, ids)[0] == stored
    check_invariants(store)


def test_parent_with_children_is_never_evicted_before_its_leaves(make_store):
    store = make_store(n_slots=5, nvme_bytes=0)  # no NVMe: eviction means leaving the node
    store.open_namespace(SPEC)
    base = prompt_tokens(1, 2 * BS)
    a_ids, a_items = chain_items(SPEC, base + prompt_tokens(2, 2 * BS))
    b_ids, b_items = chain_items(SPEC, base + prompt_tokens(3, BS))
    put(store, a_items)
    put(store, b_items[2:])  # shares a_ids[:2]
    assert lookup(store, b_ids) == (3, 3, 0)
    for seed in range(10, 16):  # one-block prompts, each forcing one eviction
        put(store, prompt(seed, 1)[1])
        check_invariants(store)
        present = {b for st in store.namespaces() for b in st.blocks}
        for ids in (a_ids, b_ids):
            held = [b in present for b in ids]
            assert held == sorted(held, reverse=True), "a child outlived its parent"


# ------------------------------------------------------------------ policies
def test_ttl_expires_and_is_refreshed_on_hit(make_store):
    clock = ManualClock()
    store = make_store(clock=clock, policy_for=policy(ttl_seconds=10))
    store.open_namespace(SPEC)
    hot_ids, hot_items = prompt(1, 2)
    cold_ids, cold_items = prompt(2, 2)
    put(store, hot_items)
    put(store, cold_items)
    clock.advance(6)
    assert len(get(store, hot_ids)[0]) == 2  # refresh: now expires at +16
    clock.advance(6)
    assert lookup(store, hot_ids)[0] == 2
    assert lookup(store, cold_ids)[0] == 0  # expired at +10, not yet collected
    assert get(store, cold_ids)[0] == []
    events_of(store)
    assert store.expire() == 2
    removed = [b for e in events_of(store, EventKind.REMOVED) for b in e.block_ids]
    assert sorted(removed) == sorted(cold_ids)
    clock.advance(5)
    assert lookup(store, hot_ids)[0] == 0
    assert store.expire() == 2
    assert store.block_count() == 0
    check_invariants(store)


def test_re_put_of_an_expired_block_refreshes_it(make_store):
    clock = ManualClock()
    store = make_store(clock=clock, policy_for=policy(ttl_seconds=10))
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    put(store, items)
    clock.advance(11)
    assert lookup(store, ids)[0] == 0
    put(store, items)  # a worker recomputed the prompt: it is fresh again
    assert lookup(store, ids)[0] == 3
    assert store.expire() == 0


def test_min_prefix_blocks(make_store):
    store = make_store(policy_for=policy(min_prefix_blocks=3))
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    assert put(store, items[:2]) == (0, 0)
    assert store.counters["below_min_prefix"] == 1
    assert lookup(store, ids)[0] == 0
    assert put(store, items[:3]) == (3, 0)  # every block of a long-enough prompt
    assert put(store, items[3:]) == (1, 0)  # a continuation of a cached prefix
    assert lookup(store, ids) == (4, 4, 0)


def test_pin_budget_and_pinned_blocks_survive_pressure(make_store):
    store = make_store(n_slots=4, nvme_bytes=0, policy_for=policy(pin_budget_bytes=2 * NB))
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    put(store, items)
    with pytest.raises(ResourceExhausted, match="pin budget"):
        store.pin(SPEC.namespace_id, 0, ids, True)
    assert store.pin(SPEC.namespace_id, 0, ids[:2], True) == (2, 2 * NB)
    assert store.pin(SPEC.namespace_id, 0, ids[:2], True) == (0, 2 * NB)  # idempotent
    for seed in range(10, 20):
        put(store, prompt(seed, 2)[1])
        check_invariants(store)
    assert lookup(store, ids)[0] == 2  # pinned prefix kept, unpinned leaf evicted
    # Two free slots left: a 3-block prompt stores only what fits.
    assert put(store, prompt(30, 3)[1]) == (2, 0)
    assert store.pin(SPEC.namespace_id, 0, ids[:2], False) == (2, 0)
    put(store, prompt(31, 4)[1])
    assert lookup(store, ids)[0] == 0
    check_invariants(store)


def test_put_when_every_slot_is_pinned_is_resource_exhausted(make_store):
    store = make_store(n_slots=2, nvme_bytes=0, policy_for=policy(pin_budget_bytes=4 * NB))
    store.open_namespace(SPEC)
    ids, items = prompt(1, 2)
    put(store, items)
    store.pin(SPEC.namespace_id, 0, ids, True)
    with pytest.raises(ResourceExhausted, match="pinned"):
        put(store, prompt(2, 1)[1])
    check_invariants(store)


# ---------------------------------------------------------------- generations
def test_generation_fencing(make_store):
    store = make_store(n_slots=4)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    demote_all(store)
    with pytest.raises(FailedPrecondition, match="ahead"):
        store.lookup(SPEC.namespace_id, 1, ids)
    events_of(store)
    assert store.set_generation(SPEC.namespace_id, 1) == 8  # both prompts
    assert store.set_generation(SPEC.namespace_id, 1) == 0  # not newer: no-op
    cleared = events_of(store)
    assert [(e.kind, e.generation) for e in cleared] == [(EventKind.NAMESPACE_CLEARED, 1)]
    for call in (
        lambda: store.lookup(SPEC.namespace_id, 0, ids),
        lambda: put(store, items, gen=0),
        lambda: get(store, ids, gen=0),
    ):
        with pytest.raises(StaleGeneration, match="stale"):
            call()
    assert store.block_count() == 0 and sum(1 for _ in store.rocks.scan()) == 0
    ids1, items1 = chain_items(SPEC, prompt_tokens(1, 2 * BS), generation=1)
    assert put(store, items1, gen=1) == (2, 0)
    assert ids1 != ids[:2]  # the generation is in the chain root
    check_invariants(store)


class FlushDuringWrite(DevicePool):
    """Fault injection: a namespace flush lands while a put copies its payloads."""

    store: BlockStore | None = None

    def _flush_once(self) -> None:
        if self.store is not None:
            store, self.store = self.store, None
            store.set_generation(SPEC.namespace_id, 1)

    def write(self, slot, src):
        digest = super().write(slot, src)
        self._flush_once()
        return digest

    def write_many(self, slots, srcs, threads=1):
        digests = super().write_many(slots, srcs, threads)
        self._flush_once()
        return digests


def test_put_racing_a_flush_stores_nothing(make_store, tmp_path):
    pool = FlushDuringWrite(4, NB, "cpu")
    store = BlockStore(pool, None)
    store.open_namespace(SPEC)
    pool.store = store
    ids, items = prompt(1, 3)
    assert put(store, items) == (0, 0)
    assert store.block_count() == 0 and pool.free_slots == 4


def test_flush_while_a_get_is_copying(make_store):
    """A flush between the lock-free copies of a get: no crash, nothing flushed is
    returned, and every slot comes back to the pool afterwards."""
    store = make_store(n_slots=4, nvme_bytes=0)
    store.open_namespace(SPEC)
    ids, items = prompt(1, 3)
    put(store, items)
    bufs = []

    def dst_for(i, n):
        if i == 1:
            store.set_generation(SPEC.namespace_id, 1)
        bufs.append(bytearray(n))
        return bufs[-1]

    root = SPEC.root(0, TEST_SECRET)
    served = store.get(SPEC.namespace_id, 0, ids, root, dst_for)
    assert served == []
    assert store.pool.free_slots == 4
    check_invariants(store)


# --------------------------------------------------------------------- events
def _apply(model: dict, ev) -> None:
    ns = model.setdefault(ev.namespace_id, {})
    if ev.kind == EventKind.NAMESPACE_CLEARED:
        ns.clear()
    elif ev.kind == EventKind.STORED:
        for b in ev.block_ids:
            ns[b] = ev.tier
    elif ev.kind == EventKind.REMOVED:
        for b in ev.block_ids:
            del ns[b]
    elif ev.kind == EventKind.TIER_CHANGED:
        for b in ev.block_ids:
            assert b in ns
            ns[b] = ev.tier


def test_snapshot_plus_events_reproduce_the_store(make_store):
    clock = ManualClock()
    store = make_store(
        n_slots=4, nvme_bytes=6 * NB, clock=clock, policy_for=policy(ttl_seconds=100)
    )
    st = store.open_namespace(SPEC)
    put(store, prompt(1, 3)[1])
    seq0, snap = store.snapshot()
    model = {ns_id: dict(blocks) for ns_id, blocks in snap}
    store.events.drain()
    ids2, items2 = prompt(2, 4)
    put(store, items2)  # STORED, demotions
    get(store, prompt(1, 3)[0])  # promotions
    for seed in range(3, 7):
        put(store, prompt(seed, 2)[1])  # NVMe evictions, REMOVED
    store.pool.raw_view(next(m.slot for m in st.blocks.values() if m.slot >= 0))[3] ^= 1
    for seed in range(3, 7):
        get(store, prompt(seed, 2)[0])  # corrupt drops
    clock.advance(150)
    put(store, prompt(8, 2)[1])
    store.expire()  # expiry
    put(store, prompt(9, 1)[1])
    evs = store.events.drain()
    assert [e.seq for e in evs] == list(range(seq0 + 1, seq0 + 1 + len(evs)))
    kinds = {e.kind for e in evs}
    assert {EventKind.STORED, EventKind.REMOVED, EventKind.TIER_CHANGED} <= kinds
    for e in evs:
        _apply(model, e)
    last, final = store.snapshot()
    assert last == evs[-1].seq
    assert {ns: dict(b) for ns, b in final} == {k: v for k, v in model.items()}
    store.set_generation(SPEC.namespace_id, 1)
    for e in store.events.drain():
        _apply(model, e)
    assert model[SPEC.namespace_id] == {}


def test_stored_events_name_the_parent_of_their_first_block(make_store):
    store = make_store()
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items[:2])
    store.events.drain()
    put(store, items)  # the first two are already present
    (ev,) = store.events.drain()
    assert ev.kind == EventKind.STORED and ev.block_ids == tuple(ids[2:])
    assert ev.parent_id == ids[1]
    assert ev.tier == Tier.HBM


def test_payloads_are_copied_not_referenced(make_store):
    store = make_store()
    store.open_namespace(SPEC)
    ids, items = prompt(1, 1)
    buf = bytearray(items[0].data)
    put(store, [PutItem(ids[0], items[0].parent_id, buf)])
    buf[:] = b"\0" * len(buf)
    assert get(store, ids)[1] == [block_payload(ids[0], NB)]


def test_concurrent_gets_puts_expiry_and_flushes(make_store):
    """Readers, writers, expiry and flushes in threads: no exception escapes, every served
    payload is the right one, and the bookkeeping adds up afterwards."""
    import threading

    clock = ManualClock()
    store = make_store(n_slots=6, nvme_bytes=6 * NB, clock=clock, policy_for=policy(ttl_seconds=5))
    store.open_namespace(SPEC)
    errors: list[BaseException] = []
    served_total = [0]

    def chains(gen):
        return [chain_items(SPEC, prompt_tokens(s, 3 * BS), generation=gen) for s in range(8)]

    def current_gen():
        return store.namespaces()[0].generation

    def reader(seed):
        import random

        rng = random.Random(seed)
        for _ in range(300):
            gen = current_gen()
            ids, items = chains(gen)[rng.randrange(8)]
            try:
                served, data = get(store, ids, gen=gen)
            except FailedPrecondition:
                continue  # flushed between reading the generation and the get
            assert data == [block_payload(b, NB) for b in ids[: len(served)]]
            served_total[0] += len(served)

    def writer():
        for i in range(300):
            gen = current_gen()
            ids, items = chains(gen)[i % 8]
            try:
                put(store, items, gen=gen)
            except (FailedPrecondition, ResourceExhausted):
                pass

    def chaos():
        for i in range(60):
            clock.advance(1)
            store.expire()
            if i % 20 == 19:
                store.set_generation(SPEC.namespace_id, current_gen() + 1)

    def guard(fn, *args):
        try:
            fn(*args)
        except BaseException as exc:  # reported below, with its traceback
            errors.append(exc)

    threads = [
        threading.Thread(target=guard, args=a)
        for a in [(reader, 1), (reader, 2), (writer,), (chaos,)]
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    assert served_total[0] > 0
    check_invariants(store)


# ------------------------------------------------------------ fault injection
class _FullPool:
    """Fault injection: the pool has no free slot left (every reserve fails)."""

    def __init__(self, pool: DevicePool) -> None:
        self._pool = pool

    def reserve(self) -> None:
        return None

    def __getattr__(self, name):
        return getattr(self._pool, name)


def test_a_pool_swapped_in_is_the_one_writes_reserve_from(make_store):
    """Tests inject pool faults by setting store.pool: the collaborators behind the facade
    (writes, residency, in-place transfers) must all use the pool set last."""
    store = make_store(n_slots=8, nvme_bytes=0)
    store.open_namespace(SPEC)
    base = store.pool
    store.pool = _FullPool(base)
    with pytest.raises(ResourceExhausted):
        put(store, prompt(1, 2)[1])
    store.pool = base
    assert put(store, prompt(1, 2)[1]) == (2, 0)
    check_invariants(store)
