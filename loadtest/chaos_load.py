"""The workload of the chaos harness (loadtest/chaos.py): one thread per tenant runs
multi-turn chat sessions through ClusterClient and checks every byte it reads.

A block's payload is derived from its id (SHAKE-128 of the id, as long as a block), and
an id names the whole prefix it ends, so any block read back can be checked without
keeping data: a byte that differs from the derivation is a wrong byte.

Each request is one chat turn: the session's tokens so far plus 1-3 new blocks; it is
fetched (route, lookup, get), verified, and its new blocks are stored on the node that
served it. A failed attempt is retried every `retry_s` with the same tokens until it
succeeds or `give_up_s` have passed since its first attempt (then it is abandoned).
A request's *unavailable time* is from the start of its first attempt to the end of its
successful one (to the give-up, or to the end of the load, when none succeeded); the
harness reports the longest. Healthy requests take milliseconds; a request that met a
dead router, an agent whose lease had not expired yet, or a paused agent takes as long as
that lasted.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from kvstore.client.cluster import ClusterClient, ClusterNamespace
from kvstore.client.convert import block_tensor
from kvstore.namespace import Namespace
from loadtest.replay_sim import BLOCK, LAYOUT  # the replay's tiny Llama: 8 KiB blocks

MiB = 1 << 20
SYSTEM_BLOCKS = 2  # every session of a tenant starts with the same system prompt
MAX_TURNS = 10
ACTIVE_SESSIONS = 4


def tenant_spec(i: int) -> Namespace:
    return Namespace(tenant=f"chaos-{i}", name="chat", **LAYOUT)


def tenant_secret(i: int) -> str:
    return f"chaos-secret-{i}"


def payload(block_id: bytes, nbytes: int) -> bytes:
    return hashlib.shake_128(block_id).digest(nbytes)


def wrong_bytes(block_id: bytes, t: torch.Tensor) -> int:
    got = t.contiguous().view(torch.uint8).reshape(-1).numpy()
    want = np.frombuffer(payload(block_id, got.size), dtype=np.uint8)
    return int(np.count_nonzero(got != want))


@dataclass
class Session:
    tenant: int
    tokens: tuple[int, ...]  # what has been stored so far (replaced, never mutated)
    turns: int = 0
    nodes: set[str] = field(default_factory=set)  # node ids that stored its blocks


class Tracker:
    """Every session the workload ran, for the faults' NVMe census (loadtest/chaos_faults)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: list[Session] = []

    def add(self, s: Session) -> None:
        with self._lock:
            self._sessions.append(s)

    def stored(self, s: Session, tokens: tuple[int, ...], node_id: str) -> None:
        with self._lock:
            s.tokens = tokens
            s.nodes.add(node_id)

    def chains(self, tenant: int, node_id: str) -> list[tuple[int, ...]]:
        with self._lock:
            return [
                s.tokens
                for s in self._sessions
                if s.tenant == tenant and node_id in s.nodes and s.tokens
            ]


