"""Control plane on top of kvstore/coord/etcd.py: atomic namespace flush with acknowledgement,
the kill switch, per-tenant quotas and the audit log of admin actions.

Keys it adds under the EtcdClient prefix (see kvstore/coord/etcd.py for the others)::

    acks/<tenant>/<ns_id hex>/<member>   {"generation": G, "dropped": N}
    name-acks/<tenant>/<name>/<member>   {"revision": F, "flushed": K, "dropped": N}
    switch-acks/<member>                 {"enabled": bool, "revision": R}
    routers/<router_id>                  {"router_id": ..., "address": ...}  (router lease)
    audit/<ns since epoch, 20 digits>-<hex>   AuditRecord JSON

A member is a node id (agents, from nodes/) or `router:<router_id>` (from routers/).
A member writes its ack only after the new state is in force on it: an agent after its
store refuses the old generation and dropped the old blocks, a router after it refuses
routes for the old generation. So "every live member acknowledged" is the point after
which no hit on the old generation can happen anywhere.

A flush is by name: besides raising every record of the name it writes the name's flush
marker (flushes/<tenant>/<name>, kvstore/coord/etcd.py), and waits for every member's name ack
too. An agent writes that only after it flushed its own copies of the name that etcd has no
record of yet (opened while etcd was unreachable: node_agent/ns_registry.py), so a flush
that returns 0 also covers specs whose registration is still pending. Its transaction
compares the tenant's record counter (ns-counts/<tenant>, bumped by every creation)
against the listing it bumped, so a record created in between makes it list again instead
of missing that record.

Every admin write goes in one etcd transaction together with its audit record, so an
action and its record are never separated; the record is updated with the final result
(acknowledged or not) when the command finishes. The records and reports themselves:
kvstore/coord/admin_records.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace

from etcd3aio import prefix_range_end
from etcd3aio._protobuf import Compare
from etcd3aio.kv import KVService

from kvstore.coord.admin_records import (
    ACKS,
    AUDIT,
    NAME_ACKS,
    ROUTERS,
    SWITCH_ACKS,
    UNCONFIRMED,
    Ack,
    AckProgress,
    AuditRecord,
    CommittedUnconfirmed,
    FlushedNamespace,
    FlushReport,
    NameAck,
    Quota,
    SwitchAck,
    SwitchReport,
    default_operator,
    marker_name,
    router_member,
)
from kvstore.coord.etcd import (
    KILLSWITCH,
    NAMESPACES,
    NODES,
    TENANTS,
    EtcdClient,
    flush_marker_key,
    killswitch_enabled,
    ns_count_key,
)
from kvstore import errors
from kvstore.errors import clip
from kvstore.auth import RESERVED_TENANTS
from kvstore.namespace import tenant_name_problem

_CAS_ATTEMPTS = 16
_TXN_MAX_OPS = 100  # etcd's default --max-txn-ops is 128
_POLL_S = 0.1


def _switch_info(raw: bytes) -> dict | None:
    """The kill switch record `raw` when it says on (None: off or no record)."""
    if not killswitch_enabled(raw):
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        info = None
    return info if isinstance(info, dict) else {"raw": raw.decode(errors="replace")}


def _switch_result(
    state: AckProgress, changed: bool, before: dict | None, elapsed: float, timeout_s: float
) -> str:
    """The kill switch change's audit result."""
    done = f"{len(state.acked)}/{len(state.members)} members"
    if not changed:
        what = "already off: nothing changed in etcd"
        result = f"{what}; off on {done}" if state.done else f"{what}; still on at: "
    elif state.done:
        result = f"in force on {done} after {elapsed:.2f}s"
    else:
        result = f"set in etcd but not acknowledged within {timeout_s:g}s by: "
    if not state.done:
        result += ", ".join(state.missing)
    if before is not None:
        result += f" (was on already: {before.get('reason') or '-'}, by {before.get('by', '?')})"
    return result


def _unreadable_quota(tenant: str, exc: Exception) -> str:
    return (
        f"etcd key {TENANTS}{tenant} holds no readable quota ({clip(str(exc))}); the agents "
        f"ignore it: `kvctl quota clear {tenant}` removes it, `kvctl quota set {tenant}` "
        "replaces it"
    )


