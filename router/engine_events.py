"""vLLM's KV events, decoded and applied to the engine index. Pure, no I/O (the sockets are
router/engine_feed.py).

Wire format (vllm/distributed/kv_events.py, vLLM 0.32): each scheduler step publishes one
ZMQ multipart message (topic, seq as 8-byte big-endian, payload); the payload is msgpack
of `KVEventBatch`, an array `[ts, [event, ...], data_parallel_rank]`, each event a map
tagged by "type": `BlockStored` (block_hashes, parent_block_hash, token_ids, block_size,
lora_name, medium, extra_keys, group_idx, ...), `BlockRemoved` (block_hashes, medium,
group_idx) or `AllBlocksCleared`. Block hashes are vLLM's (bytes, or ints with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); they are only compared here, never recomputed.

Chain ids. A stored block's kvstore id is computed exactly as the connector computes it
(kvstore/integrations/vllm_agent.py): `hash_chain(root, tokens, block_size)` with
root = salted(spec, salt).root(generation, salt_secret(tenant secret, salt)). The parent's
id comes from the per-engine map vLLM hash -> chain id; a chain's first block
(`parent_block_hash` None) starts at the root. The salt: vLLM puts a request's
`cache_salt` into the extra keys of its FIRST block only (its hash chain carries it on),
so the first block's extra keys say which salted namespace the whole chain is in, the
same namespace the connector used. Any other extra key (LoRA, multimodal, prompt
embeddings) changes vLLM's KV in a way kvstore's ids do not name: such blocks, and so
their descendants (unknown parent), are not indexed. Nothing is ever indexed that the
engine does not hold: unknown means "not in the engine's cache" (priced as recompute).

Duplicates: vLLM may report a block stored twice (two physical copies, or a prefix hit
re-reported) and removes each copy separately; a removal drops the entry at once. That can
miss a copy still held (priced as recompute, harmless) but never keeps a stale one.

Sequence numbers (`SeqTracker`): contiguous per publisher. A gap asks the replay socket
from the first missing number; a replay that cannot cover it (buffer rolled over, no
replay socket) clears the engine's entries, because the missed events may have removed
some. A number below the expected one is a new publisher (engine restart): the engine's
entries are cleared and the stream starts over. The first batch seen after subscribing
with seq > 0 replays from 0 when it can; without that history the index only misses
blocks (no removal of an entry it holds can have been missed).

Noise. The live socket carries no authentication: where the router binds it, any process
that can connect can send frames. A live frame that does not decode, or whose seq is out
of range, is dropped and counted (`dropped`), never a reason to clear. A frame that does
decode but does not follow on is checked against the engine's own replay socket (always
bound by vLLM, so only the engine answers it): a gap whose batch the engine has not
published (its replay ends before it), or a "restart" while the engine's replay still
holds the last batch applied here, byte for byte, is dropped too. What cannot be checked
(no replay socket, the ask failed) clears at most RESYNC_BURST times, then once every
RESYNC_EVERY_S: frames that would clear beyond that are dropped, so garbage cannot keep the
index empty. A well-formed frame with the next seq is indistinguishable from the engine's
own: that much a process that reaches a bound socket can still do (docs/engine-events.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack

from kvstore.hashing import BlockId, hash_chain_packed, split_ids
from kvstore.namespace import Namespace
from kvstore.salt import salt_secret, salted
from router.engine_index import EngineIndex

log = logging.getLogger("kvstore.router")

MAX_SEQ = 1 << 48  # no publisher numbers this many batches (9 years at 1M per second)
RESYNC_BURST = 2  # clears no replay could justify, at once ...
RESYNC_EVERY_S = 30.0  # ... then one per this many seconds
_GAP, _RESTART = "gap", "restart"

VllmHash = Union[bytes, int]
ENGINE_MEDIA = (None, "GPU")  # the engine's own paged cache (CPU backend reports "GPU" too)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ChainRoots",
    "EngineCache",
    "EventBatch",
    "EngineStream",
    "SeqTracker",
    "decode_batch",
]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[VllmHash, ...]
    parent_block_hash: VllmHash | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # one entry per block, or None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[VllmHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def _hashes(v: Any, what: str) -> tuple[VllmHash, ...]:
    if not isinstance(v, list) or not all(isinstance(h, (bytes, int)) for h in v):
        raise ValueError(f"{what}: block_hashes must be a list of bytes or ints")
    return tuple(v)


def _opt(d: dict, key: str, tp: type | tuple[type, ...]) -> Any:
    v = d.get(key)
    if v is not None and not isinstance(v, tp):
        raise ValueError(f"{d.get('type')}: {key} has type {type(v).__name__}")
    return v


def _event(d: Any) -> KVEvent | None:
    """One decoded event; None for a kind this router does not know (newer vLLM)."""
    if not isinstance(d, dict):
        raise ValueError(f"an event must be a map, got {type(d).__name__}")
    kind = d.get("type")
    if kind == "BlockStored":
        tokens = d.get("token_ids")
        bs = d.get("block_size")
        if not isinstance(tokens, list):  # its items are checked when hashed
            raise ValueError("BlockStored: token_ids must be a list of ints")
        if not isinstance(bs, int) or bs < 1:
            raise ValueError("BlockStored: block_size must be an int >= 1")
        parent = _opt(d, "parent_block_hash", (bytes, int))
        extra = _opt(d, "extra_keys", list)
        return BlockStored(
            _hashes(d.get("block_hashes"), kind),
            parent,
            tokens,
            bs,
            _opt(d, "medium", str),
            _opt(d, "lora_name", str),
            tuple(extra) if extra is not None else None,
            _opt(d, "group_idx", int),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            _hashes(d.get("block_hashes"), kind), _opt(d, "medium", str), _opt(d, "group_idx", int)
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(seq: int, payload: bytes) -> EventBatch:
    """A `KVEventBatch` payload; ValueError when it is not one."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"batch {seq} is not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError(f"batch {seq} is not [ts, events, dp_rank]")
    ts = raw[0]
    if not isinstance(ts, (int, float)):
        raise ValueError(f"batch {seq}: ts must be a number")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    events = tuple(ev for ev in map(_event, raw[1]) if ev is not None)
    return EventBatch(seq, float(ts), events, rank)


