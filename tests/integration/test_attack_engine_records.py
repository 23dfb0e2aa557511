"""Engine records in etcd (docs/security.md, Engine records): whoever can write etcd can
put `engines/<id>`, and the gateway forwards tenants' prompts wherever a record points
and the router's KV-event subscriber follows the endpoints it names. With the engine
record key configured (the router's `engine_record_key_file`, the registrar's
`--record-key-file`), only records signed with it are taken. Real processes: etcd, the
router serving the gateway, a stand-in engine with its real registrar, and a server of
the attacker's (a stand-in with no registrar; a TCP listener for the event sockets)."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading
from pathlib import Path

import httpx
import pytest
from support.attack import etcd_delete, etcd_items, etcd_put
from support.common import wait_for
from support.gateway import (
    MODEL,
    SPEC,
    StandIn,
    bare_standin,
    register_engine,
    stop_proc,
    write_word_tokenizer,
)

from kvstore import devcluster
from kvstore.coord.engines import ENGINES, EngineRecord, engine_record_key, read_engine_record
from kvstore.devcluster import UpOptions, engine_record_key_file

ACME = {"authorization": "Bearer key-acme"}
SECRET = "engine-record-key-of-the-test"


class Bait:
    """The attacker's server: a stand-in worker that lists what reached it."""

    def __init__(self, workdir) -> None:
        self.proc, self.url = bare_standin(workdir, "bait")

    def seen(self) -> list[dict]:
        return httpx.get(self.url + "/seen", timeout=5).json()


