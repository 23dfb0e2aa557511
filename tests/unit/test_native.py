"""kvstore._native (BLAKE2b-128 chains, XXH64, copy+checksum) against the
hashlib / xxhash references, plus the kvstore.hashing and kvstore.checksum
fronts and their pure-Python fallbacks."""

from __future__ import annotations

import hashlib
import importlib.util
import platform
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvstore import checksum as cks
from kvstore import hashing

try:
    from kvstore import _native
except ImportError:  # pragma: no cover - extension not built
    _native = None

needs_native = pytest.mark.skipif(_native is None, reason="kvstore._native not built")

RNG = random.Random(0x5EED)
SEEDS = [0, 1, 0x9E3779B185EBCA87, 2**64 - 1]
ALL_SMALL = list(range(0, 261))
LARGE = [511, 1024, 4099, 16 * 1024 - 1, 16 * 1024, 100_003, (1 << 20) + 13]


def rbytes(n: int) -> bytes:
    return RNG.randbytes(n)


def ref_b2(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def ref_chain(root: bytes, toks: bytes, block_size: int, extra: bytes) -> bytes:
    step = 4 * block_size
    out, parent = [], root
    for i in range(len(toks) // step):
        parent = ref_b2(parent + toks[i * step : (i + 1) * step] + extra)
        out.append(parent)
    return b"".join(out)


def rand_tokens(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)


# ---------------------------------------------------------------- BLAKE2b


def _cpu_has_avx2() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and " avx2" in line for line in cpuinfo.splitlines())


@pytest.fixture(params=["avx2", "scalar"])
def compression(request):
    """Run the test once with each BLAKE2b compression (set_simd), restoring the default."""
    if _native is None:
        pytest.skip("kvstore._native not built")
    use_simd = request.param == "avx2"
    if _native.set_simd(use_simd) != use_simd:
        _native.set_simd(True)
        pytest.skip("this CPU or build has no AVX2 compression")
    yield request.param
    _native.set_simd(True)


@needs_native
def test_set_simd_selects_the_compression():
    assert isinstance(_native.HAVE_AVX2, bool)
    if _cpu_has_avx2():  # on such machines both paths must really be under test
        assert _native.HAVE_AVX2
    try:
        assert _native.set_simd(False) is False
        assert _native.set_simd(True) is _native.HAVE_AVX2
        assert _native.set_simd(0) is False and _native.set_simd(1) is _native.HAVE_AVX2
    finally:
        _native.set_simd(True)


@needs_native
@pytest.mark.parametrize("n", ALL_SMALL + LARGE)
def test_blake2b16_matches_hashlib(n, compression):
    data = rbytes(n)
    assert _native.blake2b16(data) == ref_b2(data)


@needs_native
def test_blake2b16_accepts_any_contiguous_buffer():
    data = rbytes(1000)
    want = ref_b2(data[3:803])
    arr = np.frombuffer(data, dtype=np.uint8)
    assert _native.blake2b16(memoryview(data)[3:803]) == want
    assert _native.blake2b16(bytearray(data[3:803])) == want
    assert _native.blake2b16(arr[3:803]) == want
    assert _native.blake2b16(arr[3:803].view(np.int16).copy()) == want  # raw bytes, any dtype
    assert _native.blake2b16(arr[3:803].reshape(20, 40)) == want


# ---------------------------------------------------------------- XXH64


@needs_native
@pytest.mark.parametrize("n", ALL_SMALL + LARGE)
def test_xxh64_matches_xxhash(n):
    data = rbytes(n)
    for seed in SEEDS + [RNG.getrandbits(64)]:
        assert _native.xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed), seed
    assert _native.xxh64(data) == xxhash.xxh64_intdigest(data)


@needs_native
def test_xxh64_unaligned_views_and_keyword_seed():
    data = rbytes(5000)
    for off in range(9):
        view = memoryview(data)[off : off + 4000 - off]
        assert _native.xxh64(view, seed=7) == xxhash.xxh64_intdigest(bytes(view), 7)


@needs_native
def test_verify_checksum():
    data = rbytes(70_000)
    good = xxhash.xxh64_intdigest(data)
    assert _native.verify_checksum(data, good) is True
    assert _native.verify_checksum(data, good ^ 1) is False
    assert _native.verify_checksum(data, xxhash.xxh64_intdigest(data, 5), seed=5) is True
    flipped = bytearray(data)
    flipped[12345] ^= 0x10
    assert _native.verify_checksum(flipped, good) is False