@dataclass
class Figures:
    """What the workload saw; threads update it under `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ops: int = 0  # requests served (fetched, verified, stored)
    attempts: int = 0
    abandoned: int = 0
    open_at_end: int = 0  # requests still failing when the load stopped
    verified_blocks: int = 0
    verified_bytes: int = 0
    wrong_bytes: int = 0
    wrong_blocks: int = 0
    hit_blocks: int = 0
    stored_blocks: int = 0
    errors: Counter = field(default_factory=Counter)  # by gRPC status / exception type
    served_by: Counter = field(default_factory=Counter)  # requests served, by node id
    max_unavailable_s: float = 0.0
    max_unavailable_at_s: float = 0.0  # load time when that request started
    last_error: str = ""

    def unavailable(self, seconds: float, at_s: float) -> None:
        with self.lock:
            if seconds > self.max_unavailable_s:
                self.max_unavailable_s, self.max_unavailable_at_s = seconds, at_s


def error_name(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        code = exc.code()
        return code.name if code is not None else "UNKNOWN"
    return type(exc).__name__


def error_text(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return f"{error_name(exc)}: {text}"[:300]


@dataclass(frozen=True, slots=True)
class LoadParams:
    router: str
    tenants: int
    rate: float  # requests per second per tenant (an upper bound)
    seed: int
    retry_s: float
    give_up_s: float
    churn_s: float = 0.0  # > 0: each worker opens a new ClusterClient this often


class TenantWorker(threading.Thread):
    def __init__(
        self,
        i: int,
        p: LoadParams,
        figs: Figures,
        tracker: Tracker,
        stop: threading.Event,
        t0: float,
    ) -> None:
        super().__init__(name=f"tenant-{i}", daemon=True)
        self.i, self.p, self.figs, self.tracker, self.stop_ev, self.t0 = (
            i,
            p,
            figs,
            tracker,
            stop,
            t0,
        )
        self.rng = random.Random(p.seed * 1000 + i)
        self.system = tuple(self.rng.randrange(32000) for _ in range(SYSTEM_BLOCKS * BLOCK))
        self.active: list[Session] = []
        self.crashed: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_ev.is_set():
                self._serve_one_client()
        except BaseException as exc:  # noqa: BLE001 - the harness reports it as broken
            self.crashed = exc

    def _serve_one_client(self) -> None:
        """Requests through one ClusterClient until the stop or, with `churn_s`, for that
        long (an inference worker restarting: a fresh client, fresh staging regions)."""
        opened = time.monotonic()
        with ClusterClient(
            self.p.router, tenant_secret=tenant_secret(self.i), shm_bytes=2 * MiB
        ) as cc:
            ns = self._open(cc)
            while ns is not None and not self.stop_ev.is_set():
                if self.p.churn_s and time.monotonic() - opened >= self.p.churn_s:
                    return
                began = time.monotonic()
                self._request(cc, ns)
                self.stop_ev.wait(max(0.0, 1.0 / self.p.rate - (time.monotonic() - began)))

    def _open(self, cc: ClusterClient) -> ClusterNamespace | None:
        while not self.stop_ev.is_set():  # the cluster is up; a fault may be under way
            try:
                return cc.open_namespace(tenant_spec(self.i))
            except (grpc.RpcError, RuntimeError) as exc:
                with self.figs.lock:
                    self.figs.errors[error_name(exc)] += 1
                self.stop_ev.wait(self.p.retry_s)
        return None

    def _session(self) -> Session:
        self.active = [s for s in self.active if s.turns < MAX_TURNS]
        if len(self.active) < ACTIVE_SESSIONS:
            s = Session(self.i, ())
            self.active.append(s)
            self.tracker.add(s)
        return self.rng.choice(self.active)

    def _request(self, cc: ClusterClient, ns: ClusterNamespace) -> None:
        s = self._session()
        base = s.tokens or self.system
        turn = tuple(self.rng.randrange(32000) for _ in range(self.rng.randint(1, 3) * BLOCK))
        tokens = base + turn
        first = time.monotonic()
        while True:
            with self.figs.lock:
                self.figs.attempts += 1
            try:
                node_id = self._attempt(cc, ns, tokens)
            except Exception as exc:  # noqa: BLE001 - whatever the client raises is counted
                with self.figs.lock:
                    self.figs.errors[error_name(exc)] += 1
                    self.figs.last_error = error_text(exc)
                waited = time.monotonic() - first
                if self.stop_ev.is_set() or waited >= self.p.give_up_s:
                    with self.figs.lock:
                        if self.stop_ev.is_set():
                            self.figs.open_at_end += 1
                        else:
                            self.figs.abandoned += 1
                    self.figs.unavailable(waited, first - self.t0)
                    return
                self.stop_ev.wait(self.p.retry_s)
                continue
            self.figs.unavailable(time.monotonic() - first, first - self.t0)
            s.turns += 1
            self.tracker.stored(s, tokens, node_id)
            with self.figs.lock:
                self.figs.ops += 1
                self.figs.served_by[node_id] += 1
            return

    def _attempt(self, cc: ClusterClient, ns: ClusterNamespace, tokens) -> str:
        hit = cc.fetch(ns, tokens)
        try:
            bad = bad_blocks = nbytes = 0
            for bid, t in zip(hit.block_ids, hit.blocks):
                w = wrong_bytes(bid, t)
                bad += w
                bad_blocks += w > 0
                nbytes += t.numel() * t.element_size()
            with self.figs.lock:
                self.figs.verified_blocks += len(hit.blocks)
                self.figs.verified_bytes += nbytes
                self.figs.wrong_bytes += bad
                self.figs.wrong_blocks += bad_blocks
                self.figs.hit_blocks += hit.cached_blocks
            nb = ns.spec.block_bytes
            kv = list(hit.blocks) + [
                block_tensor(ns.spec, bytearray(payload(bid, nb)))
                for bid in hit.block_ids[hit.cached_blocks :]
            ]
        except BaseException:
            try:
                cc.release(hit)
            except grpc.RpcError:
                pass  # the router forgets unreleased routes after its in-flight timeout
            raise
        usage = cc.store(ns, hit, tokens, kv)
        with self.figs.lock:
            self.figs.stored_blocks += usage.cache_write_tokens // BLOCK
        return hit.node_id
