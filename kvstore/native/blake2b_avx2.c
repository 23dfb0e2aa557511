/* BLAKE2b compression with AVX2 (blake2b.c chooses it at run time).
 * The 4x4 state is held as four rows a = v0..v3, b = v4..v7, c = v8..v11,
 * d = v12..v15, one 256-bit register each, so one vector G mixes all four
 * columns at once.  A chain is one long dependency, so what counts is the
 * latency of a compression.  For the diagonal step the rows a, c and d are
 * rotated across lanes and b stays put: b is the last value G produces, so
 * the lane permutes (several cycles each) overlap with its final
 * xor/rotate instead of sitting on the critical path (rotating b, c, d
 * instead measured 174 vs 140 ns per compression on Zen 3).  Lane j then
 * holds the diagonal through v(4+j): (v3,v4,v9,v14), (v0,v5,v10,v15),
 * (v1,v6,v11,v12), (v2,v7,v8,v13), which take message words
 * sigma[14..15], [8..9], [10..11], [12..13].
 * Compiled for AVX2 by function attribute and chosen at run time, so the
 * module still builds and runs for baseline x86-64 and on other CPUs. */
#include "blake2b_impl.h"

#if KV_AVX2_BUILD
#include <immintrin.h>
#define KV_AVX2 __attribute__((target("avx2")))
#define KV_AVX2_INLINE static inline __attribute__((always_inline, target("avx2")))

/* Message vector with m[i] in lane 0 .. m[l] in lane 3. */
#define B2V_MSG(i, j, k, l) \
    _mm256_set_epi64x((long long)m[l], (long long)m[k], (long long)m[j], (long long)m[i])
#define B2V_ROT63(x) _mm256_or_si256(_mm256_srli_epi64((x), 63), _mm256_add_epi64((x), (x)))
#define B2V_LANES(x, imm) _mm256_permute4x64_epi64((x), (imm))

/* a + x first, then + b: b is the late operand (end of the previous step).
 * The empty asm keeps the compiler from reassociating to a + (b + x), which
 * would put two adds after b on the critical path. */
#define B2V_ADD3(a, x, b)                  \
    do {                                   \
        a = _mm256_add_epi64(a, (x));      \
        __asm__("" : "+x"(a));             \
        a = _mm256_add_epi64(a, b);        \
    } while (0)

#define B2V_G(x, y)                                                                \
    do {                                                                           \
        B2V_ADD3(a, x, b);                                                         \
        d = _mm256_shuffle_epi32(_mm256_xor_si256(d, a), _MM_SHUFFLE(2, 3, 0, 1)); \
        c = _mm256_add_epi64(c, d);                                                \
        b = _mm256_shuffle_epi8(_mm256_xor_si256(b, c), rot24);                    \
        B2V_ADD3(a, y, b);                                                         \
        d = _mm256_shuffle_epi8(_mm256_xor_si256(d, a), rot16);                    \
        c = _mm256_add_epi64(c, d);                                                \
        b = B2V_ROT63(_mm256_xor_si256(b, c));                                     \
    } while (0)

#define B2V_ROUND(r)                                                                 \
    do {                                                                             \
        const uint8_t *s_ = b2_sigma[r];                                             \
        B2V_G(B2V_MSG(s_[0], s_[2], s_[4], s_[6]), B2V_MSG(s_[1], s_[3], s_[5], s_[7])); \
        a = B2V_LANES(a, _MM_SHUFFLE(2, 1, 0, 3)); /* lane j <- v((j+3)%4)    */    \
        c = B2V_LANES(c, _MM_SHUFFLE(0, 3, 2, 1)); /* lane j <- v(8+(j+1)%4)  */    \
        d = B2V_LANES(d, _MM_SHUFFLE(1, 0, 3, 2)); /* lane j <- v(12+(j+2)%4) */    \
        B2V_G(B2V_MSG(s_[14], s_[8], s_[10], s_[12]),                                \
              B2V_MSG(s_[15], s_[9], s_[11], s_[13]));                               \
        a = B2V_LANES(a, _MM_SHUFFLE(0, 3, 2, 1));                                   \
        c = B2V_LANES(c, _MM_SHUFFLE(2, 1, 0, 3));                                   \
        d = B2V_LANES(d, _MM_SHUFFLE(1, 0, 3, 2));                                   \
    } while (0)

