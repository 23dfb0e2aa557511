"""Sealing of NVMe records (kvstore/tiers/sealing.py): AES-256-GCM round trips, the
associated data binding a record to its key and tenant, key files and keyring rotation."""

from __future__ import annotations

import base64
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tiers.sealing import (
    HEADER_BYTES,
    Failure,
    KeyFileError,
    Keyring,
    OpenFailed,
    Sealer,
    generate_key,
    load_keyrings,
)

K1, K2 = generate_key(), generate_key()
KEY = b"n" * 16 + b"b" * 16  # namespace id + block id, as the store keys a record


def sealer(**rings: dict[int, bytes]) -> Sealer:
    return Sealer({t: Keyring(t, keys, max(keys)) for t, keys in rings.items()})


def cause(s: Sealer, key: bytes, tenant: str, record: bytes) -> Failure:
    with pytest.raises(OpenFailed) as info:
        s.open(key, tenant, record)
    return info.value.cause


@settings(max_examples=50, deadline=None)
@given(
    plaintext=st.binary(max_size=4096),
    tenant=st.text(min_size=1, max_size=20),
    key=st.binary(min_size=1, max_size=64),
)
def test_round_trip(plaintext, tenant, key):
    s = Sealer({tenant: Keyring(tenant, {1: K1}, 1)})
    record = s.seal(key, tenant, plaintext)
    assert len(record) == HEADER_BYTES + len(plaintext) + 16
    assert s.open(key, tenant, record) == plaintext


def test_fresh_nonce_per_write():
    s = sealer(acme={1: K1})
    a, b = s.seal(KEY, "acme", b"x" * 64), s.seal(KEY, "acme", b"x" * 64)
    assert a != b and a[9:21] != b[9:21]  # the nonce (header bytes 9..21) differs


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_flipped_byte_fails_authentication(data):
    s = sealer(acme={1: K1})
    record = bytearray(s.seal(KEY, "acme", os.urandom(256)))
    i = data.draw(st.integers(0, len(record) - 1))
    record[i] ^= data.draw(st.integers(1, 255))
    # the magic is bytes 0..4: a record without it is not sealed at all
    assert cause(s, KEY, "acme", bytes(record)) in (
        Failure.TAMPERED,
        Failure.UNKNOWN_KEY,
        Failure.MALFORMED,
        Failure.PLAINTEXT,
    )


def test_record_bound_to_its_key_and_tenant():
    """A record copied under another block id, or opened as another tenant holding the very
    same key, fails: the associated data carries both."""
    s = sealer(acme={1: K1}, beta={1: K1})
    record = s.seal(KEY, "acme", b"kv" * 100)
    assert cause(s, KEY[:16] + b"c" * 16, "acme", record) is Failure.TAMPERED
    assert cause(s, b"m" * 16 + KEY[16:], "acme", record) is Failure.TAMPERED
    assert cause(s, KEY, "beta", record) is Failure.TAMPERED
    assert s.open(KEY, "acme", record) == b"kv" * 100


def test_wrong_key_unknown_key_no_keyring_plaintext_malformed():
    record = sealer(acme={1: K1}).seal(KEY, "acme", b"payload")
    assert cause(sealer(acme={1: K2}), KEY, "acme", record) is Failure.TAMPERED
    assert cause(sealer(acme={2: K1}), KEY, "acme", record) is Failure.UNKNOWN_KEY
    assert cause(sealer(beta={1: K1}), KEY, "acme", record) is Failure.NO_KEYRING
    s = sealer(acme={1: K1})
    assert cause(s, KEY, "acme", b"KVB1" + b"\0" * 100) is Failure.PLAINTEXT
    assert cause(s, KEY, "acme", record[:30]) is Failure.MALFORMED
    assert cause(s, KEY, "acme", record[:4] + b"\x09" + record[5:]) is Failure.MALFORMED


def test_rotation_keeps_old_records_readable_and_removal_makes_them_misses():
    old = Sealer({"acme": Keyring("acme", {1: K1}, 1)})
    r1 = old.seal(KEY, "acme", b"before")
    rotated = Sealer({"acme": Keyring("acme", {1: K1, 2: K2}, 2)})
    r2 = rotated.seal(KEY, "acme", b"after")
    assert int.from_bytes(r2[5:9], "little") == 2  # the new key seals
    assert rotated.open(KEY, "acme", r1) == b"before"  # the old one still opens
    assert rotated.open(KEY, "acme", r2) == b"after"
    retired = Sealer({"acme": Keyring("acme", {2: K2}, 2)})
    assert cause(retired, KEY, "acme", r1) is Failure.UNKNOWN_KEY
    assert retired.open(KEY, "acme", r2) == b"after"


