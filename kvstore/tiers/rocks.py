"""NVMe tier on RocksDB (rocksdict, raw mode): the one storage adapter in the core.

Column family `blocks`: key = namespace id (16) + block id (16), value = encoded block
(header + payload, see kvstore.payload). Column family `meta`: small records the store
needs to recover (namespace specs, generations). The WAL is off and compression is off
(KV payloads do not compress). What a crash can lose is bounded instead:
- `meta` is flushed on every write (namespace opens and flushes are rare);
- `blocks` memtables are `flush_bytes / 2` each and RocksDB keeps at most two unflushed
  (one filling, one being written; writes wait for the second), so at most `flush_bytes`
  of block records are only in memory;
- `flush()`, called by the agent every `nvme_flush_interval_s`, writes out the rest.

Failures are translated at this edge: a write RocksDB refuses (disk full, I/O error, or
read-only after a background error) raises TierUnavailable and starts a back-off during
which writes are refused without touching RocksDB (see WriteHealth); files RocksDB cannot
read raise TierCorrupt, at open or when a scan meets a damaged record.

With a Sealer (encryption at rest, kvstore.tiers.sealing) every block record is sealed
under its tenant's active key on the way in and opened on the way out; a record that does
not open is a miss (get: None; scan: an empty record, which the store drops), counted per
cause and logged once per cause. Such a tier never writes a plaintext record.
"""

from __future__ import annotations

import errno
import gc
import glob
import logging
import fcntl
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rocksdict import DBCompressionType, Options, Rdict, WriteBatch, WriteOptions

from kvstore.errors import DataLoss, Unavailable
from kvstore.tiers.sealing import Failure, OpenFailed, Sealer

log = logging.getLogger("kvstore.nvme")

DEFAULT_FLUSH_BYTES = 64 << 20
MIN_FLUSH_BYTES = 1 << 20  # two RocksDB memtables of at least 512 KiB
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
SMALL_MEMTABLE = 64 << 10  # the default and meta families (RocksDB's minimum)
QUARANTINES_KEPT = 2  # the newest quarantined copies kept on disk (older ones deleted)
PROBE_KEY = b"kvstore-write-probe"  # default family: never read, one record overwritten
QUARANTINE_PREFIX = "quarantine-"  # inside a data_dir that cannot be renamed (a mount)


class TierUnavailable(Unavailable):
    """The NVMe tier cannot write now (disk full, I/O error, backing off after one)."""


class TierRefused(TierUnavailable):
    """This record may not be written here (encryption on, and its tenant has no key):
    the tier itself is fine, so no outage starts."""


class TierCorrupt(DataLoss):
    """RocksDB's files cannot be read (damaged or missing SST, MANIFEST, CURRENT)."""


class TierInUse(Unavailable):
    """Another process holds the directory's RocksDB LOCK: its files are fine, and not
    ours to open (nor to move aside)."""


@dataclass(slots=True)
class WriteHealth:
    """Whether the tier takes writes. One failure opens an outage, logged and counted
    once; during it writes are refused until `retry_at` (backing off 1 s, 2 s, ... 30 s),
    and the first write that succeeds closes it (a spill, or RocksTier.probe when no
    spill comes). RocksDB itself, after a background ENOSPC (a failed flush), refuses
    every write until its SstFileManager sees `resume_free_bytes` free again (the largest
    memtable: RocksDB's reserved disk buffer) and resumes the DB; the retries here find
    out when that happened. Spills and probes run on different threads: `_lock`."""

    clock: Callable[[], float]
    resume_free_bytes: int = 0  # free space RocksDB wants before it resumes writes
    down_since: float | None = None
    retry_at: float = 0.0
    backoff_s: float = 0.0
    last_error: str = ""
    outages: int = 0  # times writes started failing
    recoveries: int = 0  # times they worked again
    refused: int = 0  # writes refused during outages (attempted or backed off)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def writable(self) -> bool:
        return self.down_since is None

    def may_try(self) -> bool:
        if self.down_since is None or self.clock() >= self.retry_at:
            return True
        self.refused += 1
        return False

    def due(self) -> bool:
        """Whether an outage's back-off is over (a probe may try), counting nothing."""
        return self.down_since is not None and self.clock() >= self.retry_at

    def failed(self, path: str, err: str, refused: bool = True) -> None:
        """A write (or, `refused` False, a probe) that RocksDB refused."""
        with self._lock:
            now = self.clock()
            self.refused += refused
            self.last_error = err
            if self.down_since is None:
                self.down_since = now
                self.outages += 1
                self.backoff_s = BACKOFF_FIRST_S
                log.warning(
                    "NVMe tier %s cannot write (%s): spills drop leaf blocks or keep "
                    "them in the pool until it can; retrying with back-off%s",
                    path,
                    err,
                    self._resumes(),
                )
            else:
                self.backoff_s = min(BACKOFF_MAX_S, 2 * self.backoff_s)
            self.retry_at = now + self.backoff_s

    def succeeded(self, path: str) -> None:
        with self._lock:
            if self.down_since is None:
                return
            log.warning(
                "NVMe tier %s writes again after %.1f s (%d writes refused so far)",
                path,
                self.clock() - self.down_since,
                self.refused,
            )
            self.down_since = None
            self.recoveries += 1
            self.backoff_s = 0.0

    def _resumes(self) -> str:
        if not self.resume_free_bytes:
            return ""
        return f"; resumes by itself once about {self.resume_free_bytes >> 10} KiB are free"

    def condition(self) -> str:
        """'' while writable, else why not (for Stats and `kvctl nodes`)."""
        down_since = self.down_since
        if down_since is None:
            return ""
        return (
            f"writes failing since {self.clock() - down_since:.0f}s: {self.last_error}"
            + self._resumes()
        )


