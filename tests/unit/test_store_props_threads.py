"""Concurrent variant of the BlockStore property test (issue 17): several threads run
seeded random operation sequences against one store whose pool pauses at random inside
its bulk copies (tests/support/store_world.JitterPool), so plans, copies and commits of
different threads interleave in the windows outside the store's lock. Every served byte is checked
against what was put as it is served, a borrowed view again just before its release, an
in-place commit of good payloads must never fail its checksum (a reserved slot written by
someone else), and after each round (threads joined) the store's bookkeeping holds and a
sweep reads back every chain. A restart sits between rounds.

Expiry is exercised (a clock advanced by the threads, expire() racing the rest) but not
checked against the model here: touches are recorded after the calls that make them, so a
thread may see a block refreshed by another before the model knows; test_store_props.py
checks expiry exactly.

Bounded in the normal run; longer locally:

    KVSTORE_PROPS_THREAD_SEEDS=20 KVSTORE_PROPS_THREAD_OPS=600 \
        python -m pytest -q tests/unit/test_store_props_threads.py
"""

from __future__ import annotations

import os
import random
import threading
import traceback
from collections import Counter

import numpy as np
import pytest
from support.common import ManualClock, block_payload
from support.store import check_invariants
from support.store_world import (
    MAX_BLOCKS,
    NB,
    SLOT,
    SPECS,
    TENANTS,
    ChainKey,
    JitterPool,
    Limits,
    World,
    build_store,
    check_structure,
    getter,
)

from kvstore import checksum as cks
from kvstore.errors import DataLoss, FailedPrecondition, ResourceExhausted, StaleGeneration

SEEDS = int(os.environ.get("KVSTORE_PROPS_THREAD_SEEDS", "3"))
OPS = int(os.environ.get("KVSTORE_PROPS_THREAD_OPS", "120"))
THREADS = 4
ROUNDS = 2
# Refusals a caller may get while other threads flush, fill the pool or flip the switch.
REFUSED = (ResourceExhausted, FailedPrecondition, StaleGeneration)


class Worker:
    """One thread's random operation sequence over the shared store and model."""

    def __init__(self, run: Run, seed: int) -> None:
        self.run = run
        self.rng = random.Random(seed)
        self.ops = [
            (self.put, 6),
            (self.get, 6),
            (self.lookup, 3),
            (self.in_place, 4),
            (self.borrow, 3),
            (self.pin, 1),
            (self.expire, 1),
            (self.flush, 1),
            (self.kill_switch, 1),
            (self.quota, 1),
            (self.corrupt, 1),
            (self.check, 2),
        ]

    def __call__(self, n_ops: int) -> None:
        fns, weights = zip(*self.ops)
        for fn in self.rng.choices(fns, weights, k=n_ops):
            try:
                fn()
            except REFUSED:
                pass

    def pick(self):
        r = self.rng
        key = ChainKey(
            r.choice(sorted(SPECS)), r.randrange(2), r.randrange(2), r.choice([1, 3, MAX_BLOCKS])
        )
        start = r.choice([0, 0, 0, r.randrange(MAX_BLOCKS)])
        end = min(MAX_BLOCKS, start + r.randint(1, MAX_BLOCKS))
        gen = self.run.world.gen[key.ns]
        return key.ns, gen, self.run.world.chain(key, gen), start, end

    def put(self) -> None:
        ns, gen, ids, start, end = self.pick()
        w = self.run.world
        w.offer(ns, ids, start, end, gen)
        items = w.items(ns, ids, start, end, gen, with_checksum=self.rng.random() < 0.5)
        stored, already = self.run.store.put(
            SPECS[ns].namespace_id, gen, items, root=w.root(ns, gen)
        )
        assert 0 <= stored and stored + already <= end - start
        self.run.count("stored", stored)

    def get(self) -> None:
        ns, gen, ids, start, end = self.pick()
        served, payloads = getter(
            self.run.store,
            SPECS[ns].namespace_id,
            gen,
            ids[start:end],
            self.run.world.parent(ns, ids, start, gen),
            self.rng.random() < 0.5,
        )
        self.run.world.check_served(ns, gen, ids[start:end], served, payloads, None)
        self.run.count("served", len(served))

    def lookup(self) -> None:
        ns, gen, ids, _, _ = self.pick()
        r = self.run.store.lookup(SPECS[ns].namespace_id, gen, ids)
        assert r.hbm + r.nvme == r.matched <= len(ids)

    def in_place(self) -> None:
        ns, gen, ids, start, end = self.pick()
        w, store = self.run.world, self.run.store
        w.offer(ns, ids, start, end, gen)
        res = store.reserve(
            SPECS[ns].namespace_id,
            gen,
            ids[start:end],
            w.parent(ns, ids, start, gen),
            w.root(ns, gen),
        )
        views, n = res.views, len(res)
        for i, view in enumerate(views):
            view[:] = np.frombuffer(block_payload(ids[start + i], NB), dtype=np.uint8)
        action = self.rng.random()
        if action < 0.2:
            store.abort(res)
            return
        if action < 0.35:
            n = self.rng.randint(0, n)
            store.trim(res, n)
        bad = self.rng.randrange(n) if n and self.rng.random() < 0.2 else -1
        if bad >= 0:
            views[bad][3] ^= 0x21
        sums = [cks.checksum(block_payload(b, NB)) for b in ids[start : start + n]]
        try:
            store.commit(res, sums)
        except DataLoss:
            assert bad >= 0, "a reserved slot was written by someone else"

    def borrow(self) -> None:
        ns, gen, ids, start, end = self.pick()
        w, store = self.run.world, self.run.store
        b = store.borrow(SPECS[ns].namespace_id, gen, ids[start:end], w.parent(ns, ids, start, gen))
        try:
            w.check_served(ns, gen, ids[start:end], b.served, b.views, None)
            for _ in range(self.rng.randrange(3)):
                self.rng.choice([self.put, self.get])()
            for sb, view in zip(b.served, b.views):
                assert bytes(view) == block_payload(sb.block_id, NB), (
                    "a borrowed slot was reused or evicted before release"
                )
        finally:
            store.release(b)

    def pin(self) -> None:
        ns, gen, ids, _, end = self.pick()
        self.run.store.pin(SPECS[ns].namespace_id, gen, ids[:end], self.rng.random() < 0.5)

    def expire(self) -> None:
        self.run.clock.advance(self.rng.choice([1.0, 5.0, 15.0]))
        self.run.store.expire()

    def flush(self) -> None:
        ns = self.rng.choice(sorted(SPECS))
        with self.run.flush_lock:  # the model's generation moves with the store's
            gen = self.run.world.gen[ns] + 1
            self.run.store.set_generation(SPECS[ns].namespace_id, gen)
            self.run.world.gen[ns] = gen

    def kill_switch(self) -> None:
        self.run.store.killed = self.rng.random() < 0.3

    def quota(self) -> None:
        t = self.rng.choice(TENANTS)
        hbm = self.rng.choice([None, 3 * SLOT, 6 * SLOT])
        nvme = self.rng.choice([None, 2 * NB, 5 * NB])
        with self.run.flush_lock:
            self.run.limits.hbm[t], self.run.limits.nvme[t] = hbm, nvme
            self.run.store.set_tenant_limits(t, hbm, nvme)

    def check(self) -> None:
        """The store's structure holds between any two of its critical sections."""
        with self.run.store.lock:
            check_structure(self.run.store)

    def corrupt(self) -> None:
        """Flip a byte of a held block nobody is reading: whoever reads it next verifies."""
        store = self.run.store
        with store.lock:
            metas = [
                m
                for st in store.namespaces()
                for m in st.blocks.values()
                if m.slot >= 0 and not m.readers
            ]
            if metas:
                store.pool.raw_view(self.rng.choice(metas).slot)[self.rng.randrange(NB)] ^= 4


