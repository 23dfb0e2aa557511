"""Engine records are signed by their registrar (kvstore/coord/engines.py): with the
engine record key, the gateway and the router's KV-event feed take a record only when its
signature verifies over every field as written. A record changed in any field, with a
field added or dropped, signed under another key (the node records' derivation of the
same secret included) or not signed at all is refused, counted and logged once."""

from __future__ import annotations

import json
import logging

import pytest

from kvstore.coord.engines import (
    ENGINES,
    EngineRecord,
    EngineRecordReader,
    RecordNotSigned,
    engine_record_key,
    read_engine_record,
)
from kvstore.coord.etcd import KeyValue, WatchEvent
from node_agent.peer.credential import record_key as node_record_key
from router.gateway.engines import EngineSet

SECRET = "engine-record-secret"
KEY = engine_record_key(SECRET)
REAL = EngineRecord(
    "e0",
    "http://10.0.0.5:8000",
    ("tiny",),
    "agent-0",
    namespace={"tenant": "engines", "block_size": 16, "layers": [1, 2]},
    block_size=16,
    kv_events_endpoint="tcp://*:5557",
    kv_events_replay_endpoint="tcp://*:5558",
    device="cuda:GPU-1",
)


def changed(**fields) -> bytes:
    """REAL's signed record with `fields` put over it (None: dropped), signature kept."""
    data = json.loads(REAL.to_json(KEY))
    for name, value in fields.items():
        if value is None:
            data.pop(name)
        else:
            data[name] = value
    return json.dumps(data).encode()


def test_a_signed_record_reads_back_as_written():
    raw = REAL.to_json(KEY)
    assert len(json.loads(raw)["signature"]) == 64
    assert read_engine_record(raw, KEY) == REAL
    # readers without a key, and older readers, take it as before (the field is ignored)
    assert read_engine_record(raw) == REAL == EngineRecord.from_json(raw)


@pytest.mark.parametrize(
    "change",
    [
        {"url": "http://10.6.6.6:8000"},
        {"engine_id": "e1"},
        {"node_id": "agent-9"},
        {"models": ["tiny", "big"]},
        {"namespace": {"tenant": "engines", "block_size": 16, "layers": [1, 3]}},
        {"block_size": 32},
        {"kv_events_endpoint": "tcp://10.6.6.6:5557"},
        {"kv_events_replay_endpoint": None},
        {"device": ""},
        {"added_by_a_forger": "x"},
        {"signature": "0" * 64},
        {"signature": ""},
        {"signature": None},
        {"signature": 7},
    ],
    ids=lambda c: f"{next(iter(c))}={next(iter(c.values()))!r}"[:40],
)
def test_a_record_changed_in_any_field_does_not_verify(change):
    with pytest.raises(RecordNotSigned):
        read_engine_record(changed(**change), KEY)


def test_other_keys_and_unsigned_records_do_not_verify():
    with pytest.raises(RecordNotSigned):
        read_engine_record(REAL.to_json(), KEY)
    with pytest.raises(RecordNotSigned):
        read_engine_record(REAL.to_json(engine_record_key("another secret")), KEY)
    # the agents' node-record key from the same text signs no engine record
    assert node_record_key(SECRET) != KEY
    with pytest.raises(RecordNotSigned):
        read_engine_record(REAL.to_json(node_record_key(SECRET)), KEY)
    # what JSON cannot carry, in a forged record, is a refusal, not an error
    with pytest.raises(RecordNotSigned):
        read_engine_record(changed(device=float("nan")), KEY)


def test_a_refused_record_is_counted_each_time_and_logged_once_per_key(caplog):
    reader = EngineRecordReader(KEY)
    forged = changed(url="http://10.6.6.6:8000")
    with caplog.at_level(logging.WARNING, "kvstore.engines"):
        assert reader.read(ENGINES + "e0", forged) is None
        assert reader.read(ENGINES + "e0", forged) is None
        assert reader.read(ENGINES + "e0", b"{not json") is None  # malformed: not counted
    assert reader.refused == 2
    said = [r.getMessage() for r in caplog.records if "not signed" in r.getMessage()]
    assert len(said) == 1 and "engines/e0" in said[0]
    assert SECRET not in caplog.text and KEY.hex() not in caplog.text
    reader.forget(ENGINES + "e0")  # deleted: a later forgery is said again
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvstore.engines"):
        assert reader.read(ENGINES + "e0", forged) is None
    assert "not signed" in caplog.text
    # a genuine record under its own key reads; under another key it does not
    assert reader.read(ENGINES + "e0", REAL.to_json(KEY)) == REAL
    assert reader.read(ENGINES + "e9", REAL.to_json(KEY)) is None