# --------------------------------------------------------------------------- chain ids
class ChainRoots:
    """Chain roots of one engine's namespace, per `cache_salt`, at the generation in force
    (etcd namespaces/, through `generation_of`; 0 before the namespace is registered,
    as the agent starts it). None when the tenant's secret is not known to this router."""

    def __init__(
        self,
        spec: Namespace,
        tenant_secret: str | None,
        generation_of: Callable[[bytes], int] = lambda ns_id: 0,
    ) -> None:
        self.spec = spec
        self._secret = tenant_secret
        self._generation_of = generation_of
        self._cache: dict[tuple[str, int], bytes] = {}
        self._ns: dict[str, tuple[Namespace, bytes]] = {}

    def root(self, salt: str | None) -> bytes | None:
        if not self.spec.public and not self._secret:
            return None
        key = salt or ""
        entry = self._ns.get(key)
        if entry is None:
            salted_ns = salted(self.spec, salt)
            entry = self._ns[key] = (salted_ns, salted_ns.namespace_id)
        ns, ns_id = entry
        gen = self._generation_of(ns_id)
        root = self._cache.get((key, gen))
        if root is None:
            secret = salt_secret(self._secret, salt) if self._secret else None
            root = self._cache[(key, gen)] = ns.root(gen, secret)
        return root


def _first_salt(extra: tuple[Any, ...] | None) -> tuple[bool, str | None]:
    """(usable, salt) from a chain's first block's extra keys: only a lone cache_salt
    string is something kvstore's ids name."""
    keys = extra[0] if extra else None
    if not keys:
        return True, None
    if len(keys) == 1 and isinstance(keys[0], str):
        return True, keys[0]
    return False, None


