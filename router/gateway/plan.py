"""From a request's prompt token ids to the router's ranked candidate engines: the chain
ids the engine's connector will compute (its namespace, salted per tenant, at the
generation in force), priced by RouterCore.route_engines, the router's one cost function
for engines (router/engine_scoring.py: the engine's own cache, learned from its KV events,
< its node's agent < a peer < recompute, plus load).

The gateway holds the routed request in flight on the engine it actually chose (the first
free one of the ranking) and on that engine's node (`hold`), marks its prefill done at the
first token and releases it at the end, so the router's load terms see gateway traffic as
they see ClusterClient's. When the chosen engine's node must pull part of the prefix from
a peer agent, `peer_hint` is what goes into the forwarded request's `kv_transfer_params`,
in the form the connector reads (kvstore/integrations/vllm_peer.py), so the pull starts
before prefill.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from kvstore import errors
from kvstore.coord.engines import EngineRecord
from kvstore.hashing import BLOCK_ID_BYTES, BlockId, hash_chain_packed
from kvstore.namespace import Namespace
from kvstore.salt import salt_secret, salted
from router.engine_scoring import EngineScore
from router.routing import RouterCore

__all__ = ["Plan", "Planner"]

log = logging.getLogger("kvstore.gateway")


@dataclass(frozen=True, slots=True)
class Plan:
    request_id: str
    tenant: str
    salt: str
    first_block: bytes  # the prompt's first chain id ("hash" policy); b"": shorter than one
    scores: tuple[EngineScore, ...] = ()  # the router's candidate engines, cheapest first
    # The sequences the request asks the engine for (body.choices: n, best_of): what it
    # counts against the engines' and its tenant's in-flight caps.
    weight: int = 1

    @property
    def engines(self) -> list[str]:
        return [s.engine_id for s in self.scores]

    def score_of(self, engine_id: str) -> EngineScore | None:
        return next((s for s in self.scores if s.engine_id == engine_id), None)


@dataclass(slots=True)
class _Spec:
    record: EngineRecord
    spec: Namespace


class Planner:
    def __init__(
        self,
        core: RouterCore,
        kv_secrets: dict[str, str],
        salt_key: bytes,
        generation: Callable[[bytes], int | None] = lambda ns_id: None,
    ) -> None:
        self.core = core
        self.kv_secrets = kv_secrets
        self.salt_key = salt_key
        self.generation = generation
        self._specs: dict[str, _Spec] = {}
        self._roots: dict[tuple[Namespace, str, int], tuple[bytes, bytes]] = {}
        self._salted: dict[tuple[Namespace, str], tuple[Namespace, bytes]] = {}
        self._salts: dict[str, str] = {}
        self._warned: set[str] = set()

    def salt(self, tenant: str) -> str:
        """The tenant's cache_salt: keyed, so no caller can name another tenant's."""
        s = self._salts.get(tenant)
        if s is None:
            s = hmac.new(self.salt_key, tenant.encode(), hashlib.sha256).hexdigest()[:32]
            self._salts[tenant] = s
        return s

    def _spec(self, rec: EngineRecord) -> Namespace | None:
        cached = self._specs.get(rec.engine_id)
        if cached is not None and cached.record is rec:
            return cached.spec
        try:
            spec = Namespace.from_dict(rec.namespace)
        except (ValueError, TypeError, KeyError) as exc:
            self._warn(rec.engine_id, f"engine {rec.engine_id}: bad namespace ({exc})")
            return None
        self._specs[rec.engine_id] = _Spec(rec, spec)
        return spec

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s; its requests route by load only", message)

    def _root(self, spec: Namespace, salt: str) -> tuple[bytes, bytes] | None:
        """(namespace id, chain root) of the tenant's salted namespace, as the connector
        derives them (kvstore.salt)."""
        secret = self.kv_secrets.get(spec.tenant)
        if secret is None:
            self._warn(spec.tenant, f"no kv secret for the engines' tenant {spec.tenant!r}")
            return None
        named = self._salted.get((spec, salt))
        if named is None:  # validated and hashed once per tenant, not once per request
            if len(self._salted) > 4096:
                self._salted.clear()
            ns = salted(spec, salt)
            named = self._salted[(spec, salt)] = (ns, ns.namespace_id)
        ns, ns_id = named
        gen = self.generation(ns_id) or 0
        key = (spec, salt, gen)  # the whole spec: two revisions of one name differ
        hit = self._roots.get(key)
        if hit is None:
            if len(self._roots) > 4096:  # flushed generations leave old keys behind
                self._roots.clear()
            hit = self._roots[key] = (ns_id, ns.root(gen, salt_secret(secret, salt)))
        return hit

    def chain(
        self, rec: EngineRecord | None, tokens: list[int], tenant: str
    ) -> tuple[bytes, bytes] | None:
        """(namespace id, packed chain ids) of the prompt as `rec`'s connector names them
        for this tenant's salt; None when they cannot be computed (routing by load)."""
        spec = self._spec(rec) if rec is not None else None
        named = self._root(spec, self.salt(tenant)) if spec is not None else None
        if spec is None or named is None:
            return None
        ns_id, root = named
        return ns_id, hash_chain_packed(BlockId(root), tokens, spec.block_size)

    def plan(
        self, rec: EngineRecord | None, tokens: list[int], tenant: str, model: str = ""
    ) -> Plan:
        salt = self.salt(tenant)
        rid = secrets.token_hex(16)
        chained = self.chain(rec, tokens, tenant)
        if chained is None:
            return Plan(rid, tenant, salt, b"")
        ns_id, packed = chained
        first = packed[:BLOCK_ID_BYTES]
        try:
            d = self.core.route_engines(ns_id, packed, model, request_id=rid, dry_run=True)
        except errors.KvError as exc:  # the router follows no engine of it yet: by load
            log.debug("route %s: %s", rid, exc)
            return Plan(rid, tenant, salt, first)
        return Plan(rid, tenant, salt, first, tuple(d.scores))

    def peer_hint(self, plan: Plan, engine_id: str) -> dict[str, dict[str, str]] | None:
        """The forwarded request's kv_transfer_params when the router priced a peer pull
        into `engine_id`'s node as paying (its score has peer blocks): the peer agent's
        gRPC address and UCX listener, as the connector reads them; None otherwise."""
        s = plan.score_of(engine_id)
        if s is None or not s.peer_blocks:
            return None
        peer = self.core.nodes.get(s.peer_node_id)
        if peer is None:  # left since the plan was made: recompute rather than guess
            return None
        return {"kvstore": {"peer": peer.record.address, "peer_transfer": peer.record.peer_address}}

    def engine_blocks(self) -> dict[str, int]:
        """Blocks the router indexed in each engine's own cache (the /metrics gauge)."""
        board = self.core.engines
        return {e: board.index.engine_blocks(e) for e in list(board.engines)}

    @staticmethod
    def priced(plan: Plan, engine_id: str) -> str:
        """Where the router expected `engine_id` to find the prompt's blocks, in block
        counts (the gateway's x-kvstore-route header): block counts of the caller's own
        salted namespace, never tokens, and nothing of the engine's load (requests in
        flight there are other tenants' too: the router's metrics port has them)."""
        s = plan.score_of(engine_id)
        if s is None:
            return "unpriced"
        return (
            f"engine={s.engine_blocks} agent={s.agent_blocks} peer={s.peer_blocks} "
            f"recompute={s.recompute_blocks}"
        )

    # ---------------------------------------------------- the request's lifetime
    def hold(self, plan: Plan, rec: EngineRecord) -> None:
        """Count the request in flight on the engine it was forwarded to, and on its node,
        with the prefill work the router priced for that engine (recompute plus the pull,
        its fixed part included; 0 where unpriced)."""
        s = plan.score_of(rec.engine_id)
        work = s.work if s else 0.0
        if rec.engine_id in self.core.engines.engines:
            self.core.engines.hold(plan.request_id, rec.engine_id, work)
        if rec.node_id in self.core.nodes:
            self.core.hold(plan.request_id, rec.node_id, work, plan.tenant)

    def prefill_done(self, plan: Plan) -> None:
        self.core.engines.prefill_done(plan.request_id)
        self.core.release(plan.request_id, True, plan.tenant)

    def release(self, plan: Plan) -> None:
        self.core.engines.release(plan.request_id)
        self.core.release(plan.request_id, False, plan.tenant)