class Run:
    def __init__(self, path: str, seed: int) -> None:
        self.path = path
        self.seed = seed
        self.clock = ManualClock()
        self.world = World(self.clock)
        self.limits = Limits()
        self.flush_lock = threading.Lock()
        self.stats: Counter[str] = Counter()  # what the workers did, to show they did it
        self.store = None
        self.open(recover=False)

    def count(self, what: str, n: int) -> None:
        with self.flush_lock:
            self.stats[what] += n

    def open(self, recover: bool) -> None:
        self.store = build_store(self.path, self.clock, lambda pool: JitterPool(pool, self.seed))
        if recover:
            self.store.recover()
        for name, spec in SPECS.items():
            self.store.open_namespace(spec, self.world.gen[name])
        self.limits.apply(self.store)

    def round(self, rnd: int) -> None:
        errors: list[str] = []

        def body(tid: int) -> None:
            try:
                Worker(self, self.seed * 1000 + rnd * 100 + tid)(OPS)
            except BaseException:  # noqa: BLE001 - reported by the main thread
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=body, args=(t,)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a worker hung"
        assert not errors, errors[0]
        self.store.killed = False
        check_invariants(self.store)
        self.sweep()

    def sweep(self) -> None:
        """Read back every chain of the current generations: nothing served is wrong."""
        w = self.world
        for ns in sorted(SPECS):
            gen = w.gen[ns]
            for base in range(2):
                for branch in range(2):
                    for split in (1, 3, MAX_BLOCKS):
                        ids = w.chain(ChainKey(ns, base, branch, split), gen)
                        served, payloads = getter(
                            self.store, SPECS[ns].namespace_id, gen, ids, w.root(ns, gen), False
                        )
                        w.check_served(ns, gen, ids, served, payloads, None)
        check_invariants(self.store)

    def restart(self) -> None:
        self.store.persist_pool()
        self.store.rocks.close()
        self.open(recover=True)
        check_invariants(self.store)
        self.sweep()


@pytest.mark.parametrize("seed", range(SEEDS))
def test_threads_keep_the_store_consistent_and_serve_only_what_was_put(tmp_path, seed):
    run = Run(str(tmp_path / "rocks"), seed)
    try:
        for rnd in range(ROUNDS):
            run.round(rnd)
            run.restart()
        assert run.stats["stored"] > 0 and run.stats["served"] > 0
    finally:
        run.store.rocks.close()
