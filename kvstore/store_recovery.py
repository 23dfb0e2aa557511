"""What of the store outlives the process: rebuilding the index from RocksDB after a
restart, and copying the pool's chain heads to NVMe before a clean shutdown. The pool
itself does not survive a restart."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import DataLoss
from kvstore.namespace import Namespace
from kvstore.payload import BlockHeader, decode_block, decode_header
from kvstore.policy import NamespacePolicy
from kvstore.store_eviction import EvictionQueue
from kvstore.store_residency import Residency
from kvstore.store_types import ID_BYTES, NS_META_PREFIX, BlockMeta, NsState
from kvstore.tiers.rocks import RocksTier


@dataclass(frozen=True, slots=True)
class FoundRecord:
    """A block record that passed its checks, waiting for its parent's verdict."""

    key: bytes
    header: BlockHeader


class Persistence:
    def __init__(
        self,
        rocks: RocksTier | None,
        residency: Residency,
        queue: EvictionQueue,
        lock: threading.RLock,
        counters: Counter[str],
        policy_for: Callable[[Namespace], NamespacePolicy],
        clock: Callable[[], float],
    ) -> None:
        self.rocks = rocks
        self.residency = residency
        self.queue = queue
        self.lock = lock
        self.counters = counters
        self.policy_for = policy_for
        self.clock = clock

    def recover(self, table: dict[bytes, NsState], verify: bool = True) -> dict[str, int]:
        """Rebuild `table` (the store's namespaces) and their blocks from RocksDB after a
        restart. Blocks whose header or payload checksum fails, of an old generation, or
        whose parent did not survive are deleted. Raises TierCorrupt, with the store
        unchanged, when RocksDB cannot read a record: an iterator stops at the first one
        it cannot read, and what lies beyond it would otherwise stay on disk, neither
        indexed nor dropped (the caller quarantines)."""
        rocks = self.rocks
        if rocks is None:
            return {"recovered": 0, "dropped": 0}
        with self.lock:
            ns = self._recovered_namespaces(rocks)
            found: list[FoundRecord] = []
            bad: list[bytes] = []

            def tenant_of(key: bytes) -> str | None:  # opens sealed records (encryption)
                st = ns.get(key[:ID_BYTES])
                return None if st is None else st.tenant

            for key, raw in rocks.scan(tenant_of):
                hdr = self._check_record(ns, key, raw, verify)
                if hdr is None:
                    bad.append(key)
                else:
                    found.append(FoundRecord(key, hdr))
            table.update(ns)  # the scan went through: from here on nothing raises
            recovered = self._index(table, found, bad)
            for st in table.values():
                for m in st.blocks.values():
                    self.queue.refile(m)
            if bad:
                rocks.delete_batch(bad)
            self.counters["recovered_blocks"] += recovered
            self.counters["recovery_dropped"] += len(bad)
            held = sum(len(st.blocks) for st in table.values())
            return {"recovered": held, "dropped": len(bad)}

    def _index(
        self, table: dict[bytes, NsState], found: list[FoundRecord], bad: list[bytes]
    ) -> int:
        """Index the found records parents first; one whose parent is gone joins `bad`."""
        now = self.clock()
        recovered = 0
        found.sort(key=lambda f: f.header.depth)
        for f in found:
            hdr = f.header
            st = table[hdr.namespace_id]
            parent = st.blocks.get(hdr.parent_id)
            if hdr.depth and parent is None:
                bad.append(f.key)
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
            self.residency.recovered(m)
            recovered += 1
        return recovered

    def _recovered_namespaces(self, rocks: RocksTier) -> dict[bytes, NsState]:
        """Namespace records from the meta column family (a damaged one is skipped: its
        blocks are then dropped as of an unknown namespace)."""
        out: dict[bytes, NsState] = {}
        for key, value in rocks.meta_items():
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

    @staticmethod
    def _check_record(
        ns: dict[bytes, NsState], key: bytes, raw: bytes, verify: bool
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

    def persist_pool(self, table: dict[bytes, NsState], deadline_s: float | None = None) -> int:
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
                    for st in table.values()
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
                    if m.ns.blocks.get(m.block_id) is m and self.residency.write_nvme(m):
                        m.readers += 1
                        held.append(m)
            finally:
                for m in held:
                    self.residency.done_reading(m)
            self.counters["persisted_at_shutdown"] += len(held)
            return len(held)
