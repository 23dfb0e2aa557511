"""The one etcd module: key layout, leases, compare-and-swap transactions, list-then-watch.

Key layout under a prefix (default ``/kvstore/``)::

    nodes/<node_id>                 NodeRecord JSON, written under the agent's lease
    engines/<engine_id>             EngineRecord JSON (coord/engines.py), under the
                                    registrar's lease (integrations/vllm_serve.py)
    namespaces/<tenant>/<ns_id hex> {"spec": {...}, "generation": N, "policy": {...}}
    tenants/<tenant>                {"hbm_limit_bytes": ..., "nvme_limit_bytes": ...}
    killswitch                      {"enabled": true, "reason": "..."}
    flushes/<tenant>/<name>         flush marker: its mod revision is the name's last flush
    ns-counts/<tenant>              {"count": N}: the tenant's records, bumped by each creation
    seen/<agent|router>/<id>        {"at": ..., "address": ..., "stopped": ...}, no
                                    lease: last seen, and a clean stop (coord/seen.py;
                                    kvctl status names the missing and the stopped)

A namespace record is created only by `claim_namespace`, one transaction that also checks
the tenant's namespace cap and that no flush of the name committed after the claimer's
view (the flush marker), and bumps the tenant's record counter: the cap is checked
against it, and a flush compares it to notice a record created while it ran (O(1) per
claim, where counting the records would grow with the tenant). See
node_agent/ns_registry.py for why.

Every etcd failure (connection refused, timeout, lost quorum) surfaces as
`kvstore.errors.Unavailable` with the operation and the endpoints in the message; callers
never see etcd3aio or grpc exceptions. Watches resume from the revision after the last
event they delivered (etcd keeps revisions across restarts) and report a compaction so
the caller relists.

The key names and the records (etcd_records.py) and the endpoints (etcd_endpoints.py) are
in modules of their own; this one imports them back.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
from etcd3aio import (
    EtcdError,
    EtcdPermissionDeniedError,
    EtcdUnauthenticatedError,
    prefix_range_end,
)
from etcd3aio._protobuf import (
    Compare,
    LeaseKeepAliveRequest,
    LeaseStub,
    RangeRequest,
    RequestOp,
    WatchCreateRequest,
    WatchRequest,
    WatchStub,
)
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService

from kvstore import errors
from kvstore.coord.engines import ENGINES, EngineRecord
from kvstore.coord.etcd_endpoints import _CHANNEL_OPTIONS, channel_target, parse_endpoints
from kvstore.coord.etcd_records import (  # FLUSHES, NS_COUNTS: for importers of this module
    FLUSHES as FLUSHES,
    KILLSWITCH,
    NAMESPACES,
    NODES,
    NS_COUNTS as NS_COUNTS,
    TENANTS,
    KeyValue,
    NamespaceClaim,
    NamespaceRecord,
    NodeRecord,
    WatchEvent,
    _NsSnapshot,
    flush_marker_key,
    killswitch_enabled,
    namespace_key,
    ns_count_key,
)
from kvstore.config import TLSConfig
from kvstore.tls import channel_credentials

log = logging.getLogger("kvstore.etcd")

DEFAULT_PREFIX = "/kvstore/"
_CAS_ATTEMPTS = 16


class Compacted(Exception):
    """The watch start revision was compacted away: relist, then watch again."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"revision compacted up to {revision}")
        self.revision = revision


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details() or ''}".rstrip(": ")
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


