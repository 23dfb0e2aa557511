"""Recovery from RocksDB, TTL expiry, persisting the pool at shutdown, snapshots, and the
control-plane hooks (kill switch, tenant quotas) of the block store (mixed into BlockStore).
"""

from __future__ import annotations

import json
import time

from kvstore.errors import DataLoss
from kvstore.events import Tier
from kvstore.namespace import Namespace
from kvstore.payload import BlockHeader, decode_block, decode_header
from kvstore.store_types import ID_BYTES, NS_META_PREFIX, BlockMeta, LookupResult, NsState


class MaintenanceMixin:
    # ---------------------------------------------------------------- maintenance
    def recover(self, verify: bool = True) -> dict[str, int]:
        """Rebuild the index from RocksDB after a restart. Blocks whose header or payload
        checksum fails, of an old generation, or whose parent did not survive are deleted.
        Raises TierCorrupt, with the store unchanged, when RocksDB cannot read a record:
        an iterator stops at the first one it cannot read, and what lies beyond it would
        otherwise stay on disk, neither indexed nor dropped (the caller quarantines)."""
        if self.rocks is None:
            return {"recovered": 0, "dropped": 0}
        with self.lock:
            ns = self._recovered_namespaces()
            found, bad = [], []
            for key, raw in self.rocks.scan():
                hdr = self._check_record(ns, key, raw, verify)
                if hdr is None:
                    bad.append(key)
                else:
                    found.append((key, hdr))
            self._ns.update(ns)  # the scan went through: from here on nothing raises
            now = self.clock()
            recovered = 0
            found.sort(key=lambda kh: kh[1].depth)
            for key, hdr in found:
                st = self._ns[hdr.namespace_id]
                parent = st.blocks.get(hdr.parent_id)
                if hdr.depth and parent is None:
                    bad.append(key)
                    continue
                m = BlockMeta(
                    st,
                    hdr.block_id,
                    hdr.parent_id,
                    hdr.depth,
                    hdr.length,
                    hdr.checksum,
                    on_nvme=True,
                    last_access=now,
                    expires_at=now + st.policy.ttl_seconds if st.policy.ttl_seconds else 0,
                )
                st.blocks[m.block_id] = m
                if parent is not None:
                    parent.children += 1
                self.nvme_used += m.nbytes
                self.accounts.add(st.tenant, Tier.NVME, m.nbytes)
                recovered += 1
            for st in self._ns.values():
                for m in st.blocks.values():
                    self._refile(m)
            if bad:
                self.rocks.delete_batch(bad)
            self.counters["recovered_blocks"] += recovered
            self.counters["recovery_dropped"] += len(bad)
            return {"recovered": self.block_count(), "dropped": len(bad)}

    def _recovered_namespaces(self) -> dict[bytes, NsState]:
        """Namespace records from the meta column family (a damaged one is skipped: its
        blocks are then dropped as of an unknown namespace)."""
        out: dict[bytes, NsState] = {}
        for key, value in self.rocks.meta_items():
            if not key.startswith(NS_META_PREFIX):
                continue
            try:
                rec = json.loads(value)
                spec = Namespace.from_dict(rec["spec"])
                generation = int(rec["generation"])
            except (ValueError, KeyError, TypeError):  # InvalidArgument too: a spec no
                self.counters["recovery_bad_namespaces"] += 1  # longer valid (e.g. oversized)
                continue
            out[spec.namespace_id] = NsState(
                spec, spec.namespace_id, generation, self.policy_for(spec)
            )
        return out

    def _check_record(
        self, ns: dict[bytes, NsState], key: bytes, raw: bytes, verify: bool
    ) -> BlockHeader | None:
        try:
            hdr = decode_block(raw)[0] if verify else decode_header(raw)[0]
        except DataLoss:
            return None
        st = ns.get(key[:ID_BYTES])
        if (
            st is None
            or hdr.namespace_id != st.ns_id
            or hdr.block_id != key[ID_BYTES:]
            or hdr.generation != st.generation
            or hdr.length != st.spec.block_bytes
        ):
            return None
        return hdr

    def expire(self) -> int:
        """Drop blocks whose TTL ran out (with their descendants)."""
        now = self.clock()
        total = 0
        with self.lock:
            for st in self._ns.values():
                if not st.policy.ttl_seconds:
                    continue
                dead = {
                    b
                    for b, m in st.blocks.items()
                    if m.expires_at and m.expires_at <= now and not m.readers
                }
                if dead:
                    total += self._remove_subtrees(st, dead, "expired")
        return total

    def persist_pool(self, deadline_s: float | None = None) -> int:
        """Copy pool-only blocks of persistent namespaces to NVMe, parents first, before a
        clean shutdown. The pool does not survive a restart, and NVMe mostly holds chain
        tails whose heads live in the pool: without their heads, recover() would drop them
        all as orphans. NVMe-only leaves may be evicted to make room for heads; blocks
        written here are held (readers) so they are not evicted in turn. Stops at the
        deadline. Returns the number of blocks written."""
        if self.rocks is None:
            return 0
        end = None if deadline_s is None else time.monotonic() + deadline_s
        held: list[BlockMeta] = []
        with self.lock:
            todo = sorted(
                (
                    m
                    for st in self._ns.values()
                    if st.policy.persist
                    for m in st.blocks.values()
                    if m.slot >= 0 and not m.on_nvme
                ),
                key=lambda m: m.depth,
            )
            try:
                for m in todo:
                    if end is not None and time.monotonic() > end:
                        break
                    if m.ns.blocks.get(m.block_id) is m and self._write_nvme(m):
                        m.readers += 1
                        held.append(m)
            finally:
                for m in held:
                    self._done_reading(m)
            self.counters["persisted_at_shutdown"] += len(held)
            return len(held)

    def snapshot(self) -> tuple[int, list[tuple[bytes, list[tuple[bytes, Tier]]]]]:
        """Every block held, per namespace, and the last event sequence it includes."""
        with self.lock:
            out = [
                (
                    st.ns_id,
                    [
                        (m.block_id, m.tier)
                        for m in sorted(st.blocks.values(), key=lambda b: b.depth)
                    ],
                )
                for st in self._ns.values()
            ]
            return self.events.last_seq, out

    def block_count(self) -> int:
        return sum(len(st.blocks) for st in self._ns.values())

    # ------------------------------------------------ control plane (node_agent/control.py)
    def _killed_lookup(self, st: NsState, n: int) -> LookupResult:
        """Kill switch on: a miss, counted as one so hit rates show what callers saw."""
        self.counters["lookups"] += 1
        self.counters["lookup_blocks"] += n
        self.counters["killswitch_lookups"] += 1
        return LookupResult(0, 0, 0, st.generation)

    def set_tenant_limits(self, tenant: str, hbm: int | None, nvme: int | None) -> int:
        """Apply a tenant's quota (None or 0: no limit) and evict the tenant's own blocks
        until it fits: leaves first, by value, never another tenant's. Returns the number
        of evictions (demotions count: the block stays on NVMe)."""
        with self.lock:
            self.accounts.set_limit(tenant, Tier.HBM, hbm)
            self.accounts.set_limit(tenant, Tier.NVME, nvme)
            done = 0
            while self.accounts.overflow(tenant, Tier.HBM, 0):
                victim = self._victim(Tier.HBM, tenant)
                if victim is None:
                    break
                if not self._evict_hbm(victim, "quota"):
                    self._refile(victim)  # popped from the heap: put it back
                    break
                done += 1
            while self.rocks is not None and self.accounts.overflow(tenant, Tier.NVME, 0):
                victim = self._victim(Tier.NVME, tenant)
                if victim is None:
                    break
                self._evict_nvme(victim, quota=True)
                done += 1
            return done
