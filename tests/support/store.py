"""Helpers shared by the in-process BlockStore tests (test_store*.py)."""

from __future__ import annotations

import pytest
from support.common import TEST_SECRET, chain_items, make_namespace, prompt_tokens

from kvstore.events import Tier
from kvstore.policy import NamespacePolicy
from kvstore.store import BlockStore

try:
    from kvstore import _native
except ImportError:  # pragma: no cover - extension not built
    _native = None

SPEC = make_namespace()
BS = SPEC.block_size
NB = SPEC.block_bytes
NS = SPEC.namespace_id
ROOT = SPEC.root(0, TEST_SECRET)
# Background copies (copy_checksum_start) are the native extension's.
needs_native = pytest.mark.skipif(_native is None, reason="kvstore._native not built")


def policy(**kw):
    return lambda ns: NamespacePolicy(**kw)


def prompt(seed: int, n_blocks: int, spec=SPEC, extra_tokens: int = 0):
    return chain_items(spec, prompt_tokens(seed, n_blocks * spec.block_size + extra_tokens))


def put(store, items, spec=SPEC, gen=0):
    return store.put(spec.namespace_id, gen, items)


def get(store, ids, parent=None, spec=SPEC, gen=0):
    """(served, payloads) with fresh bytearrays as destinations."""
    bufs = []

    def dst_for(i, n):
        bufs.append(bytearray(n))
        return bufs[-1]

    if parent is None:
        parent = spec.root(gen, None if spec.public else TEST_SECRET)
    served = store.get(spec.namespace_id, gen, ids, parent, dst_for)
    return served, [bytes(b) for b in bufs[: len(served)]]


def lookup(store, ids, spec=SPEC, gen=0):
    r = store.lookup(spec.namespace_id, gen, ids)
    return r.matched, r.hbm, r.nvme


def check_invariants(store: BlockStore) -> None:
    """Everything the store promises about its own bookkeeping, checked from outside."""
    in_pool = 0
    nvme_bytes = nvme_blocks = 0
    per_tenant: dict[tuple[str, Tier], int] = {}
    for st in store.namespaces():
        for m in st.blocks.values():
            kids = [c for c in st.blocks.values() if c.parent_id == m.block_id and c.depth]
            assert m.children == len(kids), "children count drifted"
            assert m.hbm_children == sum(c.slot >= 0 for c in kids)
            if m.depth:
                parent = st.blocks.get(m.parent_id)
                assert parent is not None, "a block stayed on the node without its parent"
                assert parent.depth + 1 == m.depth
                if m.slot >= 0:
                    assert parent.slot >= 0, "the pool is not prefix-closed"
            assert m.slot >= 0 or m.on_nvme, "a block held in no tier"
            if m.slot >= 0:  # a block in the pool is charged its whole slot
                in_pool += 1
                per_tenant[(st.tenant, Tier.HBM)] = (
                    per_tenant.get((st.tenant, Tier.HBM), 0) + store.pool.slot_bytes
                )
            if m.on_nvme:
                nvme_blocks += 1
                nvme_bytes += m.nbytes
                per_tenant[(st.tenant, Tier.NVME)] = (
                    per_tenant.get((st.tenant, Tier.NVME), 0) + m.nbytes
                )
                assert store.rocks.get(st.ns_id + m.block_id) is not None
    assert store.pool.n_slots - store.pool.free_slots == in_pool, "a pool slot leaked"
    assert store.nvme_used == nvme_bytes
    if store.rocks is not None:
        assert nvme_bytes <= store.rocks.capacity_bytes
        assert sum(1 for _ in store.rocks.scan()) == nvme_blocks
    for t in store.accounts.tenants():
        for tier in Tier:
            assert store.accounts.used(t, tier) == per_tenant.get((t, tier), 0)
    check_pins(store)


def check_pins(store: BlockStore) -> None:
    """Each pinned block is charged a whole pool slot, to its namespace and its tenant, and
    neither goes past its budget (the tenant's: BlockStore.tenant_pin_limit)."""
    pinned: dict[str, int] = {}
    for st in store.namespaces():
        n = sum(m.pinned for m in st.blocks.values())
        assert st.pinned_bytes == n * store.pool.slot_bytes, "a namespace's pins drifted"
        assert st.pinned_bytes <= st.policy.pin_budget_bytes
        pinned[st.tenant] = pinned.get(st.tenant, 0) + st.pinned_bytes
    for t in set(pinned) | {st.tenant for st in store.namespaces()}:
        assert store.accounts.pinned(t) == pinned.get(t, 0), "a tenant's pins drifted"
        if store.tenant_pin_bytes is not None:
            assert store.accounts.pinned(t) <= store.tenant_pin_bytes


def events_of(store, kind=None):
    evs = store.events.drain()
    return [e for e in evs if kind is None or e.kind == kind]


def demote_all(store, keep_seed: int = 500):
    """Fill the pool with another prompt so everything else spills to NVMe."""
    put(store, prompt(keep_seed, store.pool.n_slots)[1])
