"""Per-tenant byte accounting per tier, and tenant quotas on a real BlockStore."""

from __future__ import annotations

import pytest
from support.common import chain_items, make_namespace, prompt_tokens

from kvstore.accounting import TenantAccounts
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