# ----------------------------------------------------------------- etcd primitives
async def txn(etcd: EtcdClient, what: str, compares: list[Compare], ops: list) -> tuple[bool, int]:
    """One etcd transaction over several keys (EtcdClient's own helpers take one key).
    Returns (succeeded, revision)."""
    resp = await txn_response(etcd, what, compares, ops)
    return resp.succeeded, resp.header.revision


async def txn_response(etcd: EtcdClient, what: str, compares: list, success: list, failure=()):
    """The etcd TxnResponse of one transaction. Once sent it is awaited to its answer even
    when the caller is cancelled meanwhile (kvctl's Ctrl-C), so the caller learns whether
    it took; the cancellation then takes effect at the caller's next await."""
    sent = asyncio.ensure_future(etcd._call(what, etcd._kv.txn(compares, success, failure)))
    try:
        return await asyncio.shield(sent)
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is None or sent.cancelled():
            raise
        me.uncancel()  # one pending cancellation: re-requested below, not doubled
        try:
            return await sent
        finally:
            me.cancel()


def put_op(etcd: EtcdClient, key: str, value: bytes, lease: int = 0):
    return KVService.txn_op_put(etcd._key(key), value, lease=lease)


def delete_op(etcd: EtcdClient, key: str):
    return KVService.txn_op_delete(etcd._key(key))


def mod_equals(etcd: EtcdClient, key: str, mod_revision: int) -> Compare:
    return Compare(
        result=Compare.EQUAL, target=Compare.MOD, key=etcd._key(key), mod_revision=mod_revision
    )


async def put_many(etcd: EtcdClient, items: list[tuple[str, bytes]]) -> None:
    """Unconditional puts, batched into transactions (one round trip per batch)."""
    for i in range(0, len(items), _TXN_MAX_OPS):
        batch = items[i : i + _TXN_MAX_OPS]
        await txn(etcd, f"put {len(batch)} keys", [], [put_op(etcd, k, v) for k, v in batch])


async def delete_prefix(etcd: EtcdClient, prefix: str) -> int:
    start = etcd._key(prefix)
    resp = await etcd._call(
        f"delete {prefix}", etcd._kv.delete(start, range_end=prefix_range_end(start))
    )
    return resp.deleted


def audit_key(at: float) -> str:
    return f"{AUDIT}{int(at * 1e9):020d}-{os.urandom(3).hex()}"


async def live_members(etcd: EtcdClient) -> list[str]:
    """Agents (nodes/) and routers (routers/) that hold a live lease right now."""
    _, nodes = await etcd.list(NODES)
    _, routers = await etcd.list(ROUTERS)
    return sorted(
        [kv.key[len(NODES) :] for kv in nodes]
        + [router_member(kv.key[len(ROUTERS) :]) for kv in routers]
    )


