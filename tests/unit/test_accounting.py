"""Per-tenant byte accounting per tier, and tenant quotas on a real BlockStore."""

from __future__ import annotations

import pytest
from support.common import chain_items, make_namespace, prompt_tokens
from support.store import check_invariants

from kvstore.accounting import TenantAccounts
from kvstore.errors import ResourceExhausted
from kvstore.eviction import LRUPolicy
from kvstore.events import Tier
from kvstore.policy import NamespacePolicy

ACME = make_namespace(tenant="acme")
BETA = make_namespace(tenant="beta")
NB = ACME.block_bytes
BS = ACME.block_size
SECRETS = {"acme": b"acme-secret", "beta": b"beta-secret"}


def prompt(spec, seed, n_blocks):
    return chain_items(spec, prompt_tokens(seed, n_blocks * BS), secret=SECRETS[spec.tenant])


def put(store, spec, items):
    return store.put(spec.namespace_id, 0, items)


def get(store, spec, ids):
    root = spec.root(0, SECRETS[spec.tenant])
    return store.get(spec.namespace_id, 0, ids, root, lambda i, n: bytearray(n))


def usage(store, tenant):
    """(HBM bytes, HBM blocks, NVMe bytes, NVMe blocks) of a tenant, in blocks of NB."""
    a = store.accounts
    return (
        a.used(tenant, Tier.HBM) // NB,
        a.blocks(tenant, Tier.HBM),
        a.used(tenant, Tier.NVME) // NB,
        a.blocks(tenant, Tier.NVME),
    )


# ------------------------------------------------------------------- unit
def test_tenant_accounts_bookkeeping():
    acc = TenantAccounts({"acme": {Tier.HBM: 100}})
    assert acc.limit("acme", Tier.HBM) == 100 and acc.limit("acme", Tier.NVME) is None
    acc.add("acme", Tier.HBM, 60)
    assert acc.used("acme", Tier.HBM) == 60 and acc.blocks("acme", Tier.HBM) == 1
    assert acc.overflow("acme", Tier.HBM, 40) == 0
    assert acc.overflow("acme", Tier.HBM, 50) == 10
    assert acc.overflow("beta", Tier.HBM, 10**12) == 0  # no limit
    acc.sub("acme", Tier.HBM, 60)
    with pytest.raises(AssertionError, match="negative"):
        acc.sub("acme", Tier.HBM, 1)
    acc.set_limit("acme", Tier.HBM, 0)  # 0 removes the limit
    assert acc.limit("acme", Tier.HBM) is None
    acc.set_limit("beta", Tier.NVME, 5)
    assert acc.tenants() == ["acme", "beta"]


# ---------------------------------------------------------------- on a store
def test_bytes_per_tier_follow_every_move(make_store):
    store = make_store(n_slots=4, eviction=LRUPolicy())
    for spec in (ACME, BETA):
        store.open_namespace(spec)
    a_ids, a_items = prompt(ACME, 1, 3)
    put(store, ACME, a_items)
    assert usage(store, "acme") == (3, 3, 0, 0)
    assert usage(store, "beta") == (0, 0, 0, 0)

    b_ids, b_items = prompt(BETA, 2, 2)
    put(store, BETA, b_items)  # one acme leaf is demoted to make room
    # ... after its two ancestors got NVMe copies (a crash must not orphan it)
    assert usage(store, "acme") == (2, 2, 3, 3)
    assert usage(store, "beta") == (2, 2, 0, 0)

    assert len(get(store, ACME, a_ids)) == 3  # promotion: a beta leaf is demoted
    assert usage(store, "acme") == (3, 3, 3, 3)  # the promoted block keeps its NVMe copy
    assert usage(store, "beta") == (1, 1, 2, 2)

    assert store.set_generation(BETA.namespace_id, 1) == 2  # flush
    assert usage(store, "beta") == (0, 0, 0, 0)
    assert usage(store, "acme") == (3, 3, 3, 3)

    # Corruption found on a read removes the block and its descendants from both tiers.
    st = store.namespace(ACME.namespace_id, 0)
    store.pool.raw_view(st.blocks[a_ids[1]].slot)[0] ^= 1
    assert len(get(store, ACME, a_ids)) == 1
    assert usage(store, "acme") == (1, 1, 1, 1)
    assert store.set_generation(ACME.namespace_id, 1) == 1
    assert usage(store, "acme") == (0, 0, 0, 0)
    assert store.pool.free_slots == 4 and store.nvme_used == 0


