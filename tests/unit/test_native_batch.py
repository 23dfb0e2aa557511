"""The batch kernels (copy_checksum_many, xxh64_many; kvstore.checksum's *_many) give,
block by block, the very XXH64 of the single-buffer calls and of the xxhash package (the
one checksum definition every tier, transport and the device kernel share), whatever the
sizes, alignments and thread counts; they check every buffer before the first copy; and
the host pool's batch reads and writes keep the slot state machine."""

from __future__ import annotations

import contextlib
import ctypes
import threading

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvstore import checksum as cks
from kvstore.tiers.pool import DevicePool, SlotStateError

try:
    from kvstore import _native
except ImportError:  # pragma: no cover - extension not built
    _native = None

needs_native = pytest.mark.skipif(_native is None, reason="kvstore._native not built")
NT_MIN = getattr(_native, "NT_MIN_BYTES", 128 * 1024)
SIZES = hs.one_of(
    hs.integers(0, 300),
    hs.integers(NT_MIN - 70, NT_MIN + 70),
    hs.integers(4096, 3 * NT_MIN),
)
BATCH_FRONTS = [cks.copy_with_checksum_many, cks.py_copy_with_checksum_many]


def _batch(seed: int, sizes: list[int], src_off: int, dst_off: int):
    rng = np.random.default_rng(seed)
    srcs, dsts, slabs = [], [], []
    for n in sizes:
        src = rng.integers(0, 256, n + src_off, dtype=np.uint8)[src_off:]
        slab = np.full(n + dst_off + 8, 0xAB, dtype=np.uint8)
        srcs.append(src)
        dsts.append(slab[dst_off : dst_off + n + 3])  # dst larger than src
        slabs.append(slab)
    return srcs, dsts, slabs


@needs_native
@settings(max_examples=60, deadline=None)
@given(
    sizes=hs.lists(SIZES, max_size=9),
    threads=hs.integers(1, 5),
    src_off=hs.integers(0, 15),
    dst_off=hs.integers(0, 15),
    seed=hs.integers(0, 2**32 - 1),
)
def test_batch_copy_checksum_is_the_one_xxh64(sizes, threads, src_off, dst_off, seed):
    srcs, dsts, slabs = _batch(seed, sizes, src_off, dst_off)
    want = [xxhash.xxh64_intdigest(s.tobytes()) for s in srcs]
    for copy in BATCH_FRONTS:
        for slab in slabs:
            slab[:] = 0xAB
        assert copy(dsts, srcs, threads) == want
        for src, slab, n in zip(srcs, slabs, sizes):
            assert np.array_equal(slab[dst_off : dst_off + n], src)
            assert (slab[:dst_off] == 0xAB).all() and (slab[dst_off + n :] == 0xAB).all()
    assert [cks.copy_with_checksum(d, s) for d, s in zip(dsts, srcs)] == want
    assert cks.checksum_many(srcs, threads) == want == cks.py_checksum_many(srcs, threads)


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_batch_of_2mib_blocks_over_threads(threads):
    block = 2 << 20
    rng = np.random.default_rng(threads)
    srcs = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(7)]
    slab = np.zeros(7 * block, dtype=np.uint8)
    dsts = [slab[i * block : (i + 1) * block] for i in range(7)]
    got = cks.copy_with_checksum_many(dsts, srcs, threads)
    assert got == [xxhash.xxh64_intdigest(s) for s in srcs]
    assert np.array_equal(slab, np.concatenate(srcs))
    assert cks.checksum_many(dsts, threads) == got


@needs_native
def test_batch_overlapping_pair_hashes_the_original_source():
    buf = bytearray(np.random.default_rng(3).integers(0, 256, NT_MIN + 500, np.uint8).tobytes())
    mv = memoryview(buf)
    original = bytes(buf[64 : 64 + NT_MIN])
    other = bytes(1000)
    got = _native.copy_checksum_many(
        [mv[64 + 17 : 64 + 17 + NT_MIN], bytearray(1000)], [mv[64 : 64 + NT_MIN], other], 2
    )
    assert got == [xxhash.xxh64_intdigest(original), xxhash.xxh64_intdigest(other)]
    assert bytes(buf[64 + 17 : 64 + 17 + NT_MIN]) == original


