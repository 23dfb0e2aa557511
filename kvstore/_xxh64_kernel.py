"""The Triton kernel behind kvstore.device_hash (imported only when triton is installed).

XXH64 (seed 0), the specification's algorithm: four lane accumulators over 32-byte
stripes, their merge, the 8-, 4- and 1-byte tail, the avalanche. One program per slot,
scalar code: launched with one warp (more would only repeat the same work).
"""

import triton
import triton.language as tl

_P1 = tl.constexpr(0x9E3779B185EBCA87)
_P2 = tl.constexpr(0xC2B2AE3D27D4EB4F)
_P3 = tl.constexpr(0x165667B19E3779F9)
_P4 = tl.constexpr(0x85EBCA77C2B2AE63)
_P5 = tl.constexpr(0x27D4EB2F165667C5)


@triton.jit
def _rotl(x, r: tl.constexpr):
    return (x << r) | (x >> (64 - r))


@triton.jit
def _round(acc, x):
    return _rotl(acc + x * _P2, 31) * _P1


@triton.jit
def _word(p):
    return tl.load(p).to(tl.uint64, bitcast=True)


@triton.jit
def _u64(x):
    return tl.full((), 0, tl.uint64) + x


@triton.jit(do_not_specialize=["slot_words", "nbytes"])  # one compile for every size
def xxh64_slots(w64, w32, w8, slots, out, slot_words, nbytes, UNROLL: tl.constexpr):
    """out[i] = XXH64 of the first `nbytes` of slot slots[i]; w64/w32/w8: the pool as
    int64/int32/uint8 (slot_words 8-byte words a slot)."""
    pid = tl.program_id(0)
    slot = tl.load(slots + pid).to(tl.int64)
    p64 = w64 + slot * slot_words
    n_stripes = nbytes // 32
    h = _u64(_P5)
    if n_stripes > 0:
        v1 = _u64(_P1) + _P2
        v2 = _u64(_P2)
        v3 = _u64(0)
        v4 = _u64(0) - _P1
        steps = n_stripes // UNROLL
        for i in range(steps):  # UNROLL stripes: their loads are independent of the chain
            q = p64 + i * (4 * UNROLL)
            for j in tl.static_range(UNROLL):
                v1 = _round(v1, _word(q + 4 * j))
                v2 = _round(v2, _word(q + 4 * j + 1))
                v3 = _round(v3, _word(q + 4 * j + 2))
                v4 = _round(v4, _word(q + 4 * j + 3))
        for s in range(steps * UNROLL, n_stripes):
            q = p64 + 4 * s
            v1 = _round(v1, _word(q))
            v2 = _round(v2, _word(q + 1))
            v3 = _round(v3, _word(q + 2))
            v4 = _round(v4, _word(q + 3))
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = (h ^ _round(_u64(0), v1)) * _P1 + _P4
        h = (h ^ _round(_u64(0), v2)) * _P1 + _P4
        h = (h ^ _round(_u64(0), v3)) * _P1 + _P4
        h = (h ^ _round(_u64(0), v4)) * _P1 + _P4
    h = h + _u64(nbytes)
    for k in range(n_stripes * 4, nbytes // 8):  # 8-byte words left
        h = h ^ _round(_u64(0), _word(p64 + k))
        h = _rotl(h, 27) * _P1 + _P4
    done = (nbytes // 8) * 8
    if nbytes - done >= 4:
        lo = tl.load(w32 + slot * slot_words * 2 + done // 4).to(tl.uint32, bitcast=True)
        h = h ^ (lo.to(tl.uint64) * _P1)
        h = _rotl(h, 23) * _P2 + _P3
    for b in range(done + (nbytes - done) // 4 * 4, nbytes):  # single bytes left
        byte = tl.load(w8 + slot * slot_words * 8 + b).to(tl.uint64)
        h = h ^ (byte * _P5)
        h = _rotl(h, 11) * _P1
    h = h ^ (h >> 33)
    h = h * _P2
    h = h ^ (h >> 29)
    h = h * _P3
    h = h ^ (h >> 32)
    tl.store(out + pid, h.to(tl.int64, bitcast=True))
