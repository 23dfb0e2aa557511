"""kvstore.wire: the one place core types meet the protobuf messages."""

from __future__ import annotations

import pytest
from support.common import make_namespace

from kvstore import wire
from kvstore.errors import InvalidArgument
from kvstore.policy import NamespacePolicy


def test_namespace_round_trips_through_its_message():
    spec = make_namespace(public=True, rope_theta=500000.0)
    assert wire.namespace_from_proto(wire.namespace_to_proto(spec)) == spec


def test_a_message_missing_a_field_is_refused_naming_it():
    msg = wire.namespace_to_proto(make_namespace())
    msg.tokenizer_id = ""
    with pytest.raises(InvalidArgument, match="tokenizer_id"):
        wire.namespace_from_proto(msg)


def test_policy_to_proto_keeps_every_field():
    msg = wire.policy_to_proto(
        NamespacePolicy(
            ttl_seconds=30.0, min_prefix_blocks=2, persist=False, pin_budget_bytes=1 << 20
        )
    )
    assert (msg.ttl_seconds, msg.min_prefix_blocks, msg.persist, msg.pin_budget_bytes) == (
        30,
        2,
        False,
        1 << 20,
    )


def test_unpack_ids_checks_length_and_the_limit():
    ids = [bytes([i]) * 16 for i in range(3)]
    assert wire.unpack_ids(b"".join(ids), 3) == ids
    with pytest.raises(InvalidArgument, match="not a multiple of 16"):
        wire.unpack_ids(b"x" * 17, 3)
    with pytest.raises(InvalidArgument, match="limit is 2"):
        wire.unpack_ids(b"".join(ids), 2)
    with pytest.raises(InvalidArgument, match="parent_id must be 16 bytes"):
        wire.check_id(b"short", "parent_id")


def test_host_port_takes_names_and_ip_addresses_with_a_port_in_range():
    for good in ("127.0.0.1:1", "[::1]:65535", "localhost:50051", "a_b.c-d.svc:2379"):
        assert wire.check_host_port(good, "peer_address") == good
    for bad, said in (
        ("127.0.0.1:65536", "port in 1..65535"),
        ("127.0.0.1:0", "port in 1..65535"),
        ("127.0.0.1", "port in 1..65535"),
        ("unix:/tmp/x.sock", "port in 1..65535"),
        ("dns:///etcd:2379", "not a host name"),
        ("-leading.dash:80", "not a host name"),
        ("[12345::]:80", "not an IPv6 address"),
        ("x" * 300 + ":80", "port in 1..65535"),
    ):
        with pytest.raises(InvalidArgument, match=said):
            wire.check_host_port(bad, "peer_address")
