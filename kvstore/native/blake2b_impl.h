/* Internal to blake2b.c and blake2b_avx2.c: the constants (static, so each
 * file folds the sigma lookups of its unrolled rounds into immediates) and
 * the AVX2 entry points. */
#ifndef KV_NATIVE_BLAKE2B_IMPL_H
#define KV_NATIVE_BLAKE2B_IMPL_H

#include "blake2b.h"

static const uint64_t b2_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t b2_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

/* Parameter block word 0: digest length 16, key length 0, fanout 1,
 * depth 1; all other parameter words are zero. */
#define B2_PARAM0 (0x01010000ULL | B2_OUT)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KV_AVX2_BUILD 1
/* Same contract as b2_compress_scalar (x86-64 is little-endian). */
void b2_compress_avx2(uint64_t h[8], const uint8_t block[B2_BLOCK], uint64_t t0, uint64_t t1,
                      int last);
/* b2_chain's one-compression case (see blake2b_avx2.c). */
void b2_chain1_avx2(const uint8_t *prev, const uint8_t *tok, size_t tb, size_t nblocks,
                    uint64_t m[16], uint64_t msglen, uint8_t *out);
#else
#define KV_AVX2_BUILD 0
#endif

/* CPU has AVX2 (and the OS saves YMM state); 0 where KV_AVX2_BUILD is 0. */
int b2_cpu_avx2(void);

#endif /* KV_NATIVE_BLAKE2B_IMPL_H */