def test_tenant_over_hbm_quota_evicts_its_own_blocks(make_store):
    accounts = TenantAccounts({"acme": {Tier.HBM: 2 * NB}})
    store = make_store(n_slots=8, accounts=accounts)
    for spec in (ACME, BETA):
        store.open_namespace(spec)
    b_ids, b_items = prompt(BETA, 1, 3)
    put(store, BETA, b_items)
    acme = [prompt(ACME, 10 + i, 1) for i in range(5)]
    for _ids, items in acme:
        assert put(store, ACME, items) == (1, 0)
        assert store.accounts.used("acme", Tier.HBM) <= 2 * NB
    assert store.counters["evict_hbm_quota"] == 3
    # ... and counted as acme's (kvctl stats --tenant acme), none as beta's
    assert dict(store.tenant_counters["acme"]) == {"evict_hbm_quota": 3}
    assert "beta" not in store.tenant_counters
    assert store.lookup(BETA.namespace_id, 0, b_ids).hbm == 3  # untouched
    assert usage(store, "beta") == (3, 3, 0, 0)
    assert usage(store, "acme") == (2, 2, 3, 3)  # spilled, still on the node
    assert store.pool.free_slots == 3  # the quota bit, not the pool
    # The most recent acme prompts are the ones in the pool.
    assert [store.lookup(ACME.namespace_id, 0, ids).hbm for ids, _ in acme] == [0, 0, 0, 1, 1]


def test_tenant_over_nvme_quota_drops_its_own_blocks(make_store):
    accounts = TenantAccounts({"acme": {Tier.NVME: 2 * NB}})
    store = make_store(n_slots=2, accounts=accounts, eviction=LRUPolicy())
    for spec in (ACME, BETA):
        store.open_namespace(spec)
    b_ids, b_items = prompt(BETA, 1, 1)
    put(store, BETA, b_items)
    put(store, BETA, prompt(BETA, 2, 1)[1])
    assert usage(store, "beta") == (2, 2, 0, 0)
    for i in range(5):
        put(store, ACME, prompt(ACME, 10 + i, 1)[1])
        assert store.accounts.used("acme", Tier.NVME) <= 2 * NB
    assert usage(store, "acme")[2] == 2
    assert usage(store, "beta") == (0, 0, 2, 2)  # spilled by capacity, never dropped
    # per tenant: acme's NVMe quota drops, beta's capacity demotions
    acme, beta = store.tenant_counters["acme"], store.tenant_counters["beta"]
    assert dict(acme) == {"evict_hbm_capacity": 3, "evict_nvme": 1, "evict_nvme_quota": 1}
    assert dict(beta) == {"evict_hbm_capacity": 2}  # they add up to the node's
    assert store.counters["evict_hbm_capacity"] == 5 and store.counters["evict_nvme"] == 1
    assert store.set_generation(BETA.namespace_id, 1) == 2
    assert store.tenant_counters["beta"]["blocks_dropped_flush"] == 2
    assert store.tenant_counters["acme"]["blocks_dropped_flush"] == 0


def test_non_persist_tenant_quota_drops_own_blocks(make_store):
    accounts = TenantAccounts({"acme": {Tier.HBM: 1 * NB}})
    store = make_store(
        n_slots=4,
        accounts=accounts,
        policy_for=lambda ns: NamespacePolicy(persist=ns.tenant != "acme"),
    )
    for spec in (ACME, BETA):
        store.open_namespace(spec)
    b_ids, b_items = prompt(BETA, 1, 2)
    put(store, BETA, b_items)
    for i in range(3):
        put(store, ACME, prompt(ACME, 10 + i, 1)[1])
    assert usage(store, "acme") == (1, 1, 0, 0)
    assert store.counters["evict_hbm_quota"] == 2
    assert store.lookup(BETA.namespace_id, 0, b_ids).hbm == 2


# ------------------------------------------------ what a block takes in the pool
SLOT = 8 * NB  # pool slots larger than ACME's blocks
# 4-byte blocks (one layer, one head, head_dim 1, one token a block): every one of them
# still takes a whole pool slot.
TINY = make_namespace(
    tenant="acme", name="tiny", num_layers=1, num_kv_heads=1, head_dim=1, block_size=1
)


def tiny_chain(seed: int, n_blocks: int):
    return chain_items(TINY, prompt_tokens(seed, n_blocks), secret=SECRETS["acme"])


def test_a_block_in_the_pool_is_charged_its_whole_slot(make_store):
    """The tester's attack (/tmp/probe1/test_quota_slots.py): the HBM quota counted payload
    bytes, so acme's namespace of 4-byte blocks took every slot of the pool (one each)
    while 'using' a few bytes of a two-slot quota, and evicted beta's blocks. A block in
    the pool is charged its slot now; on NVMe, the bytes stored there."""
    accounts = TenantAccounts({"acme": {Tier.HBM: 2 * SLOT}})
    store = make_store(n_slots=8, slot_bytes=SLOT, accounts=accounts, eviction=LRUPolicy())
    for spec in (BETA, TINY):
        store.open_namespace(spec)
    b_ids, b_items = prompt(BETA, 1, 3)
    put(store, BETA, b_items)
    for seed in range(10, 16):
        put(store, TINY, tiny_chain(seed, 4)[1])
        assert store.accounts.used("acme", Tier.HBM) <= 2 * SLOT
    a = store.accounts
    assert (a.used("acme", Tier.HBM), a.blocks("acme", Tier.HBM)) == (2 * SLOT, 2)
    assert store.pool.free_slots == 8 - 3 - 2  # the quota bit, not the pool
    assert store.lookup(BETA.namespace_id, 0, b_ids).hbm == 3  # untouched
    assert a.used("beta", Tier.HBM) == 3 * SLOT
    # What spilled is charged the bytes NVMe holds of it.
    assert a.blocks("acme", Tier.NVME) > 0
    assert a.used("acme", Tier.NVME) == a.blocks("acme", Tier.NVME) * TINY.block_bytes
    check_invariants(store)


