"""Agents sign their `nodes/` records (node_agent/peer/credential.py): a pull shows the
agent credential only to addresses of a record whose signature verifies under the agent's
own token, stored under its own node id. Anyone who can write etcd can put any record
there; a record changed in any signed field, one signed under another key (including the
token's SHA-256, which tenants.json holds) and an unsigned one are not trusted."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from kvstore.coord.etcd import NODES, KeyValue, NodeRecord, WatchEvent
from node_agent.peer.credential import (
    PeerCredential,
    record_key,
    record_signature,
    record_verifies,
)
from node_agent.peer.transport import PeerRef

TOKEN = "agent-token"
AGENT = f"Bearer {TOKEN}"
CALLER = "Bearer caller-token"
REAL = NodeRecord("agent-0", "10.0.0.1:50051", "10.0.0.1:50052", utilization=0.25, blocks=7)
PEER = PeerRef(REAL.address, REAL.peer_address)


def follower(*records: tuple[str, bytes]) -> PeerCredential:
    """An agent's credential that has listed `records` (key under nodes/, value)."""
    cred = PeerCredential(TOKEN)
    cred._reset([KeyValue(NODES + key, value, 1) for key, value in records])
    return cred


def signed(rec: NodeRecord = REAL) -> NodeRecord:
    return PeerCredential(TOKEN).sign(rec)


def test_a_signed_record_lends_its_addresses_the_agent_credential():
    rec = signed()
    assert rec.signature and dataclasses.replace(rec, signature="") == REAL
    cred = follower(("agent-0", rec.to_json()))
    assert cred.for_pull(PEER, CALLER) == AGENT
    assert cred.for_pull(PeerRef(REAL.address, ""), CALLER) == AGENT
    # an address the record does not name, alone or next to one it does
    assert cred.for_pull(PeerRef("10.0.0.9:50051", ""), CALLER) == CALLER
    assert cred.for_pull(PeerRef(REAL.address, "10.0.0.9:50052"), CALLER) == CALLER


@pytest.mark.parametrize(
    "change",
    [
        {"node_id": "agent-9"},
        {"address": "10.0.0.66:50051"},
        {"peer_address": "10.0.0.66:50052"},
        {"peer_address": ""},
        {"signature": "0" * 64},
        {"signature": ""},
    ],
    ids=lambda c: next(iter(c)) + ("-emptied" if not next(iter(c.values())) else ""),
)
def test_a_record_changed_in_any_signed_field_is_not_trusted(change):
    """A forger copying a real agent's signature onto its own listener's address (or any
    other signed field) earns that listener nothing; the record's own addresses neither."""
    forged = dataclasses.replace(signed(), **change)
    key = forged.node_id  # stored under its own node id: only the signature is at fault
    cred = follower((key, forged.to_json()))
    for peer in (PeerRef(forged.address, ""), PeerRef(forged.peer_address, ""), PEER):
        assert cred.for_pull(peer, CALLER) == CALLER


def test_fields_outside_the_signature_change_without_losing_trust():
    """Occupancy and pull costs change at every heartbeat: only node id and addresses
    are signed."""
    rec = dataclasses.replace(signed(), utilization=0.9, blocks=1000, pull_samples=3)
    assert follower(("agent-0", rec.to_json())).for_pull(PEER, CALLER) == AGENT


def test_a_signed_record_under_another_nodes_key_is_not_trusted():
    cred = follower(("evil", signed().to_json()))
    assert cred.for_pull(PEER, CALLER) == CALLER


@pytest.mark.parametrize(
    "key",
    [
        record_key("another-token"),
        hashlib.sha256(TOKEN.encode()).digest(),  # what tenants.json reveals
        TOKEN.encode(),
    ],
    ids=["another-token", "token-sha256", "raw-token"],
)
def test_a_record_signed_under_another_key_is_not_trusted(key):
    rec = dataclasses.replace(REAL, signature=record_signature(key, REAL))
    assert follower(("agent-0", rec.to_json())).for_pull(PEER, CALLER) == CALLER


def test_unsigned_and_malformed_records_are_not_trusted():
    unsigned = REAL.to_json()
    assert "signature" in json.loads(unsigned)
    old_writer = json.dumps({"node_id": "agent-0", "address": REAL.address}).encode()
    not_a_string = [{**json.loads(signed().to_json()), "signature": v} for v in (7, [1], None)]
    values = [unsigned, old_writer, b"{not json", b"[]"]
    for value in values + [json.dumps(v).encode() for v in not_a_string]:
        assert follower(("agent-0", value)).for_pull(PEER, CALLER) == CALLER


def test_a_watched_record_replaced_by_a_forgery_loses_trust_and_a_delete_drops_it():
    cred = follower(("agent-0", signed().to_json()))
    moved = dataclasses.replace(signed(), address="10.0.0.66:50051")
    cred._apply([WatchEvent(NODES + "agent-0", moved.to_json(), 2, False)])
    assert cred.for_pull(PEER, CALLER) == CALLER
    assert cred.for_pull(PeerRef(moved.address, ""), CALLER) == CALLER
    cred._apply([WatchEvent(NODES + "agent-0", signed().to_json(), 3, False)])
    assert cred.for_pull(PEER, CALLER) == AGENT
    cred._apply([WatchEvent(NODES + "agent-0", b"", 4, True)])
    assert cred.for_pull(PEER, CALLER) == CALLER


def test_without_an_agent_token_records_stay_unsigned_and_nothing_is_trusted():
    cred = PeerCredential("")
    assert cred.sign(REAL) == REAL
    cred._reset([KeyValue(NODES + "agent-0", signed().to_json(), 1)])
    assert cred.for_pull(PEER, CALLER) == CALLER


def test_the_signature_survives_the_etcd_encoding():
    rec = signed()
    assert NodeRecord.from_json(rec.to_json()) == rec


def test_a_signature_that_is_not_ascii_is_refused_not_raised():
    """A forged record whose signature holds non-ASCII text: hmac.compare_digest raises
    TypeError on such a str, which escaped the etcd follow callback; it is refused like
    any other forgery."""
    forged = dataclasses.replace(signed(), signature="\u00e9" * 64)
    cred = follower(("agent-0", forged.to_json()))
    assert cred.for_pull(PEER, CALLER) == CALLER
    cred._apply([WatchEvent(NODES + "agent-0", forged.to_json(), 2, False)])
    assert cred.for_pull(PEER, CALLER) == CALLER
    assert record_verifies(record_key(TOKEN), signed())
    assert not record_verifies(record_key(TOKEN), forged)