# -------------------------------------------------------------------------- client
class EtcdClient:
    """Asyncio etcd v3 client scoped to a key prefix. Create it inside the event loop
    that uses it; `close()` when done (or use `async with`)."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        prefix: str = DEFAULT_PREFIX,
        timeout: float = 3.0,
        tls: TLSConfig | None = None,
    ) -> None:
        """`tls` on: etcd's own TLS with a client certificate (TLSConfig.for_etcd); each
        etcd server's certificate must name the first endpoint's host (one channel
        balances over all of them, and gRPC checks one name)."""
        self.endpoints = parse_endpoints(endpoints)
        if not prefix.endswith("/"):
            raise ValueError(f"etcd prefix must end with '/', got {prefix!r}")
        self.prefix = prefix
        self.timeout = timeout
        target = channel_target(self.endpoints)
        etcd_tls = tls.for_etcd() if tls is not None else None
        if etcd_tls is not None and etcd_tls.enabled:
            host = self.endpoints[0].rsplit(":", 1)[0]
            opts = [*_CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", host)]
            creds = channel_credentials(etcd_tls)
            self._channel = grpc.aio.secure_channel(target, creds, options=opts)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self._kv = KVService(self._channel, max_attempts=2)
        self._lease = LeaseService(self._channel, max_attempts=2)
        self._lease_stub = LeaseStub(self._channel)
        self._watch_stub = WatchStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "EtcdClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _key(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def _rel(self, raw: bytes) -> str:
        return raw.decode()[len(self.prefix) :]

    async def _call(self, what: str, aw: Awaitable):
        """The edge: every etcd call goes through here so failures read the same."""
        try:
            async with asyncio.timeout(self.timeout):
                return await aw
        except EtcdUnauthenticatedError as exc:
            raise errors.Unauthenticated(f"etcd {what}: {exc}") from exc
        except EtcdPermissionDeniedError as exc:
            raise errors.PermissionDenied(f"etcd {what}: {exc}") from exc
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # e.g. an expired lease
                raise errors.NotFound(f"etcd {what}: {exc.details()}") from exc
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                # "request is too large", "too many operations in txn request": retrying
                # cannot help, so this is not an outage.
                raise errors.InvalidArgument(f"etcd refused {what}: {exc.details()}") from exc
            raise errors.Unavailable(
                f"etcd unreachable at {','.join(self.endpoints)} ({what}): {_reason(exc)}"
            ) from exc
        except (EtcdError, TimeoutError, OSError) as exc:
            raise errors.Unavailable(
                f"etcd unreachable at {','.join(self.endpoints)} ({what}): {_reason(exc)}"
            ) from exc

    # -------------------------------------------------------------------- plain KV
    async def get(self, key: str) -> KeyValue | None:
        resp = await self._call(f"get {key}", self._kv.get(self._key(key)))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return KeyValue(key, kv.value, kv.mod_revision, kv.lease)

    async def list(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under `prefix` and the store revision the listing reflects."""
        start = self._key(prefix)
        resp = await self._call(
            f"list {prefix}", self._kv.get(start, range_end=prefix_range_end(start))
        )
        items = [
            KeyValue(self._rel(kv.key), kv.value, kv.mod_revision, kv.lease) for kv in resp.kvs
        ]
        return resp.header.revision, items

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        resp = await self._call(f"put {key}", self._kv.put(self._key(key), value, lease=lease))
        return resp.header.revision

    async def delete(self, key: str) -> bool:
        resp = await self._call(f"delete {key}", self._kv.delete(self._key(key)))
        return resp.deleted > 0

    async def _txn(self, what: str, compare: Compare, key: str, value: bytes, lease: int) -> bool:
        op = KVService.txn_op_put(self._key(key), value, lease=lease)
        resp = await self._call(what, self._kv.txn([compare], [op]))
        return resp.succeeded

    async def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        """Put only if the key does not exist (compare create_revision == 0)."""
        cmp = KVService.txn_compare_create_revision(self._key(key), 0)
        return await self._txn(f"create {key}", cmp, key, value, lease)

    async def replace(self, key: str, value: bytes, mod_revision: int, lease: int = 0) -> bool:
        """Put only if the key was last modified at `mod_revision` (optimistic CAS)."""
        cmp = Compare(
            result=Compare.EQUAL, target=Compare.MOD, key=self._key(key), mod_revision=mod_revision
        )
        return await self._txn(f"replace {key}", cmp, key, value, lease)

    async def claim(self, key: str, value: bytes, lease: int) -> bool:
        """Put `key` under `lease` only where it is absent or already attached to
        `lease`; False when another lease (or none) holds it. Never overwrites another
        holder's key (a process started twice with one id waits for the first)."""
        if await self.create(key, value, lease):
            return True
        return await self.put_if_lease(key, value, lease)

    async def put_if_lease(self, key: str, value: bytes, lease: int) -> bool:
        """Put only if the key exists and is attached to `lease` (we still own it)."""
        cmp = Compare(result=Compare.EQUAL, target=Compare.LEASE, key=self._key(key), lease=lease)
        return await self._txn(f"update {key}", cmp, key, value, lease)

    # ---------------------------------------------------------------------- leases
    async def grant(self, ttl: int) -> int:
        resp = await self._call("lease grant", self._lease.grant(ttl))
        return resp.ID

    async def keepalive(self, lease: int) -> int:
        """Refresh a lease once; returns the TTL left (0: the lease is gone)."""

        async def one():
            yield LeaseKeepAliveRequest(ID=lease)

        async def run() -> int:
            call = self._lease_stub.LeaseKeepAlive(one())
            try:
                async for resp in call:
                    return resp.TTL
                return 0
            finally:
                call.cancel()

        return await self._call("lease keepalive", run())

    async def revoke(self, lease: int) -> None:
        try:
            await self._call("lease revoke", self._lease.revoke(lease))
        except errors.NotFound:
            pass  # already expired

    async def revoke_every_lease(self) -> int:
        """Revoke every lease this etcd holds, and with them the keys attached (members'
        records: nodes/, routers/, engines/); returns how many. Whole-etcd: only for an
        etcd of one cluster's own, as `kvctl cluster up` keeps from its last run, whose
        members' leases etcd restored (and extended) at its restart."""
        resp = await self._call("lease list", self._lease.leases())
        for lease in resp.leases:
            await self.revoke(lease.ID)
        return len(resp.leases)

    # ----------------------------------------------------------------------- watch
    async def watch(
        self, prefix: str, start_revision: int
    ) -> AsyncIterator[builtins.list[WatchEvent]]:
        """Events under `prefix` from `start_revision` on, batch by batch. One stream:
        ends with Unavailable when etcd goes away, Compacted when history is gone."""
        key = self._key(prefix)
        create = WatchCreateRequest(
            key=key, range_end=prefix_range_end(key), start_revision=start_revision
        )

        # The request side stays open until the watch ends. grpc's task that reads it is
        # cancelled by call.cancel() only while the call runs: after etcd broke the call
        # it would wait here for good, and be destroyed pending at shutdown (with the
        # generator's traceback). Setting `ended` lets it finish.
        ended = asyncio.Event()

        async def requests():
            yield WatchRequest(create_request=create)
            await ended.wait()

        call = self._watch_stub.Watch(requests())
        try:
            async for resp in call:
                if resp.compact_revision:
                    raise Compacted(resp.compact_revision)
                if resp.canceled:
                    raise errors.Unavailable(
                        f"etcd cancelled the watch on {prefix}: "
                        f"{resp.cancel_reason or 'no reason given'}"
                    )
                if resp.created and resp.header.revision + 1 < start_revision:
                    # The store is behind where we were: etcd lost its data. Relist.
                    raise Compacted(resp.header.revision)
                if resp.events:
                    yield [
                        WatchEvent(
                            self._rel(ev.kv.key),
                            ev.kv.value,
                            ev.kv.mod_revision,
                            ev.type == ev.DELETE,
                        )
                        for ev in resp.events
                    ]
            raise errors.Unavailable(f"etcd closed the watch on {prefix}")
        except grpc.aio.AioRpcError as exc:
            raise errors.Unavailable(
                f"etcd watch on {prefix} at {','.join(self.endpoints)} broke: {_reason(exc)}"
            ) from exc
        finally:
            call.cancel()
            ended.set()

    async def follow(
        self,
        prefix: str,
        reset: Callable[[builtins.list[KeyValue]], None],
        apply: Callable[[builtins.list[WatchEvent]], None],
        retry_s: float = 0.5,
        max_retry_s: float = 3.0,
    ) -> None:
        """List `prefix`, hand the full state to `reset`, then hand every later change
        to `apply`, forever. Resumes from the next revision after an etcd outage and
        relists (calling `reset` again) after a compaction. Cancel the task to stop."""
        next_rev = 0
        delay = retry_s
        down = False
        while True:
            try:
                if not next_rev:
                    revision, items = await self.list(prefix)
                    reset(items)
                    next_rev = revision + 1
                async for batch in self.watch(prefix, next_rev):
                    if down:
                        log.info(
                            "etcd watch on %s%s resumed at revision %d",
                            self.prefix,
                            prefix,
                            next_rev,
                        )
                        down, delay = False, retry_s
                    apply(batch)
                    next_rev = batch[-1].mod_revision + 1
            except Compacted as exc:
                log.warning("etcd watch on %s%s: %s; relisting", self.prefix, prefix, exc)
                next_rev = 0
                continue
            except errors.Unavailable as exc:
                if not down:
                    log.warning("%s; retrying every %.1fs up to %.1fs", exc, retry_s, max_retry_s)
                down = True
            except Exception:  # a bug in a callback must not end the follow silently
                log.exception("following %s%s failed; relisting", self.prefix, prefix)
                next_rev = 0
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_retry_s)

    # --------------------------------------------------------------------- records
    async def register_node(self, record: NodeRecord, lease: int) -> bool:
        """Claim nodes/<id> under `lease`. False when another live lease holds it."""
        key = NODES + record.node_id
        if await self.create(key, record.to_json(), lease):
            return True
        current = await self.get(key)
        if current is not None and current.lease == lease:
            return await self.put_if_lease(key, record.to_json(), lease)
        return False

    async def update_node(self, record: NodeRecord, lease: int) -> bool:
        """Rewrite our record; False when the key is gone or owned by another lease."""
        return await self.put_if_lease(NODES + record.node_id, record.to_json(), lease)

    async def list_nodes(self) -> builtins.list[NodeRecord]:
        _, items = await self.list(NODES)
        out = []
        for kv in items:
            try:
                out.append(NodeRecord.from_json(kv.value))
            except (ValueError, TypeError) as exc:
                log.warning("ignoring malformed node record %s: %s", kv.key, exc)
        return out

    async def register_engine(self, record: EngineRecord, lease: int, key: bytes = b"") -> None:
        """Write engines/<id> under `lease` (the registrar owns its engine id), signed with
        `key` (engine_record_key; b"": unsigned, which routers with a key refuse unless
        their engine_record_unsigned is accept)."""
        await self.put(ENGINES + record.engine_id, record.to_json(key), lease)

    async def deregister_engine(self, engine_id: str) -> bool:
        return await self.delete(ENGINES + engine_id)

    async def list_engines(self) -> builtins.list[EngineRecord]:
        """Every engines/ record that decodes, UNVERIFIED (no signature is checked: for
        listings; the gateway and the router read through EngineRecordReader)."""
        _, items = await self.list(ENGINES)
        out = []
        for kv in items:
            try:
                out.append(EngineRecord.from_json(kv.value))
            except ValueError as exc:
                log.warning("ignoring malformed engine record %s: %s", kv.key, exc)
        return out

    async def put_namespace(
        self, tenant: str, ns_id: bytes, spec: dict, policy: dict | None = None
    ) -> int:
        """Create the namespace record if missing; returns its generation."""
        key = f"{NAMESPACES}{tenant}/{ns_id.hex()}"
        rec = {"spec": spec, "generation": 0, "policy": policy or {}}
        if await self.create(key, json.dumps(rec, sort_keys=True).encode()):
            return 0
        current = await self.get(key)
        return int(json.loads(current.value)["generation"]) if current else 0

    async def claim_namespace(
        self,
        ns_id: bytes,
        spec: dict,
        policy: dict,
        generation: int,
        seen_revision: int,
        limit: int = 0,
    ) -> "NamespaceClaim":
        """Make etcd hold the record of namespace `ns_id` (`spec`, `policy`: its JSON
        fields) at `generation` or above, in one
        transaction that also checks that
        - no flush of the spec's name committed after `seen_revision` (the caller's view
          of flushes/ was complete up to there): otherwise nothing is written and
          `flushed_at` says so; the caller must flush its own copy first;
        - creating the record keeps the tenant within `limit` records (0: no limit),
          counted and created atomically (ResourceExhausted when it is full);
        - an existing record below `generation` is raised to it (a namespace never moves
          backwards), one at or above it is left as it is and reported."""
        tenant, name = spec["tenant"], spec["name"]
        key = namespace_key(tenant, ns_id)
        # A flush by name or by namespace id (kvctl flush TENANT/<32 hex>).
        markers = [flush_marker_key(tenant, name), flush_marker_key(tenant, ns_id.hex())]
        counter = ns_count_key(tenant)
        for attempt in range(_CAS_ATTEMPTS):
            snap = await self._ns_snapshot(key, markers, tenant)
            if snap.flushed_at > seen_revision:
                return NamespaceClaim(0, False, snap.flushed_at, snap.count)
            compares = [
                Compare(
                    result=Compare.LESS,
                    target=Compare.MOD,
                    key=self._key(m),
                    mod_revision=seen_revision + 1,
                )
                for m in markers
            ]
            if snap.record is None:
                if limit and snap.count >= limit:
                    raise errors.ResourceExhausted(
                        f"tenant {tenant!r} already has {snap.count} namespaces; the limit "
                        f"is {limit} (max_namespaces_per_tenant)"
                    )
                # No record of the tenant created since we counted.
                compares += [
                    Compare(
                        result=Compare.EQUAL,
                        target=Compare.MOD,
                        key=self._key(counter),
                        mod_revision=snap.count_mod,
                    ),
                    KVService.txn_compare_create_revision(self._key(key), 0),
                ]
                rec = {"spec": spec, "generation": generation, "policy": policy}
            else:
                try:
                    rec = json.loads(snap.record.value)
                    current = int(rec["generation"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise errors.FailedPrecondition(
                        f"namespace record {key} in etcd is damaged: {exc}"
                    ) from None
                if current >= generation:
                    return NamespaceClaim(current, False, snap.flushed_at, snap.count)
                rec["generation"] = generation
                compares.append(
                    Compare(
                        result=Compare.EQUAL,
                        target=Compare.MOD,
                        key=self._key(key),
                        mod_revision=snap.record.mod_revision,
                    )
                )
            ops = [KVService.txn_op_put(self._key(key), json.dumps(rec, sort_keys=True).encode())]
            if snap.record is None:
                ops.append(
                    KVService.txn_op_put(
                        self._key(counter), json.dumps({"count": snap.count + 1}).encode()
                    )
                )
            resp = await self._call(f"claim {key}", self._kv.txn(compares, ops))
            if resp.succeeded:
                created = snap.record is None
                return NamespaceClaim(generation, created, snap.flushed_at, snap.count + created)
            await asyncio.sleep(random.uniform(0.0, 0.01 * (attempt + 1)))  # other claimers
        raise errors.Unavailable(
            f"namespace {key}: the tenant's records kept changing during "
            f"{_CAS_ATTEMPTS} attempts; retry"
        )

    async def _ns_snapshot(self, key: str, markers: Sequence[str], tenant: str) -> "_NsSnapshot":
        """The record, the newest flush marker revision and the tenant's record count,
        read at one revision (a transaction without compares)."""
        keys = [key, *markers, ns_count_key(tenant)]
        ops = [RequestOp(request_range=RangeRequest(key=self._key(k))) for k in keys]
        resp = await self._call(f"read {key}", self._kv.txn([], ops))
        rec, *marks, counter = (r.response_range for r in resp.responses)
        record = KeyValue(key, rec.kvs[0].value, rec.kvs[0].mod_revision) if rec.kvs else None
        flushed_at = max((m.kvs[0].mod_revision for m in marks if m.kvs), default=0)
        if counter.kvs:
            try:
                count = int(json.loads(counter.kvs[0].value)["count"])
            except (ValueError, KeyError, TypeError) as exc:
                raise errors.FailedPrecondition(
                    f"namespace counter of tenant {tenant!r} in etcd is damaged: {exc}"
                ) from None
            return _NsSnapshot(record, flushed_at, count, counter.kvs[0].mod_revision)
        # No counter yet (records written before it existed): start it from a count; the
        # claim creates it only if it is still absent.
        start = self._key(f"{NAMESPACES}{tenant}/")
        resp = await self._call(
            f"count {tenant}",
            self._kv.get(start, range_end=prefix_range_end(start), count_only=True),
        )
        return _NsSnapshot(record, flushed_at, resp.count, 0)

    async def list_namespaces(self, tenant: str = "") -> Sequence["NamespaceRecord"]:
        """Every namespace record (of one tenant when given), damaged ones skipped."""
        if "/" in tenant:
            raise errors.InvalidArgument(f"tenant name {tenant!r} contains '/'")
        _, items = await self.list(f"{NAMESPACES}{tenant}/" if tenant else NAMESPACES)
        out = []
        for kv in items:
            owner, _, ns_hex = kv.key[len(NAMESPACES) :].rpartition("/")
            try:
                rec = json.loads(kv.value)
                spec = rec["spec"]
                out.append(
                    NamespaceRecord(
                        owner,
                        ns_hex,
                        str(spec["name"]),
                        str(spec.get("model_name", "")),
                        int(rec["generation"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring malformed namespace record %s: %s", kv.key, exc)
        return out

    async def get_namespace(self, tenant: str, ns_id: bytes) -> dict | None:
        kv = await self.get(f"{NAMESPACES}{tenant}/{ns_id.hex()}")
        return json.loads(kv.value) if kv else None

    async def bump_generation(self, tenant: str, ns_id: bytes) -> int:
        """Atomically raise a namespace's generation by one (compare on mod revision, so
        two concurrent flushes give two distinct generations). Returns the new one."""
        key = f"{NAMESPACES}{tenant}/{ns_id.hex()}"
        for _ in range(_CAS_ATTEMPTS):
            kv = await self.get(key)
            if kv is None:
                raise errors.NotFound(f"namespace {tenant}/{ns_id.hex()} is not in etcd")
            rec = json.loads(kv.value)
            rec["generation"] = int(rec.get("generation", 0)) + 1
            if await self.replace(key, json.dumps(rec, sort_keys=True).encode(), kv.mod_revision):
                return rec["generation"]
        raise errors.Unavailable(
            f"namespace {tenant}/{ns_id.hex()}: generation kept changing "
            f"under {_CAS_ATTEMPTS} attempts; retry"
        )

    async def put_tenant(self, tenant: str, quotas: dict) -> None:
        if not tenant or "/" in tenant:
            raise errors.InvalidArgument(f"tenant name {tenant!r} is empty or contains '/'")
        await self.put(TENANTS + tenant, json.dumps(quotas, sort_keys=True).encode())

    async def get_tenant(self, tenant: str) -> dict | None:
        kv = await self.get(TENANTS + tenant)
        return json.loads(kv.value) if kv else None

    async def set_killswitch(self, enabled: bool, reason: str = "") -> None:
        if enabled:
            await self.put(KILLSWITCH, json.dumps({"enabled": True, "reason": reason}).encode())
        else:
            await self.delete(KILLSWITCH)

    async def get_killswitch(self) -> bool:
        kv = await self.get(KILLSWITCH)
        return killswitch_enabled(kv.value if kv else b"")
