"""Encryption at rest for NVMe records: AES-256-GCM under per-tenant keyrings.

A sealed record is `header | ciphertext | tag`, the header being

    magic b"KVSE" (4) | format version (1) | key id (u32 LE) | nonce (12)

The nonce is 96 fresh random bits per write. The associated data binds the record to where
it is stored and whose it is: the header itself, the RocksDB key (namespace id + block id)
and the tenant. A record copied under another key or tenant, a tampered byte, a key id
nobody lists any more: each fails authentication, and the caller treats it as a miss.

A tenant's keyring holds every key it may still have records under; the active one seals,
all of them open. Rotation is: add a key with a higher id (the highest is active unless the
configuration names one), and old records stay readable until they age out or the old key
is removed (then they are misses, dropped and counted). See docs/security-at-rest.md.

Keys come from files `<tenant>.<key id>.key` in one directory (a mounted Kubernetes Secret
works: its `..data` entries are skipped), 32 raw bytes or their base64; a file any other
user may read is refused at startup. The directory is watched (`Sealer.refresh`, which the
agent calls every second): when a file in it changes (added, replaced, removed: name, size,
mtime, inode) the keyrings are read again, so a key added for rotation seals from then on
and a removed one stops opening, with no restart. A directory that does not read cleanly
mid-change (a file not yet chmod'ed or half written) keeps the keyrings in use, is logged
once, and is read again at its next change, like kvstore/tls.py's certificates.
"""

from __future__ import annotations

import base64
import binascii
import enum
import logging
import os
import stat
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

log = logging.getLogger("kvstore.tiers.sealing")

MAGIC = b"KVSE"
VERSION = 1
KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12
TAG_BYTES = 16
MAX_KEY_ID = (1 << 32) - 1
_HEAD = struct.Struct("<4sBI12s")
HEADER_BYTES = _HEAD.size
KEY_SUFFIX = ".key"


class Failure(enum.Enum):
    """Why a record did not open (a counter and a log line each, never key material)."""

    TAMPERED = "tampered"  # authentication failed: changed bytes, wrong place or tenant
    UNKNOWN_KEY = "unknown_key"  # a key id the tenant's keyring does not hold (removed)
    NO_KEYRING = "no_keyring"  # the tenant has no keys at all on this agent
    PLAINTEXT = "plaintext"  # not sealed: written before encryption was turned on
    MALFORMED = "malformed"  # too short, or a format version this code does not know


class OpenFailed(Exception):
    def __init__(self, cause: Failure) -> None:
        super().__init__(cause.value)
        self.cause = cause


class NoKeyring(Exception):
    """Sealing for a tenant with no keyring: the record must not be written."""


class KeyFileError(ValueError):
    """A key directory or file that cannot be used (the agent refuses to start)."""


@dataclass(frozen=True, slots=True)
class Keyring:
    """One tenant's keys (id -> 32 bytes); `active` seals, every listed key opens."""

    tenant: str
    keys: Mapping[int, bytes]
    active: int
    _aead: dict[int, AESGCM] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.active not in self.keys:
            raise KeyFileError(
                f"tenant {self.tenant!r}: active key id {self.active} is not among its key "
                f"files (ids {sorted(self.keys)})"
            )
        for kid, key in self.keys.items():
            if not 0 < kid <= MAX_KEY_ID or len(key) != KEY_BYTES:
                raise KeyFileError(f"tenant {self.tenant!r}: key {kid} is not a valid key")
            self._aead[kid] = AESGCM(key)

    def aead(self, key_id: int) -> AESGCM | None:
        return self._aead.get(key_id)


def _aad(head: bytes, key: bytes, tenant: str) -> bytes:
    return head + struct.pack("<H", len(key)) + key + tenant.encode()


@dataclass(frozen=True, slots=True)
class KeyDirectory:
    """Where the keyrings come from: `keys_dir` and the configured active ids."""

    keys_dir: str
    active: Mapping[str, int] = field(default_factory=dict)

    def stamp(self) -> tuple:
        """What changes when a key file is added, removed or replaced."""
        try:
            names = sorted(os.listdir(self.keys_dir))
        except OSError:
            return ()
        out: list[tuple[str, tuple[int, int, int, int] | None]] = []
        for name in names:
            try:
                st = os.stat(os.path.join(self.keys_dir, name))
            except OSError:
                out.append((name, None))
                continue
            out.append((name, (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode)))
        return tuple(out)

    def load(self) -> dict[str, Keyring]:
        return load_keyrings(self.keys_dir, self.active)


