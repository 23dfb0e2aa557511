"""The agent's side of the control plane: namespace generations, tenant quotas and the
kill switch from etcd, applied to the BlockStore, acknowledged in etcd.

- Start-up (catch-up): `AgentControl.start()` returns only after the current generations,
  quotas and kill switch are in force, and the server starts serving after it. A node
  that was down during a flush therefore drops the old blocks (which it recovered from
  RocksDB) before it answers anything.
- A new generation: `BlockStore.set_generation` makes the store refuse the old one
  (fencing), drops every block of the namespace from every tier and emits
  NAMESPACE_CLEARED (routers resync); then `acks/<tenant>/<ns>/<node_id>` is written.
- Quotas (tenants/<tenant>): set as the tenant's per-node limits; a tenant over its new
  limit has its own blocks evicted at once. A removed record restores the configured limit.
- etcd down: the last applied state stays in force and the agent keeps serving hits for
  as long as its lease is surely alive, then misses until etcd is found out of reach
  (two failed calls), then the known generations again (the lease fence,
  kvstore/coord/fence.py, node_agent/registration.py); writes go on. A
  namespace opened meanwhile is served and registered once etcd is back; a flush of its
  name reaches it even before that (node_agent/ns_registry.py has the rule).
- Namespaces are registered with the tenant's namespace cap checked in the same etcd
  transaction (max_namespaces_per_tenant; RESOURCE_EXHAUSTED beyond it).
- Joining: a flush that committed after the start-up listing but whose membership check
  missed this agent (it registered a moment later) does not wait for it. `catch_up()`
  (kvstore/coord/follow.py) lists again after registration and applies it.

Wiring (node_agent/server.py): `await control.start()` before serving, and
`Registration(..., on_registered=control.catch_up)` so `registered` is set only after that.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvstore.coord.admin_records import Quota
from kvstore.coord.follow import ControlFollower
from kvstore.config import TLSConfig
from kvstore.coord.etcd import DEFAULT_PREFIX, EtcdClient
from kvstore import errors
from kvstore.events import Tier
from kvstore.namespace import Namespace
from kvstore.store import BlockStore, NsState
from node_agent.ns_registry import NamespaceRegistry

log = logging.getLogger("kvstore.agent")


class AgentControl(ControlFollower):
    def __init__(
        self,
        store: BlockStore,
        endpoints: str,
        node_id: str,
        publish: Callable[[], None] | None = None,
        prefix: str = DEFAULT_PREFIX,
        max_namespaces_per_tenant: int = 0,
        tls: TLSConfig | None = None,
    ) -> None:
        super().__init__(EtcdClient(endpoints, prefix, tls=tls), node_id, follow_quotas=True)
        self.store = store
        self.namespaces = NamespaceRegistry(
            store,
            self.etcd,
            max_namespaces_per_tenant,
            self.known_generation,
            self.known_namespaces,
            lambda: self.flush_view_revision,
        )
        self._publish = publish or (lambda: None)
        acc = store.accounts
        # The configured limits: what a tenant gets back when its etcd quota is removed.
        self._config_limits = {
            t: (acc.limit(t, Tier.HBM), acc.limit(t, Tier.NVME)) for t in acc.tenants()
        }

    async def start(self, timeout_s: float | None = None, what: str = "") -> None:
        await super().start(timeout_s, what or f"agent {self.member}")
        self.namespaces.start()

    async def stop(self) -> None:
        await self.namespaces.stop()
        await super().stop()
        await self.etcd.close()

    # ------------------------------------------------------------------- hooks
    async def on_generation(self, ns_id: bytes, tenant: str, generation: int) -> int:
        dropped = await asyncio.to_thread(self._set_generation, ns_id, generation)
        self._publish()
        if dropped:
            log.info(
                "namespace %s/%s now at generation %d: dropped %d blocks",
                tenant,
                ns_id.hex()[:12],
                generation,
                dropped,
            )
        return dropped

    def _set_generation(self, ns_id: bytes, generation: int) -> int:
        try:
            return self.store.set_generation(ns_id, generation)
        except errors.NotFound:  # not opened here (yet): open_namespace uses the new one
            return 0

    async def on_killswitch(self, enabled: bool) -> None:
        if enabled != self.store.killed:
            log.warning(
                "kill switch %s: %s",
                "ON" if enabled else "off",
                "every lookup misses, writes are refused" if enabled else "caching resumes",
            )
        self.store.killed = enabled

    async def on_quota(self, tenant: str, quota: Quota | None) -> None:
        hbm, nvme = self._config_limits.get(tenant, (None, None))
        if quota is not None:
            hbm = hbm if quota.hbm_limit_bytes is None else quota.hbm_limit_bytes
            nvme = nvme if quota.nvme_limit_bytes is None else quota.nvme_limit_bytes
        evicted = await asyncio.to_thread(self.store.set_tenant_limits, tenant, hbm, nvme)
        self._publish()
        log.info(
            "tenant %s limits: hbm %s, nvme %s bytes (%d blocks evicted to fit)",
            tenant,
            hbm or "unlimited",
            nvme or "unlimited",
            evicted,
        )

    async def on_flush(self, tenant: str, name: str, revision: int) -> tuple[int, int]:
        result = await self.namespaces.on_flush(tenant, name, revision)
        self._publish()  # NAMESPACE_CLEARED of what it flushed
        return result

    # -------------------------------------------------------------- namespaces
    async def registered(self, spec: Namespace) -> bool:
        """Whether `spec` is registered in the cluster: known to this node's watch, held
        here while etcd was out of reach (pending), or in etcd itself, read directly (the
        watch may not have caught up with an owner who opened it a moment ago on another
        node). False when etcd cannot answer."""
        ns_id = spec.namespace_id
        if self.known_generation(ns_id) is not None or self.namespaces.is_pending(ns_id):
            return True
        try:
            return await self.etcd.get_namespace(spec.tenant, ns_id) is not None
        except errors.KvError:
            return False

    async def open_namespace(self, spec: Namespace) -> NsState:
        """OpenNamespace with etcd: at the generation in etcd when its record is known,
        else registered now (node_agent/ns_registry.py: created at this node's
        generation for it, so a record lost with etcd's data never moves a namespace
        backwards; served unregistered while etcd is unreachable)."""
        generation = self.known_generation(spec.namespace_id)
        if generation is None or self.namespaces.is_pending(spec.namespace_id):
            return await self.namespaces.open(spec)
        return self.store.open_namespace(spec, generation)
