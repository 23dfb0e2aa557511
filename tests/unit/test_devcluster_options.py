"""kvctl cluster up's options: --tls with the gateway (it serves HTTPS from the router's
files) is accepted, and so is --tls with vLLM engines (they serve HTTPS and present the
dev CA's client pair; docs/tls.md); out-of-range counts are refused with the reason."""

from __future__ import annotations

import pytest

from kvstore.devcluster import UpOptions


def test_tls_with_the_gateway_alone_is_accepted():
    opts = UpOptions(tls=True, gateway_tokenizers=(("tiny", "/models/tiny"),))
    assert opts.tls and opts.gateway_tokenizers


def test_tls_with_engines_is_accepted():
    opts = UpOptions(tls=True, engines=1)
    assert opts.tls and opts.engines == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tls": True, "engines": 9}, "--engines must be between 0 and 8, got 9"),
        ({"tls": True, "engines": -1}, "--engines must be between 0 and 8, got -1"),
        ({"tls": True, "engines": 1, "agents": 0}, "--agents must be between 1 and 64, got 0"),
    ],
)
def test_bad_counts_with_tls_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UpOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pool_bytes": "lots"}, "--pool-bytes: invalid size 'lots'"),
        ({"slot_bytes": "64 bananas"}, "--slot-bytes: invalid size unit 'bananas'"),
        ({"nvme_bytes": "-1"}, "--nvme-bytes: invalid size '-1'"),
        ({"slot_bytes": "0"}, "--slot-bytes must be > 0"),
        ({"pool_bytes": "1KiB"}, "--pool-bytes 1KiB must hold at least one slot of 65536"),
        ({"pool_bytes": "64KiB", "engines": 1}, "one KV block of the engines' model"),
    ],
)
def test_bad_sizes_are_refused_when_the_options_are_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UpOptions(**kwargs)


def test_kvctl_cluster_up_refuses_a_bad_size_before_starting_anything(tmp_path, capsys):
    from kvstore.cli.__main__ import main

    state = tmp_path / "cluster"
    rc = main(["cluster", "up", "--agents", "1", "--state-dir", str(state), "--pool-bytes", "lots"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "kvctl cluster up: --pool-bytes: invalid size 'lots': expected a number and a unit "
        "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    )
    assert not state.exists()  # no etcd, no agent, not even the state directory


def test_etcd_with_tls_serves_clients_and_its_peer_port_over_mutual_tls(tmp_path):
    from kvstore.config import TLSConfig
    from kvstore.devcluster import etcd_command

    tls = TLSConfig(ca_file="/p/ca.crt", cert_file="/p/tls.crt", key_file="/p/tls.key")
    argv = etcd_command("etcd", "one", tmp_path, "https://h:1", "https://h:2", tls)
    pairs = dict(zip(argv, argv[1:]))
    assert (
        pairs["--listen-peer-urls"] == "https://h:2"
        and pairs["--listen-client-urls"] == "https://h:1"
    )
    assert pairs["--peer-cert-file"] == "/p/tls.crt" and pairs["--peer-key-file"] == "/p/tls.key"
    assert pairs["--peer-trusted-ca-file"] == "/p/ca.crt"
    assert "--peer-client-cert-auth" in argv and "--client-cert-auth" in argv
    with pytest.raises(ValueError, match="needs https:// URLs"):
        etcd_command("etcd", "one", tmp_path, "https://h:1", "http://h:2", tls)
    plain = etcd_command("etcd", "one", tmp_path, "http://h:1", "http://h:2")
    assert not [a for a in plain if "cert" in a]