class Sealer:
    """Seals and opens NVMe records with per-tenant keyrings (thread-safe: AESGCM is, and
    `refresh` swaps the whole keyring table at once)."""

    def __init__(
        self,
        keyrings: Mapping[str, Keyring],
        random: Callable[[int], bytes] = os.urandom,
        source: KeyDirectory | None = None,
    ) -> None:
        """`source`: the directory `refresh` reads again when it changed (None: fixed)."""
        self.keyrings = dict(keyrings)
        self._random = random
        self._source = source
        self._stamp = source.stamp() if source is not None else ()
        self._lock = threading.Lock()
        self.reloads = 0  # times changed key files were taken into use
        self.reload_errors = 0  # changes that did not read cleanly (the old keys stayed)

    @classmethod
    def from_directory(cls, keys_dir: str, active: Mapping[str, int] | None = None) -> "Sealer":
        """Keyrings from `keys_dir`, watched by refresh (KeyFileError: unusable now)."""
        source = KeyDirectory(keys_dir, dict(active or {}))
        stamp = source.stamp()
        sealer = cls(source.load(), source=source)
        sealer._stamp = stamp  # what was read: a change since then is seen next refresh
        return sealer

    def refresh(self) -> bool:
        """Read the key directory again if a file in it changed; True when new keyrings
        are in use. A change that does not read cleanly keeps the current ones."""
        if self._source is None:
            return False
        with self._lock:
            stamp = self._source.stamp()
            if stamp == self._stamp:
                return False
            self._stamp = stamp  # a bad state is reported once, retried when it changes
            try:
                keyrings = self._source.load()
            except KeyFileError as exc:
                self.reload_errors += 1
                log.warning("key files changed but cannot be used (%s); keeping the old", exc)
                return False
            before = {t: (sorted(r.keys), r.active) for t, r in self.keyrings.items()}
            self.keyrings = keyrings
            self.reloads += 1
        after = {t: (sorted(r.keys), r.active) for t, r in keyrings.items()}
        log.info(
            "key files changed: keys for %d tenants, active ids %s (key ids before: %s)",
            len(keyrings),
            {t: a for t, (_, a) in sorted(after.items())},
            {t: ids for t, (ids, _) in sorted(before.items())},
        )
        return True

    def can_seal(self, tenant: str) -> bool:
        return tenant in self.keyrings

    def seal(self, key: bytes, tenant: str, plaintext: bytes) -> bytes:
        ring = self.keyrings.get(tenant)
        if ring is None:
            raise NoKeyring(tenant)
        head = _HEAD.pack(MAGIC, VERSION, ring.active, self._random(NONCE_BYTES))
        aead = ring.aead(ring.active)
        assert aead is not None  # Keyring checked that the active key is listed
        return head + aead.encrypt(head[-NONCE_BYTES:], plaintext, _aad(head, key, tenant))

    def open(self, key: bytes, tenant: str, record: bytes) -> bytes:
        """The plaintext; OpenFailed with the cause when the record does not authenticate."""
        if record[:4] != MAGIC:
            raise OpenFailed(Failure.PLAINTEXT)
        if len(record) < HEADER_BYTES + TAG_BYTES:
            raise OpenFailed(Failure.MALFORMED)
        _, version, key_id, nonce = _HEAD.unpack_from(record, 0)
        if version != VERSION:
            raise OpenFailed(Failure.MALFORMED)
        ring = self.keyrings.get(tenant)
        if ring is None:
            raise OpenFailed(Failure.NO_KEYRING)
        aead = ring.aead(key_id)
        if aead is None:
            raise OpenFailed(Failure.UNKNOWN_KEY)
        head = bytes(record[:HEADER_BYTES])
        try:
            return aead.decrypt(nonce, memoryview(record)[HEADER_BYTES:], _aad(head, key, tenant))
        except InvalidTag:
            raise OpenFailed(Failure.TAMPERED) from None


def generate_key() -> bytes:
    """32 random bytes (what `<tenant>.<id>.key` holds; base64 of them works too)."""
    return AESGCM.generate_key(bit_length=256)


def parse_key(data: bytes, where: str) -> bytes:
    """32 raw bytes, or base64 text of them (a trailing newline allowed)."""
    if len(data) == KEY_BYTES:
        return data
    try:
        key = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise KeyFileError(
            f"{where}: a key file holds 32 raw bytes or their base64 (44 characters), "
            f"found {len(data)} bytes that are neither"
        )
    return key


def _key_name(name: str, where: str) -> tuple[str, int]:
    """`<tenant>.<key id>.key` -> (tenant, key id)."""
    tenant, _, kid = name[: -len(KEY_SUFFIX)].rpartition(".")
    if not tenant or not kid.isdigit() or not 0 < int(kid) <= MAX_KEY_ID:
        raise KeyFileError(
            f"{where}: a key file is named <tenant>.<key id>.key with a key id from 1 to "
            f"{MAX_KEY_ID} (e.g. acme.1.key)"
        )
    return tenant, int(kid)


def read_key_file(path: str) -> bytes:
    """The key in `path`; KeyFileError when it is not a regular file only its owner (and
    group) may read, or does not hold a key."""
    try:
        st = os.stat(path)  # follows a Secret volume's symlinks to the file itself
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read key file ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{path}: a key file must be a regular file")
    if st.st_mode & 0o007:
        raise KeyFileError(
            f"{path}: key file mode {stat.S_IMODE(st.st_mode):04o} lets any user read or "
            "change it; chmod 0400 (in Kubernetes: the Secret volume's defaultMode: 0400)"
        )
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read key file ({exc.strerror})") from None
    return parse_key(data, path)


def load_keyrings(keys_dir: str, active: Mapping[str, int] | None = None) -> dict[str, Keyring]:
    """Every tenant's keyring from the key files in `keys_dir`. A tenant's active key is
    `active[tenant]` if given, else its highest key id."""
    try:
        names = sorted(os.listdir(keys_dir))
    except OSError as exc:
        raise KeyFileError(f"encryption.keys_dir {keys_dir}: {exc.strerror}") from None
    found: dict[str, dict[int, bytes]] = {}
    for name in names:
        if name.startswith("."):  # a Secret volume's ..data and ..<timestamp> entries
            continue
        path = os.path.join(keys_dir, name)
        if not name.endswith(KEY_SUFFIX):
            raise KeyFileError(f"{path}: not a key file (named <tenant>.<key id>.key)")
        tenant, kid = _key_name(name, path)
        found.setdefault(tenant, {})[kid] = read_key_file(path)
    if not found:
        raise KeyFileError(
            f"encryption.keys_dir {keys_dir} holds no key files (<tenant>.<key id>.key)"
        )
    active = active or {}
    unknown = sorted(set(active) - set(found))
    if unknown:
        raise KeyFileError(
            f"encryption.active names tenants without key files: {', '.join(unknown)}"
        )
    return {t: Keyring(t, keys, active.get(t, max(keys))) for t, keys in found.items()}