def test_a_promoted_block_is_charged_its_slot_again(make_store):
    store = make_store(n_slots=2, slot_bytes=SLOT, eviction=LRUPolicy())
    store.open_namespace(TINY)
    ids, items = tiny_chain(1, 1)
    put(store, TINY, items)
    put(store, TINY, tiny_chain(2, 2)[1])  # the first block spills to NVMe
    assert store.lookup(TINY.namespace_id, 0, ids).nvme == 1
    root = TINY.root(0, SECRETS["acme"])
    assert len(store.get(TINY.namespace_id, 0, ids, root, lambda i, n: bytearray(n))) == 1
    assert store.lookup(TINY.namespace_id, 0, ids).hbm == 1  # promoted
    assert store.accounts.used("acme", Tier.HBM) == 2 * SLOT
    check_invariants(store)
    assert store.set_generation(TINY.namespace_id, 1) == 3  # a flush gives back all of it
    assert [store.accounts.used("acme", t) for t in Tier] == [0, 0]


def test_a_pinned_block_is_charged_its_whole_slot(make_store):
    store = make_store(
        n_slots=8,
        slot_bytes=SLOT,
        policy_for=lambda ns: NamespacePolicy(pin_budget_bytes=2 * SLOT),
    )
    store.open_namespace(TINY)
    ids, items = tiny_chain(1, 3)
    put(store, TINY, items)
    with pytest.raises(ResourceExhausted, match=f"a {SLOT}-byte pool slot each"):
        store.pin(TINY.namespace_id, 0, ids, True)  # 12 bytes of payload, 3 slots
    assert store.pin(TINY.namespace_id, 0, ids[:2], True) == (2, 2 * SLOT)
    assert store.accounts.pinned("acme") == 2 * SLOT
    assert store.pin(TINY.namespace_id, 0, ids[:1], False) == (1, SLOT)
    check_invariants(store)


# ------------------------------------------------------ a tenant's pins in all
ONE = make_namespace(tenant="acme", name="one")
TWO = make_namespace(tenant="acme", name="two")


def test_a_tenants_pins_across_its_namespaces_are_capped(make_store):
    """The tester's attack (/tmp/probe1/test_capacity.py): the pin budget was per
    namespace, so acme pinned every slot through namespaces of its own and beta's puts
    were refused. One tenant's pins on a node, all namespaces together, are capped."""
    store = make_store(
        n_slots=8,
        tenant_pin_bytes=3 * NB,
        policy_for=lambda ns: NamespacePolicy(pin_budget_bytes=2 * NB),
    )
    for spec in (ONE, TWO, BETA):
        store.open_namespace(spec)
    chains = {spec.name: prompt(spec, 1, 2)[0] for spec in (ONE, TWO)}
    for spec in (ONE, TWO):
        put(store, spec, prompt(spec, 1, 2)[1])
    b_ids, b_items = prompt(BETA, 1, 2)
    put(store, BETA, b_items)

    def pin(spec, ids, on=True):
        return store.pin(spec.namespace_id, 0, ids, on)

    assert pin(ONE, chains["one"]) == (2, 2 * NB)
    with pytest.raises(
        ResourceExhausted,
        match=rf"tenant acme's pin limit on this node of {3 * NB} bytes .*{2 * NB} already",
    ):
        pin(TWO, chains["two"])  # within TWO's own budget, over acme's
    assert pin(TWO, chains["two"][:1]) == (1, NB)
    assert store.accounts.pinned("acme") == 3 * NB
    assert pin(BETA, b_ids) == (2, 2 * NB)  # beta's pins are its own
    check_invariants(store)
    assert pin(ONE, chains["one"], on=False) == (2, 0)  # unpinned: room again
    assert pin(TWO, chains["two"]) == (1, 2 * NB)
    assert store.set_generation(TWO.namespace_id, 1) == 2  # a flush lets go of its pins
    assert store.accounts.pinned("acme") == 0
    assert store.accounts.pinned("beta") == 2 * NB
    check_invariants(store)


def test_a_tenants_lower_hbm_quota_caps_its_pins(make_store):
    store = make_store(
        n_slots=8,
        tenant_pin_bytes=6 * NB,
        policy_for=lambda ns: NamespacePolicy(pin_budget_bytes=8 * NB),
    )
    store.open_namespace(ACME)
    ids, items = prompt(ACME, 1, 3)
    put(store, ACME, items)
    store.set_tenant_limits("acme", 2 * NB, None)  # its leaf spills to NVMe
    with pytest.raises(
        ResourceExhausted, match=rf"pin limit on this node of {2 * NB} bytes \(its HBM quota"
    ):
        store.pin(ACME.namespace_id, 0, ids, True)
    assert store.pin(ACME.namespace_id, 0, ids[:2], True) == (2, 2 * NB)
    check_invariants(store)
