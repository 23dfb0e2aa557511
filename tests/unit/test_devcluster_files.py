"""What the dev cluster writes that names a tenant or keys its blocks (the gateway's API
keys, the engines' kv secret) is its user's alone: 0600, also over a file an older
kvctl left 0644. Other users of the host must not read them."""

from __future__ import annotations

import stat

from kvstore.devengines import gateway_files


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_gateway_keys_and_kv_secret_are_written_owner_only(tmp_path):
    d = tmp_path / "router"
    gateway_files(d, {"tiny": str(tmp_path / "model")})
    assert mode(d / "keys.json") == 0o600
    assert mode(d / "kv.secret") == 0o600


def test_files_an_older_kvctl_left_readable_are_made_owner_only(tmp_path):
    d = tmp_path / "router"
    d.mkdir()
    for name in ("keys.json", "kv.secret"):
        (d / name).write_text("{}" if name == "keys.json" else "old-secret")
        (d / name).chmod(0o644)
    gateway_files(d, {"tiny": str(tmp_path / "model")})
    assert (d / "kv.secret").read_text() == "old-secret"  # kept: engines were started with it
    assert mode(d / "keys.json") == 0o600
    assert mode(d / "kv.secret") == 0o600


def test_the_clusters_own_secrets_are_made_once_owner_only(tmp_path):
    """The engine record key and the agents' token (made by `kvctl cluster up`) are
    written by the same owner-only writer as the gateway's files, once per state
    directory: a second up keeps them (running engines signed with the key)."""
    from kvstore.devcluster import engine_record_key_file

    path = engine_record_key_file(tmp_path)
    first = path.read_text()
    assert mode(path) == 0o600 and len(first.strip()) >= 32
    assert engine_record_key_file(tmp_path).read_text() == first
