"""Agent membership in etcd: the agent's NodeRecord lives under nodes/<node_id>, attached to
a lease it keeps alive. Routers discover agents from these keys and drop an agent when its
key goes (clean shutdown revokes the lease; a crash lets it expire after lease_ttl_s).

etcd is never on the data path: while etcd is down the agent keeps serving and this loop
keeps retrying. A short outage keeps the old lease (etcd renews leases when it comes
back); if the lease did expire meanwhile, the agent registers again with a new one.
The record is claimed with compare-and-create, so a second agent started with the same
node id waits (and says so in the log) until the first one's lease is gone.

Joining: `on_registered` (the agent passes `AgentControl.catch_up`) runs after every
successful registration and before `registered` is set: it applies the namespace
generations and kill switch as of a revision after our record, so a flush whose
membership check just missed us is in force before we count as registered
(kvstore/coord/follow.py, `ControlFollower.catch_up`, has the argument).

Fencing (kvstore/coord/fence.py): `fence` says whether the lease may have lapsed. It is
confirmed by each grant or keepalive, from the time that request was sent, so the agent
stops serving hits before etcd could have expired the lease (a flush stops waiting for a
member whose lease expired). Once it lapsed, a keepalive that still succeeds is not
enough: the generations are re-read (`on_registered`) before the fence lifts, as after a
re-registration. The agent starts fenced and serves hits once registered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvstore.config import TLSConfig
from kvstore.coord.etcd import DEFAULT_PREFIX, EtcdClient, NodeRecord
from kvstore.coord.fence import LeaseFence
from kvstore import errors

log = logging.getLogger("kvstore.agent")


class Registration:
    def __init__(
        self,
        endpoints: str,
        record: Callable[[], NodeRecord],
        ttl_s: int,
        prefix: str = DEFAULT_PREFIX,
        on_registered: Callable[[], Awaitable[object]] | None = None,
        tls: TLSConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"lease_ttl_s must be >= 1, got {ttl_s}")
        self._endpoints = endpoints
        self._tls = tls
        self._prefix = prefix
        self._record = record
        self._on_registered = on_registered
        self.ttl_s = ttl_s
        # Heartbeat three times per TTL so one lost keepalive does not expire the lease.
        self.interval_s = max(ttl_s / 3.0, 0.2)
        self.lease = 0
        self.registered = asyncio.Event()
        self._clock = clock
        self.fence = LeaseFence(ttl_s, "agent", clock)
        self._etcd: EtcdClient | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._etcd = EtcdClient(
            self._endpoints,
            self._prefix,
            timeout=max(1.0, min(3.0, self.ttl_s / 2)),
            tls=self._tls,
        )
        self._task = asyncio.create_task(self._run(), name="etcd-registration")

    @property
    def _client(self) -> EtcdClient:
        """The etcd client of a started registration (the loop runs only after start)."""
        if self._etcd is None:
            raise RuntimeError("Registration used before start() or after stop()")
        return self._etcd

    async def stop(self) -> None:
        """Stop heartbeats and revoke the lease so routers drop this node at once."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._etcd is not None:
            if self.lease:
                try:
                    await self._etcd.revoke(self.lease)
                    log.info("revoked etcd lease %x", self.lease)
                except errors.KvError as exc:
                    log.warning(
                        "could not revoke etcd lease (it will expire in %ds): %s", self.ttl_s, exc
                    )
            await self._etcd.close()
            self._etcd = None

    async def _run(self) -> None:
        delay = 0.2
        complained = False
        while True:
            try:
                if await self._register():
                    delay, complained = 0.2, False
                    await self._heartbeat()
            except errors.NotFound:
                self.lease = 0  # our lease expired while we waited: take a new one
            except errors.KvError as exc:
                if isinstance(exc, errors.Unavailable):
                    self.fence.unreachable()
                if not complained:
                    log.warning(
                        "etcd registration failing (hits only once registered, or with the "
                        "generations known here while etcd is out of reach): %s",
                        exc,
                    )
                    complained = True
            except Exception:  # on_registered's hook failed: keep trying, never give up
                log.exception("applying etcd state after registering failed; retrying")
            self.registered.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.ttl_s / 2.0)

    async def _register(self) -> bool:
        rec = self._record()
        self.fence.what = f"agent {rec.node_id}"
        sent = self._clock()
        if self.lease:  # kept from before (a failed hook, a wait): is it still alive?
            ttl = await self._client.keepalive(self.lease)
            if ttl <= 0:
                self.lease = 0
        if not self.lease:
            sent = self._clock()
            self.lease, ttl = await self._client.grant(self.ttl_s), self.ttl_s
        if not await self._client.register_node(rec, self.lease):
            log.warning(
                "node id %s is held by another live agent in etcd; waiting for its lease to expire",
                rec.node_id,
            )
            return False
        if self._on_registered is not None:
            # After our record is committed, not before: see the module docstring. A
            # failure here (etcd gone again) retries the whole registration.
            await self._on_registered()
        self.fence.confirmed(sent, ttl)
        log.info(
            "registered %s at %s in etcd (lease %x, ttl %ds)",
            rec.node_id,
            rec.address,
            self.lease,
            self.ttl_s,
        )
        self.registered.set()
        self._last = rec
        return True

    async def _heartbeat(self) -> None:
        """Keep the lease alive and the record fresh; returns when the lease is lost."""
        failing = False
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                sent = self._clock()
                left = await self._client.keepalive(self.lease)
                if left <= 0:
                    log.warning("etcd lease %x expired; registering again", self.lease)
                    self.fence.lost()
                    self.lease = 0
                    return
                if self.fence.lapsed_at(sent):
                    # We may have missed a flush that stopped waiting for us (or the
                    # lease lapsed and came back with etcd): re-read etcd before hits.
                    if self._on_registered is not None:
                        await self._on_registered()
                    log.info("etcd lease %x confirmed again after a lapse", self.lease)
                self.fence.confirmed(sent, left)
                rec = self._record()
                if rec != self._last:
                    if not await self._client.update_node(rec, self.lease):
                        log.warning("our etcd record disappeared; registering again")
                        self.fence.lost()
                        return
                    self._last = rec
                if failing:
                    log.info("etcd reachable again; lease %x kept", self.lease)
                    failing = False
            except errors.NotFound:
                self.fence.lost()
                self.lease = 0
                return
            except errors.Unavailable as exc:
                self.fence.unreachable(sent)  # the keepalive's send time
                if not failing:
                    log.warning(
                        "etcd heartbeat failing (still serving: the known generations while "
                        "etcd is out of reach; misses if it answers without our lease): %s",
                        exc,
                    )
                    failing = True
