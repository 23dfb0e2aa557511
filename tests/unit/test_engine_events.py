"""vLLM KV events into the router's engine index, and the engine cost function. Pure: the
frames are built by hand in vLLM 0.32's wire format (vllm/distributed/kv_events.py), and
one golden payload was encoded by vLLM's own msgspec classes."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import msgpack
import pytest

from kvstore import errors
from kvstore.coord.engines import EngineRecord
from kvstore.hashing import BlockId, hash_chain, hash_chain_packed
from kvstore.integrations.vllm_config import salt_secret as connector_salt_secret
from kvstore.integrations.vllm_config import salted as connector_salted
from router.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChainRoots,
    EngineCache,
    EngineStream,
    decode_batch,
)
from router.engine_index import EngineIndex
from router.routing import RouterCore
from router.scoring import Pricing, Weights
from tests.support.common import make_namespace

BS = 4
SECRET = "acme-secret"
NS = make_namespace(tenant="acme", block_size=BS)

# KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[b"a"*32], parent_block_hash=None,
# token_ids=[1, 2], block_size=2, lora_id=None, medium="GPU", lora_name=None,
# extra_keys=[("salt1",)], group_idx=0), BlockRemoved([b"a"*32], "GPU", group_idx=0),
# AllBlocksCleared()], data_parallel_rank=0), encoded by msgspec in .venv-vllm (vLLM 0.32).
GOLDEN = (
    b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x93\x8a\xa4type\xabBlockStored\xacblock_hashes"
    b"\x91\xc4 " + b"a" * 32 + b"\xb1parent_block_hash\xc0\xa9token_ids\x92\x01\x02"
    b"\xaablock_size\x02\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0\xaaextra_keys"
    b"\x91\x91\xa5salt1\xa9group_idx\x00\x84\xa4type\xacBlockRemoved\xacblock_hashes\x91\xc4 "
    + b"a" * 32
    + b"\xa6medium\xa3GPU\xa9group_idx\x00\x81\xa4type\xb0AllBlocksCleared\x00"
)


def vh(tokens: list[int], parent: bytes | None, salt: str | None = None) -> bytes:
    """A stand-in for vLLM's block hash: any injective function of the same inputs."""
    return hashlib.sha256(repr((parent, tokens, salt)).encode()).digest()