@dataclass(frozen=True, slots=True)
class Quarantine:
    moved_to: str
    reason: str


def _options(write_buffer_bytes: int = SMALL_MEMTABLE) -> Options:
    o = Options(raw_mode=True)
    o.create_if_missing(True)
    o.create_missing_column_families(True)
    o.set_compression_type(DBCompressionType.none())
    # Also what RocksDB's SstFileManager wants free before it resumes writes after a
    # background ENOSPC: the default 64 MiB of the (unused) default family would hold
    # a nearly full disk read-only long after space came back.
    o.set_write_buffer_size(write_buffer_bytes)
    o.set_max_write_buffer_number(2)
    return o


def lock_held_elsewhere(path: str) -> bool:
    """Whether another process holds the RocksDB LOCK of directory `path` (RocksDB takes
    a POSIX record lock on it while the DB is open). Asked before opening: RocksDB's own
    refusal comes after it has rotated the info LOG and rocksdict has rewritten its
    config file, under the other process's feet. Never for a directory this process has
    open: closing a descriptor of the file drops all of this process's locks on it."""
    try:
        fd = os.open(os.path.join(path, "LOCK"), os.O_RDWR)
    except OSError:  # none yet, or not ours to open: RocksDB says what is wrong
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # EAGAIN / EACCES: held
        return True
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _open_error(path: str, exc: Exception) -> Exception:
    msg = str(exc)
    if "No space left" in msg:
        return TierUnavailable(f"RocksDB at {path} cannot open: {msg}")
    if "While lock file" in msg:  # flock(LOCK) refused: a live process has it open
        return TierInUse(f"RocksDB at {path} is open in another process ({msg})")
    return TierCorrupt(f"RocksDB at {path} is unreadable: {msg}")


