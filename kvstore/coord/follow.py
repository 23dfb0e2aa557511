"""What agents and routers run to follow the control plane (kvstore/coord/admin.py): namespace
generations, the kill switch and tenant quotas, list-then-watch from etcd, applied by
subclass hooks, then acknowledged in etcd.

- Readiness: `start()` returns once the first full listing of every followed prefix has
  been applied, so a process that was down during a flush catches up before it serves.
- Joining: `catch_up()`, called right after the member registered itself in etcd (agent:
  nodes/<id>, router: routers/<id>), lists generations and the kill switch again and
  returns once they are in force, so no flush can slip between `start()`'s listing and the
  registration (see `catch_up` for the revision argument).
- etcd down: the last applied state stays in force (past the member's lease, hits again
  once etcd is found out of reach: kvstore/coord/fence.py); the
  watches resume from the next revision, acks still to write are retried.
- Acks are written only after a hook returned, i.e. once the new state is in force here.
- Flushes by name (flushes/<tenant>/<name>, written by every flush): `on_flush` gets each
  new marker revision (agents flush their copies of the name that etcd has no record of),
  then name-acks/<tenant>/<name>/<member> is written. `flush_view_revision` is the
  revision up to which every marker is known here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

from kvstore.coord.admin import put_many
from kvstore.coord.admin_records import (
    SWITCH_ACKS,
    Ack,
    NameAck,
    Quota,
    SwitchAck,
    ack_key,
    name_ack_key,
)
from kvstore.coord.etcd import (
    FLUSHES,
    KILLSWITCH,
    NAMESPACES,
    TENANTS,
    Compacted,
    EtcdClient,
    KeyValue,
    WatchEvent,
    killswitch_enabled,
)
from kvstore.coord.fence import LeaseFence
from kvstore import errors

log = logging.getLogger("kvstore.control")


async def follow_revisions(
    etcd: EtcdClient,
    prefix: str,
    reset: Callable[[list[KeyValue], int], None],
    apply: Callable[[list[WatchEvent]], None],
    retry_s: float = 0.2,
    max_retry_s: float = 2.0,
) -> None:
    """Like EtcdClient.follow, but `reset` also gets the revision the listing reflects
    (the kill switch ack needs it: a deleted key leaves no revision of its own)."""
    next_rev = 0
    delay = retry_s
    down = False
    while True:
        try:
            if not next_rev:
                revision, items = await etcd.list(prefix)
                reset(items, revision)
                next_rev = revision + 1
            async for batch in etcd.watch(prefix, next_rev):
                if down:
                    log.info("etcd watch on %s resumed at revision %d", prefix, next_rev)
                    down, delay = False, retry_s
                apply(batch)
                next_rev = batch[-1].mod_revision + 1
        except Compacted as exc:
            log.warning("etcd watch on %s: %s; relisting", prefix, exc)
            next_rev = 0
            continue
        except errors.Unavailable as exc:
            if not down:
                log.warning("%s; keeping the last known state, retrying", exc)
            down = True
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_retry_s)


class LeasedKey:
    """Keep one key alive under our own lease (routers under routers/<id>); re-grant and
    rewrite after the lease is lost, retry quietly while etcd is down. `on_put` runs after
    every (re)write of the key and before `live` is set (routers: `catch_up`).

    The key is claimed, never overwritten: written only where it is absent or already
    under our lease (one transaction), so a second process started with the same id
    waits, saying so, until the holder's lease is gone, instead of taking the key over
    and deleting it when it stops (revoking its lease). After each keepalive the holder
    checks that the key is still there under its lease and claims it again otherwise.

    `fence` (kvstore/coord/fence.py) is confirmed by each grant or keepalive from the time
    it was sent; after a lapse only once `on_put` re-read etcd again."""

    def __init__(
        self,
        etcd: EtcdClient,
        key: str,
        value: bytes,
        ttl_s: int = 5,
        on_put: Callable[[], Awaitable[object]] | None = None,
        what: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.etcd, self.key, self.value, self.ttl_s = etcd, key, value, ttl_s
        self.on_put = on_put
        self.lease = 0
        self.live = asyncio.Event()
        self.what = what or key
        self._clock = clock
        self._attempt_sent: float | None = None  # the last keepalive's send time
        self.fence = LeaseFence(ttl_s, self.what, clock)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"lease-{self.key}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.lease:  # deletes the key only where it is ours (claimed under this lease)
            try:
                await self.etcd.revoke(self.lease)
            except errors.KvError as exc:
                log.warning(
                    "could not revoke lease of %s (expires in %ds): %s", self.key, self.ttl_s, exc
                )
            self.lease = 0

    async def _claim(self) -> bool:
        """Write the key under our lease where it is absent or ours already; False (and
        a warning, once per wait) when another lease holds it."""
        if await self.etcd.claim(self.key, self.value, self.lease):
            self._waiting = False
            return True
        if not self._waiting:
            log.warning(
                "%s: %s is held by another live process in etcd (the same id started "
                "twice?); waiting for its lease to expire",
                self.what,
                self.key,
            )
            self._waiting = True
        return False

    async def _run(self) -> None:
        complained = False
        self._waiting = False
        while True:
            try:
                if not self.lease:
                    self.live.clear()
                    sent = self._clock()
                    self.lease = await self.etcd.grant(self.ttl_s)
                    self._sent = sent
                if not self.live.is_set():
                    if not await self._claim():
                        await asyncio.sleep(max(self.ttl_s / 3.0, 0.2))
                        await self._renew()  # our own lease stays alive meanwhile
                        continue
                    complained = False
                    await self._after_put()
                await asyncio.sleep(max(self.ttl_s / 3.0, 0.2))
                await self._renew()
                if self.lease and self.live.is_set():
                    kv = await self.etcd.get(self.key)
                    if kv is None or kv.lease != self.lease:
                        log.warning(
                            "%s: %s is %s; claiming it again",
                            self.what,
                            self.key,
                            "gone from etcd" if kv is None else "held by another lease",
                        )
                        self.fence.lost()
                        self.live.clear()
            except errors.NotFound:
                self.fence.lost()
                self.lease = 0
            except errors.KvError as exc:
                if isinstance(exc, errors.Unavailable):
                    self.fence.unreachable(self._attempt_sent)
                if not complained:
                    log.warning("keeping %s alive in etcd failed (retrying): %s", self.key, exc)
                    complained = True
                await asyncio.sleep(0.5)

    async def _renew(self) -> None:
        """One keepalive; lease 0 when it is gone. Confirms the fence while the key is
        ours and no lapse needs a re-read first (else `_after_put` confirms it)."""
        sent = self._attempt_sent = self._clock()
        if await self.etcd.keepalive(self.lease) <= 0:
            self.fence.lost()
            self.lease = 0
            return
        self._sent = sent
        if self.live.is_set():
            if self.fence.lapsed_at(sent):  # re-read etcd before serving on the cache
                self.live.clear()
            else:
                self.fence.confirmed(sent)

    async def _after_put(self) -> None:
        """Run on_put, then set `live` and confirm the fence as of the last grant or
        keepalive sent before it; on failure `live` stays clear and the next round
        (after the keepalive, so the key is kept meanwhile) tries again."""
        sent = self._sent
        try:
            if self.on_put is not None:
                await self.on_put()
            self.live.set()
            self.fence.confirmed(sent)
        except errors.KvError as exc:
            log.warning("after writing %s to etcd (retrying): %s", self.key, exc)
        except Exception:  # a failing hook must not end the keepalive loop
            log.exception("after writing %s to etcd (retrying)", self.key)


class ControlFollower:
    """Follows namespaces/, killswitch and (optionally) tenants/, calls the hooks, acks.
    Subclasses override the `on_*` hooks; the base keeps the applied state."""

    def __init__(self, etcd: EtcdClient, member: str, follow_quotas: bool = False) -> None:
        self.etcd = etcd
        self.member = member
        self.ready = asyncio.Event()
        self._prefixes = [NAMESPACES, KILLSWITCH, FLUSHES] + ([TENANTS] if follow_quotas else [])
        self._synced: set[str] = set()
        self._want_gen: dict[bytes, tuple[str, int]] = {}  # ns_id -> (tenant, generation)
        self._applied_gen: dict[bytes, int] = {}
        self._want_switch: tuple[bool, int] | None = None  # (enabled, revision)
        self._applied_switch: tuple[bool, int] | None = None
        self._want_quota: dict[str, Quota] = {}  # mirrors tenants/ in etcd
        self._applied_quota: dict[str, Quota] = {}
        self._want_flush: dict[tuple[str, str], int] = {}  # (tenant, name) -> revision
        self._applied_flush: dict[tuple[str, str], int] = {}
        self._flush_seen = 0  # every marker up to this revision is in _want_flush
        self._acks: dict[str, bytes] = {}
        self._dirty = asyncio.Event()
        self._acks_dirty = asyncio.Event()
        self._applying = asyncio.Lock()  # the reconcile loop and catch_up() take turns
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ public
    @property
    def killed(self) -> bool:
        return bool(self._applied_switch and self._applied_switch[0])

    def generation(self, ns_id: bytes) -> int | None:
        """The generation in force here for `ns_id`; None when etcd never named it."""
        return self._applied_gen.get(ns_id)

    def known_namespaces(self, tenant: str) -> set[bytes]:
        """Ids of the tenant's namespace records seen in etcd."""
        return {ns_id for ns_id, (t, _) in self._want_gen.items() if t == tenant}

    @property
    def flush_view_revision(self) -> int:
        """Every flush committed at or before this revision is known here."""
        return self._flush_seen

    def known_generation(self, ns_id: bytes) -> int | None:
        """The newest generation seen in etcd (may not be applied yet)."""
        want = self._want_gen.get(ns_id)
        return want[1] if want else None

    async def start(self, timeout_s: float | None = None, what: str = "") -> None:
        """Start following; return once the first listing of everything is applied. With
        no timeout this waits for etcd as long as it takes, logging every few seconds."""
        for prefix in self._prefixes:
            self._tasks.append(asyncio.create_task(self._follow(prefix), name=f"control-{prefix}"))
        self._tasks.append(asyncio.create_task(self._reconcile_loop(), name="control-apply"))
        self._tasks.append(asyncio.create_task(self._ack_loop(), name="control-acks"))
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not self.ready.is_set():
            wait = 5.0 if deadline is None else min(5.0, max(0.0, deadline - loop.time()))
            try:
                async with asyncio.timeout(wait):
                    await self.ready.wait()
            except TimeoutError:
                if deadline is not None and loop.time() >= deadline:
                    await self.stop()
                    raise errors.Unavailable(
                        f"{what or self.member}: could not load generations and the kill "
                        f"switch from etcd at {','.join(self.etcd.endpoints)} within "
                        f"{timeout_s:g}s"
                    ) from None
                log.warning(
                    "%s waits for etcd at %s to load namespace generations and the "
                    "kill switch before serving",
                    what or self.member,
                    ",".join(self.etcd.endpoints),
                )

    async def catch_up(self) -> int:
        """List generations and the kill switch again and return once they are in force
        here; returns the revision listed. Call it after every (re-)registration, before
        reporting ready.

        Why this closes the join race: a flush commits at revision F, then polls
        membership (nodes/, routers/) and acks. It finishes without us only if a
        membership read at some revision M > F did not see our key, i.e. our registration
        was committed at R > M > F. etcd reads are linearizable, so a listing started
        after our registration returned reflects a revision L >= R > F and holds that
        flush's generation. With it applied before we report ready, every flush either
        waits for our ack or is in force here already. Without this such a flush reached
        us only through the watch started at `start()`'s listing, a moment after we had
        joined and served the old generation. The kill switch has the same race (its
        acks are awaited from the same membership)."""
        revision = 0
        for prefix in (NAMESPACES, KILLSWITCH, FLUSHES):
            revision, items = await self.etcd.list(prefix)
            if prefix == FLUSHES:
                self._flushes_listed(items, revision)
            elif prefix == KILLSWITCH:
                raw = next((kv.value for kv in items if kv.key == KILLSWITCH), b"")
                if self._want_switch is None or self._want_switch[1] < revision:
                    self._want_switch = (killswitch_enabled(raw), revision)
            else:  # _record keeps the higher generation: the watch may be ahead of us
                for kv in items:
                    self._record(prefix, kv.key, kv.value, False, revision)
        async with self._applying:
            await self._reconcile()
        return revision

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    # ------------------------------------------------------------------- hooks
    async def on_generation(self, ns_id: bytes, tenant: str, generation: int) -> int:
        """Put `generation` in force; return the number of blocks dropped."""
        return 0

    async def on_killswitch(self, enabled: bool) -> None:
        pass

    async def on_quota(self, tenant: str, quota: Quota | None) -> None:
        pass

    async def on_flush(self, tenant: str, name: str, revision: int) -> tuple[int, int]:
        """A flush of `tenant/name` committed at `revision`: flush whatever etcd's records
        do not cover; return (namespaces flushed, blocks dropped)."""
        return 0, 0

    # ------------------------------------------------------------------ follow
    async def _follow(self, prefix: str) -> None:
        def reset(items: list[KeyValue], revision: int) -> None:
            if prefix == FLUSHES:
                self._flushes_listed(items, revision)
                items = []
            elif prefix == KILLSWITCH:
                raw = next((kv.value for kv in items if kv.key == KILLSWITCH), b"")
                self._want_switch = (killswitch_enabled(raw), revision)
            elif prefix == TENANTS:
                self._want_quota.clear()  # tenants gone from etcd fall back to config
            for kv in items:
                self._record(prefix, kv.key, kv.value, False, revision)
            self._synced.add(prefix)
            self._dirty.set()

        def apply(events: list[WatchEvent]) -> None:
            for ev in events:
                self._record(prefix, ev.key, ev.value, ev.deleted, ev.mod_revision)
            if prefix == FLUSHES:
                self._flush_seen = max(self._flush_seen, events[-1].mod_revision)
            self._dirty.set()

        await follow_revisions(self.etcd, prefix, reset, apply)

    def _flushes_listed(self, items: list[KeyValue], revision: int) -> None:
        for kv in items:  # a marker's revision is its flush's: its mod revision
            self._record(FLUSHES, kv.key, kv.value, False, kv.mod_revision)
        self._flush_seen = max(self._flush_seen, revision)

    def _record(self, prefix: str, key: str, value: bytes, deleted: bool, rev: int) -> None:
        try:
            if prefix == FLUSHES:
                tenant, _, name = key[len(FLUSHES) :].partition("/")
                if not deleted and tenant and name:
                    old = self._want_flush.get((tenant, name), 0)
                    self._want_flush[(tenant, name)] = max(old, rev)
            elif prefix == KILLSWITCH:
                # Older than what catch_up() listed: a lagging watch must not undo it.
                if key == KILLSWITCH and (self._want_switch is None or rev >= self._want_switch[1]):
                    self._want_switch = (not deleted and killswitch_enabled(value), rev)
            elif prefix == TENANTS:
                tenant = key[len(TENANTS) :]
                if deleted:
                    self._want_quota.pop(tenant, None)
                else:
                    self._want_quota[tenant] = Quota.parse(value)
            elif not deleted:  # a deleted namespace record keeps its last generation
                tenant, ns_hex = key[len(NAMESPACES) :].rsplit("/", 1)
                ns_id = bytes.fromhex(ns_hex)
                gen = int(json.loads(value)["generation"])
                old = self._want_gen.get(ns_id, ("", -1))[1]
                self._want_gen[ns_id] = (tenant, max(gen, old))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring malformed etcd record %s: %s", key, exc)

    # --------------------------------------------------------------- reconcile
    async def _reconcile_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            complete = self._synced.issuperset(self._prefixes)
            try:
                async with self._applying:
                    await self._reconcile()
            except Exception:  # one bad hook must not stop the control plane
                log.exception("applying control state failed; retrying")
                await asyncio.sleep(0.5)
                self._dirty.set()
                continue
            if complete and not self.ready.is_set():
                log.info(
                    "%s caught up with etcd: %d namespaces, kill switch %s",
                    self.member,
                    len(self._want_gen),
                    "ON" if self.killed else "off",
                )
                self.ready.set()

    async def _reconcile(self) -> None:
        want = self._want_switch
        if want is not None and want != self._applied_switch:  # first: the most urgent
            await self.on_killswitch(want[0])
            self._applied_switch = want
            self._ack(SWITCH_ACKS + self.member, SwitchAck(*want).to_json())
        for ns_id, (tenant, gen) in list(self._want_gen.items()):
            if self._applied_gen.get(ns_id, -1) >= gen:
                continue
            dropped = await self.on_generation(ns_id, tenant, gen)
            self._applied_gen[ns_id] = gen
            if gen > 0:  # generation 0 was never flushed: nobody waits for it
                self._ack(ack_key(tenant, ns_id.hex(), self.member), Ack(gen, dropped).to_json())
        # After the generations: a flush's name ack follows its record acks here.
        for (tenant, name), rev in list(self._want_flush.items()):
            if self._applied_flush.get((tenant, name), 0) >= rev:
                continue
            flushed, dropped = await self.on_flush(tenant, name, rev)
            self._applied_flush[(tenant, name)] = rev
            self._ack(
                name_ack_key(tenant, name, self.member), NameAck(rev, flushed, dropped).to_json()
            )
        for tenant in sorted(set(self._want_quota) | set(self._applied_quota)):
            quota = self._want_quota.get(tenant)
            if quota != self._applied_quota.get(tenant):
                await self.on_quota(tenant, quota)
                if quota is None:
                    self._applied_quota.pop(tenant, None)
                else:
                    self._applied_quota[tenant] = quota

    # -------------------------------------------------------------------- acks
    def _ack(self, key: str, value: bytes) -> None:
        self._acks[key] = value
        self._acks_dirty.set()

    async def _ack_loop(self) -> None:
        delay = 0.2
        while True:
            await self._acks_dirty.wait()
            self._acks_dirty.clear()
            batch = dict(self._acks)
            try:
                await put_many(self.etcd, list(batch.items()))
            except errors.KvError as exc:
                log.debug("writing %d acks failed (retrying): %s", len(batch), exc)
                self._acks_dirty.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            delay = 0.2
            for k, v in batch.items():
                if self._acks.get(k) == v:
                    del self._acks[k]
