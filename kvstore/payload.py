"""Block payload format: a fixed header followed by the raw K/V bytes.

    magic "KVB1" | u8 version | u8 dtype code | u8 ndim | u8 reserved
    namespace id (16) | u64 generation | block id (16) | parent id (16) | u32 depth
    u32 dims[ndim] | u64 payload length | u64 payload XXH64 | u64 header XXH64

Little-endian throughout. The payload tensor is laid out as
(layers, 2 [K, V], block tokens, KV heads, head dim) in the namespace's KV dtype.
The last field checks the header itself, so a flipped bit anywhere in a stored record is
caught by `decode_block` (DataLoss), never served.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvstore import checksum as cks
from kvstore.errors import DataLoss, InvalidArgument
from kvstore.namespace import Namespace

MAGIC = b"KVB1"
VERSION = 1
DTYPE_CODES = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float8_e4m3fn": 4,
    "float8_e5m2": 5,
    "int8": 6,
}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
_FIXED = struct.Struct("<4sBBBB16sQ16s16sI")
_TAIL = struct.Struct("<QQ")
_HCHK = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class BlockHeader:
    namespace_id: bytes
    generation: int
    block_id: bytes
    parent_id: bytes
    depth: int
    dtype: str
    shape: tuple[int, ...]
    length: int
    checksum: int

    def encode(self) -> bytes:
        if self.dtype not in DTYPE_CODES:
            raise InvalidArgument(f"unknown dtype {self.dtype!r}")
        for name in ("namespace_id", "block_id", "parent_id"):
            if len(getattr(self, name)) != 16:
                raise InvalidArgument(f"{name} must be 16 bytes")
        head = _FIXED.pack(
            MAGIC,
            VERSION,
            DTYPE_CODES[self.dtype],
            len(self.shape),
            0,
            self.namespace_id,
            self.generation,
            self.block_id,
            self.parent_id,
            self.depth,
        )
        body = (
            head
            + struct.pack(f"<{len(self.shape)}I", *self.shape)
            + _TAIL.pack(self.length, self.checksum)
        )
        return body + _HCHK.pack(cks.checksum(body))


def block_shape(ns: Namespace) -> tuple[int, ...]:
    return (ns.num_layers, 2, ns.block_size, ns.num_kv_heads, ns.head_dim)


def decode_header(buf: bytes | memoryview) -> tuple[BlockHeader, int]:
    """Parse and verify a header; returns it and the offset where the payload starts."""
    mv = memoryview(buf)
    if len(mv) < _FIXED.size:
        raise DataLoss("block record shorter than its header")
    magic, version, code, ndim, _, ns_id, gen, bid, pid, depth = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC or version != VERSION or code not in DTYPE_NAMES:
        raise DataLoss("block record has a bad magic, version or dtype")
    off = _FIXED.size
    end = off + 4 * ndim + _TAIL.size
    if len(mv) < end + _HCHK.size:
        raise DataLoss("block record header truncated")
    shape = struct.unpack_from(f"<{ndim}I", mv, off)
    length, checksum = _TAIL.unpack_from(mv, off + 4 * ndim)
    (hchk,) = _HCHK.unpack_from(mv, end)
    if cks.checksum(mv[:end]) != hchk:
        raise DataLoss("block header checksum mismatch")
    hdr = BlockHeader(
        bytes(ns_id),
        gen,
        bytes(bid),
        bytes(pid),
        depth,
        DTYPE_NAMES[code],
        tuple(shape),
        length,
        checksum,
    )
    return hdr, end + _HCHK.size


def encode_block(header: BlockHeader, payload: bytes | memoryview) -> bytes:
    if len(payload) != header.length:
        raise InvalidArgument(f"payload is {len(payload)} bytes, header says {header.length}")
    return header.encode() + bytes(payload)


def decode_block(buf: bytes | memoryview) -> tuple[BlockHeader, memoryview]:
    """Verify header and payload checksums; DataLoss on any mismatch."""
    hdr, off = decode_header(buf)
    payload = memoryview(buf)[off:]
    if len(payload) != hdr.length:
        raise DataLoss(f"block payload is {len(payload)} bytes, header says {hdr.length}")
    if not cks.verify(payload, hdr.checksum):
        raise DataLoss("block payload checksum mismatch")
    return hdr, payload
