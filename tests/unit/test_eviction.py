"""Eviction strategies: priority functions, removal from the heaps, a workload where
value-aware eviction keeps a hot shared prefix that LRU throws away, and value per slot in
the pool (every block takes a whole slot) against value per byte on NVMe."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from support.common import TEST_SECRET, ManualClock, chain_items, make_namespace, prompt_tokens
from support.store import get, lookup, prompt, put

from kvstore.eviction import LRUPolicy, ValueAwarePolicy, make_policy
from kvstore.events import Tier
from kvstore.policy import NamespacePolicy
from kvstore.store_eviction import EvictionQueue
from kvstore.store_types import BlockMeta, NsState

SPEC = make_namespace()
BS = SPEC.block_size
# Another tenant's namespace of a smaller model: its blocks are 1/8 of SPEC's, and of the
# pool's slots in the tests below, which are sized for SPEC's blocks.
TINY = make_namespace(tenant="tiny", name="small", num_layers=1, num_kv_heads=1, head_dim=8)


@dataclass
class Meta:
    hits: int = 0
    last_access: float = 0.0
    depth: int = 0


SLOT = 4096  # the charge passed below: a block's slot, or its bytes on NVMe


# ------------------------------------------------------------- priority functions
def test_lru_priority_is_last_access():
    p = LRUPolicy()
    assert p.priority(Meta(last_access=5.0), SLOT) < p.priority(Meta(last_access=6.0), SLOT)
    assert p.priority(Meta(hits=100, last_access=5.0), SLOT) == p.priority(
        Meta(last_access=5.0), SLOT
    )
    assert p.priority(Meta(last_access=5.0), 64) == p.priority(Meta(last_access=5.0), SLOT)


def test_value_aware_orders_by_value_per_byte_charged():
    p = ValueAwarePolicy()
    base = p.priority(Meta(), SLOT)
    assert p.priority(Meta(hits=3), SLOT) > base  # hit more often: keep
    assert p.priority(Meta(depth=40), SLOT) > base  # deeper: more prefill saved per hit
    assert p.priority(Meta(), 2 * SLOT) < base  # costs more for the same saving: go first
    assert p.priority(Meta(last_access=60), SLOT) > base  # recent: keep


def test_value_aware_exact_formula_and_half_life():
    p = ValueAwarePolicy(half_life_s=100.0, attention_weight=0.5)
    m = Meta(hits=3, last_access=250.0, depth=2)
    assert p.priority(m, 1024) == pytest.approx(math.log2(4 * 2.0 / 1024) + 2.5)
    # One doubling of value is worth exactly one half-life of recency.
    assert p.priority(Meta(hits=1, last_access=0.0), SLOT) == pytest.approx(
        p.priority(Meta(hits=0, last_access=100.0), SLOT)
    )


def test_make_policy():
    assert make_policy("lru").name == "lru"
    assert make_policy("value", half_life_s=10.0) == ValueAwarePolicy(half_life_s=10.0)
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_policy("fifo")


# ------------------------------------------------------------- removal from heaps
def _one_block_prompts(store, seeds):
    ids = {}
    for s in seeds:
        bids, items = chain_items(SPEC, prompt_tokens(s, BS))
        store.put(SPEC.namespace_id, 0, items)
        ids[s] = bids
    return ids


def _present(store, bids) -> bool:
    return store.lookup(SPEC.namespace_id, 0, bids).matched == len(bids)


@pytest.mark.parametrize("policy", ["lru", "value"])
def test_removed_block_is_never_chosen_as_victim(make_store, policy):
    clock = ManualClock()
    store = make_store(
        n_slots=4,
        nvme_bytes=0,
        eviction=make_policy(policy),
        clock=clock,
        policy_for=lambda ns: NamespacePolicy(ttl_seconds=50),
    )
    st = store.open_namespace(SPEC)
    ids = _one_block_prompts(store, [1])
    clock.advance(40)
    ids.update(_one_block_prompts(store, [2, 3, 4]))
    # Block 1 (the oldest, first in every heap) leaves by expiry ...
    clock.advance(20)
    assert store.expire() == 1
    # ... and is stored again: a new record under the same id, now the newest.
    ids.update(_one_block_prompts(store, [1]))
    assert st.blocks[ids[1][0]].last_access == clock.t
    # Two more prompts need two victims: 2 and 3, never the re-stored 1 through its old
    # heap entry.
    ids.update(_one_block_prompts(store, [5, 6]))
    assert [_present(store, ids[s]) for s in (1, 2, 3, 4, 5, 6)] == [
        True,
        False,
        False,
        True,
        True,
        True,
    ]


def test_pinned_and_read_blocks_are_not_victims(make_store):
    store = make_store(
        n_slots=2,
        nvme_bytes=0,
        eviction=LRUPolicy(),
        policy_for=lambda ns: NamespacePolicy(pin_budget_bytes=1 << 20),
    )
    store.open_namespace(SPEC)
    ids = _one_block_prompts(store, [1, 2])
    store.pin(SPEC.namespace_id, 0, ids[1], True)
    ids.update(_one_block_prompts(store, [3]))  # 2 goes, not the older pinned 1
    assert [_present(store, ids[s]) for s in (1, 2, 3)] == [True, False, True]
    # A block being read (dst_for runs while the copy is in flight) is not a victim either.
    held = []

    def dst_for(i, n):
        ids.update(_one_block_prompts(store, [4]))  # needs a victim: only 3 is eligible...
        held.append(bytearray(n))
        return held[-1]

    root = SPEC.root(0, TEST_SECRET)
    store.pin(SPEC.namespace_id, 0, ids[1], False)
    served = store.get(SPEC.namespace_id, 0, ids[3], root, dst_for)
    assert len(served) == 1  # ... but 3 is being read, so 1 went instead
    assert [_present(store, ids[s]) for s in (1, 3, 4)] == [False, True, True]


# --------------------------------------------------------------------- workload
def _hit_rate_of_hot_prompt(make_store, policy) -> float:
    """A hot system prompt shared by several requests, then a scan of one-off prompts
    (more blocks than the pool), then the hot prompt again. Pool only, no NVMe, so a block
    that is evicted is gone."""
    clock = ManualClock()
    store = make_store(n_slots=16, nvme_bytes=0, eviction=policy, clock=clock)
    store.open_namespace(SPEC)
    system = prompt_tokens(7, 4 * BS)
    root = SPEC.root(0, TEST_SECRET)

    def serve(tokens):
        ids, items = chain_items(SPEC, tokens)
        matched = store.lookup(SPEC.namespace_id, 0, ids).matched
        if matched:
            store.get(SPEC.namespace_id, 0, ids[:matched], root, lambda i, n: bytearray(n))
        store.put(SPEC.namespace_id, 0, items[matched:])
        clock.advance(1.0)
        return matched, len(ids)

    for user in range(6):  # system prompt + a different user question each time
        serve(system + prompt_tokens(100 + user, BS))
    for one_off in range(30):  # 60 blocks of prompts nobody asks for again
        serve(prompt_tokens(1000 + one_off, 2 * BS))
    matched, total = serve(system + prompt_tokens(200, BS))
    return matched / 4  # of the 4 system-prompt blocks


def test_value_aware_keeps_the_hot_prefix_that_lru_loses(make_store):
    lru = _hit_rate_of_hot_prompt(make_store, LRUPolicy())
    value = _hit_rate_of_hot_prompt(make_store, ValueAwarePolicy())
    assert value > lru
    assert (lru, value) == (0.0, 1.0)


# ------------------------------------------------------------ deferred refiles
def test_deferred_refiles_push_each_block_once_at_the_end():
    """A commit refiles a chain's blocks inside EvictionQueue.deferred(): nothing is a
    victim before the end, each block's older entries are stale at once, and every block
    comes out once afterwards (an inner deferral leaves the push to the outer one)."""
    queue = EvictionQueue(LRUPolicy(), spills=False, slot_bytes=SPEC.block_bytes)
    st = NsState(SPEC, SPEC.namespace_id, 0, NamespacePolicy())
    a, b = (
        BlockMeta(st, bytes([k]) * 16, bytes(16), 0, st.block_bytes, 0, slot=k, last_access=k)
        for k in (1, 2)
    )
    for m in (a, b):
        st.blocks[m.block_id] = m
    queue.refile(b)  # filed before: stale once b is refiled again
    with queue.deferred():
        queue.refile(a)
        queue.refile(b)
        with queue.deferred():
            queue.refile(a)
        assert (a.version, b.version) == (2, 2)
        assert queue.victim(Tier.HBM, None) is None  # b's old entry is stale, a not filed
    assert queue.victim(Tier.HBM, None) is a  # the older access first (LRU)
    assert queue.victim(Tier.HBM, None) is b
    assert queue.victim(Tier.HBM, None) is None


# ------------------------------------------------------ value per slot in the pool
def _tiny_and_normal_in_a_full_pool(make_store, tiny_hits: int):
    """A pool of 8 slots: 4 one-block prompts of TINY, read `tiny_hits` times each, then a
    minute later 4 of SPEC, read once each. Then, a minute on, a 4-block prompt of SPEC
    needs 4 slots. No NVMe: an evicted block is gone. Returns which of the 8 stayed."""
    assert TINY.block_bytes * 8 == SPEC.block_bytes
    clock = ManualClock()
    store = make_store(n_slots=8, nvme_bytes=0, slot_bytes=SPEC.block_bytes, clock=clock)
    held = {}
    for spec, seeds, hits in ((TINY, (1, 2, 3, 4), tiny_hits), (SPEC, (11, 12, 13, 14), 1)):
        store.open_namespace(spec)
        for s in seeds:
            ids, items = prompt(s, 1, spec)
            put(store, items, spec)
            for _ in range(hits):
                assert len(get(store, ids, spec=spec)[0]) == 1
            held[s] = (spec, ids)
        clock.advance(60)
    ids, items = prompt(99, 4, SPEC)
    assert put(store, items).stored == 4
    assert lookup(store, ids)[1] == 4  # all 4 in the pool
    return {s for s, (spec, ids) in held.items() if lookup(store, ids, spec=spec)[0] == 1}


def test_pool_values_tiny_blocks_per_slot_not_per_byte(make_store):
    """Same hits and depth, the tiny blocks a minute older: per slot they are worth less,
    so they leave first. Per byte they looked 8 x as valuable, three half-lives of
    recency, and pushed out the newer normal blocks."""
    assert _tiny_and_normal_in_a_full_pool(make_store, tiny_hits=1) == {11, 12, 13, 14}


def test_pool_keeps_tiny_blocks_worth_more_per_slot(make_store):
    """Value still counts: tiny blocks read 3 times (4 x the value per slot, two
    half-lives) outweigh normal blocks read once a minute later."""
    assert _tiny_and_normal_in_a_full_pool(make_store, tiny_hits=3) == {1, 2, 3, 4}


def test_pool_victim_per_slot_nvme_victim_per_byte():
    """Two blocks held in both tiers, same hits and depth, the tiny one older: the pool
    (a slot each) gives up the older one, NVMe (charged bytes stored) the bigger one."""
    queue = EvictionQueue(ValueAwarePolicy(), spills=True, slot_bytes=SPEC.block_bytes)
    metas = []
    for spec, age in ((TINY, 0.0), (SPEC, 60.0)):
        st = NsState(spec, spec.namespace_id, 0, NamespacePolicy())
        m = BlockMeta(st, spec.namespace_id, bytes(16), 0, st.block_bytes, 0, slot=len(metas))
        m.on_nvme, m.last_access = True, 1_000.0 + age
        st.blocks[m.block_id] = m
        queue.refile(m)
        metas.append(m)
    tiny, normal = metas
    assert queue.victim(Tier.HBM, None) is tiny
    assert queue.victim(Tier.NVME, None) is normal
