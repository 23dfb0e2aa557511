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

The ledger keeps the last `capacity` request ids; one forgotten earlier is counted again.
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
    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        # (tenant, request id) -> hit blocks counted so far; oldest first
        self._seen: OrderedDict[tuple[str, str], int] = OrderedDict()

    def _first(self, key: tuple[str, str], asked: int, hit: int) -> RequestDelta:
        self._seen[key] = hit
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
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
        key = (tenant, request_id)
        before = self._seen.get(key)
        if before is None:
            return self._first(key, asked, matched)
        self._seen.move_to_end(key)
        if matched <= before:
            return NOTHING
        self._seen[key] = matched
        return RequestDelta(0, int(before == 0), 0, matched - before)

    def get(self, tenant: str, request_id: str, asked: int, served: int) -> RequestDelta:
        """A Get of `asked` blocks that served the leading `served`."""
        if not request_id:
            return NOTHING
        key = (tenant, request_id)
        if key in self._seen:
            self._seen.move_to_end(key)
            return NOTHING
        return self._first(key, asked, served)