@needs_native
@pytest.mark.parametrize(
    ("call", "exc", "msg"),
    [
        (lambda: _native.xxh64("text"), TypeError, "data must be a bytes-like"),
        (lambda: _native.xxh64(b"x", -1), ValueError, r"seed must be in \[0, 2\*\*64\)"),
        (lambda: _native.xxh64(b"x", 2**64), ValueError, "seed must be in"),
        (lambda: _native.xxh64(b"x", 1.5), TypeError, "seed must be an int"),
        (lambda: _native.xxh64(b"x", True), TypeError, "seed must be an int"),
        (lambda: _native.xxh64(np.zeros((4, 4), np.uint8)[:, 1]), ValueError, "C-contiguous"),
        (lambda: _native.blake2b16(None), TypeError, "data must be a bytes-like"),
        (lambda: _native.blake2b16(memoryview(b"abcdef")[::2]), ValueError, "C-contiguous"),
        (lambda: _native.verify_checksum(b"x", -5), ValueError, "expected must be in"),
        (lambda: _native.verify_checksum(b"x", "1"), TypeError, "expected must be an int"),
    ],
)
def test_hash_bad_inputs(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


# ---------------------------------------------------------------- chain_hash

# msg = 16 + 4*bs + len(extra): covers the one-compression path (<= 128 bytes),
# its exact boundary (bs=28, or bs=27 with 4 extra bytes) and the streaming path.
BLOCK_SIZES = [1, 2, 7, 16, 27, 28, 29, 32, 64, 100]
EXTRAS = [b"", b"m", b"\x00\x01\x02\x03", b"\x00\x01\x02\x03\x04", bytes(range(47)), rbytes(200)]


@needs_native
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("extra", EXTRAS, ids=lambda e: f"extra{len(e)}")
def test_chain_hash_matches_reference(block_size, extra, compression):
    root = rbytes(16)
    for ntok in (0, block_size - 1, block_size, 3 * block_size + 1, 301):
        toks = rand_tokens(max(ntok, 0))
        want = ref_chain(root, toks.tobytes(), block_size, extra)
        assert len(want) == 16 * (len(toks) // block_size)
        assert _native.chain_hash(root, toks, block_size, extra) == want
        assert _native.chain_hash(root, toks.tobytes(), block_size, extra=extra) == want
        assert _native.chain_hash(bytearray(root), memoryview(toks), block_size, extra) == want


@needs_native
def test_chain_hash_random_inputs_match_hashlib(compression):
    """Random roots, tokens, extras and block sizes on both sides of the
    one-block (128-byte message) boundary, compared with hashlib."""
    rng = random.Random(f"chain-{compression}")
    for case in range(300):
        block_size = rng.choice([rng.randint(1, 28), rng.randint(29, 80), 16])
        extra = rng.randbytes(rng.choice([0, 0, rng.randint(1, 16), rng.randint(17, 160)]))
        root = rng.randbytes(16)
        ntok = rng.randint(0, 6 * block_size + 3)
        toks = np.frombuffer(rng.randbytes(4 * ntok), dtype="<i4")
        want = ref_chain(root, toks.tobytes(), block_size, extra)
        got = _native.chain_hash(root, toks, block_size, extra)
        assert got == want, (case, block_size, len(extra), ntok)


@needs_native
def test_chain_hash_paths_agree_on_a_long_prompt():
    root = rbytes(16)
    toks = rand_tokens(32768 + 7)
    try:
        _native.set_simd(False)
        scalar = _native.chain_hash(root, toks, 16, b"tenant")
    finally:
        _native.set_simd(True)
    assert _native.chain_hash(root, toks, 16, b"tenant") == scalar
    assert scalar == ref_chain(root, toks.tobytes(), 16, b"tenant")


@needs_native
def test_chain_hash_is_hash_block_loop_and_ignores_partial_tail():
    root = hashing.BlockId(rbytes(16))
    toks = rand_tokens(16 * 9 + 5)
    packed = _native.chain_hash(root, toks, 16, b"lora:7")
    parent, ids = root, []
    for i in range(9):
        parent = hashing.hash_block(parent, toks[16 * i : 16 * (i + 1)], b"lora:7")
        ids.append(parent)
    assert packed == b"".join(ids)
    assert _native.chain_hash(root, toks[: 16 * 9], 16, b"lora:7") == packed
    # prefix property: the chain of a prefix is a prefix of the chain
    assert _native.chain_hash(root, toks[: 16 * 4], 16, b"lora:7") == packed[: 16 * 4]
    # extra=None and omitted mean no suffix
    assert _native.chain_hash(root, toks, 16) == _native.chain_hash(root, toks, 16, None)
    assert _native.chain_hash(root, toks, 16) == ref_chain(root, toks.tobytes(), 16, b"")


@needs_native
def test_chain_hash_long_prompt_and_threads():
    root = rbytes(16)
    toks = rand_tokens(32768)
    want = ref_chain(root, toks.tobytes(), 16, b"")
    results = [None] * 4

    def work(i):
        results[i] = _native.chain_hash(root, toks, 16, b"")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want] * 4


@needs_native
def test_chain_hash_distinguishes_inputs():
    root = rbytes(16)
    toks = rand_tokens(64)
    base = _native.chain_hash(root, toks, 16)
    other_root = bytes([root[0] ^ 1]) + root[1:]
    assert _native.chain_hash(other_root, toks, 16)[:16] != base[:16]
    changed = toks.copy()
    changed[40] ^= 1  # block 2: ids 0..1 equal, 2..3 differ
    out = _native.chain_hash(root, changed, 16)
    assert out[:32] == base[:32] and out[32:48] != base[32:48] and out[48:] != base[48:]
    assert _native.chain_hash(root, toks, 16, b"x") != base


@needs_native
@pytest.mark.parametrize(
    ("args", "exc", "msg"),
    [
        ((b"\0" * 15, b"", 16), ValueError, "root must be 16 bytes, got 15"),
        ((b"\0" * 17, b"", 16), ValueError, "root must be 16 bytes, got 17"),
        (("0" * 16, b"", 16), TypeError, "root must be a bytes-like"),
        ((b"\0" * 16, b"\0" * 6, 1), ValueError, "multiple of 4"),
        ((b"\0" * 16, np.zeros(8, np.int64), 2), TypeError, "int32.*format 'l'"),
        ((b"\0" * 16, np.zeros(8, np.uint32), 2), TypeError, "format 'I'"),
        ((b"\0" * 16, np.zeros(8, np.float32), 2), TypeError, "format 'f'"),
        ((b"\0" * 16, np.zeros(8, ">i4"), 2), TypeError, "format '>i'"),
        ((b"\0" * 16, np.zeros(16, np.int32)[::2], 2), ValueError, "C-contiguous"),
        ((b"\0" * 16, [1, 2, 3, 4], 2), TypeError, "tokens must be a bytes-like"),
        ((b"\0" * 16, b"", 0), ValueError, "block_size must be >= 1, got 0"),
        ((b"\0" * 16, b"", -3), ValueError, "block_size must be >= 1, got -3"),
        ((b"\0" * 16, b"", 2**80), ValueError, "block_size out of range"),
        ((b"\0" * 16, b"", 16.0), TypeError, "block_size must be an int"),
        ((b"\0" * 16, b"", True), TypeError, "block_size must be an int"),
        ((b"\0" * 16, b"", 16, "x"), TypeError, "extra must be a bytes-like"),
    ],
)
def test_chain_hash_bad_inputs(args, exc, msg):
    with pytest.raises(exc, match=msg):
        _native.chain_hash(*args)


@needs_native
def test_chain_hash_short_input_is_empty():
    assert _native.chain_hash(b"\0" * 16, np.arange(15, dtype=np.int32), 16) == b""
    assert _native.chain_hash(b"\0" * 16, b"", 1) == b""
    big = np.arange(40, dtype=np.int32)
    assert _native.chain_hash(b"\0" * 16, big, 2**40) == b""


# ---------------------------------------------------------------- hashing front


def test_tokens_to_bytes_canonical_across_containers():
    vals = [0, 1, -1, 2**31 - 1, -(2**31), 50256, 128000]
    want = np.array(vals, dtype="<i4").tobytes()
    forms = [
        vals,
        tuple(vals),
        np.array(vals, dtype=np.int64),
        np.array(vals, dtype=np.int32),
        np.array(vals, dtype=">i4"),
        np.array(vals, dtype=np.int64)[::-1][::-1],
        torch.tensor(vals, dtype=torch.int64),
        torch.tensor(vals, dtype=torch.int32),
        want,
        memoryview(want),
        bytearray(want),
    ]
    for form in forms:
        assert bytes(hashing.tokens_to_bytes(form)) == want, type(form)
    for dtype in (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.uint64):
        arr = np.array([0, 1, 100, 127], dtype=dtype)
        assert bytes(hashing.tokens_to_bytes(arr)) == arr.astype("<i4").tobytes()
    assert bytes(hashing.tokens_to_bytes(range(5))) == np.arange(5, dtype="<i4").tobytes()
    assert (
        bytes(hashing.tokens_to_bytes(torch.arange(10)[::2]))
        == np.arange(0, 10, 2, dtype="<i4").tobytes()
    )


@pytest.mark.parametrize(
    ("tokens", "exc", "msg"),
    [
        ([2**31], ValueError, "int32"),
        ([-(2**31) - 1], ValueError, "int32"),
        ([1, 2.5], ValueError, "integers"),
        (np.array([2**31], dtype=np.int64), ValueError, r"int32, got range \[2147483648"),
        (np.array([2**31], dtype=np.uint32), ValueError, "int32"),
        (np.array([2**63], dtype=np.uint64), ValueError, "int32"),
        (np.array([1.0, 2.0]), ValueError, "integer dtype, got float64"),
        (np.array([True]), ValueError, "integer dtype, got bool"),
        (np.zeros((2, 3), dtype=np.int32), ValueError, r"1-D, got shape \(2, 3\)"),
        (torch.tensor([1.0]), ValueError, "integer dtype"),
        (torch.tensor([True]), ValueError, "integer dtype"),
        (torch.tensor([-(2**31) - 1]), ValueError, "int32"),
        (b"\0" * 5, ValueError, "multiple of 4, got 5"),
        (memoryview(np.zeros(4, np.int32)), ValueError, "contiguous byte buffer"),
        ("1234", TypeError, "tokens must be"),
        ({1: 2}, TypeError, "tokens must be"),
    ],
)
def test_tokens_to_bytes_rejects(tokens, exc, msg):
    with pytest.raises(exc, match=msg):
        hashing.tokens_to_bytes(tokens)


def test_hash_block_is_blake2b_of_canonical_bytes():
    parent = rbytes(16)
    toks = [5, -7, 2**31 - 1, 0]
    want = ref_b2(parent + np.array(toks, "<i4").tobytes() + b"extra")
    assert hashing.hash_block(parent, toks, b"extra") == want
    assert hashing.hash_block(parent, np.array(toks), b"extra") == want
    assert hashing.hash_block(parent, torch.tensor(toks), b"extra") == want
    assert hashing.hash_block(parent, toks) == ref_b2(parent + np.array(toks, "<i4").tobytes())
    with pytest.raises(ValueError, match="parent must be 16 bytes"):
        hashing.hash_block(parent[:8], toks)
    with pytest.raises(TypeError, match="extra must be bytes"):
        hashing.hash_block(parent, toks, "extra")


@pytest.mark.parametrize("block_size", [1, 3, 16, 28, 29, 64])
@pytest.mark.parametrize(
    "extra", [b"", b"tenant-model", rbytes(120)], ids=lambda e: f"extra{len(e)}"
)
def test_hash_chain_front_and_fallback_agree(block_size, extra):
    root = hashing.BlockId(rbytes(16))
    toks = rand_tokens(7 * block_size + block_size // 2)
    want = ref_chain(root, toks.tobytes(), block_size, extra)
    assert hashing.hash_chain_packed(root, toks, block_size, extra) == want
    assert hashing.py_hash_chain_packed(root, toks, block_size, extra) == want
    assert hashing.py_hash_chain_packed(root, toks.tolist(), block_size, extra) == want
    assert hashing.hash_chain_packed(root, torch.from_numpy(toks).long(), block_size, extra) == want
    ids = hashing.hash_chain(root, toks.tolist(), block_size, extra)
    assert ids == hashing.py_hash_chain(root, toks, block_size, extra)
    assert len(ids) == 7 and all(isinstance(i, bytes) and len(i) == 16 for i in ids)
    assert hashing.pack_ids(ids) == want
    parent = root
    for i, block_id in enumerate(ids):
        parent = hashing.hash_block(parent, toks[i * block_size : (i + 1) * block_size], extra)
        assert block_id == parent


@pytest.mark.parametrize(
    "fn", [hashing.hash_chain_packed, hashing.py_hash_chain_packed, hashing.hash_chain]
)
def test_hash_chain_validation(fn):
    root = b"\0" * 16
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        fn(root, [1, 2], 0)
    with pytest.raises(TypeError, match="block_size must be an int"):
        fn(root, [1, 2], 2.0)
    with pytest.raises(ValueError, match="root must be 16 bytes, got 4"):
        fn(b"\0" * 4, [1, 2], 1)
    with pytest.raises(TypeError, match="root must be bytes"):
        fn("r" * 16, [1, 2], 1)
    with pytest.raises(ValueError, match="int32"):
        fn(root, [1, 2**40], 1)
    assert fn(root, [1, 2, 3], 4) in (b"", [])


def test_fallback_module_matches_native(monkeypatch):
    monkeypatch.setenv("KVSTORE_NO_NATIVE", "1")
    path = Path(hashing.__file__)
    spec = importlib.util.spec_from_file_location("kvstore_hashing_fallback", path)
    fallback = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fallback)
    assert fallback.NATIVE is False
    root = rbytes(16)
    toks = rand_tokens(1000)
    for bs in (1, 16, 50):
        assert fallback.hash_chain_packed(root, toks, bs, b"e") == hashing.hash_chain_packed(
            root, toks, bs, b"e"
        )


def test_split_and_pack_ids():
    ids = [rbytes(16) for _ in range(5)]
    packed = hashing.pack_ids(ids)
    assert packed == b"".join(ids)
    assert hashing.split_ids(packed) == ids
    assert hashing.split_ids(memoryview(packed)) == ids
    assert hashing.split_ids(b"") == [] and hashing.pack_ids([]) == b""
    with pytest.raises(ValueError, match="multiple of 16, got 33"):
        hashing.split_ids(packed[:33])
    with pytest.raises(ValueError, match="id #1 must be 16 bytes, got 15"):
        hashing.pack_ids([ids[0], ids[1][:15]])
    with pytest.raises(TypeError, match="id #0 must be bytes"):
        hashing.pack_ids(["x" * 16])


# ---------------------------------------------------------------- copies

NT_MIN = getattr(_native, "NT_MIN_BYTES", 128 * 1024)
COPY_SIZES = [
    0,
    1,
    15,
    16,
    17,
    31,
    63,
    64,
    65,
    1000,
    4096 + 3,
    NT_MIN - 1,
    NT_MIN,
    NT_MIN + 1,
    NT_MIN + 77,
    (2 << 20) + 5,
]


def _check_copy(copy_fn, n, src_off, dst_off, seed=None):
    src_buf = np.frombuffer(rbytes(n + 16), dtype=np.uint8)
    dst_buf = np.full(n + 64, 0xAB, dtype=np.uint8)
    src = src_buf[src_off : src_off + n]
    dst = memoryview(dst_buf)[dst_off : dst_off + n + 8]  # dst larger than src
    ret = copy_fn(dst, src) if seed is None else copy_fn(dst, src, seed)
    assert np.array_equal(dst_buf[dst_off : dst_off + n], src)
    assert (dst_buf[:dst_off] == 0xAB).all() and (dst_buf[dst_off + n :] == 0xAB).all()
    return ret, src


@needs_native
@pytest.mark.parametrize("n", COPY_SIZES)
def test_copy_checksum_copies_and_hashes(n):
    for src_off, dst_off in [(0, 0), (1, 0), (0, 1), (3, 13), (7, 15), (16, 8)]:
        seed = RNG.choice(SEEDS)
        got, src = _check_copy(_native.copy_checksum, n, src_off, dst_off, seed)
        assert got == xxhash.xxh64_intdigest(src.tobytes(), seed), (src_off, dst_off)
    got, src = _check_copy(_native.copy_checksum, n, 5, 3)
    assert got == xxhash.xxh64_intdigest(src.tobytes())


@needs_native
@pytest.mark.parametrize("n", COPY_SIZES)
def test_copy_nt_copies(n):
    for src_off, dst_off in [(0, 0), (5, 0), (0, 9), (2, 15)]:
        assert _check_copy(_native.copy_nt, n, src_off, dst_off)[0] is None


@needs_native
@pytest.mark.parametrize("n", [100, NT_MIN + 1000])
@pytest.mark.parametrize("shift", [-17, -1, 1, 33])
def test_copy_overlapping_hashes_original_source(n, shift):
    for fn in (_native.copy_checksum, _native.copy_nt):
        buf = bytearray(rbytes(n + 128))
        mv = memoryview(buf)
        s0 = 48
        original = bytes(buf[s0 : s0 + n])
        ret = fn(mv[s0 + shift : s0 + shift + n], mv[s0 : s0 + n])
        assert bytes(buf[s0 + shift : s0 + shift + n]) == original
        if fn is _native.copy_checksum:
            assert ret == xxhash.xxh64_intdigest(original)


@needs_native
def test_copy_checksum_large_blocks_into_slab():
    block = 2 << 20
    slab = np.zeros(4 * block, dtype=np.uint8)
    srcs = [np.frombuffer(rbytes(block), dtype=np.uint8) for _ in range(4)]
    for i, src in enumerate(srcs):
        assert _native.copy_checksum(
            slab[i * block : (i + 1) * block], src
        ) == xxhash.xxh64_intdigest(src)
    for i, src in enumerate(srcs):
        assert np.array_equal(slab[i * block : (i + 1) * block], src)


@needs_native
@pytest.mark.parametrize("fn", ["copy_checksum", "copy_nt"])
@pytest.mark.parametrize(
    ("dst", "src", "exc", "msg"),
    [
        (bytearray(3), b"abcd", ValueError, "dst is too small: 3 bytes < 4 bytes of src"),
        (b"xxxx", b"abcd", TypeError, "dst must be a writable buffer"),
        (None, b"ab", TypeError, "dst must be a bytes-like"),
        (bytearray(4), "abcd", TypeError, "src must be a bytes-like"),
        (np.zeros(8, np.uint8)[::2], b"ab", ValueError, "dst must be a C-contiguous"),
        (bytearray(8), memoryview(b"abcdefgh")[::2], ValueError, "src must be a C-contiguous"),
    ],
)
def test_copy_bad_inputs(fn, dst, src, exc, msg):
    with pytest.raises(exc, match=msg):
        getattr(_native, fn)(dst, src)


@needs_native
def test_copy_into_readonly_array_rejected():
    ro = np.zeros(8, np.uint8)
    ro.setflags(write=False)
    with pytest.raises(TypeError, match="dst must be a writable buffer"):
        _native.copy_checksum(ro, b"ab")
    with pytest.raises(ValueError, match="seed must be in"):
        _native.copy_checksum(bytearray(2), b"ab", -1)


# ---------------------------------------------------------------- checksum front


@pytest.mark.parametrize("n", [0, 7, 32, 1000, NT_MIN + 3])
def test_checksum_front_and_fallback(n):
    data = rbytes(n)
    want = xxhash.xxh64_intdigest(data)
    assert cks.checksum(data) == want == cks.py_checksum(data)
    assert cks.checksum(np.frombuffer(data, np.uint8)) == want
    assert cks.py_checksum(np.frombuffer(data, np.uint8)) == want
    assert cks.verify(data, want) and cks.py_verify(data, want)
    assert not cks.verify(data, want ^ 0xFF) and not cks.py_verify(data, want ^ 0xFF)
    for copy in (cks.copy_with_checksum, cks.py_copy_with_checksum):
        dst = bytearray(b"\xee" * (n + 3))
        assert copy(memoryview(dst)[1:], memoryview(data)) == want
        assert bytes(dst[1 : n + 1]) == data and dst[0] == 0xEE and dst[n + 1 :] == b"\xee\xee"


def test_checksum_fallback_errors_match_native_types():
    for copy in (cks.copy_with_checksum, cks.py_copy_with_checksum):
        with pytest.raises(ValueError, match="dst is too small"):
            copy(bytearray(1), b"ab")
        with pytest.raises(TypeError, match="writable"):
            copy(b"xx", b"ab")
        with pytest.raises(TypeError, match="bytes-like"):
            copy(bytearray(2), "ab")
    for check in (cks.checksum, cks.py_checksum):
        with pytest.raises(ValueError, match="C-contiguous"):
            check(np.zeros(8, np.uint8)[::2])
    for ver in (cks.verify, cks.py_verify):
        with pytest.raises(ValueError, match="expected must be in"):
            ver(b"x", -1)
    assert cks.py_checksum(np.arange(4, dtype=np.int64)) == xxhash.xxh64_intdigest(
        np.arange(4, dtype=np.int64).tobytes()
    )