def _plain(extra: tuple[Any, ...] | None, i: int) -> bool:
    return not extra or i >= len(extra) or not extra[i]


@dataclass(slots=True)
class EngineCache:
    """One engine's events applied to the shared EngineIndex: the vLLM hash -> chain id
    map (what BlockRemoved needs; it carries vLLM hashes only) and the chain roots."""

    engine_id: str
    block_size: int
    roots: ChainRoots
    index: EngineIndex
    ids: dict[VllmHash, bytes] = field(default_factory=dict)
    skipped: int = 0  # blocks not indexed (extra keys, unknown parent, other media)

    def apply(self, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev)
            else:
                self.clear()

    def clear(self) -> None:
        self.ids.clear()
        self.index.clear_engine(self.engine_id)

    def _stored(self, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if (
            ev.medium not in ENGINE_MEDIA
            or ev.group_idx not in (None, 0)
            or ev.lora_name
            or ev.block_size != self.block_size
            or len(ev.token_ids) != n * self.block_size
        ):
            self.skipped += n
            return
        if ev.parent_block_hash is None:
            usable, salt = _first_salt(ev.extra_keys)
            parent = self.roots.root(salt) if usable else None
            first = 1  # block 0's extra keys are the salt, checked above
        else:
            parent = self.ids.get(ev.parent_block_hash)
            first = 0
        # Blocks up to the first one whose extra keys kvstore ids cannot name.
        extra = ev.extra_keys
        usable_n = (
            n
            if not extra or not any(extra[first:])
            else next((i for i in range(first, n) if not _plain(extra, i)), n)
        )
        if parent is None or not usable_n:
            self.skipped += n
            return
        tokens = ev.token_ids if usable_n == n else ev.token_ids[: usable_n * self.block_size]
        chain = split_ids(hash_chain_packed(BlockId(parent), tokens, self.block_size))
        new = []
        for h, cid in zip(ev.block_hashes, chain):
            if self.ids.get(h) != cid:
                self.ids[h] = cid
                new.append(cid)
        self.index.store(self.engine_id, new)
        self.skipped += n - usable_n

    def _removed(self, ev: BlockRemoved) -> None:
        if ev.medium not in ENGINE_MEDIA or ev.group_idx not in (None, 0):
            return
        gone = [cid for cid in (self.ids.pop(h, None) for h in ev.block_hashes) if cid]
        if gone:
            self.index.remove(self.engine_id, gone)


# -------------------------------------------------------------------------- sequence
@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with a live batch: apply it, drop it (a duplicate of a replayed one),
    or first replay from `replay_from` (then apply it). `restart`: the publisher is new,
    the engine's entries must go first."""

    apply: bool
    replay_from: int | None = None
    restart: bool = False


class SeqTracker:
    def __init__(self) -> None:
        self.expected: int | None = None  # next seq; None: nothing seen yet
        self._replayed: tuple[int, int] | None = None  # [lo, hi) just replayed

    def live(self, seq: int) -> Verdict:
        """`restart` leaves `expected` as it is: the stream decides (EngineStream) whether
        the publisher is new, and then calls `restart`."""
        exp = self.expected
        if exp is None:
            return Verdict(True, 0 if seq > 0 else None)
        if seq == exp:
            return Verdict(True)
        if seq > exp:
            return Verdict(True, exp)
        if self._replayed is not None and self._replayed[0] <= seq < self._replayed[1]:
            return Verdict(False)  # already applied through the replay
        return Verdict(True, 0 if seq > 0 else None, restart=True)

    def restart(self) -> None:
        self.expected = None  # a new publisher: its stream starts over

    def applied(self, seq: int) -> None:
        self.expected = seq + 1

    def replayed(self, lo: int, hi: int) -> None:
        self._replayed = (lo, hi)


class EngineStream:
    """One engine's event stream: live batches in, replays when a gap shows, every batch
    applied once and in order. The feed (router/engine_feed.py) does the socket work:
    when `live` (or `replayed`) returns a seq it asks the replay socket from there and
    hands the answer (None when there is no replay socket or it failed) to `replayed`.
    `verifiable`: the engine has a replay socket, which settles whether a live frame that
    does not follow on is the engine's (module doc, "Noise")."""

    def __init__(
        self,
        cache: EngineCache,
        verifiable: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.verifiable = verifiable
        self.seq = SeqTracker()
        self.applied_events = 0
        self.resyncs = 0
        self.catch_ups = 0  # catch-up replays that brought batches the live socket lost
        self.dropped = 0  # live frames dropped as noise (module doc)
        self.drops: dict[str, int] = {}  # ... by reason
        self._clock = clock
        self._budget = float(RESYNC_BURST)  # clears no replay justified, left to spend
        self._budget_at = clock()
        self._last: tuple[int, int] | None = None  # (seq, hash of payload) last applied
        self._pending: tuple[int, bytes, EventBatch, str] | None = None

    def live(self, seq: int, payload: bytes) -> int | None:
        if not 0 <= seq < MAX_SEQ:
            self.drop(seq, "sequence number out of range")
            return None
        try:
            batch = decode_batch(seq, payload)
        except ValueError:
            self.drop(seq, "not a KV event batch")
            return None
        v = self.seq.live(seq)
        if not v.apply:
            return None
        if v.restart:
            if self.verifiable and self._last is not None:
                # Did the engine restart? Its replay socket still holds the last batch
                # applied here, unchanged, if not.
                self._pending = (seq, payload, batch, _RESTART)
                return self._last[0]
            return self._restart(seq, payload, batch, verified=False)
        if v.replay_from is not None and v.replay_from < seq:
            self._pending = (seq, payload, batch, _GAP)
            return v.replay_from
        self._apply_live(seq, payload, batch)
        return None

    def replayed(self, start: int, frames: list[tuple[int, bytes]] | None) -> int | None:
        """The replay from `start` (seq, payload in order), or None: none to be had.
        Returns where to ask the replay socket from next, if anywhere."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        seq, payload, batch, kind = pending
        if kind == _RESTART:
            return self._restart_checked(seq, payload, batch, frames)
        if frames is None:
            if self.seq.expected is not None:
                if not self._may_resync():
                    self.drop(seq, "gap not replayable, resyncs spent")
                    return None
                log.info(
                    "engine %s: events %d..%d lost and no replay to be had; resyncing",
                    self.cache.engine_id,
                    start,
                    seq - 1,
                )
                self._resync()
            self._apply_live(seq, payload, batch)
            return None
        got = {s: p for s, p in frames if s >= start}
        if seq not in got and (not got or max(got) < seq - 1):
            # The engine has not published up to this seq: not its batch.
            self.drop(seq, "ahead of the engine's own stream")
            if got:
                self.caught_up(start, sorted(got.items()))
            return None
        if seq not in got:
            got[seq] = payload
        if start not in got:
            # Missed events the replay cannot give back. Mid-stream they may have removed
            # blocks we index: start over. Before anything was applied nothing is stale.
            if self.seq.expected is not None:
                log.info(
                    "engine %s: events %d..%d lost and not replayable; resyncing",
                    self.cache.engine_id,
                    start,
                    seq - 1,
                )
                self._resync()
            self._apply(seq, got[seq])
            return None
        s = start
        while s in got:
            self._apply(s, got[s])
            s += 1
        if s <= seq:  # a hole inside the replay itself
            self._resync()
            self._apply(seq, got[seq])
            s = seq + 1
        self.seq.replayed(start, s)
        return None

    def _restart_checked(
        self, seq: int, payload: bytes, batch: EventBatch, frames: list[tuple[int, bytes]] | None
    ) -> int | None:
        if frames is None or self._last is None:
            return self._restart(seq, payload, batch, verified=False)
        last_seq, digest = self._last
        held = dict(frames).get(last_seq)
        if held is not None and hash(held) == digest:
            # The engine's stream still holds what was applied here: no new publisher.
            self.drop(seq, "behind the engine's own stream")
            newer = sorted((s, p) for s, p in frames if s > last_seq)
            if newer:
                self.caught_up(last_seq + 1, newer)
            return None
        return self._restart(seq, payload, batch, verified=True)

    def _restart(self, seq: int, payload: bytes, batch: EventBatch, verified: bool) -> int | None:
        if not verified and not self._may_resync():
            self.drop(seq, "restart not verifiable, resyncs spent")
            return None
        log.info(
            "engine %s: event seq went back to %d: restarted; resyncing",
            self.cache.engine_id,
            seq,
        )
        self._resync()
        self.seq.restart()
        if seq > 0:  # its history, from 0, when the replay socket has it
            self._pending = (seq, payload, batch, _GAP)
            return 0
        self._apply_live(seq, payload, batch)
        return None

    def catch_up_from(self) -> int:
        """Where an idle catch-up asks the replay socket from: the next seq expected."""
        return 0 if self.seq.expected is None else self.seq.expected

    def caught_up(self, start: int, frames: list[tuple[int, bytes]]) -> None:
        """A catch-up replay from `start` (catch_up_from), asked while the live socket
        was idle: batches it never delivered. A PUB drops what it sends before the
        subscription reaches it, so an engine's first batches after a (re)connect can be
        lost with no later batch to show the gap. Applied like any replay; a batch that
        then arrives live is a duplicate and dropped."""
        got = sorted({s: p for s, p in frames if s >= start}.items())
        if not got:
            return
        first = got[0][0]
        if first != start and self.seq.expected is not None:
            log.info(
                "engine %s: events %d..%d lost and not replayable; resyncing",
                self.cache.engine_id,
                start,
                first - 1,
            )
            self._resync()
        self.catch_ups += 1
        prev = first - 1
        for s, p in got:
            if s != prev + 1:  # a hole inside the replay itself
                self._resync()
            self._apply(s, p)
            prev = s
        self.seq.replayed(first, prev + 1)

    def drop(self, seq: int, why: str) -> None:
        """Count a live frame dropped as noise; logged at the 1st, 10th, 100th, ... (the
        seq and the reason: never the payload, which carries token ids)."""
        self.dropped += 1
        self.drops[why] = self.drops.get(why, 0) + 1
        n = self.dropped
        if n == 10 ** (len(str(n)) - 1):
            log.warning(
                "engine %s: dropped a KV event frame (seq %d): %s; %d dropped so far",
                self.cache.engine_id,
                seq,
                why,
                n,
            )

    def _may_resync(self) -> bool:
        """A clear no replay justified: RESYNC_BURST at once, then one per
        RESYNC_EVERY_S (a token bucket)."""
        now = self._clock()
        self._budget = min(
            float(RESYNC_BURST), self._budget + (now - self._budget_at) / RESYNC_EVERY_S
        )
        self._budget_at = now
        if self._budget < 1.0:
            return False
        self._budget -= 1.0
        return True

    def _resync(self) -> None:
        self.resyncs += 1
        self.cache.clear()

    def _apply_live(self, seq: int, payload: bytes, batch: EventBatch) -> None:
        """A live batch, decoded already. One with an event that cannot be applied is
        dropped, the seq not taken: were it the engine's, the next batch shows a gap and
        the replay brings it again, and an unusable batch from the replay resyncs."""
        try:
            self.cache.apply(batch)
        except (ValueError, TypeError):
            self.drop(seq, "unusable event")
            return
        self.applied_events += len(batch.events)
        self._last = (seq, hash(payload))
        self.seq.applied(seq)

    def _apply(self, seq: int, payload: bytes) -> None:
        """A batch from the engine's replay socket (only the engine answers it)."""
        try:
            batch = decode_batch(seq, payload)
            self.cache.apply(batch)
        except (ValueError, TypeError) as exc:  # what it changed is unknown: start over
            log.warning(
                "engine %s: unusable batch %d: %s; resyncing", self.cache.engine_id, seq, exc
            )
            self._resync()
        else:
            self.applied_events += len(batch.events)
        self._last = (seq, hash(payload))
        self.seq.applied(seq)
