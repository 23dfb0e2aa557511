"""NVMe tier on RocksDB (rocksdict, raw mode): the one storage adapter in the core.

Column family `blocks`: key = namespace id (16) + block id (16), value = encoded block
(header + payload, see kvstore.payload). Column family `meta`: small records the store
needs to recover (namespace specs, generations). The WAL is off and compression is off
(KV payloads do not compress): a block written just before a crash may be lost, which for
a cache is a miss; `flush()` on clean shutdown makes everything durable.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator

from rocksdict import DBCompressionType, Options, Rdict, WriteBatch, WriteOptions


def _options() -> Options:
    o = Options(raw_mode=True)
    o.create_if_missing(True)
    o.create_missing_column_families(True)
    o.set_compression_type(DBCompressionType.none())
    return o


class RocksTier:
    def __init__(self, path: str, capacity_bytes: int) -> None:
        self.path = path
        self.capacity_bytes = capacity_bytes
        self._db = Rdict(path, _options(), column_families={"blocks": _options(),
                                                            "meta": _options()})
        wo = WriteOptions()
        wo.disable_wal = True
        self._db.set_write_options(wo)
        self._blocks = self._db.get_column_family("blocks")
        self._meta = self._db.get_column_family("meta")
        self._blocks.set_write_options(wo)
        self._meta.set_write_options(wo)
        self._blocks_handle = self._db.get_column_family_handle("blocks")

    def put_batch(self, items: list[tuple[bytes, bytes]]) -> None:
        wb = WriteBatch(raw_mode=True)
        wb.set_default_column_family(self._blocks_handle)
        for key, value in items:
            wb.put(key, value)
        self._db.write(wb)

    def get(self, key: bytes) -> bytes | None:
        return self._blocks.get(key)

    def delete_batch(self, keys: list[bytes]) -> None:
        wb = WriteBatch(raw_mode=True)
        wb.set_default_column_family(self._blocks_handle)
        for key in keys:
            wb.delete(key)
        self._db.write(wb)

    def delete_prefix(self, prefix: bytes) -> None:
        """Drop every block whose key starts with `prefix` (a namespace id)."""
        end = (int.from_bytes(prefix, "big") + 1).to_bytes(len(prefix), "big")
        self._blocks.delete_range(prefix, end)

    def scan(self) -> Iterator[tuple[bytes, bytes]]:
        it = self._blocks.iter()
        it.seek_to_first()
        while it.valid():
            yield it.key(), it.value()
            it.next()

    def meta_put(self, key: bytes, value: bytes) -> None:
        self._meta[key] = value

    def meta_get(self, key: bytes) -> bytes | None:
        return self._meta.get(key)

    def meta_items(self) -> Iterator[tuple[bytes, bytes]]:
        it = self._meta.iter()
        it.seek_to_first()
        while it.valid():
            yield it.key(), it.value()
            it.next()

    def flush(self) -> None:
        self._db.flush()

    def close(self) -> None:
        """Flush and close; closing twice is a no-op (shutdown paths may overlap)."""
        if getattr(self, "_db", None) is None:
            return
        self._db.flush()
        del self._blocks, self._meta, self._blocks_handle
        self._db.close()
        del self._db
        gc.collect()
