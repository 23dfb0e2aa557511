/* Copy kernels: plain or non-temporal copies, and the fused copy+XXH64 that
 * moves a block into a slab and checksums it in one pass. */
#ifndef KV_NATIVE_COPY_H
#define KV_NATIVE_COPY_H

#include "common.h"

#ifdef __SSE2__
#define KV_HAVE_SSE2 1
#else
#define KV_HAVE_SSE2 0
#endif

/* Below this size non-temporal stores do not pay off: use memcpy. */
#define NT_MIN_BYTES ((size_t)128 * 1024)

static inline int ranges_overlap(const uint8_t *a, size_t an, const uint8_t *b, size_t bn) {
    uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    return a0 < b0 + bn && b0 < a0 + an;
}

/* dst[0..n) = src[0..n), non-temporal when large; the ranges must not overlap. */
void copy_plain_or_nt(uint8_t *dst, const uint8_t *src, size_t n);
/* The same copy, returning the XXH64 (seed) of the bytes written into dst (each
 * word loaded once, hashed and stored from one register: neither side changing
 * meanwhile can make them differ); the ranges
 * must not overlap. */
uint64_t copy_hash(uint8_t *dst, const uint8_t *src, size_t n, uint64_t seed);

#endif /* KV_NATIVE_COPY_H */