def test_the_gateway_drops_an_engine_whose_key_now_holds_a_forged_record():
    engines = EngineSet(4, 5.0, records=EngineRecordReader(KEY))
    engines.reset([KeyValue(ENGINES + "e0", REAL.to_json(KEY), 1)])
    assert list(engines.engines) == ["e0"]
    forged = changed(url="http://10.6.6.6:8000")
    engines.apply([WatchEvent(ENGINES + "e0", forged, 2, False)])
    assert engines.engines == {}  # never the forged url, nor the old one it replaced
    engines.apply([WatchEvent(ENGINES + "e0", REAL.to_json(KEY), 3, False)])
    assert engines.engines["e0"].record.url == REAL.url
    unsigned = EngineSet(4, 5.0)  # no key: as before, every record is taken
    unsigned.reset([KeyValue(ENGINES + "e0", REAL.to_json(), 1)])
    assert list(unsigned.engines) == ["e0"]


# ---- engine_record_unsigned: accept (a chart upgrade's first step) ----------------------


def test_accept_unsigned_takes_an_unsigned_record_logged_once_per_key_and_counted(caplog):
    """While registrars are being given the key, routers with `engine_record_unsigned:
    accept` take records that carry no signature: each etcd key is logged once and
    counted (`unsigned`, the etcd keys holding one now) until it holds a signed record
    or is deleted."""
    reader = EngineRecordReader(KEY, accept_unsigned=True)
    unsigned = REAL.to_json()
    assert "signature" not in json.loads(unsigned)
    with caplog.at_level(logging.WARNING, "kvstore.engines"):
        assert reader.read(ENGINES + "e0", unsigned) == REAL
        assert reader.read(ENGINES + "e0", unsigned) == REAL  # rewritten: said once
        other = EngineRecord("e1", "http://10.0.0.6:8000", ("tiny",), "agent-1")
        assert reader.read(ENGINES + "e1", other.to_json()) == other
    said = [r.getMessage() for r in caplog.records if "is unsigned and taken" in r.getMessage()]
    assert len(said) == 2 and "engines/e0" in said[0] and "engines/e1" in said[1]
    assert (reader.unsigned, reader.refused) == (2, 0)
    assert reader.read(ENGINES + "e0", REAL.to_json(KEY)) == REAL  # the registrar signs now
    assert reader.unsigned == 1
    reader.forget(ENGINES + "e1")  # deleted
    assert reader.unsigned == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvstore.engines"):  # unsigned again: said again
        assert reader.read(ENGINES + "e1", other.to_json()) == other
    assert "is unsigned and taken" in caplog.text and reader.unsigned == 1


def test_accept_unsigned_never_takes_an_unsigned_record_where_a_signed_one_was(caplog):
    """Before the fix accept mode took a record with its signature stripped (and its url
    changed) under a key that had just held the registrar's signed record: anyone who can
    write etcd could move a signed engine. Now a key that held a verified record, deleted
    since or not, takes only records that verify: the unsigned one is refused, counted
    and logged once; keys that never held a signed record still take unsigned ones."""
    reader = EngineRecordReader(KEY, accept_unsigned=True)
    assert reader.read(ENGINES + "e0", REAL.to_json(KEY)) == REAL
    stripped = json.loads(REAL.to_json(KEY))
    del stripped["signature"]
    stripped["url"] = "http://10.6.6.6:8000"
    with caplog.at_level(logging.WARNING, "kvstore.engines"):
        assert reader.read(ENGINES + "e0", json.dumps(stripped).encode()) is None
        reader.forget(ENGINES + "e0")  # deleted, then put again unsigned
        assert reader.read(ENGINES + "e0", REAL.to_json()) is None
        assert reader.read(ENGINES + "e0", REAL.to_json()) is None
    said = [r.getMessage() for r in caplog.records if "where a signed record was" in r.getMessage()]
    assert len(said) == 2 and all("engines/e0" in m for m in said), said
    assert (reader.refused, reader.unsigned) == (3, 0)
    other = EngineRecord("e1", "http://10.0.0.6:8000", ("tiny",), "agent-1")
    assert reader.read(ENGINES + "e1", other.to_json()) == other
    assert reader.read(ENGINES + "e0", REAL.to_json(KEY)) == REAL  # signed: taken again