@pytest.mark.parametrize("copy", BATCH_FRONTS)
@pytest.mark.parametrize(
    ("dsts", "srcs", "threads", "exc", "msg"),
    [
        ([bytearray(4)], [b"abcd", b"ef"], 1, ValueError, "1 dsts for 2 srcs"),
        (
            [bytearray(4), bytearray(1)],
            [b"abcd", b"ef"],
            1,
            ValueError,
            r"dsts\[1\] is too small: 1 bytes < 2 bytes of srcs\[1\]",
        ),
        ([bytearray(4), b"xx"], [b"abcd", b"ef"], 1, TypeError, r"dsts\[1\] must be a writable"),
        ([bytearray(4)], ["abcd"], 1, TypeError, r"srcs\[0\] must be a bytes-like"),
        ([bytearray(4)], [b"abcd"], 0, ValueError, r"threads must be in \[1, 64\]"),
        ([bytearray(4)], [b"abcd"], 65, ValueError, r"threads must be in \[1, 64\]"),
        ([bytearray(4)], [b"abcd"], True, TypeError, "threads must be an int"),
    ],
)
def test_batch_bad_input_copies_nothing(copy, dsts, srcs, threads, exc, msg):
    if copy is cks.copy_with_checksum_many and _native is None:
        pytest.skip("kvstore._native not built")
    before = [bytes(d) for d in dsts]
    with pytest.raises(exc, match=msg):
        copy(dsts, srcs, threads)
    assert [bytes(d) for d in dsts] == before  # checked before the first copy


@needs_native
def test_batch_hash_bad_input():
    with pytest.raises(TypeError, match="bufs must be a sequence"):
        _native.xxh64_many(5)
    with pytest.raises(TypeError, match=r"bufs\[1\] must be a bytes-like"):
        _native.xxh64_many([b"ab", 3])
    assert _native.xxh64_many([], 4) == [] == _native.copy_checksum_many([], [], 4)
    assert _native.xxh64_many([b"ab"], seed=7) == [xxhash.xxh64_intdigest(b"ab", 7)]


def test_host_pool_batch_keeps_the_slot_states():
    pool = DevicePool(4, 4096, "cpu")
    a, b = pool.reserve(), pool.reserve()
    assert a is not None and b is not None
    data = [bytes(range(256)) * 16, b"\x07" * 1000]
    assert pool.write_many([a, b], data, 2) == [cks.checksum(d) for d in data]
    with pytest.raises(SlotStateError, match="read while RESERVED"):
        pool.read_many([a], [4096], [bytearray(4096)])
    pool.commit(a)
    pool.commit(b)
    with pytest.raises(SlotStateError, match="written while OCCUPIED"):
        pool.write_many([b], [b"x"])
    c = pool.reserve()
    assert c is not None
    untouched = bytes(pool.raw_view(c))
    with pytest.raises(SlotStateError):  # c is fine, a is not: nothing is written
        pool.write_many([c, a], [b"y" * 10, b"z"])
    assert bytes(pool.raw_view(c)) == untouched
    out = [bytearray(4096), bytearray(1000)]
    assert pool.read_many([a, b], [4096, 1000], out, 2) == [cks.checksum(d) for d in data]
    assert [bytes(o) for o in out] == data


# ------------------------------------------------------------ cma_read_checksum
@needs_native
@settings(max_examples=30, deadline=None)
@given(
    sizes=hs.lists(hs.one_of(hs.integers(0, 300), hs.integers(250_000, 800_000)), max_size=6),
    threads=hs.integers(1, 3),
    off=hs.integers(0, 7),
)
def test_cma_read_checksum_reads_and_hashes_like_xxh64(sizes, threads, off):
    """Reading from this very process (process_vm_readv allows it): every dst holds the
    bytes at its address, and each digest is the XXH64 of the xxhash package, across
    the 512 KiB pieces the reads are hashed in, for any size and alignment."""
    import os

    rng = np.random.default_rng(len(sizes) + off)
    srcs = [rng.integers(0, 256, n + off, dtype=np.uint8)[off:] for n in sizes]
    dsts = [np.zeros(n, dtype=np.uint8) for n in sizes]
    got = _native.cma_read_checksum(
        os.getpid(), dsts, [s.__array_interface__["data"][0] for s in srcs], threads=threads
    )
    assert got == [xxhash.xxh64_intdigest(s.tobytes()) for s in srcs]
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))