class RocksTier:
    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        flush_bytes: int = DEFAULT_FLUSH_BYTES,
        clock: Callable[[], float] = time.monotonic,
        sealer: Sealer | None = None,
    ) -> None:
        self.path = path
        self.sealer = sealer  # None: records are stored as they come (no encryption)
        self.open_failures: Counter[Failure] = Counter()
        self.seal_refused = 0  # spills refused: encryption on and the tenant has no key
        self._told: set[object] = set()  # causes (and keyless tenants) logged once
        self.capacity_bytes = capacity_bytes
        self.flushes = 0
        self.stalls = 0  # writes refused while a flush catches up (not an outage)
        self._memtable_bytes = max(flush_bytes // 2, SMALL_MEMTABLE)
        # RocksDB reserves its largest write buffer as free space to resume after ENOSPC
        self.health = WriteHealth(clock, resume_free_bytes=self._memtable_bytes)
        # Set by whoever opened this tier over a quarantined directory: where the old
        # files went and why (node_agent/server.py; Stats and `kvctl nodes` show it).
        self.quarantined: Quarantine | None = None
        self.write_errors = 0  # deletes and meta writes that failed (best effort)
        # close() must not run under a flush the agent started on another thread.
        self._io_lock = threading.Lock()
        try:
            self._db = Rdict(
                path,
                _options(),
                column_families={"blocks": _options(self._memtable_bytes), "meta": _options()},
            )
        except Exception as exc:  # noqa: BLE001 - rocksdict raises Exception
            raise _open_error(path, exc) from None
        wo = WriteOptions()
        # rocksdict's stub declares disable_wal a method; it is a property (a getset
        # descriptor) at run time, like no_slowdown.
        wo.disable_wal = True  # type: ignore[method-assign,assignment]
        # A write that would wait for a flush fails instead: on a full disk the flush
        # never comes and RocksDB would block the caller (holding the GIL) for good.
        wo.no_slowdown = True
        self._db.set_write_options(wo)
        self._blocks = self._db.get_column_family("blocks")
        self._meta = self._db.get_column_family("meta")
        self._blocks.set_write_options(wo)
        self._meta.set_write_options(wo)
        self._blocks_handle = self._db.get_column_family_handle("blocks")

    # ------------------------------------------------------------------- writes
    def _write(self, wb: WriteBatch) -> None:
        self._db.write(wb)

    def may_write(self, tenant: str) -> bool:
        """Whether a record of `tenant` would be tried now: not backing off, and (with
        encryption on) the tenant has a key. Asked before room is made for a spill."""
        if self.sealer is not None and not self.sealer.can_seal(tenant):
            self._refuse(tenant)
            return False
        return self.health.may_try()

    def _refuse(self, tenant: str) -> None:
        self.seal_refused += 1
        if ("tenant", tenant) not in self._told:
            self._told.add(("tenant", tenant))
            log.warning(
                "NVMe tier %s: tenant %s has no encryption key, its blocks are not "
                "spilled to NVMe (add a key file <tenant>.<id>.key and restart)",
                self.path,
                tenant,
            )

    def put_batch(self, items: list[tuple[bytes, bytes]], tenant: str | None = None) -> None:
        """Write block records of `tenant`; TierUnavailable when the tier cannot write
        now, TierRefused when encryption is on and the tenant has no key."""
        if self.sealer is not None:
            if tenant is None or not self.sealer.can_seal(tenant):
                self._refuse(str(tenant))
                raise TierRefused(f"NVMe tier {self.path}: no encryption key for this tenant")
            items = [(k, self.sealer.seal(k, tenant, v)) for k, v in items]
        if not self.health.may_try():
            raise TierUnavailable(f"NVMe tier {self.path} is backing off: {self.health.last_error}")
        wb = WriteBatch(raw_mode=True)
        wb.set_default_column_family(self._blocks_handle)
        for key, value in items:
            wb.put(key, value)
        try:
            self._write(wb)
        except Exception as exc:  # noqa: BLE001 - rocksdict raises Exception
            why = self._why(exc)
            if "Write stall" in str(exc) and not self._background_errors():
                # Both memtables full while one is written out, and no flush failed: this
                # spill is dropped, the next one will likely go through.
                self.stalls += 1
            else:
                self.health.failed(self.path, why)
            raise TierUnavailable(f"NVMe tier {self.path}: {why}") from None
        self.health.succeeded(self.path)

    def probe(self) -> bool:
        """Whether the tier writes again, asked once an outage's back-off is over: a
        small record in the (otherwise unused) default family, which RocksDB refuses
        like any other while it is stopped after a background error. The agent asks on
        a timer, so an idle agent notices recovery without waiting for a spill."""
        if not self.health.due():
            return self.health.writable
        wb = WriteBatch(raw_mode=True)
        wb.put(PROBE_KEY, b"")
        with self._io_lock:  # not under close()
            if getattr(self, "_db", None) is None:
                return False
            try:
                self._write(wb)
            except Exception as exc:  # noqa: BLE001 - rocksdict raises Exception
                self.health.failed(self.path, self._why(exc), refused=False)
                return False
        self.health.succeeded(self.path)
        return True

    def _background_errors(self) -> int:
        """Flushes and compactions that failed since the DB was opened (RocksDB keeps
        no count of recoveries, so any means: a stall may be for good)."""
        try:
            return self._db.property_int_value("rocksdb.background-errors") or 0
        except Exception:  # noqa: BLE001 - rocksdict raises Exception
            return 1

    def _free(self) -> int:
        try:
            return shutil.disk_usage(self.path).free
        except OSError:
            return 0

    def _why(self, exc: Exception) -> str:
        """RocksDB's message, and the free space: a write stalled behind a flush that a
        full disk fails says only 'Write stall'."""
        return f"{exc} ({self._free() >> 10} KiB free on its filesystem)"

    def _best_effort(self, what: str, fn) -> bool:
        """Deletes and meta writes never fail the caller: a record left behind is
        dropped or re-validated by recovery at the next start."""
        try:
            fn()
            return True
        except Exception as exc:  # noqa: BLE001 - rocksdict raises Exception
            self.write_errors += 1
            log.debug("NVMe tier %s: %s failed: %s", self.path, what, exc)
            return False

    def delete_batch(self, keys: list[bytes]) -> bool:
        wb = WriteBatch(raw_mode=True)
        wb.set_default_column_family(self._blocks_handle)
        for key in keys:
            wb.delete(key)
        return self._best_effort("delete", lambda: self._write(wb))

    def delete_prefix(self, prefix: bytes) -> bool:
        """Drop every block whose key starts with `prefix` (a namespace id)."""
        end = (int.from_bytes(prefix, "big") + 1).to_bytes(len(prefix), "big")
        return self._best_effort("delete_range", lambda: self._blocks.delete_range(prefix, end))

    def meta_put(self, key: bytes, value: bytes) -> bool:
        def put() -> None:
            self._meta[key] = value
            self._meta.flush()  # durable now: blocks of an unknown namespace are dropped

        return self._best_effort("meta write", put)

    # -------------------------------------------------------------------- reads
    def get(self, key: bytes, tenant: str | None = None) -> bytes | None:
        """The record, or None when absent or unreadable (a miss; the caller drops it).
        With encryption on it is opened as `tenant`'s (None: the stored bytes as they are,
        which never decode as a block)."""
        try:
            raw = self._blocks.get(key)
        except Exception as exc:  # noqa: BLE001 - rocksdict raises Exception
            log.debug("NVMe tier %s: read failed: %s", self.path, exc)
            return None
        if raw is None or self.sealer is None or tenant is None:
            return raw
        return self._open(key, tenant, raw)

    def _open(self, key: bytes, tenant: str, raw: bytes) -> bytes | None:
        assert self.sealer is not None
        try:
            return self.sealer.open(key, tenant, raw)
        except OpenFailed as exc:
            self.open_failures[exc.cause] += 1
            if exc.cause not in self._told:  # once per cause: the counters tell the rest
                self._told.add(exc.cause)
                log.warning(
                    "NVMe tier %s: a record failed to open (%s): a miss, dropped; "
                    "kvstore_nvme_events_total counts them",
                    self.path,
                    exc.cause.value,
                )
            return None

    def _iterate(self, cf, what: str) -> Iterator[tuple[bytes, bytes]]:
        it = cf.iter()
        it.seek_to_first()
        while it.valid():
            yield it.key(), it.value()
            it.next()
        err = ""
        try:  # an iterator stops at the first record it cannot read: say so
            it.status()
        except Exception as exc:  # noqa: BLE001 - rocksdict raises Exception
            err = str(exc)
        # The traceback keeps this frame: holding the iterator or the family there would
        # keep the DB open (and its LOCK taken) after close(), so drop them first.
        del it, cf
        if err:
            raise TierCorrupt(f"RocksDB at {self.path}: {what} unreadable: {err}")

    def scan(
        self, tenant_of: Callable[[bytes], str | None] | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Every block record; TierCorrupt (at the end) when one could not be read. With
        encryption on and `tenant_of` (key -> tenant, None when unknown) each is opened,
        and one that does not open comes as b"" (the store drops it); without `tenant_of`
        the records come as stored."""
        records = self._iterate(self._blocks, "block records")
        if self.sealer is None or tenant_of is None:
            return records
        return self._opened(records, tenant_of)

    def _opened(
        self, records: Iterator[tuple[bytes, bytes]], tenant_of: Callable[[bytes], str | None]
    ) -> Iterator[tuple[bytes, bytes]]:
        for key, raw in records:
            tenant = tenant_of(key)
            opened = None if tenant is None else self._open(key, tenant, raw)
            yield key, b"" if opened is None else opened

    def meta_get(self, key: bytes) -> bytes | None:
        return self._meta.get(key)

    def meta_items(self) -> Iterator[tuple[bytes, bytes]]:
        return self._iterate(self._meta, "meta records")

    def counters(self) -> dict[str, int]:
        """The tier's own tallies, for Stats and Prometheus."""
        h = self.health
        return {
            "nvme_write_outages": h.outages,
            "nvme_write_recoveries": h.recoveries,
            "nvme_writes_refused": h.refused,
            "nvme_flushes": self.flushes,
            "nvme_write_stalls": self.stalls,
            "nvme_write_errors": self.write_errors,
            "nvme_quarantined": int(self.quarantined is not None),
            "nvme_encrypted": int(self.sealer is not None),
            "nvme_seal_refused": self.seal_refused,
            "nvme_key_reloads": self.sealer.reloads if self.sealer is not None else 0,
            "nvme_key_reload_errors": self.sealer.reload_errors if self.sealer is not None else 0,
            **{f"nvme_open_failed_{f.value}": self.open_failures[f] for f in Failure},
        }

    def unflushed_bytes(self) -> int:
        """About how many bytes of block records are only in memtables, not yet in SST
        files (what a kill -9 would lose); 0 when none, or when RocksDB cannot say."""
        try:
            cf = self._blocks
            entries = cf.property_int_value("rocksdb.num-entries-active-mem-table") or 0
            entries += cf.property_int_value("rocksdb.num-entries-imm-mem-tables") or 0
            if not entries:  # an empty memtable still reports its arena
                return 0
            return cf.property_int_value("rocksdb.cur-size-all-mem-tables") or 0
        except Exception:  # noqa: BLE001 - rocksdict raises Exception; closed: no _blocks
            return 0

    def condition(self) -> str:
        """'' when healthy, else what an operator should know about this tier."""
        notes = [self.health.condition()]
        if self.quarantined is not None:
            notes.append(f"started empty: unreadable files moved to {self.quarantined.moved_to}")
        return "; ".join(n for n in notes if n)

    # --------------------------------------------------------------- durability
    def flush(self) -> bool:
        """Write both memtables out (what makes block records survive a crash)."""
        with self._io_lock:
            if getattr(self, "_db", None) is None:
                return False
            try:
                self._blocks.flush()
                self._meta.flush()
            except Exception as exc:  # noqa: BLE001 - rocksdict raises Exception
                self.health.failed(self.path, self._why(exc))
                return False
            self.flushes += 1
            return True

    def close(self) -> None:
        """Flush and close; closing twice is a no-op (shutdown paths may overlap). On a
        full disk the flush fails: what was flushed before stays, the rest is lost."""
        with self._io_lock:
            if getattr(self, "_db", None) is None:
                return
            try:
                self._blocks.flush()
                self._meta.flush()
            except Exception as exc:  # noqa: BLE001 - rocksdict raises Exception
                log.warning(
                    "NVMe tier %s: final flush failed, unflushed blocks are lost: %s",
                    self.path,
                    exc,
                )
            del self._blocks, self._meta, self._blocks_handle
            try:
                self._db.close()
            except Exception as exc:  # noqa: BLE001 - RocksDB still releases its LOCK
                log.warning("NVMe tier %s: close reported: %s", self.path, exc)
            del self._db
            gc.collect()


def quarantine(path: str, now: Callable[[], float] = time.time) -> str:
    """Move an unreadable RocksDB directory aside to `<path>.quarantine-<UTC time>` (a
    sibling on the same filesystem, so this is a rename) and leave `path` empty. Where
    `path` cannot be renamed (a mount point: EBUSY; EXDEV) its files are moved into
    `<path>/quarantine-<UTC time>/` instead, still on its own filesystem (RocksDB ignores
    a subdirectory). Keeps the QUARANTINES_KEPT newest copies: an agent restarted over
    and over on a damaged disk must not fill it. Returns where the files went; OSError
    when they could not be moved."""
    path = path.rstrip("/")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now()))
    older = sorted(
        glob.glob(glob.escape(path) + ".quarantine-*")
        + glob.glob(os.path.join(glob.escape(path), QUARANTINE_PREFIX + "*")),
        key=os.path.getmtime,
    )
    for old in older[: max(0, len(older) - QUARANTINES_KEPT + 1)]:
        shutil.rmtree(old, ignore_errors=True)
    dest = _unused(f"{path}.quarantine-{stamp}")
    try:
        os.rename(path, dest)
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.EXDEV):
            raise
        return _quarantine_inside(path, _unused(os.path.join(path, QUARANTINE_PREFIX + stamp)))
    os.makedirs(path)
    return dest


def _unused(dest: str) -> str:
    """`dest`, or `dest-2`, `dest-3`, ... if it exists (two quarantines in one second)."""
    name, n = dest, 1
    while os.path.exists(name):
        n += 1
        name = f"{dest}-{n}"
    return name


def _quarantine_inside(path: str, dest: str) -> str:
    """Move every entry of `path` (but earlier quarantines and a filesystem's lost+found)
    into the new directory `dest` inside it: renames within one filesystem."""
    os.mkdir(dest)
    for entry in os.listdir(path):
        if entry.startswith(QUARANTINE_PREFIX) or entry == "lost+found":
            continue
        os.rename(os.path.join(path, entry), os.path.join(dest, entry))
    return dest
