"""The block store over an encrypted NVMe tier (RocksTier with a Sealer): blocks spill
sealed, come back identical after a restart, survive a key rotation, and a record that does
not open (tampered, key removed, written in plaintext before encryption) is a miss, dropped
and counted, never served."""

from __future__ import annotations

from pathlib import Path

from support.common import flip_rocks_byte, make_namespace
from support.store import SPEC, check_invariants, demote_all, get, lookup, prompt, put

from kvstore.tiers.sealing import Keyring, Sealer, generate_key

K1, K2 = generate_key(), generate_key()


def sealer(active: int = 1, **keys: bytes) -> Sealer:
    ids = {int(k[1:]): v for k, v in keys.items()}  # k1=..., k2=...
    return Sealer({"acme": Keyring("acme", ids, active)})


def disk_bytes(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())


def spilled_store(make_store, path, seal: Sealer | None, seed: int = 1):
    """A store whose first prompt (4 blocks) sits on NVMe only, then closed."""
    store = make_store(n_slots=4, path=path, sealer=seal)
    store.open_namespace(SPEC)
    ids, items = prompt(seed, 4)
    put(store, items)
    demote_all(store)
    assert lookup(store, ids) == (4, 0, 4)
    store.rocks.close()
    return ids, items


def test_sealed_blocks_survive_a_restart_and_leave_no_plaintext(make_store, tmp_path):
    ids, items = spilled_store(make_store, tmp_path / "db", sealer(k1=K1))
    disk = disk_bytes(tmp_path / "db")
    assert not any(it.data[:64] in disk for it in items), "plaintext KV on disk"
    # the same check finds the payload when encryption is off: it can fail
    plain_ids, plain_items = spilled_store(make_store, tmp_path / "plain", None)
    assert plain_items[0].data[:64] in disk_bytes(tmp_path / "plain")

    again = make_store(n_slots=4, path=tmp_path / "db", sealer=sealer(k1=K1))
    assert again.recover()["dropped"] == 0
    served, data = get(again, ids)
    assert data == [it.data for it in items]
    check_invariants(again)


def test_rotation_keeps_old_blocks_readable_and_removing_the_key_drops_them(make_store, tmp_path):
    path = tmp_path / "db"
    old_ids, old_items = spilled_store(make_store, path, sealer(k1=K1))
    rotated = make_store(n_slots=4, path=path, sealer=sealer(2, k1=K1, k2=K2))
    assert rotated.recover()["dropped"] == 0
    new_ids, new_items = prompt(7, 4)
    put(rotated, new_items)
    demote_all(rotated, keep_seed=600)
    rotated.rocks.close()

    both = make_store(n_slots=4, path=path, sealer=sealer(2, k1=K1, k2=K2))
    assert both.recover()["dropped"] == 0
    assert get(both, old_ids)[1] == [it.data for it in old_items]
    assert get(both, new_ids)[1] == [it.data for it in new_items]
    both.rocks.close()

    retired = make_store(n_slots=4, path=path, sealer=sealer(2, k2=K2))
    rec = retired.recover()
    assert rec["dropped"] > 0
    assert retired.rocks.counters()["nvme_open_failed_unknown_key"] == rec["dropped"]
    assert lookup(retired, old_ids)[0] == 0  # a miss, not an error
    assert get(retired, new_ids)[1] == [it.data for it in new_items]  # sealed under key 2
    assert sum(1 for _ in retired.rocks.scan()) == retired.nvme_used // SPEC.block_bytes
    check_invariants(retired)


def test_a_tampered_record_is_dropped_at_recovery(make_store, tmp_path):
    path = tmp_path / "db"
    ids, items = spilled_store(make_store, path, sealer(k1=K1))
    flip_rocks_byte(path, SPEC.namespace_id + ids[2], offset=100)
    again = make_store(n_slots=4, path=path, sealer=sealer(k1=K1))
    rec = again.recover()
    assert rec["dropped"] == 2  # ids[2], and ids[3] whose parent is gone
    assert again.rocks.counters()["nvme_open_failed_tampered"] == 1
    assert again.rocks.get(SPEC.namespace_id + ids[2]) is None  # gone from RocksDB
    assert get(again, ids)[1] == [it.data for it in items[:2]]
    put(again, items)  # recomputed and put again: served whole
    assert get(again, ids)[1] == [it.data for it in items]
    check_invariants(again)


class FlippingSealer(Sealer):
    """Fault injection: records read back with one byte flipped (bit rot after recovery)."""

    def open(self, key: bytes, tenant: str, record: bytes) -> bytes:
        damaged = bytearray(record)
        damaged[-1] ^= 1
        return super().open(key, tenant, bytes(damaged))


def test_a_record_that_fails_to_open_on_get_is_a_miss_and_dropped(make_store, tmp_path):
    store = make_store(n_slots=4, sealer=FlippingSealer({"acme": Keyring("acme", {1: K1}, 1)}))
    store.open_namespace(SPEC)
    ids, items = prompt(1, 4)
    put(store, items)
    demote_all(store)
    served, data = get(store, ids)  # no exception: a miss from the first block on
    assert served == []
    assert store.rocks.counters()["nvme_open_failed_tampered"] == 1
    assert store.counters["corrupt_dropped"] == 1
    assert lookup(store, ids)[0] == 0
    assert store.rocks.get(SPEC.namespace_id + ids[0]) is None
    check_invariants(store)


def test_plaintext_records_from_before_encryption_are_dropped(make_store, tmp_path):
    path = tmp_path / "db"
    ids, _ = spilled_store(make_store, path, None)
    again = make_store(n_slots=4, path=path, sealer=sealer(k1=K1))
    rec = again.recover()
    assert rec == {"recovered": 0, "dropped": 4}
    assert again.rocks.counters()["nvme_open_failed_plaintext"] == 4
    assert sum(1 for _ in again.rocks.scan()) == 0


def test_a_tenant_without_a_key_never_reaches_nvme(make_store, tmp_path):
    """Nothing of a keyless tenant is written (never in plaintext), and making room for
    its spills does not evict the blocks of a tenant that has a key."""
    beta = make_namespace(tenant="beta")
    store = make_store(n_slots=4, nvme_bytes=4 * SPEC.block_bytes, sealer=sealer(k1=K1))
    store.open_namespace(SPEC)
    store.open_namespace(beta)
    ids, items = prompt(1, 4)
    put(store, items)
    beta_ids, beta_items = prompt(2, 4, spec=beta)
    put(store, beta_items, spec=beta)  # acme's blocks spill (sealed) to make room
    assert lookup(store, ids) == (4, 0, 4)
    put(store, prompt(3, 4, spec=beta)[1], spec=beta)  # beta's cannot spill: dropped
    assert lookup(store, beta_ids, spec=beta)[0] == 0
    assert lookup(store, ids) == (4, 0, 4)
    assert store.rocks.counters()["nvme_seal_refused"] > 0
    assert all(k.startswith(SPEC.namespace_id) for k, _ in store.rocks.scan())
    check_invariants(store)
