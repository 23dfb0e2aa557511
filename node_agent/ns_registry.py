"""Namespace registration in etcd, and the namespaces an agent holds that etcd has no
record of yet.

Every namespace an agent serves is registered with `EtcdClient.claim_namespace` (one
transaction: create or raise the record, check the tenant's namespace cap, check that no
flush of the name committed after our view of flushes/). When etcd cannot be reached the
agent still opens the namespace (the data path keeps serving) and keeps it here as
*pending*; a background loop claims it with backoff until etcd answers.

The flush guarantee for a pending namespace. A flush cannot raise a record that does not
exist, so it also writes a marker for the name (flushes/<tenant>/<name>) and waits for a
name ack from every member. The rule here: each pending namespace remembers
`seen_revision`, the revision up to which this agent knew every flush marker when it
opened it (0 for one recovered from RocksDB without a record: we cannot know). A marker
newer than that may postdate some of its blocks, so the namespace is flushed here — its
generation raised locally, fencing old requests and dropping its blocks — before the name
ack is written (`on_flush`), and before a claim can succeed (the claim refuses while a
newer marker exists). So:
- a flush whose name ack we wrote has flushed every pending copy of that name here;
- a claim that commits before a flush is seen by that flush (its transaction compares
  every record of the tenant against its listing, kvstore/coord/admin.py);
- a claim that would commit after a flush fails on the marker, and we flush first.
A flush issued while etcd is down fails in kvctl ("etcd unreachable", exit 3) and changes
nothing; once etcd is back, a flush reaches pending namespaces through the marker even
before they are registered.

The cap (max_namespaces_per_tenant) is enforced by the claim, atomically across the
cluster; for namespaces opened while etcd is unreachable it is checked against what this
agent knows (the records it follows plus its pending ones), per agent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvstore import errors
from kvstore.coord.etcd import EtcdClient
from kvstore.namespace import Namespace
from kvstore.store import BlockStore, NsState

log = logging.getLogger("kvstore.agent")
_ATTEMPTS = 16
_RETRY_S, _MAX_RETRY_S = 0.2, 5.0


@dataclass(slots=True)
class Pending:
    """A namespace this agent serves that etcd has no record of (yet)."""

    spec: Namespace
    seen_revision: int  # flush markers up to here are older than its blocks
    generation: int  # the generation it is served at (raised by local flushes)
    refused: str = ""  # why etcd refused to register it (logged once), e.g. the cap


def check_cap(tenant: str, held: set[bytes], ns_id: bytes, limit: int) -> None:
    """ResourceExhausted when `ns_id` would be one namespace too many for `tenant`."""
    if limit and ns_id not in held and len(held) >= limit:
        raise errors.ResourceExhausted(
            f"tenant {tenant!r} already has {len(held)} namespaces; the limit is {limit} "
            "(max_namespaces_per_tenant)"
        )


class NamespaceRegistry:
    """Owned by AgentControl. `known(ns_id)` is the generation etcd has for a namespace
    (None: no record known), `known_ids(tenant)` the ids of the tenant's records, and
    `flush_view` the revision up to which every flush marker is known."""

    def __init__(
        self,
        store: BlockStore,
        etcd: EtcdClient,
        limit: int,
        known: Callable[[bytes], int | None],
        known_ids: Callable[[str], set[bytes]],
        flush_view: Callable[[], int],
    ) -> None:
        self.store, self.etcd, self.limit = store, etcd, limit
        self._known, self._known_ids, self._flush_view = known, known_ids, flush_view
        self._pending: dict[bytes, Pending] = {}
        # Registered by us: counted for the cap before our watch delivers their records.
        self._claimed: dict[str, set[bytes]] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # one tenant's claims go in turn
        self._wake = asyncio.Event()
        self._etcd_down = False
        self._task: asyncio.Task | None = None

    @property
    def pending(self) -> list[Namespace]:
        return [p.spec for p in self._pending.values()]

    def is_pending(self, ns_id: bytes) -> bool:
        return ns_id in self._pending

    def start(self) -> None:
        """Adopt namespaces recovered from RocksDB that etcd has no record of, then keep
        claiming pending namespaces. Call once the first listing of etcd is applied."""
        for st in self.store.namespaces():
            if self._known(st.ns_id) is None and st.ns_id not in self._pending:
                self._pending[st.ns_id] = Pending(st.spec, 0, st.generation)
        if self._pending:
            log.info(
                "%d namespaces recovered without an etcd record; registering them",
                len(self._pending),
            )
            self._wake.set()
        self._task = asyncio.create_task(self._run(), name="namespace-registration")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # -------------------------------------------------------------------- open
    async def open(self, spec: Namespace) -> NsState:
        """OpenNamespace for a namespace etcd has no record of that we know about."""
        ns_id = spec.namespace_id
        p = self._pending.get(ns_id)
        if p is not None:
            return self.store.open_namespace(spec, p.generation)
        p = Pending(spec, self._flush_view(), self._local_generation(ns_id))
        if not self._etcd_down:
            try:
                generation = await self._claim(p)
                self._claimed.setdefault(spec.tenant, set()).add(ns_id)
                return self.store.open_namespace(spec, generation)
            except errors.Unavailable as exc:
                self._etcd_down = True
                log.warning(
                    "namespace %s opened without etcd (%s); registering it as soon as etcd answers",
                    spec.key,
                    exc,
                )
        if ns_id in self._pending:  # opened by a concurrent call meanwhile
            return self.store.open_namespace(spec, self._pending[ns_id].generation)
        held = (
            self._known_ids(spec.tenant)
            | self._claimed.get(spec.tenant, set())
            | {i for i, q in self._pending.items() if q.spec.tenant == spec.tenant}
        )
        check_cap(spec.tenant, held, ns_id, self.limit)
        st = self.store.open_namespace(spec, p.generation)
        p.generation = max(p.generation, st.generation)
        self._pending[ns_id] = p
        self._wake.set()
        return st

    def _local(self, ns_id: bytes) -> NsState | None:
        return next((s for s in self.store.namespaces() if s.ns_id == ns_id), None)

    def _local_generation(self, ns_id: bytes) -> int:
        st = self._local(ns_id)
        return st.generation if st is not None else 0

    # ------------------------------------------------------------------- flush
    async def on_flush(self, tenant: str, name: str, revision: int) -> tuple[int, int]:
        """Flush every pending namespace of `tenant/name` (or of that namespace id)
        opened before we knew of the flush at `revision`. Returns (flushed, dropped)."""
        flushed = dropped = 0
        for ns_id, p in list(self._pending.items()):
            if (
                p.spec.tenant == tenant
                and name in (p.spec.name, ns_id.hex())
                and self._pending.get(ns_id) is p
                and p.seen_revision < revision
            ):
                dropped += await self._flush_locally(p, revision)
                flushed += 1
        if flushed:
            log.info(
                "flush of %s/%s (revision %d) applied to %d namespaces not yet in etcd: "
                "%d blocks dropped",
                tenant,
                name,
                revision,
                flushed,
                dropped,
            )
        return flushed, dropped

    async def _flush_locally(self, p: Pending, revision: int) -> int:
        # Both fields change before the await: a claim in flight sees them and retries.
        p.seen_revision = max(p.seen_revision, revision)
        p.generation = max(p.generation, self._local_generation(p.spec.namespace_id)) + 1
        try:
            return await asyncio.to_thread(
                self.store.set_generation, p.spec.namespace_id, p.generation
            )
        except errors.NotFound:  # not opened here yet: it opens at p.generation
            return 0

    # ------------------------------------------------------------------- claim
    async def _claim(self, p: Pending) -> int:
        """Register `p` in etcd; returns the generation to serve it at. A flush of its
        name newer than `p.seen_revision` is applied here first."""
        spec = p.spec
        lock = self._locks.setdefault(spec.tenant, asyncio.Lock())
        async with lock:
            for _ in range(_ATTEMPTS):
                seen, gen = p.seen_revision, p.generation
                local = self._local(spec.namespace_id)
                policy = local.policy if local is not None else self.store.policy_for(spec)
                claim = await self.etcd.claim_namespace(
                    spec.namespace_id, spec.to_dict(), policy.to_dict(), gen, seen, self.limit
                )
                if (p.seen_revision, p.generation) != (seen, gen):
                    continue  # flushed here while we asked: claim the new generation
                if claim.flushed_at > seen:
                    await self._flush_locally(p, claim.flushed_at)
                    continue
                return max(claim.generation, gen)
        raise errors.Unavailable(
            f"namespace {spec.key}: kept being flushed while it was registered; retrying"
        )

    def _finish(self, p: Pending, generation: int) -> None:
        """Registered: etcd's record (and the watch) govern it from now on. No await
        between the claim's last check and here, so no flush slips in between."""
        ns_id = p.spec.namespace_id
        if self._pending.get(ns_id) is not p:
            return
        if generation > self._local_generation(ns_id):
            self.store.set_generation(ns_id, generation)
        del self._pending[ns_id]
        self._claimed.setdefault(p.spec.tenant, set()).add(ns_id)
        log.info("namespace %s registered in etcd at generation %d", p.spec.key, generation)

    async def _run(self) -> None:
        delay = _RETRY_S
        while True:
            await self._wake.wait()
            self._wake.clear()
            failed = False
            for p in list(self._pending.values()):
                if self._pending.get(p.spec.namespace_id) is not p:
                    continue
                try:
                    self._finish(p, await self._claim(p))
                    self._etcd_down = False
                except errors.Unavailable as exc:
                    if not self._etcd_down or delay == _RETRY_S:
                        log.warning(
                            "%d namespaces wait for etcd to register them (still "
                            "served, flushed by name meanwhile): %s",
                            len(self._pending),
                            exc,
                        )
                    self._etcd_down, failed = True, True
                    break
                except errors.KvError as exc:  # cap reached meanwhile, damaged record
                    if p.refused != str(exc):
                        log.warning(
                            "namespace %s cannot be registered in etcd: %s (still "
                            "served, flushed by name; retrying)",
                            p.spec.key,
                            exc,
                        )
                    p.refused, failed = str(exc), True
            if failed:
                self._wake.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_RETRY_S)
            else:
                delay = _RETRY_S
