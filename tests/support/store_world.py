"""The world the property-based BlockStore tests run in (test_store_props*.py): a real
BlockStore over a small host pool and a small RocksDB tier, three namespaces of two
tenants, chains that share prefixes, and a model of what was put that every served byte
is checked against.

A block id names the whole prefix up to it, so one id names exactly one payload
(`block_payload(id)`): a served block is right only if it is a block some caller offered
(put or reserved), of the generation in force, with exactly that payload, and (in TTL
namespaces) not past the expiry the model allows."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from support.common import TEST_SECRET, ManualClock, block_payload, make_namespace, prompt_tokens
from support.store import check_pins

from kvstore import checksum as cks
from kvstore.events import Tier
from kvstore.hashing import hash_chain
from kvstore.policy import NamespacePolicy
from kvstore.store import BlockStore, PutItem
from kvstore.tiers.pool import DevicePool, SlotState
from kvstore.tiers.rocks import RocksTier

SPECS = {
    "keep": make_namespace(tenant="acme", name="keep"),
    "drop": make_namespace(tenant="acme", name="drop"),
    "beta": make_namespace(tenant="beta", name="beta"),
}
NB = SPECS["keep"].block_bytes
BS = SPECS["keep"].block_size
# Pool slots are larger than the blocks: the pool's quota and pin accounting charge a
# whole slot per block, and the NVMe tier's the payload bytes, so the two differ here.
SLOT = 2 * NB
# keep: spills to NVMe, never expires; drop: dropped on eviction, expires; beta: the other
# tenant, spills, expires, caches only chains of two blocks or more.
POLICIES = {
    "keep": NamespacePolicy(pin_budget_bytes=3 * SLOT),
    "drop": NamespacePolicy(persist=False, ttl_seconds=30.0, pin_budget_bytes=2 * SLOT),
    "beta": NamespacePolicy(ttl_seconds=20.0, min_prefix_blocks=2, pin_budget_bytes=2 * SLOT),
}
# What one tenant may pin across its namespaces: less than acme's two budgets together.
TENANT_PIN_BYTES = 4 * SLOT
TENANTS = ("acme", "beta")
MAX_BLOCKS = 6
N_SLOTS = 10
NVME_BLOCKS = 8


def policy_for(spec) -> NamespacePolicy:
    return POLICIES[spec.name]


def build_store(path: str, clock, pool_wrapper=None) -> BlockStore:
    pool = DevicePool(N_SLOTS, SLOT, "cpu")
    if pool_wrapper is not None:
        pool = pool_wrapper(pool)
    return BlockStore(
        pool,
        RocksTier(path, NVME_BLOCKS * NB),
        policy_for=policy_for,
        clock=clock,
        tenant_pin_bytes=TENANT_PIN_BYTES,
    )


@dataclass(frozen=True, slots=True)
class ChainKey:
    """A prompt: `split` blocks of base prompt `base`, then blocks of branch `branch`
    (chains of one base share their first `split` blocks)."""

    ns: str
    base: int
    branch: int
    split: int


class World:
    """The model: which ids were offered, of which generation, and when each was last
    touched (a touch of a block refreshes its ancestors too, as the store's expiry is
    monotone along a chain). Touches are recorded generously (every offered item of a put,
    whether stored or not), so the model's expiry is never earlier than the store's."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.gen = {name: 0 for name in SPECS}
        self.offered: dict[bytes, tuple[str, int]] = {}  # id -> (namespace, generation)
        self.parent_of: dict[bytes, bytes] = {}
        self.last_touch: dict[bytes, float] = {}
        self._chains: dict[tuple[ChainKey, int], list[bytes]] = {}
        self._lock = threading.Lock()

    def root(self, ns: str, gen: int | None = None) -> bytes:
        return SPECS[ns].root(self.gen[ns] if gen is None else gen, TEST_SECRET)

    def chain(self, key: ChainKey, gen: int | None = None) -> list[bytes]:
        gen = self.gen[key.ns] if gen is None else gen
        ids = self._chains.get((key, gen))
        if ids is None:
            split = min(key.split, MAX_BLOCKS)
            tokens = prompt_tokens(key.base, split * BS) + prompt_tokens(
                1000 + 10 * key.base + key.branch, (MAX_BLOCKS - split) * BS
            )
            ids = list(hash_chain(self.root(key.ns, gen), tokens, BS))
            with self._lock:
                self._chains[(key, gen)] = ids
        return ids

    def parent(self, ns: str, ids: list[bytes], i: int, gen: int | None = None) -> bytes:
        return ids[i - 1] if i else self.root(ns, gen)

    def items(
        self,
        ns: str,
        ids: list[bytes],
        start: int,
        end: int,
        gen: int | None = None,
        with_checksum: bool = False,
        bad_at: int = -1,
    ) -> list[PutItem]:
        """PutItems for ids[start:end]; item `bad_at` carries damaged bytes (with the
        checksum of the right ones when `with_checksum`)."""
        out = []
        for i in range(start, end):
            data = block_payload(ids[i], NB)
            good = data
            if i == bad_at:
                data = bytes([data[0] ^ 0x5A]) + data[1:]
            out.append(
                PutItem(
                    ids[i],
                    self.parent(ns, ids, i, gen),
                    data,
                    cks.checksum(good) if with_checksum else None,
                )
            )
        return out

    def offer(
        self, ns: str, ids: list[bytes], start: int, end: int, gen: int | None = None
    ) -> None:
        """Record ids[start:end] as given to the store (before the call that gives them)."""
        gen = self.gen[ns] if gen is None else gen
        with self._lock:
            for i in range(start, end):
                self.offered[ids[i]] = (ns, gen)
                self.parent_of[ids[i]] = self.parent(ns, ids, i, gen)

    def touch(self, ids, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        with self._lock:
            for bid in ids:
                while bid in self.offered and self.last_touch.get(bid, -1.0) < now:
                    self.last_touch[bid] = now
                    bid = self.parent_of[bid]

    def touch_all(self) -> None:
        """A restart: recovery gives every recovered block a fresh TTL."""
        now = self.clock()
        with self._lock:
            for bid in self.offered:
                self.last_touch[bid] = now

    def live(self, bid: bytes, now: float) -> bool:
        ns, _ = self.offered[bid]
        ttl = POLICIES[ns].ttl_seconds
        return not ttl or now < self.last_touch.get(bid, -1e18) + ttl

    def check_block(self, ns: str, gen: int, bid: bytes, now: float | None, data=None) -> None:
        """One block the store claims (lookup) or serves (get, borrow); `now` None skips
        the expiry check (threads: touches are recorded after the fact)."""
        assert bid in self.offered, "served a block nobody put"
        assert self.offered[bid] == (ns, gen), (
            "served a block of another namespace or of a flushed generation"
        )
        if now is not None:
            assert self.live(bid, now), "served a block past its TTL"
        if data is not None:
            assert bytes(data) == block_payload(bid, NB), "served bytes that were not put"

    def check_served(
        self, ns: str, gen: int, want: list[bytes], served, payloads, now: float | None
    ) -> None:
        """Served blocks are the leading ones asked for, in order, each right."""
        assert [s.block_id for s in served] == list(want[: len(served)])
        assert len(payloads) == len(served)
        for s, data in zip(served, payloads):
            self.check_block(ns, gen, s.block_id, now, data)
            assert s.checksum == cks.checksum(block_payload(s.block_id, NB))


def getter(
    store: BlockStore, ns_id: bytes, gen: int, ids: list[bytes], parent: bytes, as_bytes: bool
):
    """store.get with fresh buffers (or bytes back); returns (served, payloads)."""
    bufs: list[bytearray] = []

    def dst_for(i, n):
        if as_bytes:
            return None
        bufs.append(bytearray(n))
        return bufs[-1]

    served = store.get(ns_id, gen, ids, parent, dst_for)
    payloads = [s.data for s in served] if as_bytes else bufs[: len(served)]
    return served, payloads


def slot_of(pool, view) -> int:
    """The pool slot a slot view (host array) lies in."""
    base = pool.raw_view(0).__array_interface__["data"][0]
    return (view.__array_interface__["data"][0] - base) // pool.slot_bytes


def check_slots(store: BlockStore, reserved: set[int], borrowed: set[int]) -> None:
    """Every pool slot is accounted for while reservations and borrows are open (when
    none is, tests/support/store.check_invariants says the same): RESERVED slots are
    exactly the open reservations', OCCUPIED ones exactly the held blocks' plus `borrowed`
    ones: slots lent to borrowers, or held as the parent of a write in flight (a block
    removed meanwhile keeps its slot until the borrow or the write ends)."""
    held = [m.slot for st in store.namespaces() for m in st.blocks.values() if m.slot >= 0]
    assert len(held) == len(set(held)), "two blocks share a pool slot"
    pool = store.pool
    states = [pool.state(s) for s in range(pool.n_slots)]
    assert {s for s, x in enumerate(states) if x == SlotState.RESERVED} == reserved
    assert {s for s, x in enumerate(states) if x == SlotState.OCCUPIED} == set(held) | borrowed, (
        "a pool slot leaked, or is held by nobody"
    )
    assert pool.free_slots == states.count(SlotState.FREE)


def check_structure(store: BlockStore) -> None:
    """What holds at any moment the store's lock is held, writes in flight or not (run
    under it by the threads test): every block's parent is held and, for a block in the
    pool, in the pool; child counts, tenant accounts and pins match the blocks held."""
    used: dict[tuple[str, Tier], int] = {}
    for st in store.namespaces():
        kids: dict[bytes, list] = {}
        for m in st.blocks.values():
            if m.depth:
                kids.setdefault(m.parent_id, []).append(m)
                parent = st.blocks.get(m.parent_id)
                assert parent is not None, "a block stayed on the node without its parent"
                assert m.slot < 0 or parent.slot >= 0, "the pool is not prefix-closed"
            # a block in the pool is charged its whole slot, one on NVMe its payload
            for tier, held, charge in (
                (Tier.HBM, m.slot >= 0, store.pool.slot_bytes),
                (Tier.NVME, m.on_nvme, m.nbytes),
            ):
                if held:
                    used[(st.tenant, tier)] = used.get((st.tenant, tier), 0) + charge
        for m in st.blocks.values():
            mine = kids.get(m.block_id, [])
            assert m.children == len(mine), "children count drifted"
            assert m.hbm_children == sum(c.slot >= 0 for c in mine)
    for t in store.accounts.tenants():
        for tier in Tier:
            assert store.accounts.used(t, tier) == used.get((t, tier), 0)
    check_pins(store)


class JitterPool:
    """Fault injection: the pool's bulk copies (which the store runs outside its lock)
    pause briefly at random, so other threads run inside the copy windows."""

    def __init__(self, pool, seed: int = 0, pause_s: float = 0.0005) -> None:
        self._pool = pool
        self._rng = random.Random(seed)
        self._pause_s = pause_s

    def _pause(self) -> None:
        r = self._rng.random()
        if r < 0.3:
            time.sleep(self._pause_s)
        elif r < 0.6:
            time.sleep(0)

    def write(self, slot, src):
        self._pause()
        digest = self._pool.write(slot, src)
        self._pause()
        return digest

    def read_into(self, slot, nbytes, dst):
        self._pause()
        digest = self._pool.read_into(slot, nbytes, dst)
        self._pause()
        return digest

    def write_many(self, slots, srcs, threads=1):
        self._pause()
        digests = self._pool.write_many(slots, srcs, threads)
        self._pause()
        return digests

    def read_many(self, slots, sizes, dsts, threads=1):
        self._pause()
        digests = self._pool.read_many(slots, sizes, dsts, threads)
        self._pause()
        return digests

    def digests(self, views):
        self._pause()
        return self._pool.digests(views)

    def __getattr__(self, name):
        return getattr(self._pool, name)


@dataclass(slots=True)
class Limits:
    """Tenant quotas in force (re-applied after a restart, as the agent does from etcd)."""

    hbm: dict[str, int | None] = field(default_factory=dict)
    nvme: dict[str, int | None] = field(default_factory=dict)

    def apply(self, store: BlockStore) -> None:
        for t in TENANTS:
            store.set_tenant_limits(t, self.hbm.get(t), self.nvme.get(t))
