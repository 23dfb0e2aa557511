"""Per-request accounting: each engine request counts once in the per-tenant hit rates,
whichever of Lookup and Get it made and how often.

An engine request reaches the agent as several calls: vLLM's scheduler may ask (Lookup)
again each step a request waits, its worker then Gets the blocks, a client without a
Lookup (the replay) only Gets. A caller names the request (`request_id` on Lookup and Get)
and the ledger remembers, per tenant, which requests it already counted:

- a Lookup without an id is one request (what clients that send none always got);
- the first call naming a request counts it: asked = the blocks it names, hit = those
  matched (Lookup) or served (Get);
- a later Lookup of that request that matches more (a peer pull landed in between) raises
  its hit to that; a later Get counts nothing (its blocks may be a tail of the prompt);
- a Get without an id counts nothing: a Lookup of the same request did;
- blocks a Lookup says the caller holds itself (`caller_held`: vLLM's own prefix cache)
  are neither asked nor hit: the rates say what kvstore had beyond the engine's cache.

The ledger keeps, per tenant, that tenant's last `capacity` request ids (one forgotten
earlier is counted again): one tenant's fresh ids push out only its own (the ledger is the
namespace owner's: readers of a public namespace share it), never another
tenant's. It remembers at most `max_tenants` tenants; past that the one whose requests
were seen least recently is forgotten whole. Memory: at most capacity x max_tenants ids.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["RequestDelta", "RequestLedger"]


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one call adds to its tenant's tallies."""

    requests: int = 0  # 1 when this call is the request's first
    hits: int = 0  # 1 when this call made the request a hit
    asked_blocks: int = 0
    hit_blocks: int = 0

    @property
    def first(self) -> bool:
        return self.requests > 0


NOTHING = RequestDelta()


class RequestLedger:
    def __init__(self, capacity: int = 16384, max_tenants: int = 64) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if max_tenants < 1:
            raise ValueError("max_tenants must be at least 1")
        self.capacity = capacity  # per tenant
        self.max_tenants = max_tenants
        # tenant -> (request id -> hit blocks counted so far; oldest first), the tenant
        # seen least recently first
        self._seen: OrderedDict[str, OrderedDict[str, int]] = OrderedDict()

    def _ids(self, tenant: str) -> OrderedDict[str, int]:
        ids = self._seen.get(tenant)
        if ids is None:
            ids = self._seen[tenant] = OrderedDict()
            if len(self._seen) > self.max_tenants:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(tenant)
        return ids

    def _first(self, ids: OrderedDict[str, int], rid: str, asked: int, hit: int) -> RequestDelta:
        ids[rid] = hit
        if len(ids) > self.capacity:
            ids.popitem(last=False)
        return RequestDelta(1, int(hit > 0), asked, hit)

    def lookup(
        self, tenant: str, request_id: str, asked: int, matched: int, caller_held: int = 0
    ) -> RequestDelta:
        """A Lookup of `asked` blocks that matched the leading `matched`, of which the
        caller held the leading `caller_held` in a cache of its own (an engine's prefix
        cache): those count neither as asked nor as hit, and a Lookup of nothing else
        counts nothing (kvstore had no part in that request)."""
        if caller_held:
            if caller_held >= asked:
                return NOTHING
            asked, matched = asked - caller_held, max(0, matched - caller_held)
        if not request_id:
            return RequestDelta(1, int(matched > 0), asked, matched)
        ids = self._ids(tenant)
        before = ids.get(request_id)
        if before is None:
            return self._first(ids, request_id, asked, matched)
        ids.move_to_end(request_id)
        if matched <= before:
            return NOTHING
        ids[request_id] = matched
        return RequestDelta(0, int(before == 0), 0, matched - before)

    def get(self, tenant: str, request_id: str, asked: int, served: int) -> RequestDelta:
        """A Get of `asked` blocks that served the leading `served`."""
        if not request_id:
            return NOTHING
        ids = self._ids(tenant)
        if request_id in ids:
            ids.move_to_end(request_id)
            return NOTHING
        return self._first(ids, request_id, asked, served)
