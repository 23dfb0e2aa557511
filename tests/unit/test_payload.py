"""Block payload format: header round trip, and every single-byte flip is DataLoss."""

from __future__ import annotations

import random

import pytest

from kvstore import checksum as cks
from kvstore.errors import DataLoss, InvalidArgument
from kvstore.payload import BlockHeader, block_shape, decode_block, decode_header, encode_block
from support.common import make_namespace


def _header(payload: bytes, **kw) -> BlockHeader:
    spec = make_namespace()
    fields = dict(
        namespace_id=spec.namespace_id,
        generation=7,
        block_id=b"\x11" * 16,
        parent_id=b"\x22" * 16,
        depth=3,
        dtype=spec.kv_dtype,
        shape=block_shape(spec),
        length=len(payload),
        checksum=cks.checksum(payload),
    )
    fields.update(kw)
    return BlockHeader(**fields)


def _payload(n: int = 256) -> bytes:
    return random.Random(n).randbytes(n)


def test_header_round_trip():
    payload = _payload()
    hdr = _header(payload)
    raw = encode_block(hdr, payload)
    got, off = decode_header(raw)
    assert got == hdr
    assert raw[off:] == payload
    hdr2, body = decode_block(raw)
    assert hdr2 == hdr and bytes(body) == payload


def test_block_shape_matches_namespace_bytes():
    spec = make_namespace()
    shape = block_shape(spec)
    n = 1
    for d in shape:
        n *= d
    assert n * spec.dtype_bytes == spec.block_bytes


def test_every_single_byte_flip_is_data_loss():
    payload = _payload(64)
    raw = encode_block(_header(payload), payload)
    hdr_len = decode_header(raw)[1]
    assert hdr_len < len(raw)
    for i in range(len(raw)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(raw)
            bad[i] ^= mask
            with pytest.raises(DataLoss):
                decode_block(bytes(bad))


def test_truncated_and_extended_records_are_data_loss():
    payload = _payload(64)
    raw = encode_block(_header(payload), payload)
    for n in (0, 3, 20, decode_header(raw)[1] - 1, len(raw) - 1):
        with pytest.raises(DataLoss):
            decode_block(raw[:n])
    with pytest.raises(DataLoss):
        decode_block(raw + b"\x00")


def test_encode_refuses_bad_headers():
    payload = _payload(32)
    with pytest.raises(InvalidArgument, match="dtype"):
        _header(payload, dtype="fp4").encode()
    with pytest.raises(InvalidArgument, match="block_id"):
        _header(payload, block_id=b"short").encode()
    with pytest.raises(InvalidArgument, match="header says"):
        encode_block(_header(payload), payload + b"x")