# -------------------------------------------------------------------- admin actions
class ControlPlane:
    """Admin actions for kvctl. Every method raises kvstore.errors.Unavailable when etcd
    cannot be reached, NotFound for unknown targets, InvalidArgument for bad input."""

    def __init__(self, etcd: EtcdClient, who: str | None = None) -> None:
        self.etcd = etcd
        self.who = who or default_operator()

    # ------------------------------------------------------------------- audit
    def _audit_op(
        self, key: str, action: str, target: str, ok: bool, result: str, params: dict, at: float
    ):
        rec = AuditRecord(at, self.who, action, target, ok, result, params)
        return put_op(self.etcd, key, rec.to_json())

    async def audit(
        self,
        action: str,
        target: str,
        ok: bool,
        result: str,
        params: dict | None = None,
        key: str | None = None,
    ) -> str:
        """Write (or, given `key`, rewrite) one audit record; returns its key."""
        at = time.time()
        key = key or audit_key(at)
        rec = AuditRecord(at, self.who, action, target, ok, result, params or {})
        await self.etcd.put(key, rec.to_json())
        return key

    async def audit_log(self, limit: int = 50) -> tuple[list[AuditRecord], list[str]]:
        """(the last `limit` audit records that read, oldest first (0: all), why each of
        the others among them does not): a damaged record does not end the listing, and
        is not passed over in silence either."""
        _, items = await self.etcd.list(AUDIT)
        out, bad = [], []
        for kv in items[-limit:] if limit else items:
            try:
                out.append(AuditRecord.parse(kv.value))
            except (ValueError, KeyError, TypeError) as exc:
                bad.append(
                    f"etcd key {kv.key} holds no readable audit record "
                    f"({clip(f'{type(exc).__name__}: {exc}')}): not shown"
                )
        return out, bad

    # ------------------------------------------------------------------- flush
    async def _matching(self, tenant: str, name: str):
        """(listing revision, matches) among the tenant's namespace records."""
        revision, items = await self.etcd.list(f"{NAMESPACES}{tenant}/")
        out = []
        for kv in items:
            ns_hex = kv.key.rsplit("/", 1)[-1]
            try:
                rec = json.loads(kv.value)
                spec_name = rec["spec"]["name"]
            except (ValueError, KeyError, TypeError):
                continue
            if spec_name == name or ns_hex == name.lower():
                out.append((kv, ns_hex, spec_name, rec))
        return revision, out

    async def flush_target_problem(self, tenant: str, name: str) -> str | None:
        """Why `tenant/name` names no registered namespace (None: it does), with the
        registered names it may have meant (case and spaces aside). Reads only."""
        if (await self._matching(tenant, name))[1]:
            return None
        want = name.strip().lower()
        near: set[str] = set()
        for t in {tenant, tenant.strip().lower()}:
            if not t or "/" in t:
                continue
            for r in await self.etcd.list_namespaces(t):
                if r.name.lower() == want or r.ns_hex == want:
                    near.add(f"{r.tenant}/{r.name}")
        hint = f" Did you mean {' or '.join(sorted(near))}?" if near else ""
        shown = clip(f"{tenant}/{name}", bare=True)
        return f"no namespace named {shown} is registered in etcd.{hint}"

    async def commit_flush(self, tenant: str, name: str) -> tuple[list[FlushedNamespace], int, str]:
        """Raise the generation of every namespace record `tenant/name` (every spec and
        revision under that name, or one namespace id) by one and write the name's flush
        marker, in one transaction that carries the audit record and compares each record
        and the tenant's record counter with the listing (so neither a concurrent flush nor
        a namespace registered meanwhile is missed). No record at all is not an error here:
        agents may hold the name unregistered (`flush` decides). Returns (flushed, revision,
        key)."""
        target = f"{tenant}/{name}"
        if not tenant or not name or "/" in tenant or "/" in name:
            raise errors.InvalidArgument(f"flush target must be TENANT/NAME, got {target!r}")
        for _ in range(_CAS_ATTEMPTS):
            listed, matches = await self._matching(tenant, name)
            # No record created since the listing (the tenant's counter, bumped by every
            # creation, is as old as it), none of ours changed (a concurrent flush).
            compares = [
                Compare(
                    result=Compare.LESS,
                    target=Compare.MOD,
                    key=self.etcd._key(ns_count_key(tenant)),
                    mod_revision=listed + 1,
                )
            ]
            flushed, ops = [], []
            for kv, ns_hex, spec_name, rec in matches:
                old = int(rec.get("generation", 0))
                rec["generation"] = old + 1
                flushed.append(FlushedNamespace(ns_hex, spec_name, old, old + 1))
                compares.append(mod_equals(self.etcd, kv.key, kv.mod_revision))
                ops.append(put_op(self.etcd, kv.key, json.dumps(rec, sort_keys=True).encode()))
            at = time.time()
            akey = audit_key(at)
            params = {"namespaces": [asdict(f) for f in flushed]}
            ops.append(
                put_op(
                    self.etcd,
                    flush_marker_key(tenant, marker_name(name)),
                    json.dumps({"by": self.who, "at": at}).encode(),
                )
            )
            ops.append(
                self._audit_op(
                    akey,
                    "flush",
                    target,
                    False,  # until kvctl saw every acknowledgement and rewrote it
                    UNCONFIRMED,
                    params,
                    at,
                )
            )
            ok, revision = await txn(self.etcd, f"flush {target}", compares, ops)
            if ok:
                return flushed, revision, akey
        raise errors.Unavailable(
            f"flush {target}: the namespace records kept changing "
            f"during {_CAS_ATTEMPTS} attempts; retry"
        )

    async def flush_progress(
        self, tenant: str, name: str, flushed: list[FlushedNamespace], revision: int
    ) -> AckProgress:
        """A member counts once it acknowledged every flushed record and the flush by
        name (its unregistered copies of the name are flushed too)."""
        members = await live_members(self.etcd)
        acks: dict[str, list[Ack]] = {}
        for f in flushed:
            _, items = await self.etcd.list(f"{ACKS}{tenant}/{f.ns_hex}/")
            for kv in items:
                try:
                    ack = Ack.parse(kv.value)
                except (ValueError, KeyError, TypeError):
                    continue
                if ack.generation >= f.new_generation:
                    acks.setdefault(kv.key.rsplit("/", 1)[-1], []).append(ack)
        by_name: dict[str, NameAck] = {}
        _, items = await self.etcd.list(f"{NAME_ACKS}{tenant}/{marker_name(name)}/")
        for kv in items:
            try:
                nack = NameAck.parse(kv.value)
            except (ValueError, KeyError, TypeError):
                continue
            if nack.revision >= revision:
                by_name[kv.key.rsplit("/", 1)[-1]] = nack
        acked = [m for m in members if len(acks.get(m, ())) == len(flushed) and m in by_name]
        dropped = sum(a.dropped for m in acked for a in acks.get(m, ()))
        dropped += sum(by_name[m].dropped for m in acked)
        return AckProgress(
            tuple(members),
            tuple(acked),
            tuple(m for m in members if m not in acked),
            dropped,
            sum(by_name[m].flushed for m in acked),
        )

    async def flush(
        self,
        tenant: str,
        name: str,
        timeout_s: float = 30.0,
        progress: Callable[[AckProgress], None] | None = None,
        on_commit: Callable[[list[FlushedNamespace], int], None] | None = None,
    ) -> FlushReport:
        """Commit the flush, then wait (at most `timeout_s`) until every live agent and
        router acknowledged the new generations and the flush by name. Members that leave
        meanwhile (lease gone) stop counting; members that join catch up before they
        serve. NotFound when no record and no member's unregistered copy had the name."""
        t0 = time.monotonic()
        target = f"{tenant}/{name}"
        try:
            flushed, revision, akey = await self.commit_flush(tenant, name)
        except errors.InvalidArgument as exc:
            await self.audit("flush", target, False, str(exc))
            raise
        if on_commit is not None:
            on_commit(flushed, revision)
        state = await self._wait_committed(
            "flush",
            target,
            akey,
            revision,
            {"namespaces": [asdict(f) for f in flushed], "revision": revision},
            lambda: self.flush_progress(tenant, name, flushed, revision),
            t0 + timeout_s,
            progress,
        )
        elapsed = time.monotonic() - t0
        if not flushed and state.done and not state.unregistered:
            msg = (
                f"no namespace named {target} in etcd (an agent creates the record when "
                "a client opens it), nor unregistered on any agent. The flush by name "
                f"stays recorded (flushes/{target}, etcd revision {revision}) with its "
                "audit record: copies of the name an agent opened while etcd was out of "
                "reach are flushed when they register"
            )
            await self.audit("flush", target, False, msg, key=akey)
            raise errors.NotFound(msg)
        gens = (
            ", ".join(f"{f.ns_hex[:12]} {f.old_generation}->{f.new_generation}" for f in flushed)
            or "no etcd record"
        )
        extra = f"; {state.unregistered} unregistered on agents" if state.unregistered else ""
        result = (
            f"acknowledged by {len(state.acked)}/{len(state.members)} members in "
            f"{elapsed:.2f}s; {state.dropped} blocks dropped ({gens}{extra})"
            if state.done
            else f"generation committed ({gens}) but not acknowledged within {timeout_s:g}s "
            f"by: {', '.join(state.missing)}"
        )
        params = {
            "namespaces": [asdict(f) for f in flushed],
            "revision": revision,
            "acked": list(state.acked),
            "missing": list(state.missing),
            "left": list(state.left),
            "unregistered": state.unregistered,
        }
        await self.audit("flush", target, state.done, result, params, key=akey)
        return FlushReport(tenant, name, tuple(flushed), revision, state, elapsed, akey)

    async def _wait_committed(
        self, action, target, akey, revision, params, poll, deadline, progress
    ) -> AckProgress:
        """`_wait` after a commit: etcd failing now raises CommittedUnconfirmed (the change
        is in force; its audit record is rewritten to say so if etcd answers once more)."""
        seen: list[AckProgress] = []

        def track(p: AckProgress) -> None:
            seen.append(p)
            if progress is not None:
                progress(p)

        try:
            return await self._wait(poll, deadline, track)
        except errors.Unavailable as exc:
            last = seen[-1] if seen else None
            acked = f"{len(last.acked)}/{len(last.members)}" if last else "none"
            result = (
                f"committed at etcd revision {revision}; acknowledgements unconfirmed: etcd "
                f"became unreachable while waiting ({acked} acknowledged when last read)"
            )
            try:
                await self.audit(action, target, False, result, params, key=akey)
            except errors.Unavailable:
                pass  # the record committed with the change already says unconfirmed
            raise CommittedUnconfirmed(f"{result}: {exc}", revision, last) from exc

    async def _wait(self, poll, deadline: float, progress) -> AckProgress:
        """Poll until done or the deadline. Polling (not a watch) because both the acks
        and the membership change, and one listing of each answers the question."""
        last = None
        seen: set[str] = set()
        acked: set[str] = set()
        while True:
            state = await poll()
            acked.update(state.acked)
            gone = seen - set(state.members) - acked
            seen.update(state.members)
            if gone or (last is not None and last.left):
                left = tuple(sorted(gone | set(last.left if last is not None else ())))
                state = replace(state, left=tuple(m for m in left if m not in state.members))
            if progress is not None and state != last:
                progress(state)
            last = state
            if state.done or time.monotonic() >= deadline:
                return state
            await asyncio.sleep(_POLL_S)

    # -------------------------------------------------------------- kill switch
    async def set_killswitch(
        self,
        enabled: bool,
        reason: str = "",
        timeout_s: float = 30.0,
        progress: Callable[[AckProgress], None] | None = None,
        on_commit: Callable[[int], None] | None = None,
    ) -> SwitchReport:
        """Turn the switch on (a put: every member sees it and acknowledges, also when it
        was on already: its reason is replaced) or off (a delete, only of a key that is
        there: deleting an absent key makes no watch event, so nothing would be
        acknowledged). `off` when off writes nothing to etcd until its wait is over (only
        for members whose last acknowledgement says on: one that missed the change), so
        Ctrl-C or etcd lost in that wait leaves no record of a change that was not made;
        its audit record is written after the wait."""
        t0 = time.monotonic()
        at = time.time()
        akey = audit_key(at)
        target = "on" if enabled else "off"
        params: dict = {"reason": reason}
        pending = self._audit_op(akey, "killswitch", target, False, UNCONFIRMED, params, at)
        if enabled:
            revision, before = await self._switch_on(reason, at, pending)
            changed = True
        else:
            revision, changed = await self._switch_off(pending)
            before = None
        if before is not None:
            params["was_on"] = before
        if changed and on_commit is not None:
            on_commit(revision)
        state = await self._switch_wait(
            enabled, changed, akey, revision, params, t0 + timeout_s, progress
        )
        elapsed = time.monotonic() - t0
        await self.audit(
            "killswitch",
            target,
            state.done,
            _switch_result(state, changed, before, elapsed, timeout_s),
            {**params, "revision": revision, "missing": list(state.missing)},
            key=akey,
        )
        return SwitchReport(enabled, reason, revision, state, elapsed, changed, before)

    async def _switch_wait(
        self, enabled, changed, akey, revision, params, deadline, progress
    ) -> AckProgress:
        """Wait for the members' acknowledgements of a change (`_wait_committed`), or,
        nothing changed, for those whose last one says on: a plain wait (nothing was
        written, so etcd lost in it is Unavailable: no change)."""
        if not changed:
            return await self._wait(lambda: self.switch_progress(False, 0), deadline, progress)
        return await self._wait_committed(
            "killswitch",
            "on" if enabled else "off",
            akey,
            revision,
            {**params, "revision": revision},
            lambda: self.switch_progress(enabled, revision),
            deadline,
            progress,
        )

    async def _switch_on(self, reason: str, at: float, audit_op) -> tuple[int, dict | None]:
        """Put the switch on with its audit record, in one transaction; returns the
        revision and the record it replaced when it was on already."""
        value = {"enabled": True, "reason": reason, "by": self.who, "at": at}
        key = self.etcd._key(KILLSWITCH)
        put = KVService.txn_op_put(key, json.dumps(value).encode(), prev_kv=True)
        resp = await txn_response(self.etcd, "kill switch on", [], [put, audit_op])
        prev = resp.responses[0].response_put.prev_kv
        return resp.header.revision, _switch_info(prev.value) if prev.key else None

    async def _switch_off(self, audit_op) -> tuple[int, bool]:
        """Delete the switch with its audit record, in one transaction, if it is there;
        returns the revision and whether it was (nothing is written when not)."""
        key = self.etcd._key(KILLSWITCH)
        exists = KVService.txn_compare_create_revision(key, 0, result=Compare.GREATER)
        resp = await txn_response(
            self.etcd, "kill switch off", [exists], [delete_op(self.etcd, KILLSWITCH), audit_op]
        )
        return resp.header.revision, resp.succeeded

    async def switch_progress(self, enabled: bool, revision: int) -> AckProgress:
        members = await live_members(self.etcd)
        _, items = await self.etcd.list(SWITCH_ACKS)
        good = set()
        for kv in items:
            try:
                ack = SwitchAck.parse(kv.value)
            except (ValueError, KeyError, TypeError):
                continue
            if ack.enabled == enabled and ack.revision >= revision:
                good.add(kv.key[len(SWITCH_ACKS) :])
        acked = tuple(m for m in members if m in good)
        return AckProgress(tuple(members), acked, tuple(m for m in members if m not in good))

    async def killswitch(self) -> tuple[bool, dict]:
        kv = await self.etcd.get(KILLSWITCH)
        if kv is None:
            return False, {}
        try:
            info = json.loads(kv.value)
        except ValueError:
            info = {"raw": kv.value.decode(errors="replace")}
        return killswitch_enabled(kv.value), info if isinstance(info, dict) else {}

    # ------------------------------------------------------------------- quotas
    async def set_quota(self, tenant: str, quota: Quota) -> Quota:
        """Merge `quota` into the tenant's record (unset fields keep their value)."""
        if problem := tenant_name_problem(tenant):
            raise errors.InvalidArgument(f"tenant name {tenant!r} {problem}")
        if tenant in RESERVED_TENANTS:  # they hold no blocks: a limit would mean nothing
            raise errors.InvalidArgument(f"{tenant!r} is a reserved identity, not a tenant")
        key = TENANTS + tenant
        for _ in range(_CAS_ATTEMPTS):
            kv = await self.etcd.get(key)
            current = Quota()
            if kv is not None:
                try:
                    current = Quota.parse(kv.value)
                except (ValueError, TypeError):
                    pass  # a damaged record is replaced
            new = current.merged(quota)
            at = time.time()
            cmp = (
                mod_equals(self.etcd, key, kv.mod_revision)
                if kv is not None
                else KVService.txn_compare_create_revision(self.etcd._key(key), 0)
            )
            ok, _ = await txn(
                self.etcd,
                f"quota set {tenant}",
                [cmp],
                [
                    put_op(self.etcd, key, new.to_json()),
                    self._audit_op(
                        audit_key(at),
                        "quota-set",
                        tenant,
                        True,
                        new.describe(),
                        json.loads(new.to_json()),
                        at,
                    ),
                ],
            )
            if ok:
                return new
        raise errors.Unavailable(f"quota {tenant}: the record kept changing; retry")

    async def clear_quota(self, tenant: str) -> bool:
        at = time.time()
        ok, _ = await txn(
            self.etcd,
            f"quota clear {tenant}",
            [
                KVService.txn_compare_create_revision(
                    self.etcd._key(TENANTS + tenant), 0, result=Compare.GREATER
                )
            ],
            [
                delete_op(self.etcd, TENANTS + tenant),
                self._audit_op(
                    audit_key(at),
                    "quota-clear",
                    tenant,
                    True,
                    "removed; agents use their configured limits",
                    {},
                    at,
                ),
            ],
        )
        return ok

    async def get_quota(self, tenant: str) -> Quota | None:
        """The tenant's quota; DataLoss naming the key when its record does not read
        (written by hand or by another tool: the agents ignore it too)."""
        kv = await self.etcd.get(TENANTS + tenant)
        if kv is None:
            return None
        try:
            return Quota.parse(kv.value)
        except (ValueError, TypeError) as exc:
            raise errors.DataLoss(_unreadable_quota(tenant, exc)) from None

    async def list_quotas(self) -> tuple[dict[str, Quota], dict[str, str]]:
        """(every tenant's quota that reads, {tenant: why} for the records that do not)."""
        _, items = await self.etcd.list(TENANTS)
        out, bad = {}, {}
        for kv in items:
            tenant = kv.key[len(TENANTS) :]
            try:
                out[tenant] = Quota.parse(kv.value)
            except (ValueError, TypeError) as exc:
                bad[tenant] = _unreadable_quota(tenant, exc)
        return out, bad
