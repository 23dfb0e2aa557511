"""The NVMe tier when the disk fails it, in-process (BlockStore over a real RocksTier):
a real full filesystem (tmpfs), injected write failures with a manual clock for the
back-off, and RocksDB files damaged on disk before recovery."""

from __future__ import annotations

import logging

import pytest
from support.common import ManualClock, wait_for
from support.nvme import BIG, FailingTier, flip_sst_byte, mount_small_fs
from support.store import SPEC, demote_all, lookup, prompt, put

from kvstore.store import BlockStore
from kvstore.tiers.pool import DevicePool
from kvstore.tiers.rocks import BACKOFF_FIRST_S, RocksTier, TierCorrupt, TierUnavailable


@pytest.fixture
def small_fs(tmp_path):
    yield from mount_small_fs(tmp_path)


def big_store(path, n_slots: int = 4, tier_cls=RocksTier, clock=None) -> BlockStore:
    kw = {"clock": clock} if clock is not None else {}
    rocks = tier_cls(str(path), 1 << 30, flush_bytes=1 << 20, **kw)  # far above the disk
    return BlockStore(DevicePool(n_slots, BIG.block_bytes, "cpu"), rocks)


def put_prompts(store, seeds, n_blocks: int = 1) -> list[tuple[int, int]]:
    return [put(store, prompt(s, n_blocks, BIG)[1], BIG) for s in seeds]


def outage_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvstore.nvme" and "cannot write" in r.getMessage()
    ]


# ------------------------------------------------------------------------ full disk
def test_full_disk_spills_fail_over_and_resume(small_fs, caplog):
    """Spill until a real 4 MiB filesystem is full: every Put keeps working (leaves are
    dropped instead of spilled), the outage is logged once, and spills resume once space
    comes back (RocksDB resumes itself; the tier's retry finds out)."""
    caplog.set_level(logging.WARNING, logger="kvstore.nvme")
    clock = ManualClock()
    store = big_store(small_fs / "db", clock=clock)
    store.open_namespace(BIG)
    health = store.rocks.health
    results = put_prompts(store, range(200), n_blocks=2)  # 25 MiB through a 4 MiB disk
    while health.writable:  # spills a write stall dropped do not fill it
        results += put_prompts(store, [len(results)], n_blocks=2)
        assert len(results) < 3000, "a 4 MiB disk never filled"
    assert all(r == (2, 0) for r in results)
    assert not health.writable and health.outages == 1
    # RocksDB's ENOSPC, or a write stalled behind the flush it failed
    assert "No space left on device" in health.last_error or "Write stall" in health.last_error
    assert "KiB free" in health.last_error
    assert len(outage_warnings(caplog)) == 1
    assert store.counters["nvme_spill_failed"] > 0
    assert store.counters["demotions"] > 0  # what fit before the disk filled
    check_invariants_nvme(store)

    (small_fs / "filler").unlink()  # space comes back

    def resumed() -> bool:
        clock.advance(60)  # past any back-off
        put_prompts(store, [10_000 + int(clock.t)])
        return health.recoveries >= 1

    wait_for(resumed, timeout=120, interval=0.5, what="NVMe writes to resume")
    assert any("writes again" in r.getMessage() for r in caplog.records)
    store.rocks.close()


def check_invariants_nvme(store) -> None:
    """The store's bookkeeping (as check_invariants) for BIG blocks, minus its count of
    records on disk: deletes a full disk refused leave records there, which recovery
    validates again at the next start."""
    metas = [m for st in store.namespaces() for m in st.blocks.values()]
    for m in metas:
        assert m.slot >= 0 or m.on_nvme, "a block held in no tier"
        if m.depth:
            parent = m.ns.blocks.get(m.parent_id)
            assert parent is not None, "a block stayed on the node without its parent"
            assert m.slot < 0 or parent.slot >= 0, "the pool is not prefix-closed"
    assert store.pool.n_slots - store.pool.free_slots == sum(m.slot >= 0 for m in metas)
    assert store.nvme_used == sum(m.nbytes for m in metas if m.on_nvme)


def test_full_disk_clean_close_keeps_what_was_flushed(small_fs, tmp_path):
    """Closing on a full disk does not raise, and reopening recovers the records that
    reached SST files before the disk filled (and their namespace)."""
    store = big_store(small_fs / "db")
    store.open_namespace(BIG)
    seed = 0
    while store.rocks.health.writable:  # spills a write stall dropped do not fill it
        put_prompts(store, [seed])
        seed += 1
        assert seed < 3000, "a 4 MiB disk never filled"
    spilled = sum(m.on_nvme for st in store.namespaces() for m in st.blocks.values())
    assert store.persist_pool(deadline_s=10) == 0  # refused fast, nothing raised
    store.rocks.close()
    again = big_store(small_fs / "db")
    rec = again.recover()
    assert 0 < rec["recovered"] <= spilled
    assert lookup(again, prompt(0, 1, BIG)[0], BIG)[0] == 1  # the first spill survived
    again.rocks.close()


