"""Router state and decisions, without I/O: the block index, the known nodes (from etcd),
requests in flight (assigned by this router), namespace layouts for peer pricing.
router/follower.py feeds it; router/server.py exposes it over gRPC; the benchmark drives
it directly.
"""

from __future__ import annotations

import bisect
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.coord.etcd import NodeRecord
from kvstore import errors
from kvstore.hashing import BLOCK_ID_BYTES, hash_chain_packed
from router.engines import EngineBoard, EngineDecision
from router.index import BlockIndex
from router.scoring import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_BLOCK_TOKENS,
    NodeLoad,
    Pricing,
    Score,
    Weights,
    load_cost,
    score_nodes,
    score_ranked,
)

MAX_CANDIDATES = 4  # candidates returned per decision: the chosen node and 3 fallbacks

log = logging.getLogger("kvstore.router")
_new = tuple.__new__


class InFlight:
    """Requests routed and not yet released, per node, with the prefill work (in blocks)
    each brought. Entries expire after `timeout_s` so a client that never calls Release
    cannot pin load on a node forever. A request is named by (tenant, request id): a
    tenant's ids name its own requests only, so no tenant can release another's, and the
    same id sent by two tenants names two requests.

    The work a tenant's requests hold on one node can be capped (`add(..., cap=)`): a
    Route names block ids nobody can verify, so without a cap one tenant's single request
    could queue 65,536 made-up blocks on a node and push every other tenant's prefix off
    it. Work beyond the cap is not counted (the request itself still is)."""

    def __init__(
        self,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str], None] = lambda node_id: None,
    ) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._on_change = on_change
        self._by_request: OrderedDict[tuple[str, str], tuple[str, float, float]] = OrderedDict()
        # Plain dicts, not Counters: every route adds and every release removes a key,
        # and Counter's __missing__ / __delitem__ are Python frames on that path.
        self._per_node: dict[str, int] = {}
        self._per_tenant: dict[str, int] = {}
        self._work: dict[str, float] = {}
        # (tenant, node) -> the work its requests hold there, kept only while above 0.
        self._tenant_work: dict[tuple[str, str], float] = {}

    def add(
        self, request_id: str, node_id: str, work: float = 0.0, tenant: str = "", cap: float = 0.0
    ) -> float:
        """Count the request on `node_id` with `work` blocks of prefill; `cap` (> 0): the
        most work this tenant's requests may hold on that node together, beyond which
        work is not counted. Returns the work counted."""
        key = (tenant, request_id)
        if key in self._by_request:
            self.release(request_id, tenant)  # a retried request id moves, not double counts
        if cap and work:
            work = min(work, max(0.0, cap - self._tenant_work.get((tenant, node_id), 0.0)))
        if work:
            tk = (tenant, node_id)
            self._tenant_work[tk] = self._tenant_work.get(tk, 0.0) + work
        self._by_request[key] = (node_id, self._clock() + self.timeout_s, work)
        per_node, per_tenant = self._per_node, self._per_tenant
        per_node[node_id] = per_node.get(node_id, 0) + 1
        per_tenant[tenant] = per_tenant.get(tenant, 0) + 1
        self._work[node_id] = self._work.get(node_id, 0.0) + work
        self._on_change(node_id)
        return work

    def _drop_tenant_work(self, tenant: str, node_id: str, work: float) -> None:
        tk = (tenant, node_id)
        left = self._tenant_work[tk] - work
        if left > 1e-9:
            self._tenant_work[tk] = left
        else:
            del self._tenant_work[tk]  # exactly 0 again, whatever float rounding left

    def tenant_work(self, tenant: str, node_id: str) -> float:
        """Prefill work (blocks) the tenant's requests hold on the node, as counted."""
        return self._tenant_work.get((tenant, node_id), 0.0)

    def release(self, request_id: str, tenant: str = "") -> bool:
        entry = self._by_request.pop((tenant, request_id), None)
        if entry is None:
            return False
        per_node, per_tenant = self._per_node, self._per_tenant
        if per_tenant[tenant] > 1:
            per_tenant[tenant] -= 1
        else:
            del per_tenant[tenant]
        node_id = entry[0]
        if entry[2]:
            self._drop_tenant_work(tenant, node_id, entry[2])
        if per_node[node_id] > 1:
            per_node[node_id] -= 1
            self._work[node_id] -= entry[2]
        else:
            del per_node[node_id]
            del self._work[node_id]  # exactly 0 again, whatever float rounding left
        self._on_change(node_id)
        return True

    def prefill_done(self, request_id: str, tenant: str = "") -> bool:
        """The request's prefill finished: its queued work goes, the request stays in
        flight (decoding) until released."""
        entry = self._by_request.get((tenant, request_id))
        if entry is None:
            return False
        node_id, deadline, work = entry
        if work:
            self._by_request[(tenant, request_id)] = (node_id, deadline, 0.0)
            self._work[node_id] = max(0.0, self._work[node_id] - work)
            self._drop_tenant_work(tenant, node_id, work)
            self._on_change(node_id)
        return True

    def expire(self) -> int:
        """Drop entries past their deadline (insertion order is deadline order)."""
        now, n = self._clock(), 0
        while self._by_request:
            (tenant, rid), (_, deadline, _) = next(iter(self._by_request.items()))
            if deadline > now:
                break
            self.release(rid, tenant)
            n += 1
        return n

    def holds(self, request_id: str, tenant: str = "") -> bool:
        return (tenant, request_id) in self._by_request

    def tenant_count(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def count(self, node_id: str) -> int:
        return self._per_node.get(node_id, 0)

    def work(self, node_id: str) -> float:
        """Prefill work of the node's in-flight requests, in blocks."""
        return self._work.get(node_id, 0.0)

    def load_of(self, node_id: str) -> tuple[int, float]:
        """(requests in flight, their prefill work in blocks) on the node: count and
        work at once, for the re-rank every route and release makes."""
        n = self._per_node.get(node_id)
        return (0, 0.0) if n is None else (n, self._work[node_id])

    def forget_node(self, node_id: str) -> None:
        for tenant, rid in [k for k, (n, _, _) in self._by_request.items() if n == node_id]:
            self.release(rid, tenant)

    def __len__(self) -> int:
        return len(self._by_request)


class LoadBoard:
    """The nodes routes may go to, kept sorted by (load cost under the configured
    weights, node id), updated per change in O(log n) comparisons, so a route never
    sorts or even visits every node (router/scoring.py:score_ranked)."""

    def __init__(self, weights: Weights) -> None:
        self.weights = weights
        self._keys: list[tuple[float, str]] = []  # parallel to _ranked: C-speed bisect
        self._ranked: list[NodeLoad] = []
        self._by_id: dict[str, NodeLoad] = {}
        # Where each node was last put: right unless a move since shifted it, which
        # _index checks (by identity) before trusting it. Saves a bisection over
        # (float, str) keys, and the old load's cost, on most changes.
        self._pos: dict[str, int] = {}

    def set(self, load: NodeLoad) -> None:
        node_id = load.node_id
        old = self._by_id.get(node_id)
        if old == load:
            return
        keys, ranked = self._keys, self._ranked
        key = (load_cost(load, self.weights), node_id)
        self._by_id[node_id] = load
        if old is not None:
            i = self._index(old)
            # Every route moves one node one place or a few: shift in place when it stays
            # between its neighbours (the common case), else delete and reinsert.
            if (i == 0 or keys[i - 1] < key) and (i + 1 == len(keys) or key < keys[i + 1]):
                keys[i], ranked[i] = key, load
                self._pos[node_id] = i
                return
            del keys[i], ranked[i]
        i = bisect.bisect_right(keys, key)
        keys.insert(i, key)
        ranked.insert(i, load)
        self._pos[node_id] = i

    def _index(self, old: NodeLoad) -> int:
        i = self._pos.get(old.node_id, -1)
        if 0 <= i < len(self._ranked) and self._ranked[i] is old:
            return i
        # Keys are unique (node id is part of them), so this finds exactly `old`.
        return bisect.bisect_left(self._keys, (load_cost(old, self.weights), old.node_id))

    def remove(self, node_id: str) -> None:
        old = self._by_id.pop(node_id, None)
        if old is not None:
            i = self._index(old)
            del self._keys[i], self._ranked[i]
            del self._pos[node_id]

    @property
    def ranked(self) -> list[NodeLoad]:
        return self._ranked

    @property
    def by_id(self) -> dict[str, NodeLoad]:
        return self._by_id

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._by_id

    def __len__(self) -> int:
        return len(self._ranked)


class Decision(NamedTuple):
    """A NamedTuple rather than a frozen dataclass: built on every route (hot path), with
    tuple.__new__ (`_new`), skipping the NamedTuple's Python-level __new__."""

    request_id: str
    total_blocks: int
    scores: list[Score]  # cheapest first
    pricing: Pricing | None = None  # the prices the costs were counted in

    @property
    def chosen(self) -> Score:
        return self.scores[0]


@dataclass(slots=True)
class NodeState:
    record: NodeRecord
    synced: bool = False
    epoch: str = ""  # epoch of the event stream the index reflects


class RouterCore:
    def __init__(
        self,
        weights: Weights,
        prefill_tokens_per_s: float = 8000.0,
        peer_gbps: float = 1.0,
        inflight_timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        tenant_secrets: dict[str, str] | None = None,
        engine_local_price: float = 0.05,
    ) -> None:
        """`tenant_secrets`: tenant -> chain-root secret, to name engines' cached blocks."""
        self.weights = weights
        self.index = BlockIndex()
        self.nodes: dict[str, NodeState] = {}
        self.board = LoadBoard(weights)
        self.inflight = InFlight(inflight_timeout_s, clock, self._touch)
        self.killswitch = False
        # True while this router's etcd lease may have lapsed (kvstore/coord/fence.py,
        # set by router/control.py): it may have missed a flush that stopped waiting for
        # it, so it routes by load only, as with the kill switch, until it re-joined.
        self.fence: Callable[[], bool] | None = None
        self.fenced_routes = 0
        self._prefill_tokens_per_s, self._peer_gbps = prefill_tokens_per_s, peer_gbps
        self._pull: tuple[float, float] | None = None  # (fixed s, s per byte), measured
        self._capacity_bytes = 0  # the agents' device pools and NVMe tiers together
        self._default_pricing = Pricing(prefill_tokens_per_s, peer_gbps)
        self._layouts: dict[bytes, tuple[int, int]] = {}  # ns -> (block bytes, tokens)
        self._pricing: dict[bytes, Pricing] = {}
        self._generations: dict[bytes, int] = {}
        # Serving engines and their own caches (router/engine_feed.py feeds them).
        self.engines = EngineBoard(tenant_secrets, self.generation, engine_local_price)

    @classmethod
    def from_config(cls, cfg) -> "RouterCore":
        return cls(
            Weights.from_config(cfg),
            cfg.prefill_tokens_per_s,
            cfg.peer_gbps,
            cfg.inflight_timeout_s,
            tenant_secrets=read_secret_files(cfg.tenant_secret_files),
            engine_local_price=cfg.engine_local_price,
        )

    def _load(self, node_id: str) -> NodeLoad:
        count, work = self.inflight.load_of(node_id)
        return _new(NodeLoad, (node_id, count, self.nodes[node_id].record.utilization, work))

    def _touch(self, node_id: str) -> None:
        """Re-rank a node after its load, utilization or sync state changed (on every
        route and release: the load is built here rather than through _load)."""
        st = self.nodes.get(node_id)
        if st is not None and st.synced:
            count, work = self.inflight.load_of(node_id)
            self.board.set(_new(NodeLoad, (node_id, count, st.record.utilization, work)))
        else:
            self.board.remove(node_id)

    # ------------------------------------------------------------- membership
    def upsert_node(self, record: NodeRecord) -> bool:
        """Add or refresh a node from etcd. True when it is new or moved address (the
        caller then (re)starts its event stream)."""
        st = self.nodes.get(record.node_id)
        if st is None:
            self.nodes[record.node_id] = NodeState(record)
            self.index.add_node(record.node_id)
            self._capacity_bytes += _capacity_of(record)
            self._measure_pulls()
            self._measure_store()
            return True
        moved = st.record.address != record.address
        old, st.record = st.record, record
        self._capacity_bytes += _capacity_of(record) - _capacity_of(old)
        if _pull_of(old) != _pull_of(record):
            self._measure_pulls()
        self._measure_store()  # a heartbeat: the index has moved on since the last one
        if moved:
            st.synced = False
        self._touch(record.node_id)
        return moved

    def remove_node(self, node_id: str) -> None:
        st = self.nodes.pop(node_id, None)
        if st is not None:
            self._capacity_bytes -= _capacity_of(st.record)
            self.board.remove(node_id)
            n = self.index.drop_node(node_id)
            self.inflight.forget_node(node_id)
            self._measure_pulls()
            self._measure_store()
            log.info("node %s left; dropped %d index entries", node_id, n)

    def begin_snapshot(self, node_id: str, epoch: str) -> None:
        st = self.nodes.get(node_id)
        if st is None:
            return
        if st.epoch and st.epoch != epoch:
            log.info(
                "node %s restarted (epoch %s -> %s); resyncing", node_id, st.epoch[:8], epoch[:8]
            )
        st.epoch = epoch
        self.mark_unsynced(node_id)
        self.index.clear_node(node_id)

    def mark_synced(self, node_id: str) -> None:
        self._set_synced(node_id, True)

    def mark_unsynced(self, node_id: str) -> None:
        self._set_synced(node_id, False)

    def _set_synced(self, node_id: str, synced: bool) -> None:
        st = self.nodes.get(node_id)
        if st is not None and st.synced != synced:
            st.synced = synced
            self._touch(node_id)

    def set_namespace_layout(self, ns_id: bytes, block_bytes: int, block_tokens: int) -> None:
        self._layouts[ns_id] = (block_bytes, block_tokens)
        self._pricing[ns_id] = self._priced(block_bytes, block_tokens)

    def _priced(self, block_bytes: int, block_tokens: int) -> Pricing:
        fixed, per_byte = self._pull if self._pull is not None else (0.0, None)
        return Pricing(
            self._prefill_tokens_per_s,
            self._peer_gbps,
            block_bytes,
            block_tokens,
            fixed,
            per_byte,
            self._store_fill(block_bytes),
        )

    def _store_fill(self, block_bytes: int) -> float:
        """How full the agents' stores are, 0..1, counting every indexed block at
        `block_bytes` (exact where namespaces share a layout), to 2 decimals so that
        prices are rebuilt only when it moves. 0 before any agent reports capacity."""
        if self._capacity_bytes <= 0:
            return 0.0
        return round(min(1.0, self.index.entries * block_bytes / self._capacity_bytes), 2)

    def _measure_store(self) -> None:
        """Re-measure the store's fill (Pricing.store_fill, which prices a copy's pool
        space): one figure for the cluster, like the pull cost, so that score_ranked's
        order holds. Prices are rebuilt only for layouts whose fill moved."""
        fill = self._store_fill(DEFAULT_BLOCK_BYTES)
        if fill != self._default_pricing.store_fill:
            self._default_pricing = self._priced(DEFAULT_BLOCK_BYTES, DEFAULT_BLOCK_TOKENS)
        for ns, (block_bytes, tokens) in self._layouts.items():
            if self._store_fill(block_bytes) != self._pricing[ns].store_fill:
                self._pricing[ns] = self._priced(block_bytes, tokens)

    def _measure_pulls(self) -> None:
        """The pull cost every price uses: the mean of the agents' measured fits
        (NodeRecord.pull_*), over the agents that have pulled. One figure for the
        cluster, not one per node: nodes that hold none of a prompt must keep the same
        peer term for score_ranked's order to hold (router/scoring.py)."""
        fits = [_pull_of(st.record) for st in self.nodes.values() if st.record.pull_samples]
        pull = (
            (sum(f[0] for f in fits) / len(fits), sum(f[1] for f in fits) / len(fits))
            if fits
            else None
        )
        if pull == self._pull:
            return
        self._pull = pull
        self._default_pricing = self._priced(DEFAULT_BLOCK_BYTES, DEFAULT_BLOCK_TOKENS)
        self._pricing = {ns: self._priced(*lay) for ns, lay in self._layouts.items()}

    @property
    def pull_cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per byte) of a peer pull as the agents measured it;
        None until one has pulled."""
        return self._pull

    def forget_namespace(self, ns_id: bytes) -> None:
        self._layouts.pop(ns_id, None)
        self._pricing.pop(ns_id, None)
        self._generations.pop(ns_id, None)

    def set_generation(self, ns_id: bytes, generation: int) -> None:
        self._generations[ns_id] = generation

    def generation(self, ns_id: bytes) -> int:
        """The namespace's generation in etcd; 0 (where agents start) before it is there."""
        return self._generations.get(ns_id, 0)

    def pricing(self, ns_id: bytes) -> Pricing:
        return self._pricing.get(ns_id, self._default_pricing)

    # --------------------------------------------------------------- routing
    def _scores(
        self, total: int, local: dict[str, int], w: Weights, pricing: Pricing
    ) -> list[Score]:
        # `w is self.weights` first: a route without an override skips building tuples.
        if len(self.board) and (
            w is self.weights
            or (w.load, w.utilization, w.queue)
            == (self.weights.load, self.weights.utilization, self.weights.queue)
        ):
            return score_ranked(
                total, local, self.board.ranked, w, pricing, MAX_CANDIDATES, self.board.by_id
            )
        # Slow path: load weights overridden (the board's order does not apply), or no
        # node in sync yet (router just started): score every eligible node.
        ids = [n.node_id for n in self.board.ranked] or list(self.nodes)
        return score_nodes(total, local, [self._load(i) for i in ids], w, pricing, MAX_CANDIDATES)

    def route(
        self,
        namespace_id: bytes,
        packed_ids: bytes,
        weights: Weights | None = None,
        request_id: str = "",
        dry_run: bool = False,
        tenant: str = "",
        max_inflight: int = 0,
        max_request_work: float = 0.0,
        max_tenant_work: float = 0.0,
    ) -> Decision:
        """`tenant` scopes the request id (InFlight); `max_inflight` (0: none) caps the
        tenant's requests in flight, checked before anything is counted.
        `max_request_work` and `max_tenant_work` (0: none) cap the prefill work (blocks)
        the request is counted with, alone and with the tenant's others on the chosen
        node: the ids are the caller's word, so what it could queue without doing the
        work is bounded. The request is routed all the same; only its weight is capped."""
        if len(namespace_id) != 16:
            raise errors.InvalidArgument(f"namespace_id must be 16 bytes, got {len(namespace_id)}")
        if len(packed_ids) % BLOCK_ID_BYTES:
            raise errors.InvalidArgument(
                f"block_ids is {len(packed_ids)} bytes, not a multiple of {BLOCK_ID_BYTES}"
            )
        self.inflight.expire()
        if not self.nodes:
            raise errors.Unavailable("no node agents are registered in etcd")
        if (
            max_inflight
            and not dry_run
            and self.inflight.tenant_count(tenant) - self.inflight.holds(request_id, tenant)
            >= max_inflight
        ):
            raise errors.ResourceExhausted(
                f"{max_inflight} routed requests of this tenant are in flight; release some first"
            )
        total = len(packed_ids) // BLOCK_ID_BYTES
        local = {} if self.cache_off() else self.index.prefix_lengths(packed_ids)
        pricing = self._pricing.get(namespace_id, self._default_pricing)  # self.pricing()
        scores = self._scores(total, local, weights or self.weights, pricing)
        # Unguessable (ids are capabilities within a tenant), ~1us on the hot path.
        rid = request_id or secrets.token_hex(16)
        if not dry_run:
            c = scores[0]  # the work it queues there: recompute, plus the pull
            work = c.recompute_blocks + pricing.pull_blocks(c.peer_blocks)
            if max_request_work and work > max_request_work:
                work = max_request_work
            self.inflight.add(rid, c.node_id, work, tenant, max_tenant_work)
        if log.isEnabledFor(logging.DEBUG):
            _log_decision(rid, namespace_id, total, scores, pricing)
        return _new(Decision, (rid, total, scores, pricing))

    def route_tokens(
        self,
        namespace_id: bytes,
        root: bytes,
        tokens,
        block_size: int,
        weights: Weights | None = None,
        request_id: str = "",
        dry_run: bool = False,
    ) -> Decision:
        """Hash a prompt's tokens into block ids (kvstore.hashing), then route."""
        packed = hash_chain_packed(root, tokens, block_size)
        return self.route(namespace_id, packed, weights, request_id, dry_run)

    def route_engines(
        self,
        namespace_id: bytes,
        packed_ids: bytes,
        model: str = "",
        weights: Weights | None = None,
        request_id: str = "",
        dry_run: bool = False,
    ) -> EngineDecision:
        """Which serving engine should take this prompt (chain ids): its own cache first,
        then its node's agent, a peer, recompute, plus load (router/engine_scoring.py)."""
        if len(namespace_id) != 16:
            raise errors.InvalidArgument(f"namespace_id must be 16 bytes, got {len(namespace_id)}")
        if len(packed_ids) % BLOCK_ID_BYTES:
            raise errors.InvalidArgument(
                f"block_ids is {len(packed_ids)} bytes, not a multiple of {BLOCK_ID_BYTES}"
            )
        off = self.cache_off()
        node_prefix = {} if off else self.index.prefix_lengths(packed_ids)
        return self.engines.route(
            packed_ids,
            node_prefix,
            weights or self.weights,
            self.pricing(namespace_id),
            model,
            request_id,
            dry_run,
            use_cache=not off,
        )

    def cache_off(self) -> bool:
        """Route by load only: the kill switch is on, or the lease fence is up."""
        if self.killswitch:
            return True
        if self.fence is not None and self.fence():
            self.fenced_routes += 1
            return True
        return False

    def hold(self, request_id: str, node_id: str, work: float, tenant: str = "") -> None:
        """Count a request routed elsewhere than `route` chose (the gateway's choice among
        engines, from a dry-run decision) in flight on `node_id`, with `work` blocks of
        prefill, until `release`."""
        self.inflight.add(request_id, node_id, work, tenant)

    def release(self, request_id: str, prefill_done: bool = False, tenant: str = "") -> bool:
        """The request completed (or, with prefill_done, only its prefill did). False when
        `tenant` has no such request in flight."""
        if prefill_done:
            return self.inflight.prefill_done(request_id, tenant)
        return self.inflight.release(request_id, tenant)


