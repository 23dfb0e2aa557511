"""Stats RPC: occupancy per tier and tenant, counters."""

from __future__ import annotations

from collections import Counter

from kvstore.events import Tier
from kvstore.store import BlockStore
from kvstore.v1 import agent_pb2
from kvstore.wire import tier_to_proto
from node_agent.metrics import ASKED_BLOCKS, HIT_BLOCKS, REQUESTS, REQUESTS_HIT, AgentMetrics


def build_stats(
    store: BlockStore, metrics: AgentMetrics, node_id: str, tenant: str | None, in_flight: int
) -> agent_pb2.StatsResponse:
    """`metrics` holds the per-tenant request tallies (each engine request once)."""
    with store.lock:
        pool = store.pool
        hbm_used = (pool.n_slots - pool.free_slots) * pool.slot_bytes
        hbm_blocks = nvme_blocks = 0
        per_tenant: set[str] = set()
        for st in store.namespaces():
            per_tenant.add(st.tenant)
            for m in st.blocks.values():
                hbm_blocks += m.slot >= 0
                nvme_blocks += m.on_nvme
        tiers = [
            agent_pb2.TierStats(
                tier=tier_to_proto(Tier.HBM),
                capacity_bytes=pool.capacity_bytes,
                used_bytes=hbm_used,
                blocks=hbm_blocks,
                slots_total=pool.n_slots,
                slots_free=pool.free_slots,
            )
        ]
        rocks = store.rocks
        if rocks is not None:
            tiers.append(
                agent_pb2.TierStats(
                    tier=tier_to_proto(Tier.NVME),
                    capacity_bytes=rocks.capacity_bytes,
                    used_bytes=store.nvme_used,
                    blocks=nvme_blocks,
                    condition=rocks.condition(),
                    unflushed_bytes=rocks.unflushed_bytes(),
                )
            )
        tenants = []
        for name in sorted(per_tenant | set(store.accounts.tenants()) | set(metrics.tenants())):
            if tenant is not None and name != tenant:
                continue
            acc = store.accounts
            tc = metrics.tally(name)
            tenants.append(
                agent_pb2.TenantStats(
                    tenant=name,
                    hbm_bytes=acc.used(name, Tier.HBM),
                    nvme_bytes=acc.used(name, Tier.NVME),
                    hbm_limit_bytes=acc.limit(name, Tier.HBM) or 0,
                    nvme_limit_bytes=acc.limit(name, Tier.NVME) or 0,
                    lookups=tc[REQUESTS],
                    lookup_hits=tc[REQUESTS_HIT],
                    lookup_blocks=tc[ASKED_BLOCKS],
                    lookup_hit_blocks=tc[HIT_BLOCKS],
                )
            )
        # A tenant's Stats: its own evictions by reason (the node's other counters are
        # every tenant's); the node's: every counter.
        counters = {
            k: int(v)
            for k, v in (
                store.counters if tenant is None else store.tenant_counters.get(tenant, Counter())
            ).items()
        }
        if tenant is None and rocks is not None:
            counters.update(rocks.counters())
        return agent_pb2.StatsResponse(
            node_id=node_id,
            device=str(pool.device),
            tiers=tiers,
            tenants=tenants,
            counters=counters,
            in_flight=in_flight,
            utilization=1.0 - pool.free_slots / pool.n_slots,
        )


def withhold_occupancy(resp: agent_pb2.StatsResponse) -> None:
    """A tenant's Stats: the node's occupancy is every tenant's (requests in flight, pool
    utilization, each tier's used bytes, blocks, free slots and NVMe bytes not flushed
    yet: what every tenant spilled lately), so it is left at 0; the
    tenant's own usage is in its TenantStats, and capacities stay."""
    resp.in_flight = 0
    resp.utilization = 0.0
    for t in resp.tiers:
        for name in ("used_bytes", "blocks", "slots_free", "unflushed_bytes"):
            t.ClearField(name)