@needs_native
def test_cma_read_checksum_reads_another_process_and_reports_errno():
    """A child's memory, read by address; an unmapped address is EFAULT, a PID no process
    has ESRCH; bad arguments fail before any read."""
    import errno
    import mmap
    import multiprocessing as mp
    import os

    mem = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    src = np.frombuffer(mem, dtype=np.uint8)
    src[:] = np.random.default_rng(3).integers(0, 256, src.size, dtype=np.uint8)
    addr = src.__array_interface__["data"][0]
    ready, stop = mp.get_context("fork").Event(), mp.get_context("fork").Event()

    def child():  # a forked copy: the same address, its own pages from here on
        ready.set()
        stop.wait(30)

    proc = mp.get_context("fork").Process(target=child)
    proc.start()
    try:
        assert ready.wait(30)
        expected = src.copy()
        src[:] = 0  # ours changes; the child's copy does not
        dst = np.zeros(src.size, dtype=np.uint8)
        got = _native.cma_read_checksum(proc.pid, [dst[:4096], dst[4096:]], [addr, addr + 4096])
        assert np.array_equal(dst, expected)
        assert got == [
            xxhash.xxh64_intdigest(expected[:4096].tobytes()),
            xxhash.xxh64_intdigest(expected[4096:].tobytes()),
        ]
        with pytest.raises(OSError) as e:
            _native.cma_read_checksum(proc.pid, [dst[:64]], [8])
        assert e.value.errno == errno.EFAULT
    finally:
        stop.set()
        proc.join(30)
    with open("/proc/sys/kernel/pid_max") as f:
        nobody = int(f.read())
    with pytest.raises(OSError) as e:
        _native.cma_read_checksum(nobody, [dst[:64]], [addr])
    assert e.value.errno == errno.ESRCH
    with pytest.raises(ValueError, match="2 addresses for 1 dsts"):
        _native.cma_read_checksum(os.getpid(), [dst], [addr, addr])
    with pytest.raises(TypeError, match="writable"):
        _native.cma_read_checksum(os.getpid(), [bytes(8)], [addr])
    with pytest.raises(ValueError, match="pid must be > 0"):
        _native.cma_read_checksum(0, [dst], [addr])
    with pytest.raises(ValueError, match=r"addresses\[0\]"):
        _native.cma_read_checksum(os.getpid(), [dst], [-1])


@contextlib.contextmanager
def scribbled(buf: np.ndarray):
    """Another thread rewrites `buf` over and over (ctypes.memset releases the GIL) for
    as long as the block runs, as another process writing shared memory would."""
    stop = threading.Event()

    def scribble() -> None:
        value = 0
        while not stop.is_set():
            value = (value + 1) & 0xFF
            ctypes.memset(buf.ctypes.data, value, buf.nbytes)

    writer = threading.Thread(target=scribble, daemon=True)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()


@needs_native
def test_the_digest_is_of_the_bytes_written_while_the_source_changes():
    """The source may be memory another process writes to (a client's staging area, a
    peer's pool mapped read-only): each word is loaded once, for the hash and the store
    alike, so whatever the source held at the time, the digest matches dst."""
    n = 4 << 20
    src = np.zeros(n, dtype=np.uint8)
    dsts = [np.empty(n, dtype=np.uint8) for _ in range(2)]
    with scribbled(src):
        for _ in range(40):
            digests = cks.copy_with_checksum_many(dsts, [src, src], threads=2)
            assert digests == [xxhash.xxh64_intdigest(d) for d in dsts]


@needs_native
@pytest.mark.parametrize("n", [100_003, (4 << 20) + 17])
def test_the_digest_is_of_the_bytes_read_while_the_destination_changes(n):
    """A Get copies a pool slot into a client's staging area, which the client may write
    to meanwhile: the digest is of the bytes read from the (stable) source, never of what
    the client put into dst, so a client cannot make a good block look corrupt. Sizes
    below the streaming threshold and one with a tail of 17 bytes."""
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want = xxhash.xxh64_intdigest(src)
    dst = np.zeros(n, dtype=np.uint8)
    with scribbled(dst):
        for _ in range(200):
            assert cks.copy_with_checksum_many([dst], [src], threads=1) == [want]