def _capacity_of(r: NodeRecord) -> int:
    """Bytes of blocks a node's store holds: its device pool and NVMe tier."""
    return r.hbm_capacity_bytes + r.nvme_capacity_bytes


def _pull_of(r: NodeRecord) -> tuple[float, float]:
    """A node record's measured pull cost: (fixed seconds, seconds per byte)."""
    return r.pull_fixed_ms / 1e3, r.pull_ms_per_mib / 1e3 / (1 << 20)


def _log_decision(
    rid: str, namespace_id: bytes, total: int, scores: list[Score], pricing: Pricing
) -> None:
    """Block counts and cost terms only: never tokens. Costs are in blocks recomputed
    (recompute_ms each); a pull costs pull_fixed + peer_price per block."""
    c = scores[0]
    log.debug(
        "route %s ns=%s blocks=%d recompute_ms=%.3f pull_fixed=%.2f peer_price=%.3f "
        "space_price=%.3f "
        "-> %s local=%d peer=%d(%s) recompute=%d "
        "in_flight=%d queued=%.1f util=%.2f cost=%.3f [recompute=%.3f peer=%.3f "
        "space=%.3f load=%.3f util=%.3f] runner_up=%s",
        rid,
        namespace_id.hex()[:12],
        total,
        pricing.recompute_s * 1e3,
        pricing.pull_fixed,
        pricing.peer_price,
        pricing.space_price,
        c.node_id,
        c.local_blocks,
        c.peer_blocks,
        c.peer_node_id or "-",
        c.recompute_blocks,
        c.in_flight,
        c.queued,
        c.utilization,
        c.cost,
        c.recompute_cost,
        c.peer_cost,
        c.space_cost,
        c.load_cost,
        c.utilization_cost,
        f"{scores[1].node_id}:{scores[1].cost:.3f}" if len(scores) > 1 else "-",
    )


def read_secret_files(files: dict[str, str]) -> dict[str, str]:
    """tenant -> secret, each read from its file (stripped); OSError names the file."""
    out = {}
    for tenant, path in files.items():
        with open(path) as f:
            secret = f.read().strip()
        if not secret:
            raise ValueError(f"tenant_secret_files.{tenant}: {path} is empty")
        out[tenant] = secret
    return out
