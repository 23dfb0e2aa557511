"""Per-tenant byte quotas of the store, per tier (set through etcd, applied by
node_agent/control.py). A tenant over quota evicts its own blocks, leaves first and by
value, never another tenant's. The limits and the usage live in the shared
TenantAccounts (kvstore/accounting.py), which the residency keeps in step."""

from __future__ import annotations

from kvstore.accounting import TenantAccounts
from kvstore.events import Tier
from kvstore.store_eviction import EvictionQueue
from kvstore.store_residency import Residency


class TenantQuotas:
    def __init__(
        self, accounts: TenantAccounts, queue: EvictionQueue, residency: Residency, spills: bool
    ) -> None:
        self.accounts = accounts
        self.queue = queue
        self.residency = residency
        self.spills = spills  # an NVMe tier to enforce a quota on (follows BlockStore.rocks)

    def set_limits(self, tenant: str, hbm: int | None, nvme: int | None) -> int:
        """Apply a tenant's quota (None or 0: no limit) and evict the tenant's own blocks
        until it fits. Returns the number of evictions (demotions count: the block stays
        on NVMe). Under the store's lock."""
        self.accounts.set_limit(tenant, Tier.HBM, hbm)
        self.accounts.set_limit(tenant, Tier.NVME, nvme)
        done = 0
        while self.accounts.overflow(tenant, Tier.HBM, 0):
            victim = self.queue.victim(Tier.HBM, tenant)
            if victim is None:
                break
            if not self.residency.evict_hbm(victim, "quota"):
                self.queue.refile(victim)  # popped from the heap: put it back
                break
            done += 1
        while self.spills and self.accounts.overflow(tenant, Tier.NVME, 0):
            victim = self.queue.victim(Tier.NVME, tenant)
            if victim is None:
                break
            self.residency.evict_nvme(victim, quota=True)
            done += 1
        return done