# ---------------------------------------------------------------- injected failures
def test_probe_ends_an_outage_without_a_spill(tmp_path):
    """The agent's timer calls probe(): it asks RocksDB only once each back-off is over,
    backs off further while writes still fail, ends the outage once one works, and
    counts no refused write of its own; its record is not a block record."""
    clock = ManualClock()
    tier = FailingTier(str(tmp_path / "db"), 1 << 30, flush_bytes=1 << 20, clock=clock)
    tier.failing = True
    with pytest.raises(TierUnavailable):
        tier.put_batch([(b"k" * 32, b"v")])
    h, writes = tier.health, tier.writes
    refused = h.refused
    assert "resumes by itself once about 512 KiB are free" in tier.condition()
    assert not tier.probe() and tier.writes == writes  # backing off: RocksDB not asked
    clock.advance(BACKOFF_FIRST_S)
    assert not tier.probe() and tier.writes == writes + 1
    assert h.backoff_s == 2 * BACKOFF_FIRST_S and not h.writable
    tier.failing = False
    clock.advance(2 * BACKOFF_FIRST_S)
    assert tier.probe() and h.writable and h.recoveries == 1 and tier.condition() == ""
    assert h.refused == refused and h.outages == 1
    assert list(tier.scan()) == []
    tier.close()


def test_failing_tier_backs_off_and_victims_stay_evictable(tmp_path, caplog):
    """While writes fail, a spill victim with children stays in the pool and is filed
    again (it was popped from the heap before the write), leaves are dropped, RocksDB is
    not called during the back-off, and the first retry that works ends the outage."""
    caplog.set_level(logging.WARNING, logger="kvstore.nvme")
    clock = ManualClock()
    store = big_store(tmp_path / "db", n_slots=2, tier_cls=FailingTier, clock=clock)
    tier = store.rocks
    store.open_namespace(BIG)
    head_ids, items = prompt(1, 2, BIG)
    put(store, items, BIG)  # head + leaf fill the pool
    tier.failing = True
    writes = tier.writes
    for seed in range(2, 12):  # each Put drops the coldest leaf instead of spilling it
        assert put_prompts(store, [seed]) == [(1, 0)]
    assert tier.writes == writes + 1  # one attempt, then backing off
    assert tier.health.outages == 1 and len(outage_warnings(caplog)) == 1
    assert lookup(store, head_ids, BIG)[0] < 2  # the chain's leaf left first
    check_invariants_nvme(store)

    clock.advance(BACKOFF_FIRST_S)  # retry: still failing, the back-off doubles
    put_prompts(store, [20])
    assert tier.writes == writes + 2 and tier.health.backoff_s == 2 * BACKOFF_FIRST_S
    tier.failing = False
    put_prompts(store, [21])
    assert tier.writes == writes + 2  # still backing off
    clock.advance(2 * BACKOFF_FIRST_S)
    put_prompts(store, [22])
    assert tier.health.writable and tier.health.recoveries == 1
    assert store.counters["demotions"] == 1
    assert len(outage_warnings(caplog)) == 1
    check_invariants_nvme(store)


def test_nvme_failure_never_wedges_a_pool_of_chains(tmp_path):
    """A pool of chain heads, each with a child, while every spill fails: victims popped
    for a failed spill are filed again or dropped as leaves, so Puts never run out of
    victims (RESOURCE_EXHAUSTED was what main answered once a spill had raised)."""
    clock = ManualClock()
    store = big_store(tmp_path / "db", n_slots=4, tier_cls=FailingTier, clock=clock)
    store.open_namespace(BIG)
    for seed in (1, 2):
        put(store, prompt(seed, 2, BIG)[1], BIG)
    store.rocks.failing = True
    for round_ in range(3):
        clock.advance(60)  # every spill tries RocksDB again, and fails
        for seed in range(100 * round_ + 10, 100 * round_ + 14):
            assert put(store, prompt(seed, 2, BIG)[1], BIG) == (2, 0)
    check_invariants_nvme(store)


# ------------------------------------------------------------------ damaged files
def test_recover_raises_on_unreadable_sst_and_leaves_the_store_empty(make_store, tmp_path):
    """Regression: the scan stopped at the first record RocksDB could not read without
    saying so: some blocks were recovered, some dropped as orphans, the rest (beyond the
    damage) were neither. Now recover() raises TierCorrupt and indexes nothing."""
    path = tmp_path / "db"
    store = make_store(n_slots=4, path=path, nvme_bytes=64 << 20)
    store.open_namespace(SPEC)
    for seed in range(40):
        put(store, prompt(seed, 4)[1])
    demote_all(store)
    store.rocks.close()
    flip_sst_byte(path)
    again = make_store(n_slots=4, path=path, nvme_bytes=64 << 20)
    with pytest.raises(TierCorrupt, match="unreadable"):
        again.recover()
    assert again.block_count() == 0 and again.namespaces() == []
    assert again.nvme_used == 0


# ------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "field, value, match",
    [
        ("nvme_flush_bytes", "512KiB", "nvme_flush_bytes must be >= 1MiB"),
        ("nvme_flush_interval_s", "0", "nvme_flush_interval_s must be > 0"),
        ("nvme_flush_interval_s", "nan", "nvme_flush_interval_s must be > 0"),
        ("nvme_flush_interval_s", "7200", "<= 3600"),
    ],
)
def test_flush_budget_is_validated(field, value, match):
    from kvstore.config import AgentConfig, load_config

    with pytest.raises(ValueError, match=match):
        load_config(AgentConfig, overrides={field: value})
    cfg = load_config(AgentConfig, overrides={"nvme_flush_bytes": "8MiB"})
    assert cfg.nvme_flush_bytes == 8 << 20 and cfg.nvme_flush_interval_s == 10.0