def stored_events(tokens: list[int], salt: str | None = None, parent_blocks: int = 0):
    """BlockStored for the full blocks of `tokens` after the first `parent_blocks`, as
    vLLM emits it (salt in the first block's extra keys only), and the vLLM hashes."""
    hashes, parent = [], None
    for i in range(len(tokens) // BS):
        parent = vh(tokens[i * BS : (i + 1) * BS], parent, salt if i == 0 else None)
        hashes.append(parent)
    new = hashes[parent_blocks:]
    ev: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": new,
        "parent_block_hash": hashes[parent_blocks - 1] if parent_blocks else None,
        "token_ids": tokens[parent_blocks * BS : len(hashes) * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    if salt and not parent_blocks:
        ev["extra_keys"] = [[salt]] + [None] * (len(new) - 1)
    return ev, hashes


def payload(*events: dict, ts: float = 1.0) -> bytes:
    return msgpack.packb([ts, list(events), 0], use_bin_type=True)


def removed(hashes: list[bytes]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def connector_ids(tokens: list[int], salt: str | None = None, generation: int = 0) -> bytes:
    """What the connector stores (kvstore/integrations/vllm_agent.py): the salted spec's
    root at the generation, keyed by the salted secret."""
    spec = connector_salted(NS, salt)
    root = spec.root(generation, connector_salt_secret(SECRET, salt))
    return hash_chain_packed(BlockId(root), tokens, BS)


def make_stream(index: EngineIndex, engine: str = "e1", gen: int = 0) -> EngineStream:
    roots = ChainRoots(NS, SECRET, lambda ns_id: gen)
    return EngineStream(EngineCache(engine, BS, roots, index))


TOKENS = list(range(100, 120))  # 5 blocks


# --------------------------------------------------------------------------- decoding
def test_decodes_the_payload_vllm_itself_encoded():
    b = decode_batch(7, GOLDEN)
    assert (b.seq, b.ts, b.data_parallel_rank) == (7, 1.5, 0)
    stored, rem, cleared = b.events
    assert stored == BlockStored((b"a" * 32,), None, [1, 2], 2, "GPU", None, (["salt1"],), 0)
    assert rem == BlockRemoved((b"a" * 32,), "GPU", 0)
    assert cleared == AllBlocksCleared()


@pytest.mark.parametrize(
    "bad",
    [b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [{"type": "BlockStored"}], 0])],
)
def test_malformed_payloads_are_value_errors(bad):
    with pytest.raises(ValueError):
        decode_batch(0, bad)


@pytest.mark.parametrize(
    "seq, frame",
    [(1, b"\xc1"), (1, b"garbage"), (2**62, b"garbage"), (-5, None), (1 << 48, None)],
    ids=["not-msgpack", "garbage", "absurd-seq", "negative-seq", "seq-out-of-range"],
)
def test_a_live_frame_that_is_not_a_batch_is_dropped_and_counted_not_a_reason_to_clear(seq, frame):
    """Anyone who reaches a socket the router binds can send frames: noise is dropped
    (and counted), the index and the sequence stay as they were."""
    index = EngineIndex()
    s = make_stream(index)
    ev, hashes = stored_events(TOKENS)
    assert s.live(0, payload(ev)) is None
    for _ in range(3):
        assert s.live(seq, frame if frame is not None else payload(removed(hashes))) is None
    assert (index.engine_blocks("e1"), s.resyncs, s.dropped, s.seq.expected) == (5, 0, 3, 1)
    assert s.live(1, payload(removed(hashes[4:]))) is None  # the engine's next: applied
    assert index.engine_blocks("e1") == 4 and s.seq.expected == 2


def test_an_undecodable_batch_from_the_replay_resyncs_and_the_stream_goes_on():
    """The replay socket is the engine's own: a batch there that cannot be read may have
    removed blocks, so the index starts over."""
    index = EngineIndex()
    s = make_stream(index)
    ev, _ = stored_events(TOKENS)
    assert s.live(0, payload(ev)) is None
    assert s.live(2, payload(ev)) == 1
    s.replayed(1, [(1, b"\xc1"), (2, payload(ev))])
    assert s.resyncs == 1 and s.seq.expected == 3
    assert index.engine_blocks("e1") == 5  # seq 2 stored them again


# ------------------------------------------------------------------------ chain ids
@pytest.mark.parametrize("salt", [None, "tenant-x-salt"])
def test_chain_ids_equal_what_the_connector_stores(salt):
    index = EngineIndex()
    s = make_stream(index, gen=3)
    ev, hashes = stored_events(TOKENS[:8], salt)  # a first step stores 2 blocks
    s.live(0, payload(ev))
    ev2, _ = stored_events(TOKENS, salt, parent_blocks=2)  # the next 3, parent known
    s.live(1, payload(ev2))
    want = connector_ids(TOKENS, salt, generation=3)
    assert index.prefix_lengths(want) == {"e1": 5}
    # Another salt's (or the unsalted) ids of the same tokens are not held.
    other = connector_ids(TOKENS, None if salt else "other", generation=3)
    assert index.prefix_lengths(other) == {}
    assert index.prefix_lengths(connector_ids(TOKENS, salt, generation=2)) == {}


def test_blocks_with_extra_keys_kvstore_does_not_name_are_not_indexed():
    index = EngineIndex()
    s = make_stream(index)
    ev, hashes = stored_events(TOKENS)
    ev["extra_keys"] = [None, None, [["mm-hash", 0]], None, None]  # an image in block 2
    s.live(0, payload(ev))
    assert index.prefix_lengths(connector_ids(TOKENS)) == {"e1": 2}
    lora, _ = stored_events(list(range(500, 508)))
    lora["lora_name"] = "adapter"
    s.live(1, payload(lora))
    assert index.prefix_lengths(connector_ids(list(range(500, 508)))) == {}
    # A child of a block not indexed has no known parent: not indexed either.
    child, _ = stored_events(TOKENS + list(range(4)), parent_blocks=5)
    s.live(2, payload(child))
    assert index.engine_blocks("e1") == 2


def test_removed_blocks_leave_and_all_blocks_cleared_empties():
    index = EngineIndex()
    s = make_stream(index)
    ev, hashes = stored_events(TOKENS)
    s.live(0, payload(ev))
    s.live(1, payload(removed(hashes[3:])))  # vLLM evicted the tail
    ids = connector_ids(TOKENS)
    assert index.prefix_lengths(ids) == {"e1": 3}
    s.live(2, payload(removed(hashes[1:2])))  # a hole: the prefix ends before it
    assert index.prefix_lengths(ids) == {"e1": 1}
    s.live(3, payload({"type": "AllBlocksCleared"}))
    assert index.prefix_lengths(ids) == {} and len(index) == 0


# ------------------------------------------------------------------- gaps, restarts
def test_gap_replays_from_the_first_missing_seq():
    index = EngineIndex()
    s = make_stream(index)
    ev, hashes = stored_events(TOKENS)
    frames = [payload(ev), payload(removed(hashes[2:])), payload(removed(hashes[1:2]))]
    assert s.live(0, frames[0]) is None
    assert s.live(2, frames[2]) == 1  # seq 1 was lost: replay from 1
    s.replayed(1, [(1, frames[1]), (2, frames[2])])
    assert index.prefix_lengths(connector_ids(TOKENS)) == {"e1": 1}
    assert s.resyncs == 0 and s.seq.expected == 3
    assert s.live(2, frames[2]) is None  # the live copy of a replayed batch: dropped
    assert s.resyncs == 0


def test_a_gap_the_replay_cannot_cover_resyncs():
    index = EngineIndex()
    s = make_stream(index)
    ev, hashes = stored_events(TOKENS)
    s.live(0, payload(ev))
    other, _ = stored_events(list(range(300, 308)))
    assert s.live(5, payload(other)) == 1
    s.replayed(1, None)  # no replay socket (or it failed): seq 1..4 may have removed some
    assert s.resyncs == 1
    assert index.prefix_lengths(connector_ids(TOKENS)) == {}
    assert index.prefix_lengths(connector_ids(list(range(300, 308)))) == {"e1": 2}
    s.live(6, payload(removed([])))
    assert s.seq.expected == 7


def test_a_stream_joined_late_replays_its_history_without_resync():
    index = EngineIndex()
    s = make_stream(index)
    ev, hashes = stored_events(TOKENS)
    later = payload(removed(hashes[4:]))
    assert s.live(3, later) == 0
    s.replayed(0, [(2, payload(ev)), (3, later)])  # buffer rolled past 0, 1: not a resync
    assert s.resyncs == 0
    assert index.prefix_lengths(connector_ids(TOKENS)) == {}  # only seq 3 applied
    assert s.seq.expected == 4


def test_a_catch_up_before_any_live_batch_applies_the_history_from_seq_0():
    index = EngineIndex()
    s = make_stream(index)
    ev, hashes = stored_events(TOKENS)
    frames = [payload(ev), payload(removed(hashes[3:]))]
    assert s.catch_up_from() == 0
    s.caught_up(0, [(1, frames[1]), (0, frames[0])])  # in any order
    assert index.prefix_lengths(connector_ids(TOKENS)) == {"e1": 3}
    assert (s.seq.expected, s.resyncs, s.catch_ups) == (2, 0, 1)
    assert s.catch_up_from() == 2
    assert s.live(1, frames[1]) is None  # its live copy, late: dropped
    assert s.live(2, payload(removed(hashes[2:3]))) is None
    assert index.prefix_lengths(connector_ids(TOKENS)) == {"e1": 2}
    assert s.resyncs == 0


def test_an_empty_catch_up_changes_nothing():
    index = EngineIndex()
    s = make_stream(index)
    ev, _ = stored_events(TOKENS)
    s.live(0, payload(ev))
    s.caught_up(1, [])
    s.caught_up(1, [(0, payload(ev))])  # older than asked: ignored
    assert (s.seq.expected, s.resyncs, s.catch_ups) == (1, 0, 0)
    assert index.engine_blocks("e1") == 5


@pytest.mark.parametrize(
    "live_first, start, last",
    [(True, 1, 4), (False, 0, 2)],
    ids=["rolled-out-of-the-buffer", "hole-inside-the-replay"],
)
def test_a_catch_up_missing_batches_resyncs_before_the_batch_after_them(live_first, start, last):
    """The chain stored at seq 0 (live, or first in the catch-up), another at `last`, and
    the batches between lost for good: they may have removed blocks, so the index starts
    over before `last`."""
    index = EngineIndex()
    s = make_stream(index)
    ev, _ = stored_events(TOKENS)
    other, _ = stored_events(list(range(300, 308)))
    frames = [(last, payload(other))]
    if live_first:
        s.live(0, payload(ev))
    else:
        frames.insert(0, (0, payload(ev)))
    s.caught_up(start, frames)
    assert s.resyncs == 1
    assert index.prefix_lengths(connector_ids(TOKENS)) == {}
    assert index.prefix_lengths(connector_ids(list(range(300, 308)))) == {"e1": 2}
    assert s.seq.expected == last + 1


def test_engine_restart_seq_reset_resyncs():
    index = EngineIndex()
    s = make_stream(index)
    ev, _ = stored_events(TOKENS)
    for seq in range(3):
        s.live(seq, payload(removed([])) if seq else payload(ev))
    assert index.engine_blocks("e1") == 5
    fresh, _ = stored_events(list(range(300, 308)))
    assert s.live(0, payload(fresh)) is None  # a new publisher starts at 0
    assert s.resyncs == 1
    assert index.prefix_lengths(connector_ids(TOKENS)) == {}
    assert index.prefix_lengths(connector_ids(list(range(300, 308)))) == {"e1": 2}


def checked_stream(index: EngineIndex, clock=lambda: 0.0) -> EngineStream:
    """An engine with a replay socket: out-of-order frames are checked against it."""
    roots = ChainRoots(NS, SECRET, lambda ns_id: 0)
    return EngineStream(EngineCache("e1", BS, roots, index), verifiable=True, clock=clock)


def test_a_gap_the_engine_never_published_is_dropped_and_what_it_missed_applied():
    """A well-formed batch far ahead: the engine's replay ends before it, so it is not
    the engine's. Dropped; the batches the replay did bring are applied; no clear."""
    index = EngineIndex()
    s = checked_stream(index)
    ev, hashes = stored_events(TOKENS)
    frames = [payload(ev), payload(removed(hashes[4:]))]
    assert s.live(0, frames[0]) is None
    forged = payload({"type": "AllBlocksCleared"})
    assert s.live(1000, forged) == 1
    assert s.replayed(1, [(1, frames[1])]) is None  # the engine is at seq 1
    assert (s.resyncs, s.dropped, s.seq.expected) == (0, 1, 2)
    assert index.engine_blocks("e1") == 4
    # A real gap still replays and applies: the engine's replay reaches the batch.
    assert s.live(3, payload(removed(hashes[2:3]))) == 2
    s.replayed(2, [(2, payload(removed(hashes[3:4]))), (3, payload(removed(hashes[2:3])))])
    assert (s.resyncs, s.seq.expected, index.engine_blocks("e1")) == (0, 4, 2)


def test_a_seq_going_back_is_a_restart_only_if_the_engines_replay_says_so():
    index = EngineIndex()
    s = checked_stream(index)
    ev, hashes = stored_events(TOKENS)
    frames = [payload(ev), payload(removed([])), payload(removed([]), ts=2.0)]
    for seq, f in enumerate(frames):
        assert s.live(seq, f) is None
    # Forged: seq 0 again, clearing. The engine's replay still has seq 2 as applied.
    assert s.live(0, payload({"type": "AllBlocksCleared"})) == 2
    assert s.replayed(2, [(2, frames[2])]) is None
    assert (s.resyncs, s.dropped, index.engine_blocks("e1")) == (0, 1, 5)
    # The engine did restart: its replay's seq 2 (if any) is another batch.
    fresh, _ = stored_events(list(range(300, 308)))
    assert s.live(1, payload(fresh)) == 2
    assert s.replayed(2, [(0, payload(removed([]), ts=9.0))]) == 0  # resynced; history
    s.replayed(0, [(0, payload(removed([]), ts=9.0)), (1, payload(fresh))])
    assert (s.resyncs, s.seq.expected) == (1, 2)
    assert index.prefix_lengths(connector_ids(TOKENS)) == {}
    assert index.prefix_lengths(connector_ids(list(range(300, 308)))) == {"e1": 2}


def test_clears_no_replay_can_justify_are_rate_limited():
    """Without a replay socket (or with one that fails) a seq going back, or a gap,
    cannot be checked: it clears RESYNC_BURST times, then once per RESYNC_EVERY_S; the
    frames in between are dropped, so forged ones cannot keep the index empty."""
    from router.engine_events import RESYNC_BURST, RESYNC_EVERY_S

    now = [0.0]
    index = EngineIndex()
    roots = ChainRoots(NS, SECRET, lambda ns_id: 0)
    s = EngineStream(EngineCache("e1", BS, roots, index), clock=lambda: now[0])
    ev, _ = stored_events(TOKENS)
    clear = payload({"type": "AllBlocksCleared"})
    for seq in range(3):
        s.live(seq, payload(ev))
    for _ in range(RESYNC_BURST + 3):
        assert s.live(0, clear) is None  # a "restart" nobody can check
    assert (s.resyncs, s.dropped) == (RESYNC_BURST, 3)
    # The engine goes on at seq 3: a gap from 1 it cannot replay, and nothing left to
    # clear with: dropped too, until the budget refills.
    assert s.live(3, payload(ev)) == 1
    assert s.replayed(1, None) is None
    assert (s.resyncs, s.dropped, s.seq.expected) == (RESYNC_BURST, 4, 1)
    now[0] += RESYNC_EVERY_S
    assert s.live(4, payload(ev)) == 1
    s.replayed(1, None)
    assert (s.resyncs, s.seq.expected, index.engine_blocks("e1")) == (RESYNC_BURST + 1, 5, 5)
    assert s.live(0, clear) is None  # spent again: dropped, the index stays
    assert (s.dropped, index.engine_blocks("e1")) == (5, 5)


# ----------------------------------------------------------------- engine routing
def record(engine_id: str, node_id: str, spec=NS, events: str | None = "tcp://127.0.0.1:1"):
    return EngineRecord(
        engine_id,
        f"http://127.0.0.1:{8000 + int(engine_id[-1])}",
        ("tiny",),
        node_id,
        spec.to_dict(),
        BS,
        events,
    )


def core_with(*records: EngineRecord) -> RouterCore:
    core = RouterCore(Weights(), tenant_secrets={"acme": SECRET})
    for r in records:
        core.engines.upsert(r)
    return core


def test_engine_cache_evictions_seen_through_events_change_the_choice():
    core = core_with(record("e1", "n1"), record("e2", "n2"))
    s1 = core.engines.engines["e1"].stream
    ev, hashes = stored_events(TOKENS)
    s1.live(0, payload(ev))
    ids = connector_ids(TOKENS)
    ns_id = NS.namespace_id
    d = core.route_engines(ns_id, ids, "tiny")
    assert (d.chosen.engine_id, d.chosen.engine_blocks, d.chosen.recompute_blocks) == ("e1", 5, 0)
    # e1 now has that request in flight; its cache still wins the next one.
    assert core.route_engines(ns_id, ids, "tiny", dry_run=True).chosen.engine_id == "e1"
    s1.live(1, payload(removed(hashes)))  # vLLM evicted the prompt from e1
    d = core.route_engines(ns_id, ids, "tiny", dry_run=True)
    assert d.chosen.engine_id == "e2"  # no cache left on e1, and it is busier
    assert {s.engine_id: s.engine_blocks for s in d.scores} == {"e1": 0, "e2": 0}


def test_engines_sharing_a_device_share_its_queue():
    """Two engines on one device (one GPU, or one host's CPU cores): work queued on either
    delays both, so it moves no request away from the engine holding its prefix; engines
    of their own devices are balanced by their own queues."""

    def board(device: str):
        core = core_with(
            replace(record("e1", "n1"), device=device), replace(record("e2", "n2"), device=device)
        )
        ev, _ = stored_events(TOKENS)
        core.engines.engines["e1"].stream.live(0, payload(ev))
        for i in range(4):  # e1 is busy: four requests of 20 blocks of prefill each
            core.engines.hold(f"busy-{i}", "e1", 20.0)
        return core, core.route_engines(
            NS.namespace_id, connector_ids(TOKENS), "tiny", dry_run=True
        )

    _, own = board("")
    assert own.chosen.engine_id == "e2"  # e1's own queue outweighs its five cached blocks
    core, shared = board("cpu:host-a")
    by = {s.engine_id: s for s in shared.scores}
    assert shared.chosen.engine_id == "e1"
    assert (
        (by["e1"].in_flight, by["e1"].queued) == (by["e2"].in_flight, by["e2"].queued) == (4, 80.0)
    )
    assert by["e1"].engine_blocks == 5 and by["e1"].load_cost == by["e2"].load_cost
    # A request done with its prefill leaves the device's queue, whichever engine ran it.
    core.engines.prefill_done("busy-0")
    assert (
        core.route_engines(NS.namespace_id, connector_ids(TOKENS), "tiny", dry_run=True)
        .scores[1]
        .queued
        == 60.0
    )


def test_pricing_order_engine_cache_then_agent_then_peer_then_recompute():
    core = core_with(record("e1", "n1"), record("e2", "n2"), record("e3", "n3"))
    ev, _ = stored_events(TOKENS)
    core.engines.engines["e1"].stream.live(0, payload(ev))
    ids = connector_ids(TOKENS)
    core.index.store("n2", [ids[i * 16 : i * 16 + 16] for i in range(5)])
    pricing = Pricing(block_bytes=8192, block_tokens=BS)  # peer_price well below 1
    core.set_namespace_layout(NS.namespace_id, pricing.block_bytes, pricing.block_tokens)
    d = core.route_engines(NS.namespace_id, ids, "tiny", dry_run=True)
    by = {s.engine_id: s for s in d.scores}
    assert [s.engine_id for s in d.scores] == ["e1", "e2", "e3"]
    assert (by["e1"].engine_blocks, by["e1"].cost) == (5, 0.0)
    assert (by["e2"].agent_blocks, by["e2"].peer_blocks) == (5, 0)
    assert (by["e3"].peer_blocks, by["e3"].peer_node_id) == (5, "n2")
    assert 0 < by["e2"].cost < by["e3"].cost < 5.0  # 5.0: recomputing all five
    assert by["e3"].terms()["peer_cost"] == by["e3"].cost
    # The kill switch: every engine is priced by load alone.
    core.killswitch = True
    d = core.route_engines(NS.namespace_id, ids, "tiny", dry_run=True)
    assert all(s.recompute_blocks == 5 for s in d.scores)


def test_engine_routing_refuses_bad_input_and_unknown_models():
    core = core_with(record("e1", "n1"))
    with pytest.raises(errors.InvalidArgument):
        core.route_engines(NS.namespace_id, b"x" * 17)
    with pytest.raises(errors.InvalidArgument):
        core.route_engines(b"short", b"")
    with pytest.raises(errors.Unavailable):
        core.route_engines(NS.namespace_id, b"", "other-model")


def test_engines_without_events_or_secret_are_routed_but_not_indexed():
    core = RouterCore(Weights(), tenant_secrets={})
    core.engines.upsert(record("e1", "n1"))  # tenant acme: no secret known here
    core.engines.upsert(record("e2", "n2", events=None))
    assert core.engines.engines["e1"].stream is None
    assert core.engines.engines["e2"].stream is None
    d = core.route_engines(NS.namespace_id, connector_ids(TOKENS), "tiny")
    assert {s.engine_id for s in d.scores} == {"e1", "e2"}
    assert core.engines.release(d.request_id)


def test_re_registration_with_a_new_endpoint_resyncs_and_removal_drops():
    core = core_with(record("e1", "n1"))
    ev, _ = stored_events(TOKENS)
    core.engines.engines["e1"].stream.live(0, payload(ev))
    assert not core.engines.upsert(record("e1", "n1"))  # same stream: kept
    assert core.engines.index.engine_blocks("e1") == 5
    assert core.engines.upsert(record("e1", "n1", events="tcp://127.0.0.1:2"))
    assert core.engines.index.engine_blocks("e1") == 0
    core.engines.remove("e1")
    assert core.engines.index.engines == []


def test_chain_ids_match_hash_chain_of_the_connector_client():
    """The connector's KVClient names blocks with hash_chain(handle.root, ...): the same
    ids as hash_chain_packed, split."""
    root = NS.root(0, SECRET)
    assert b"".join(hash_chain(BlockId(root), TOKENS, BS)) == connector_ids(TOKENS)


def test_dropped_frames_and_resyncs_are_in_the_routers_metrics():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from router.metrics import RouterMetrics

    core = RouterCore(Weights(), tenant_secrets={"acme": SECRET})
    core.engines.upsert(record("vllm-0", "n0"))
    stream = core.engines.engines["vllm-0"].stream
    assert stream is not None
    ev, _ = stored_events(TOKENS)
    stream.live(0, payload(ev))
    stream.live(2**62, b"garbage")
    stream.live(1, b"\xc1")
    reader = InMemoryMetricReader()
    RouterMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"), core)
    seen = {
        m.name: {p.attributes["engine"]: p.value for p in m.data.data_points}
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name.startswith("kvstore_router_engine_")
    }
    assert seen["kvstore_router_engine_events_dropped"] == {"vllm-0": 2}
    assert seen["kvstore_router_engine_resyncs"] == {"vllm-0": 0}
