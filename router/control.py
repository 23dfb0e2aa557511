"""The router's side of the control plane: follows namespace generations and the kill
switch from etcd, fences Route by generation, and acknowledges as `router:<router_id>`.

The router announces itself under routers/<router_id> (its own lease), so a flush waits
for its acknowledgement too; a router that stops (lease revoked or expired) stops
counting. The key is claimed, not overwritten: a second router started with the same id
waits until the first one's lease is gone (kvstore/coord/follow.py, LeasedKey). While the
lease may have lapsed (frozen, cut off from etcd) the router routes by load only, as with
the kill switch, until it has re-announced itself and re-read the generations
(kvstore/coord/fence.py).

`start()` returns once the current generations and kill switch are loaded, the router
is announced and has caught up again as of its announcement (`catch_up`): the
router should start serving after it.

Wiring (router/server.py): create it next to the ClusterFollower with the RouterCore,
`await control.start()` before `server.start()`, `await control.stop()` on shutdown, and
call `control.check(request.namespace_id, request.generation)` at the top of Route.
"""

from __future__ import annotations

import asyncio
import json
import logging

from kvstore.coord.admin_records import ROUTERS, router_member
from kvstore.coord.follow import ControlFollower, LeasedKey
from kvstore.coord.seen import SeenWriter
from kvstore.coord.etcd import EtcdClient
from kvstore import errors

log = logging.getLogger("kvstore.router")


class RouterControl(ControlFollower):
    def __init__(
        self, etcd: EtcdClient, router_id: str, core=None, address: str = "", lease_ttl_s: int = 5
    ) -> None:
        """`core` (a RouterCore, optional): its `killswitch` flag is set here before the
        kill switch is acknowledged, so the ack means routing no longer uses the cache."""
        if not router_id or "/" in router_id:
            raise ValueError(f"router_id must be non-empty without '/', got {router_id!r}")
        super().__init__(etcd, router_member(router_id))
        self.router_id = router_id
        self.core = core
        value = json.dumps({"router_id": router_id, "address": address}).encode()
        self._presence = LeasedKey(
            etcd,
            ROUTERS + router_id,
            value,
            lease_ttl_s,
            on_put=self.catch_up,
            what=f"router {router_id}",
        )
        # Route by load only while the lease may have lapsed (kvstore/coord/fence.py): a
        # flush that stopped waiting for us may not be in force here yet.
        self.fence = self._presence.fence
        if core is not None:
            core.fence = self.fence.fenced
        # seen/router/<id>, lease-less, while announced: `kvctl status` names a router
        # that vanished without leaving (kvstore/coord/seen.py); a clean stop deletes it.
        self._seen = SeenWriter(
            etcd, "router", router_id, self._presence.live, address, forget_on_stop=True
        )

    async def start(self, timeout_s: float | None = None, what: str = "") -> None:
        what = what or f"router {self.router_id}"
        await super().start(timeout_s, what)
        # Announced only once caught up: a flush never waits on a router still loading.
        # Then caught up again as of the announcement (`catch_up`, after every write of
        # routers/<id>) before we return and the router serves: a flush whose membership
        # check just missed us is in force here by then.
        self._presence.start()
        self._seen.start()
        try:
            async with asyncio.timeout(timeout_s):
                await self._presence.live.wait()
        except TimeoutError:
            await self.stop()
            raise errors.Unavailable(
                f"{what}: could not announce itself in etcd within {timeout_s:g}s"
            ) from None

    async def stop(self) -> None:
        await self._seen.stop()
        await self._presence.stop()
        await super().stop()

    # ---------------------------------------------------------------- fencing
    def is_killed(self) -> bool:
        return self.killed

    def check(self, ns_id: bytes, generation: int) -> None:
        """Refuse a Route for a generation older than the one in force (fencing): its
        block ids belong to a flushed namespace and must not be matched."""
        current = self.generation(ns_id)
        if current is not None and generation < current:
            raise errors.StaleGeneration(
                f"namespace {ns_id.hex()[:12]} generation {generation} is stale (current "
                f"{current}): reopen the namespace"
            )

    # ------------------------------------------------------------------ hooks
    async def on_killswitch(self, enabled: bool) -> None:
        if self.core is not None:
            if enabled != self.core.killswitch:
                log.warning(
                    "kill switch %s: routing %s",
                    "ON" if enabled else "off",
                    "by load only" if enabled else "by cache again",
                )
            self.core.killswitch = enabled

    async def on_generation(self, ns_id: bytes, tenant: str, generation: int) -> int:
        return 0  # the fence is `generation()`, updated by the base class before the ack