def test_keyring_refuses_an_active_id_it_does_not_hold():
    with pytest.raises(KeyFileError, match="active key id 3"):
        Keyring("acme", {1: K1}, 3)


# ------------------------------------------------------------------------ key files
def write_key(d, name: str, data: bytes, mode: int = 0o400) -> str:
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


def test_load_keyrings_raw_and_base64_highest_id_active(tmp_path):
    write_key(tmp_path, "acme.1.key", K1)
    write_key(tmp_path, "acme.2.key", base64.b64encode(K2) + b"\n", 0o440)
    write_key(tmp_path, "team.x.2.key", K1)  # a tenant name with a dot in it
    os.mkdir(tmp_path / "..data")  # what a mounted Secret adds beside its files
    rings = load_keyrings(str(tmp_path))
    assert set(rings) == {"acme", "team.x"}
    assert rings["acme"].active == 2 and dict(rings["acme"].keys) == {1: K1, 2: K2}
    assert load_keyrings(str(tmp_path), {"acme": 1})["acme"].active == 1


@pytest.mark.parametrize(
    "name, data, mode, message",
    [
        ("acme.1.key", b"k" * 32, 0o444, "lets any user read"),
        ("acme.1.key", b"k" * 32, 0o604, "lets any user read"),
        ("acme.1.key", b"k" * 31, 0o400, "32 raw bytes or their base64"),
        ("acme.1.key", base64.b64encode(b"k" * 16), 0o400, "32 raw bytes or their base64"),
        ("acme.0.key", b"k" * 32, 0o400, "key id from 1"),
        ("acme.one.key", b"k" * 32, 0o400, "key id from 1"),
        (".1.key", b"k" * 32, 0o400, None),  # a dot file: skipped, so the dir is empty
        ("acme.1", b"k" * 32, 0o400, "not a key file"),
    ],
)
def test_bad_key_files_are_refused_with_the_reason(tmp_path, name, data, mode, message):
    write_key(tmp_path, name, data, mode)
    with pytest.raises(KeyFileError, match=message or "holds no key files"):
        load_keyrings(str(tmp_path))


def test_missing_dir_and_active_for_unknown_tenant(tmp_path):
    with pytest.raises(KeyFileError, match="No such file"):
        load_keyrings(str(tmp_path / "absent"))
    write_key(tmp_path, "acme.1.key", K1)
    with pytest.raises(KeyFileError, match="without key files: beta"):
        load_keyrings(str(tmp_path), {"beta": 1})
    with pytest.raises(KeyFileError, match="active key id 5"):
        load_keyrings(str(tmp_path), {"acme": 5})


def test_refresh_takes_changed_key_files_into_use(tmp_path):
    write_key(tmp_path, "acme.1.key", K1)
    s = Sealer.from_directory(str(tmp_path))
    old = s.seal(KEY, "acme", b"sealed under key 1")
    assert s.refresh() is False  # nothing changed: the table is not read again
    assert not s.can_seal("beta")

    write_key(tmp_path, "acme.2.key", K2)  # rotation: key 2 seals from now on
    write_key(tmp_path, "beta.1.key", K2)  # a tenant that had no key may now spill
    assert s.refresh() is True and s.reloads == 1
    new = s.seal(KEY, "acme", b"sealed under key 2")
    assert int.from_bytes(new[5:9], "little") == 2
    assert s.open(KEY, "acme", old) == b"sealed under key 1"  # the old key still opens
    assert s.can_seal("beta")

    os.unlink(tmp_path / "acme.1.key")  # retired: what it sealed no longer opens
    assert s.refresh() is True
    assert cause(s, KEY, "acme", old) is Failure.UNKNOWN_KEY
    assert s.open(KEY, "acme", new) == b"sealed under key 2"


def test_refresh_keeps_the_keys_in_use_when_a_change_cannot_be_used(tmp_path):
    write_key(tmp_path, "acme.1.key", K1)
    s = Sealer.from_directory(str(tmp_path))
    write_key(tmp_path, "acme.2.key", K2, 0o644)  # not yet chmod'ed
    assert s.refresh() is False and (s.reloads, s.reload_errors) == (0, 1)
    assert s.refresh() is False and s.reload_errors == 1  # reported once per change
    rec = s.seal(KEY, "acme", b"x")
    assert int.from_bytes(rec[5:9], "little") == 1  # key 1 goes on sealing
    os.chmod(tmp_path / "acme.2.key", 0o400)
    assert s.refresh() is True
    assert int.from_bytes(s.seal(KEY, "acme", b"x")[5:9], "little") == 2
    assert Sealer(s.keyrings).refresh() is False  # a fixed table has nothing to watch