@pytest.mark.parametrize("accept_unsigned", [False, True], ids=["refuse", "accept"])
@pytest.mark.parametrize(
    "change",
    [
        {"url": "http://10.6.6.6:8000"},
        {"added_by_a_forger": "x"},
        {"signature": "0" * 64},
        {"signature": ""},
        {"signature": [1]},
        {"signature": 7},
        {"signature": "\u00e9" * 64},  # not ASCII
    ],
    ids=lambda c: f"{next(iter(c))}={next(iter(c.values()))!r}"[:40],
)
def test_a_signature_that_does_not_verify_is_refused_in_every_mode(change, accept_unsigned):
    """A record that carries a signature field at all must verify, whether or not
    unsigned records are accepted: accept mode lets old registrars in, not forgeries of
    signed records."""
    with pytest.raises(RecordNotSigned):
        read_engine_record(changed(**change), KEY, accept_unsigned)
    reader = EngineRecordReader(KEY, accept_unsigned)
    assert reader.read(ENGINES + "e0", changed(**change)) is None
    assert (reader.refused, reader.unsigned) == (1, 0)


def test_the_gateway_in_accept_mode_routes_unsigned_engines_and_drops_forged_ones():
    engines = EngineSet(4, 5.0, records=EngineRecordReader(KEY, accept_unsigned=True))
    engines.reset([KeyValue(ENGINES + "e0", REAL.to_json(), 1)])
    assert list(engines.engines) == ["e0"]
    engines.apply([WatchEvent(ENGINES + "e0", changed(url="http://10.6.6.6:8000"), 2, False)])
    assert engines.engines == {}
    engines.apply([WatchEvent(ENGINES + "e0", REAL.to_json(KEY), 3, False)])
    assert engines.engines["e0"].record == REAL
    assert engines.records.unsigned == 0


def test_without_a_key_the_first_record_says_records_are_not_authenticated(caplog):
    """A router without a gateway says nothing at start (router/server.py); its reader
    says it when an engine record first appears, once."""
    reader = EngineRecordReader()
    with caplog.at_level(logging.WARNING, "kvstore.engines"):
        assert reader.read(ENGINES + "e0", REAL.to_json()) == REAL
        assert reader.read(ENGINES + "e0", REAL.to_json(KEY)) == REAL
    assert caplog.text.count("not authenticated") == 1
    caplog.clear()
    said = EngineRecordReader(said_unauthenticated=True)  # the router said so at start
    with caplog.at_level(logging.WARNING, "kvstore.engines"):
        assert said.read(ENGINES + "e0", REAL.to_json()) == REAL
    assert "not authenticated" not in caplog.text


def test_the_router_says_records_are_unauthenticated_at_start_only_with_a_gateway(caplog, tmp_path):
    from kvstore.config import RouterConfig
    from router.server import engine_record_readers

    with caplog.at_level(logging.WARNING):
        readers = engine_record_readers(RouterConfig())
    assert "not authenticated" not in caplog.text  # no gateway, no engine yet: nothing
    with caplog.at_level(logging.WARNING):
        readers["router"].read(ENGINES + "e0", REAL.to_json())  # an engine appears
    assert caplog.text.count("not authenticated") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        readers = engine_record_readers(RouterConfig(), gateway=True)
        for reader in readers.values():
            reader.read(ENGINES + "e0", REAL.to_json())
    assert caplog.text.count("not authenticated") == 1  # at start, not again
    key_file = tmp_path / "key"
    key_file.write_text(SECRET)
    caplog.clear()
    cfg = RouterConfig(engine_record_key_file=str(key_file), engine_record_unsigned="accept")
    with caplog.at_level(logging.WARNING):
        readers = engine_record_readers(cfg, gateway=True)
    assert "engine_record_unsigned: accept" in caplog.text
    assert "not authenticated" not in caplog.text
    assert all(r.key == KEY and r.accept_unsigned for r in readers.values())
    with pytest.raises(ValueError, match="engine_record_unsigned"):
        RouterConfig(engine_record_unsigned="maybe")


@pytest.mark.parametrize(
    "engine_id",
    ["e0\r\nset-cookie: x=1", "e 0", "é0", "a/b", "", "x" * 513, 7, None],
)
def test_an_engine_id_a_header_cannot_carry_is_refused(engine_id):
    """The engine id goes into the gateway's answers (x-kvstore-engine), its metrics and
    logs: CR/LF would split an answer's head, a non-ASCII character break it (a probe
    read this in the code, 2026-12-07). Such a record is refused like a malformed one."""
    raw = json.dumps({**json.loads(REAL.to_json()), "engine_id": engine_id}).encode()
    with pytest.raises(ValueError, match="engine_id must be 1-512 printable ASCII"):
        EngineRecord.from_json(raw)
    assert EngineRecord.from_json(REAL.to_json()).engine_id == REAL.engine_id  # the controls
    long_node = "n" * 253 + "-gpu7"  # the chart's engine id on a node of the longest name
    assert (
        EngineRecord.from_json(
            json.dumps({**json.loads(REAL.to_json()), "engine_id": long_node}).encode()
        ).engine_id
        == long_node
    )
