"""Payload checksums for KV blocks.

The checksum is XXH64 (seed 0) over the block's payload bytes.  It exists to
detect corruption -- torn or partial writes, bit flips, truncated transfers,
a slot reused before a copy finished -- not to authenticate data: XXH64 is
not cryptographic and anyone can construct payloads with a chosen checksum.
The security of block *identity* comes from the BLAKE2b-128 block ids
(``kvstore.hashing``), never from this checksum.

``copy_with_checksum`` is the hot path used when a block is moved into (or
out of) a tier's preallocated slab: the C extension ``kvstore._native``
hashes and copies in one pass with non-temporal stores, so the copy does
not evict the working set from cache and the hash costs almost nothing on
top of the copy.  Without the extension, the ``xxhash`` package plus a
``memoryview`` copy give identical results (``kvstore.native.load`` logs that
fallback and ``ACCEL`` names it).

``copy_with_checksum_many`` and ``checksum_many`` do a whole batch of blocks in one
native call with the GIL released, split over threads (one core's fused pass is bound by
XXH64's multiplies, below what memory can do): the same XXH64, block by block, as the
single-buffer functions.

All functions accept any C-contiguous buffer (bytes, bytearray, memoryview,
numpy arrays, mmap ...); lengths are in bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore import native

ACCEL = native.load()  # the extension, or None and why (logged)
_native = ACCEL.module
NATIVE: bool = _native is not None

__all__ = [
    "NATIVE",
    "checksum",
    "checksum_many",
    "copy_with_checksum",
    "copy_with_checksum_many",
    "copy_with_checksum_start",
    "verify",
]


def _byte_view(buf: Any, what: str) -> memoryview:
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"{what} must be a bytes-like object, not {type(buf).__name__!r}") from None
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _check_u64(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {type(value).__name__!r}")
    if not 0 <= value < 2**64:
        raise ValueError(f"{what} must be in [0, 2**64), got {value}")
    return value


# --------------------------------------------------------------------------
# Pure-Python fallbacks (always available when ``xxhash`` is installed)
# --------------------------------------------------------------------------


def _xxh64():
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - depends on environment
        raise ImportError(
            "kvstore checksums need the kvstore._native extension or the xxhash package"
        ) from exc
    return xxhash.xxh64_intdigest


def py_checksum(buf: Any) -> int:
    return _xxh64()(_byte_view(buf, "buf"))


def py_copy_with_checksum(dst: Any, src: Any) -> int:
    d = _byte_view(dst, "dst")
    s = _byte_view(src, "src")
    if d.readonly:
        raise TypeError("dst must be a writable buffer")
    if d.nbytes < s.nbytes:
        raise ValueError(f"dst is too small: {d.nbytes} bytes < {s.nbytes} bytes of src")
    digest = _xxh64()(s)  # before the copy: src and dst may overlap
    d[: s.nbytes] = s
    return digest


def _check_threads(threads: Any) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be an int, not {type(threads).__name__!r}")
    if not 1 <= threads <= 64:
        raise ValueError(f"threads must be in [1, 64], got {threads}")
    return threads


def py_copy_with_checksum_many(
    dsts: Sequence[Any], srcs: Sequence[Any], threads: int = 1
) -> list[int]:
    """One buffer after another (the fallback has no threads to split over), every pair
    checked before the first copy, as the native call does."""
    _check_threads(threads)
    if len(dsts) != len(srcs):
        raise ValueError(f"{len(dsts)} dsts for {len(srcs)} srcs")
    pairs = []
    for i, (dst, src) in enumerate(zip(dsts, srcs)):
        s = _byte_view(src, f"srcs[{i}]")
        d = _byte_view(dst, f"dsts[{i}]")
        if d.readonly:
            raise TypeError(f"dsts[{i}] must be a writable buffer")
        if d.nbytes < s.nbytes:
            raise ValueError(
                f"dsts[{i}] is too small: {d.nbytes} bytes < {s.nbytes} bytes of srcs[{i}]"
            )
        pairs.append((d, s))
    return [py_copy_with_checksum(d, s) for d, s in pairs]


def py_checksum_many(bufs: Sequence[Any], threads: int = 1) -> list[int]:
    _check_threads(threads)
    return [py_checksum(b) for b in bufs]


def py_verify(buf: Any, expected: int) -> bool:
    return py_checksum(buf) == _check_u64(expected, "expected")


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def checksum(buf: Any) -> int:
    """XXH64 (seed 0) of ``buf`` as an unsigned 64-bit int."""
    if _native is not None:
        return _native.xxh64(buf)
    return py_checksum(buf)


def copy_with_checksum(dst: Any, src: Any) -> int:
    """Copy ``src`` into the start of ``dst`` and return ``checksum(src)``: of exactly
    the bytes copied (natively, each word is loaded once, so another process writing to
    either buffer meanwhile cannot make the digest differ from what landed in ``dst``).

    ``dst`` must be writable and at least ``len(src)`` bytes (ValueError
    otherwise); bytes of ``dst`` beyond ``len(src)`` are left untouched.
    """
    if _native is not None:
        return _native.copy_checksum(dst, src)
    return py_copy_with_checksum(dst, src)


def copy_with_checksum_many(
    dsts: Sequence[Any], srcs: Sequence[Any], threads: int = 1
) -> list[int]:
    """``copy_with_checksum(dsts[i], srcs[i])`` for every i, on up to `threads` threads
    (the caller's and threads - 1 started for the call, each over a contiguous run of
    about equal bytes). ValueError when the lengths differ or a dst is too small; nothing
    is copied then."""
    if _native is not None:
        return _native.copy_checksum_many(dsts, srcs, threads)
    return py_copy_with_checksum_many(dsts, srcs, threads)


def copy_with_checksum_start(
    dsts: Sequence[Any], srcs: Sequence[Any], threads: int = 1, deadline_ns: int | None = None
):
    """``copy_with_checksum_many`` in the background, on `threads` threads started for
    it (none of them the caller's), for a caller waiting on an event loop: returns a
    job at once, whose ``fileno()`` (an eventfd) turns readable when every copy is done
    and whose ``result()`` is the digests (it waits for the threads first, then lets go
    of the buffers). None without the native extension, or when no thread could be
    started: the caller copies in the foreground instead. Argument errors are raised
    here, before anything is copied. `deadline_ns` (CLOCK_MONOTONIC): a copy not begun
    by then is not made, its destination left as it was and its digest None."""
    start = getattr(_native, "copy_checksum_start", None)
    if start is None:
        return None
    return start(dsts, srcs, threads, deadline_ns=deadline_ns or 0)


def checksum_many(bufs: Sequence[Any], threads: int = 1) -> list[int]:
    """``checksum(b)`` for every buffer of `bufs`, split over threads likewise."""
    if _native is not None:
        return _native.xxh64_many(bufs, threads)
    return py_checksum_many(bufs, threads)


def verify(buf: Any, expected: int) -> bool:
    """True when ``checksum(buf) == expected``."""
    if _native is not None:
        return _native.verify_checksum(buf, expected)
    return py_verify(buf, expected)