class Listener:
    """A TCP port that counts the connections made to it (where a forged record's KV
    event endpoints point: the router's subscriber would connect there)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


@pytest.fixture
def world(tmp_path, etcd, start_gateway, start_standin):
    key_file = tmp_path / "engine-record-key"
    key_file.write_text(SECRET + "\n")
    tok = str(write_word_tokenizer(tmp_path / "tok"))
    gw = start_gateway({MODEL: tok}, router={"engine_record_key_file": str(key_file)})
    w0 = start_standin("w0", MODEL, registrar_args=["--record-key-file", str(key_file)])
    wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the signed engine in the gateway")
    bait = Bait(tmp_path / "bait")
    yield gw, w0, bait, etcd
    stop_proc(bait.proc)


def _chat() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "w5 w6 w7 " * 4}]}


def _send(gw, n: int) -> list[int]:
    url = gw.url + "/v1/chat/completions"
    return [httpx.post(url, json=_chat(), headers=ACME, timeout=30).status_code for _ in range(n)]


def _models(gw) -> set[str]:
    r = httpx.get(gw.url + "/v1/models", headers=ACME, timeout=5)
    return {m["id"] for m in r.json()["data"]}


def _router_engines(gw) -> set[str]:
    return set(
        re.findall(r'^kvstore_router_engine_inflight\{[^}]*engine="([^"]+)"', gw.metrics(), re.M)
    )


def _settled(gw, etcd) -> None:
    """Every etcd write before this call has been applied by the gateway and by the
    router's event feed: a record signed with the key, written after them, is seen by
    both (etcd delivers a prefix's events in order), then deleted again."""
    mark = EngineRecord("zz-mark", "http://127.0.0.1:9", ("mark",), "node-mark")
    etcd_put(etcd.endpoint, ENGINES + "zz-mark", mark.to_json(engine_record_key(SECRET)))
    wait_for(lambda: "mark" in _models(gw), 20, 0.1, what="the mark in the gateway")
    wait_for(lambda: "zz-mark" in _router_engines(gw), 20, 0.1, what="the mark in the router")
    etcd_delete(etcd.endpoint, ENGINES + "zz-mark")
    wait_for(lambda: "mark" not in _models(gw), 20, 0.1, what="the mark gone")
    wait_for(lambda: "zz-mark" not in _router_engines(gw), 20, 0.1, what="the mark gone")


def _refused(gw, reader: str) -> float:
    m = re.search(
        rf'^kvstore_router_engine_records_refused_total\{{[^}}]*reader="{reader}"[^}}]*\}} (\S+)$',
        gw.metrics(),
        re.M,
    )
    return float(m.group(1)) if m else 0.0


def test_a_forged_record_gets_no_request_and_the_signed_engine_still_routes(world):
    """A record written straight into etcd, unsigned or with a made-up signature, names
    the attacker's server under an engine id that sorts first (chosen first by load when
    taken): no request reaches it, every one goes to the registered engine."""
    gw, w0, bait, etcd = world
    forged = EngineRecord("evil", bait.url, (MODEL,), "node-evil")
    etcd_put(etcd.endpoint, ENGINES + "evil", forged.to_json())
    data = json.loads(forged.to_json())
    data["engine_id"], data["signature"] = "evil2", "00" * 32
    etcd_put(etcd.endpoint, ENGINES + "evil2", json.dumps(data).encode())
    _settled(gw, etcd)
    assert _send(gw, 6) == [200] * 6
    assert bait.seen() == []
    assert len(w0.seen()) == 6
    assert gw.engines() == 1
    assert (_refused(gw, "gateway"), _refused(gw, "router")) == (2, 2)
    # logged once per record, naming its key and never the key file's text
    assert gw.log.count("ignoring engine record engines/evil:") == 2  # router, gateway
    assert SECRET not in gw.log


def test_a_copied_record_with_another_url_is_refused(world):
    """The genuine record, copied and changed to point at the attacker's server (under
    the engine's own key and lease, and under a key of its own) verifies no more: the
    engine drops out (503) rather than send a prompt there; put back as it was, the
    engine routes again."""
    gw, w0, bait, etcd = world
    key = ENGINES + "w0"
    genuine = etcd_items(etcd.endpoint)[key]
    assert json.loads(genuine)["signature"]  # the registrar signed it
    changed = json.loads(genuine)
    changed["url"] = bait.url
    etcd_put(etcd.endpoint, key, json.dumps(changed).encode())
    renamed = dict(changed, engine_id="w0b")
    etcd_put(etcd.endpoint, ENGINES + "w0b", json.dumps(renamed).encode())
    _settled(gw, etcd)
    assert set(_send(gw, 3)) == {503}
    assert bait.seen() == []
    assert gw.engines() == 0
    assert _refused(gw, "gateway") == 2
    etcd_put(etcd.endpoint, key, genuine)  # the genuine record, as the registrar wrote it
    wait_for(lambda: gw.engines() == 1, 20, 0.1, what="w0 back")
    assert _send(gw, 2) == [200, 200]
    assert bait.seen() == [] and len(w0.seen()) == 2


def test_the_event_subscriber_follows_no_forged_record(world):
    """A forged record naming KV-event endpoints at a listener of the attacker's (the
    subscriber connects to `tcp://*:PORT` endpoints at the url's host): no connection is
    made. The control: the same record signed with the key is followed at once."""
    gw, w0, bait, etcd = world
    pub, replay = Listener(), Listener()
    forged = EngineRecord(
        "evil",
        bait.url,
        (MODEL,),
        "node-evil",
        namespace=SPEC.to_dict(),
        block_size=SPEC.block_size,
        kv_events_endpoint=f"tcp://*:{pub.port}",
        kv_events_replay_endpoint=f"tcp://*:{replay.port}",
    )
    etcd_put(etcd.endpoint, ENGINES + "evil", forged.to_json())
    # The control, written after it: a signed record with listeners of its own. The
    # feed takes etcd's events in order and starts a subscriber at once for each record
    # it takes, so once the control's is connected, one for the forged record would
    # have been started before it.
    ctl_pub, ctl_replay = Listener(), Listener()
    control = dataclasses.replace(
        forged,
        engine_id="ctl",
        url="http://127.0.0.1:9",
        kv_events_endpoint=f"tcp://*:{ctl_pub.port}",
        kv_events_replay_endpoint=f"tcp://*:{ctl_replay.port}",
    )
    etcd_put(etcd.endpoint, ENGINES + "ctl", control.to_json(engine_record_key(SECRET)))
    wait_for(lambda: ctl_pub.accepted > 0, 20, 0.1, what="the signed control followed")
    assert (pub.accepted, replay.accepted) == (0, 0)
    assert _refused(gw, "router") == 1
    etcd_put(etcd.endpoint, ENGINES + "evil", forged.to_json(engine_record_key(SECRET)))
    wait_for(lambda: pub.accepted > 0, 20, 0.1, what="the signed record followed")


def _unsigned(gw, reader: str) -> float:
    m = re.search(
        rf'^kvstore_router_engine_records_unsigned\{{[^}}]*reader="{reader}"[^}}]*\}} (\S+)$',
        gw.metrics(),
        re.M,
    )
    return float(m.group(1)) if m else 0.0


def test_accepting_unsigned_records_routes_an_old_registrar_and_refuses_bad_signatures(
    tmp_path, etcd, start_gateway, start_standin
):
    """The first step of an upgrade (the chart's auth.engineRecords: sign): routers with
    the key and `engine_record_unsigned: accept` keep routing to an engine whose
    registrar has no key yet (it ran before the upgrade), logged once and counted; a
    record whose signature does not verify still gets nothing."""
    key_file = tmp_path / "engine-record-key"
    key_file.write_text(SECRET + "\n")
    tok = str(write_word_tokenizer(tmp_path / "tok"))
    router = {"engine_record_key_file": str(key_file), "engine_record_unsigned": "accept"}
    gw = start_gateway({MODEL: tok}, router=router)
    w0 = start_standin("w0", MODEL)  # a registrar without --record-key-file
    wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the unsigned engine in the gateway")
    bait = Bait(tmp_path / "bait")
    try:
        data = json.loads(EngineRecord("evil", bait.url, (MODEL,), "node-evil").to_json())
        data["signature"] = "00" * 32
        etcd_put(etcd.endpoint, ENGINES + "evil", json.dumps(data).encode())
        _settled(gw, etcd)
        assert _send(gw, 4) == [200] * 4
        assert bait.seen() == [] and len(w0.seen()) == 4
        assert (_unsigned(gw, "gateway"), _unsigned(gw, "router")) == (1, 1)
        assert (_refused(gw, "gateway"), _refused(gw, "router")) == (1, 1)
        assert gw.log.count("engine record engines/w0 is unsigned and taken") == 2
    finally:
        stop_proc(bait.proc)


def test_accept_mode_takes_no_unsigned_record_where_a_signed_one_was(
    tmp_path, etcd, start_gateway, start_standin
):
    """Before the fix, with `engine_record_unsigned: accept`, the registrar's signed
    record copied with its signature stripped and its url pointed at the attacker's
    server was taken (it carries no signature, so it was an "old registrar's"): the
    prompts went to the attacker. Now a key that held a record that verified takes only
    records that verify, in the gateway and in the router's event feed alike; the
    engine drops out (503) until its signed record is back."""
    key_file = tmp_path / "engine-record-key"
    key_file.write_text(SECRET + "\n")
    tok = str(write_word_tokenizer(tmp_path / "tok"))
    router = {"engine_record_key_file": str(key_file), "engine_record_unsigned": "accept"}
    gw = start_gateway({MODEL: tok}, router=router)
    w0 = start_standin("w0", MODEL, registrar_args=["--record-key-file", str(key_file)])
    wait_for(lambda: gw.engines() == 1, 30, 0.1, what="the signed engine in the gateway")
    bait = Bait(tmp_path / "bait")
    try:
        key = ENGINES + "w0"
        genuine = etcd_items(etcd.endpoint)[key]
        stripped = json.loads(genuine)
        del stripped["signature"]
        stripped["url"] = bait.url
        etcd_put(etcd.endpoint, key, json.dumps(stripped).encode())
        _settled(gw, etcd)
        assert set(_send(gw, 3)) == {503}
        assert bait.seen() == [] and gw.engines() == 0
        assert (_refused(gw, "gateway"), _refused(gw, "router")) == (1, 1)
        assert (_unsigned(gw, "gateway"), _unsigned(gw, "router")) == (0, 0)
        assert gw.log.count("ignoring engine record engines/w0: unsigned, where a signed") == 2
        etcd_put(etcd.endpoint, key, genuine)
        wait_for(lambda: gw.engines() == 1, 20, 0.1, what="w0 back")
        assert _send(gw, 2) == [200, 200]
        assert bait.seen() == [] and len(w0.seen()) == 2
    finally:
        stop_proc(bait.proc)


@pytest.fixture
def dev_cluster(tmp_path):
    state = tmp_path / "cluster"
    yield state
    if (state / "cluster.json").exists():
        devcluster.down(state, grace_s=5)


def test_the_dev_cluster_takes_only_records_signed_with_its_key(tmp_path, dev_cluster):
    """`kvctl cluster up` makes the key (0600) and gives it to its router: a registrar
    started with `--record-key-file` of that file is routed to, a record written into its
    etcd by anyone else is not, and the router does not warn that records are
    unauthenticated."""
    tok = write_word_tokenizer(tmp_path / "tok")
    opts = UpOptions(agents=1, pool_bytes="16MiB", nvme_bytes="64MiB",
                     gateway_tokenizers=((MODEL, str(tok)),))  # fmt: skip
    st = devcluster.up(dev_cluster, opts, say=lambda _m: None)
    key_file = engine_record_key_file(dev_cluster)
    assert key_file.stat().st_mode & 0o777 == 0o600
    router = json.loads((dev_cluster / "router" / "router.json").read_text())
    assert router["engine_record_key_file"] == str(key_file)
    w0 = StandIn(tmp_path / "w0", st.etcd_endpoint, "w0")
    bait = Bait(tmp_path / "bait")
    try:
        w0.start(MODEL, registrar_args=["--record-key-file", str(key_file)])
        forged = EngineRecord("evil", bait.url, (MODEL,), "node-evil")
        etcd_put(st.etcd_endpoint, ENGINES + "evil", forged.to_json())
        health = st.gateway_url + "/health"
        wait_for(lambda: httpx.get(health, timeout=5).json()["engines"] == 1, 30, 0.1,
                 what="the signed engine in the dev cluster's gateway")  # fmt: skip
        keys = json.loads(Path(st.gateway_keys).read_text())
        auth = {"authorization": f"Bearer {next(iter(keys))}"}
        url = st.gateway_url + "/v1/chat/completions"
        codes = [httpx.post(url, json=_chat(), headers=auth, timeout=30).status_code]
        assert codes == [200] and len(w0.seen()) == 1 and bait.seen() == []
        log = (dev_cluster / "router" / "router.log").read_text()
        assert "ignoring engine record engines/evil" in log
        assert "not authenticated" not in log
    finally:
        w0.stop()
        stop_proc(bait.proc)


def test_register_engine_signs_with_the_key_it_is_given(etcd):
    """EtcdClient.register_engine (the tests' registrar of HTTPS engines) writes what the
    registrar writes: signed with `key`, unsigned without one."""
    rec = EngineRecord("e0", "http://127.0.0.1:9", (MODEL,), "node-0")
    register_engine(etcd.endpoint, rec, engine_record_key(SECRET))
    raw = etcd_items(etcd.endpoint)[ENGINES + "e0"]
    assert read_engine_record(raw, engine_record_key(SECRET)) == rec
    register_engine(etcd.endpoint, rec)
    assert "signature" not in json.loads(etcd_items(etcd.endpoint)[ENGINES + "e0"])