/* The 12 rounds on rows v[0..3] with message words m (host order). */
KV_AVX2_INLINE void b2v_rounds(__m256i v[4], const uint64_t m[16]) {
    /* Byte shuffles rotating each 64-bit lane right by 24 and 16 bits. */
    const __m256i rot24 = _mm256_setr_epi8(
        3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10,
        3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10);
    const __m256i rot16 = _mm256_setr_epi8(
        2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9,
        2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9);
    __m256i a = v[0], b = v[1], c = v[2], d = v[3];
    B2V_ROUND(0); B2V_ROUND(1); B2V_ROUND(2); B2V_ROUND(3); B2V_ROUND(4); B2V_ROUND(5);
    B2V_ROUND(6); B2V_ROUND(7); B2V_ROUND(8); B2V_ROUND(9); B2V_ROUND(10); B2V_ROUND(11);
    v[0] = a; v[1] = b; v[2] = c; v[3] = d;
}

/* Row d of the initial state: IV[4..7] ^ (t0, t1, last flag, 0). */
KV_AVX2_INLINE __m256i b2v_row3(uint64_t t0, uint64_t t1, int last) {
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b2_iv + 4)),
                            _mm256_set_epi64x(0, last ? -1LL : 0, (long long)t1, (long long)t0));
}

KV_AVX2 void b2_compress_avx2(uint64_t h[8], const uint8_t block[B2_BLOCK], uint64_t t0,
                              uint64_t t1, int last) {
    uint64_t m[16];
    memcpy(m, block, B2_BLOCK);
    __m256i h0 = _mm256_loadu_si256((const __m256i *)h);
    __m256i h1 = _mm256_loadu_si256((const __m256i *)(h + 4));
    __m256i v[4] = {h0, h1, _mm256_loadu_si256((const __m256i *)b2_iv), b2v_row3(t0, t1, last)};
    b2v_rounds(v, m);
    _mm256_storeu_si256((__m256i *)h, _mm256_xor_si256(h0, _mm256_xor_si256(v[0], v[2])));
    _mm256_storeu_si256((__m256i *)(h + 4), _mm256_xor_si256(h1, _mm256_xor_si256(v[1], v[3])));
}

/* b2_chain's one-compression case: m holds the constant tail of the
 * message (extra, zero padding); parent and tokens are written per block.
 * Only h[0..1] (the 16-byte digest) is computed. */
KV_AVX2 void b2_chain1_avx2(const uint8_t *prev, const uint8_t *tok, size_t tb,
                            size_t nblocks, uint64_t m[16], uint64_t msglen, uint8_t *out) {
    const __m256i iv0 = _mm256_loadu_si256((const __m256i *)b2_iv);
    const __m256i h0 = _mm256_xor_si256(iv0, _mm256_set_epi64x(0, 0, 0, (long long)B2_PARAM0));
    const __m256i h1 = _mm256_loadu_si256((const __m256i *)(b2_iv + 4));
    const __m256i row3 = b2v_row3(msglen, 0, 1);
    for (size_t i = 0; i < nblocks; i++) {
        memcpy(m, prev, B2_OUT);
        memcpy((uint8_t *)m + B2_OUT, tok + i * tb, tb);
        __m256i v[4] = {h0, h1, iv0, row3};
        b2v_rounds(v, m);
        __m256i hn = _mm256_xor_si256(h0, _mm256_xor_si256(v[0], v[2]));
        _mm_storeu_si128((__m128i *)out, _mm256_castsi256_si128(hn));
        prev = out;
        out += B2_OUT;
    }
}

/* CPU has AVX2 (and the OS saves YMM state: libgcc/compiler-rt check XCR0). */
int b2_cpu_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
}
#else
int b2_cpu_avx2(void) { return 0; }
#endif /* KV_AVX2_BUILD */
