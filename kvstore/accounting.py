"""Per-tenant byte accounting per tier, with limits (from configuration and etcd quotas),
and the bytes each tenant has pinned. Pure bookkeeping: the store decides what to evict
and what it charges. What it charges is what a block takes in the tier: a whole pool slot
(the pool's slot_bytes, whatever the block's payload) in the pool, the payload's bytes on
NVMe, and a whole pool slot for a pinned block (kvstore/store.py `pin`)."""

from __future__ import annotations

from collections import defaultdict

from kvstore.events import Tier


class TenantAccounts:
    def __init__(self, limits: dict[str, dict[Tier, int]] | None = None) -> None:
        self._used: dict[tuple[str, Tier], int] = defaultdict(int)
        self._blocks: dict[tuple[str, Tier], int] = defaultdict(int)
        self._limits: dict[tuple[str, Tier], int] = {}
        self._pinned: dict[str, int] = defaultdict(int)  # tenant -> pinned bytes charged
        for tenant, per_tier in (limits or {}).items():
            for tier, limit in per_tier.items():
                self.set_limit(tenant, tier, limit)

    def set_limit(self, tenant: str, tier: Tier, limit: int | None) -> None:
        """None or 0 removes the limit."""
        if limit:
            self._limits[(tenant, tier)] = int(limit)
        else:
            self._limits.pop((tenant, tier), None)

    def limit(self, tenant: str, tier: Tier) -> int | None:
        return self._limits.get((tenant, tier))

    def used(self, tenant: str, tier: Tier) -> int:
        return self._used.get((tenant, tier), 0)

    def blocks(self, tenant: str, tier: Tier) -> int:
        return self._blocks.get((tenant, tier), 0)

    def add(self, tenant: str, tier: Tier, nbytes: int, blocks: int = 1) -> None:
        """`nbytes` more in `tier` for `tenant`, over `blocks` blocks."""
        self._used[(tenant, tier)] += nbytes
        self._blocks[(tenant, tier)] += blocks

    def sub(self, tenant: str, tier: Tier, nbytes: int) -> None:
        key = (tenant, tier)
        self._used[key] -= nbytes
        self._blocks[key] -= 1
        if self._used[key] < 0 or self._blocks[key] < 0:
            raise AssertionError(f"accounting went negative for {tenant}/{tier.name}")

    def pinned(self, tenant: str) -> int:
        """Bytes `tenant` has pinned on this node, across all its namespaces."""
        return self._pinned.get(tenant, 0)

    def add_pinned(self, tenant: str, delta: int) -> None:
        self._pinned[tenant] += delta
        if self._pinned[tenant] < 0:
            raise AssertionError(f"pinned bytes went negative for {tenant}")
        if not self._pinned[tenant]:
            del self._pinned[tenant]

    def overflow(self, tenant: str, tier: Tier, extra: int) -> int:
        """Bytes over the limit if `extra` more were added (0 when within it)."""
        limit = self._limits.get((tenant, tier))
        if limit is None:
            return 0
        return max(0, self.used(tenant, tier) + extra - limit)

    def tenants(self) -> list[str]:
        return sorted({t for t, _ in self._used} | {t for t, _ in self._limits})
