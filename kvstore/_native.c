/*
 * kvstore._native -- hot-path primitives for the KV-cache store.
 *
 *   chain_hash(root, tokens, block_size, extra=b"") -> bytes
 *   blake2b16(data) -> bytes
 *   xxh64(data, seed=0) -> int
 *   copy_checksum(dst, src, seed=0) -> int
 *   copy_nt(dst, src) -> None
 *   verify_checksum(data, expected, seed=0) -> bool
 *   set_simd(enabled) -> bool    (AVX2 or scalar BLAKE2b; HAVE_AVX2 says
 *                                 whether this CPU and build have AVX2)
 *
 * BLAKE2b follows RFC 7693 (sequential mode, unkeyed, 16-byte digest).
 * XXH64 follows the xxHash specification.  Both are written from the specs;
 * the Python front-ends (kvstore/hashing.py, kvstore/checksum.py) hold the
 * reference definitions and the tests check bit-identity against hashlib and
 * the xxhash package.
 *
 * Every function accepts any C-contiguous object exporting the buffer
 * protocol and releases the GIL while it works on large inputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#ifdef __SSE2__
#include <emmintrin.h>
#define KV_HAVE_SSE2 1
#else
#define KV_HAVE_SSE2 0
#endif

#if PY_BIG_ENDIAN
#define KV_LITTLE_ENDIAN 0
#else
#define KV_LITTLE_ENDIAN 1
#endif

/* Inputs at least this large are processed with the GIL released. */
#define GIL_RELEASE_BYTES ((Py_ssize_t)16 * 1024)
#define RELEASE_GIL_IF(big) PyThreadState *ts_ = (big) ? PyEval_SaveThread() : NULL
#define REACQUIRE_GIL() if (ts_) PyEval_RestoreThread(ts_)
/* Software prefetch distance for the fused copy+hash loop. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif

/* Prefetching past the end of a buffer is harmless (no fault). */
#if defined(__GNUC__) || defined(__clang__)
#define KV_PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#else
#define KV_PREFETCH(p) ((void)0)
#endif
/* Below this size non-temporal stores do not pay off: use memcpy. */
#define NT_MIN_BYTES ((size_t)128 * 1024)

/* ---- Little-endian loads/stores ---------------------------------------- */

static inline uint64_t load64_le(const uint8_t *p) {
#if KV_LITTLE_ENDIAN
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) |
           ((uint64_t)p[5] << 40) | ((uint64_t)p[6] << 48) |
           ((uint64_t)p[7] << 56);
#endif
}

static inline uint32_t load32_le(const uint8_t *p) {
#if KV_LITTLE_ENDIAN
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#else
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
#endif
}

static inline void store64_le(uint8_t *p, uint64_t v) {
#if KV_LITTLE_ENDIAN
    memcpy(p, &v, 8);
#else
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
#endif
}

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }
static inline uint64_t rotl64(uint64_t x, unsigned n) { return (x << n) | (x >> (64 - n)); }

/* ---- BLAKE2b (RFC 7693) ------------------------------------------------ */

#define B2_BLOCK 128
#define B2_OUT 16

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

#define B2_G(a, b, c, d, x, y)                                     \
    do {                                                           \
        a = a + b + (x); d = rotr64(d ^ a, 32);                    \
        c = c + d;       b = rotr64(b ^ c, 24);                    \
        a = a + b + (y); d = rotr64(d ^ a, 16);                    \
        c = c + d;       b = rotr64(b ^ c, 63);                    \
    } while (0)

#define B2_ROUND(r)                                                            \
    do {                                                                       \
        B2_G(v0, v4, v8, v12, m[b2_sigma[r][0]], m[b2_sigma[r][1]]);           \
        B2_G(v1, v5, v9, v13, m[b2_sigma[r][2]], m[b2_sigma[r][3]]);           \
        B2_G(v2, v6, v10, v14, m[b2_sigma[r][4]], m[b2_sigma[r][5]]);          \
        B2_G(v3, v7, v11, v15, m[b2_sigma[r][6]], m[b2_sigma[r][7]]);          \
        B2_G(v0, v5, v10, v15, m[b2_sigma[r][8]], m[b2_sigma[r][9]]);          \
        B2_G(v1, v6, v11, v12, m[b2_sigma[r][10]], m[b2_sigma[r][11]]);        \
        B2_G(v2, v7, v8, v13, m[b2_sigma[r][12]], m[b2_sigma[r][13]]);         \
        B2_G(v3, v4, v9, v14, m[b2_sigma[r][14]], m[b2_sigma[r][15]]);         \
    } while (0)

/* Compression function F: h is updated in place.  t0/t1 is the 128-bit byte
 * counter including this block; last is nonzero for the final block. */
static inline void b2_compress_scalar(uint64_t h[8], const uint8_t block[B2_BLOCK],
                                      uint64_t t0, uint64_t t1, int last) {
    uint64_t m[16];
    for (int i = 0; i < 16; i++) m[i] = load64_le(block + 8 * i);
    uint64_t v0 = h[0], v1 = h[1], v2 = h[2], v3 = h[3];
    uint64_t v4 = h[4], v5 = h[5], v6 = h[6], v7 = h[7];
    uint64_t v8 = b2_iv[0], v9 = b2_iv[1], v10 = b2_iv[2], v11 = b2_iv[3];
    uint64_t v12 = b2_iv[4] ^ t0, v13 = b2_iv[5] ^ t1;
    uint64_t v14 = last ? ~b2_iv[6] : b2_iv[6], v15 = b2_iv[7];

    B2_ROUND(0); B2_ROUND(1); B2_ROUND(2); B2_ROUND(3); B2_ROUND(4); B2_ROUND(5);
    B2_ROUND(6); B2_ROUND(7); B2_ROUND(8); B2_ROUND(9); B2_ROUND(10); B2_ROUND(11);

    h[0] ^= v0 ^ v8;  h[1] ^= v1 ^ v9;  h[2] ^= v2 ^ v10; h[3] ^= v3 ^ v11;
    h[4] ^= v4 ^ v12; h[5] ^= v5 ^ v13; h[6] ^= v6 ^ v14; h[7] ^= v7 ^ v15;
}

/* ---- BLAKE2b compression with AVX2 ------------------------------------- *
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
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KV_AVX2_BUILD 1
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

/* Same contract as b2_compress_scalar (x86-64 is little-endian). */
static KV_AVX2 void b2_compress_avx2(uint64_t h[8], const uint8_t block[B2_BLOCK], uint64_t t0,
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
static KV_AVX2 void b2_chain1_avx2(const uint8_t *prev, const uint8_t *tok, size_t tb,
                                   size_t nblocks, uint64_t m[16], uint64_t msglen,
                                   uint8_t *out) {
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
static int kv_cpu_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
}
#else
#define KV_AVX2_BUILD 0
static int kv_cpu_avx2(void) { return 0; }
#endif

/* Nonzero: use the AVX2 compression.  Set at import from the CPU and by
 * set_simd(); every path computes identical digests, so a change while
 * another thread hashes only changes its speed. */
static int kv_use_avx2 = 0;

static inline void b2_compress(uint64_t h[8], const uint8_t block[B2_BLOCK], uint64_t t0,
                               uint64_t t1, int last) {
#if KV_AVX2_BUILD
    if (kv_use_avx2) {
        b2_compress_avx2(h, block, t0, t1, last);
        return;
    }
#endif
    b2_compress_scalar(h, block, t0, t1, last);
}

typedef struct {
    uint64_t h[8];
    uint64_t t0, t1;
    size_t buflen;
    uint8_t buf[B2_BLOCK];
} b2_state;

static inline void b2_init16(b2_state *s) {
    for (int i = 0; i < 8; i++) s->h[i] = b2_iv[i];
    s->h[0] ^= B2_PARAM0;
    s->t0 = s->t1 = 0;
    s->buflen = 0;
}

static inline void b2_count(b2_state *s, uint64_t n) {
    s->t0 += n;
    if (s->t0 < n) s->t1++;
}

/* The final block must be compressed with the "last" flag, so a full buffer
 * is only compressed once more input is known to follow. */
static void b2_update(b2_state *s, const uint8_t *in, size_t inlen) {
    if (inlen == 0) return;
    size_t fill = B2_BLOCK - s->buflen;
    if (inlen > fill) {
        memcpy(s->buf + s->buflen, in, fill);
        b2_count(s, B2_BLOCK);
        b2_compress(s->h, s->buf, s->t0, s->t1, 0);
        s->buflen = 0;
        in += fill;
        inlen -= fill;
        while (inlen > B2_BLOCK) {
            b2_count(s, B2_BLOCK);
            b2_compress(s->h, in, s->t0, s->t1, 0);
            in += B2_BLOCK;
            inlen -= B2_BLOCK;
        }
    }
    memcpy(s->buf + s->buflen, in, inlen);
    s->buflen += inlen;
}

static void b2_final16(b2_state *s, uint8_t out[B2_OUT]) {
    b2_count(s, s->buflen);
    memset(s->buf + s->buflen, 0, B2_BLOCK - s->buflen);
    b2_compress(s->h, s->buf, s->t0, s->t1, 1);
    store64_le(out, s->h[0]);
    store64_le(out + 8, s->h[1]);
}

/* ids[i] = BLAKE2b-128(ids[i-1] || tokens[i*tb : (i+1)*tb] || extra) */
static void b2_chain(const uint8_t root[B2_OUT], const uint8_t *tok, size_t tb, size_t nblocks,
                     const uint8_t *extra, size_t el, uint8_t *out) {
    const uint8_t *prev = root;
    size_t msglen = B2_OUT + tb + el;

    if (msglen <= B2_BLOCK) {
        /* Fast path: each id is exactly one compression.  The padding and
         * the extra suffix are fixed; only parent and tokens change. */
        uint64_t m[B2_BLOCK / 8];
        uint8_t *block = (uint8_t *)m;
        memset(block, 0, sizeof(m));
        if (el) memcpy(block + B2_OUT + tb, extra, el);
#if KV_AVX2_BUILD
        if (kv_use_avx2) {
            b2_chain1_avx2(prev, tok, tb, nblocks, m, (uint64_t)msglen, out);
            return;
        }
#endif
        for (size_t i = 0; i < nblocks; i++) {
            uint64_t h[8];
            memcpy(block, prev, B2_OUT);
            memcpy(block + B2_OUT, tok + i * tb, tb);
            for (int k = 0; k < 8; k++) h[k] = b2_iv[k];
            h[0] ^= B2_PARAM0;
            b2_compress_scalar(h, block, (uint64_t)msglen, 0, 1);
            store64_le(out, h[0]);
            store64_le(out + 8, h[1]);
            prev = out;
            out += B2_OUT;
        }
        return;
    }
    for (size_t i = 0; i < nblocks; i++) {
        b2_state s;
        b2_init16(&s);
        b2_update(&s, prev, B2_OUT);
        b2_update(&s, tok + i * tb, tb);
        b2_update(&s, extra, el);
        b2_final16(&s, out);
        prev = out;
        out += B2_OUT;
    }
}

/* ---- XXH64 ------------------------------------------------------------- */

#define XP1 0x9E3779B185EBCA87ULL
#define XP2 0xC2B2AE3D27D4EB4FULL
#define XP3 0x165667B19E3779F9ULL
#define XP4 0x85EBCA77C2B2AE63ULL
#define XP5 0x27D4EB2F165667C5ULL

static inline uint64_t xx_round(uint64_t acc, uint64_t input) {
    acc += input * XP2;
    acc = rotl64(acc, 31);
    return acc * XP1;
}

static inline uint64_t xx_merge(uint64_t acc, uint64_t val) {
    acc ^= xx_round(0, val);
    return acc * XP1 + XP4;
}

typedef struct {
    uint64_t v[4];
    uint64_t seed;
} xx_state;

static inline void xx_init(xx_state *s, uint64_t seed) {
    s->seed = seed;
    s->v[0] = seed + XP1 + XP2; s->v[1] = seed + XP2; s->v[2] = seed; s->v[3] = seed - XP1;
}

#define XX_STRIPE(p)                                                        \
    do {                                                                    \
        v1 = xx_round(v1, load64_le(p));      v2 = xx_round(v2, load64_le((p) + 8));  \
        v3 = xx_round(v3, load64_le((p) + 16)); v4 = xx_round(v4, load64_le((p) + 24)); \
    } while (0)

/* Consume n 32-byte stripes. */
static inline void xx_stripes(xx_state *s, const uint8_t *p, size_t n) {
    uint64_t v1 = s->v[0], v2 = s->v[1], v3 = s->v[2], v4 = s->v[3];
    for (; n >= 2; n -= 2, p += 64) {
        KV_PREFETCH(p + PREFETCH_AHEAD);
        XX_STRIPE(p);
        XX_STRIPE(p + 32);
    }
    if (n) XX_STRIPE(p);
    s->v[0] = v1; s->v[1] = v2; s->v[2] = v3; s->v[3] = v4;
}

/* total: length of the whole input; tail: its last total % 32 bytes. */
static uint64_t xx_finish(const xx_state *s, uint64_t total, const uint8_t *tail) {
    uint64_t h;
    size_t len = (size_t)(total & 31);
    if (total >= 32) {
        h = rotl64(s->v[0], 1) + rotl64(s->v[1], 7) + rotl64(s->v[2], 12) +
            rotl64(s->v[3], 18);
        for (int i = 0; i < 4; i++) h = xx_merge(h, s->v[i]);
    } else {
        h = s->seed + XP5;
    }
    h += total;
    for (; len >= 8; len -= 8, tail += 8) {
        h ^= xx_round(0, load64_le(tail));
        h = rotl64(h, 27) * XP1 + XP4;
    }
    if (len >= 4) {
        h ^= (uint64_t)load32_le(tail) * XP1;
        h = rotl64(h, 23) * XP2 + XP3;
        tail += 4;
        len -= 4;
    }
    for (; len > 0; len--, tail++) {
        h ^= (uint64_t)(*tail) * XP5;
        h = rotl64(h, 11) * XP1;
    }
    h ^= h >> 33; h *= XP2;
    h ^= h >> 29; h *= XP3;
    h ^= h >> 32;
    return h;
}

static uint64_t xxh64_buf(const uint8_t *p, size_t n, uint64_t seed) {
    xx_state s;
    xx_init(&s, seed);
    size_t stripes = n / 32;
    xx_stripes(&s, p, stripes);
    return xx_finish(&s, (uint64_t)n, p + stripes * 32);
}

/* ---- Copies ------------------------------------------------------------ */

#if KV_HAVE_SSE2
/* 64 bytes from src (any alignment) to dst (16-byte aligned), bypassing the cache. */
#define NT_STORE64(d, s)                                                           \
    do {                                                                           \
        __m128i a_ = _mm_loadu_si128((const __m128i *)(s));                        \
        __m128i b_ = _mm_loadu_si128((const __m128i *)((s) + 16));                 \
        __m128i c_ = _mm_loadu_si128((const __m128i *)((s) + 32));                 \
        __m128i d_ = _mm_loadu_si128((const __m128i *)((s) + 48));                 \
        _mm_stream_si128((__m128i *)(d), a_);                                      \
        _mm_stream_si128((__m128i *)((d) + 16), b_);                               \
        _mm_stream_si128((__m128i *)((d) + 32), c_);                               \
        _mm_stream_si128((__m128i *)((d) + 48), d_);                               \
    } while (0)
#endif

/* Copy with non-temporal stores (no trailing sfence: callers fence once). */
static void nt_copy(uint8_t *dst, const uint8_t *src, size_t n) {
#if KV_HAVE_SSE2
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    if (head) {
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
    }
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        KV_PREFETCH(src + PREFETCH_AHEAD);
        NT_STORE64(dst, src);
    }
    for (; n >= 16; n -= 16, dst += 16, src += 16)
        _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
    if (n) memcpy(dst, src, n);
#else
    memcpy(dst, src, n);
#endif
}

static inline void nt_fence(void) {
#if KV_HAVE_SSE2
    _mm_sfence();
#endif
}

static inline int ranges_overlap(const uint8_t *a, size_t an, const uint8_t *b, size_t bn) {
    uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    return a0 < b0 + bn && b0 < a0 + an;
}

static void copy_plain_or_nt(uint8_t *dst, const uint8_t *src, size_t n) {
    if (n < NT_MIN_BYTES || !KV_HAVE_SSE2) {
        memcpy(dst, src, n);
        return;
    }
    nt_copy(dst, src, n);
    nt_fence();
}

/* One pass over src: every 64-byte step hashes two XXH64 stripes and
 * streams the same (L1-hot) bytes into dst.  The hash is latency-bound on
 * its multiply chains, which leaves issue slots for the loads and the
 * non-temporal stores, so the two overlap instead of running back to back.
 * Hash stripes are aligned to src; the copy is aligned to dst and runs
 * ahead of the hash by `head` (< 16) bytes. */
static uint64_t copy_hash(uint8_t *dst, const uint8_t *src, size_t n, uint64_t seed) {
    if (n < NT_MIN_BYTES || !KV_HAVE_SSE2) {
        uint64_t h = xxh64_buf(src, n, seed);
        memcpy(dst, src, n);
        return h;
    }
#if KV_HAVE_SSE2
    xx_state s;
    xx_init(&s, seed);
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* n >= NT_MIN_BYTES > 15 */
    memcpy(dst, src, head);
    size_t steps = (n - head) / 64; /* full 64-byte copy steps after head */
    uint64_t v1 = s.v[0], v2 = s.v[1], v3 = s.v[2], v4 = s.v[3];
    const uint8_t *hp = src;
    const uint8_t *cs = src + head;
    uint8_t *cd = dst + head;
    for (size_t k = 0; k < steps; k++, hp += 64, cs += 64, cd += 64) {
        KV_PREFETCH(hp + PREFETCH_AHEAD);
        XX_STRIPE(hp);
        XX_STRIPE(hp + 32);
        NT_STORE64(cd, cs);
    }
    s.v[0] = v1; s.v[1] = v2; s.v[2] = v3; s.v[3] = v4;
    /* Remaining whole stripes, then the remaining (< 64) copy bytes. */
    size_t hashed = steps * 64;
    xx_stripes(&s, hp, (n - hashed) / 32);
    nt_copy(cd, cs, n - head - hashed);
    nt_fence();
    return xx_finish(&s, (uint64_t)n, src + (n & ~(size_t)31));
#else
    return 0; /* unreachable */
#endif
}

/* ---- Argument helpers -------------------------------------------------- */

/* Get a C-contiguous buffer view of obj.  Returns 0 on success, -1 with an
 * exception set (TypeError: not a buffer / not writable; ValueError: not
 * contiguous or the exporter refused). */
static int get_buffer(PyObject *obj, Py_buffer *view, const char *name, int writable) {
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a bytes-like object (buffer protocol), not '%.100s'",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_Format(PyExc_ValueError, "%s: cannot export buffer: %S", name,
                         value ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous buffer", name);
        return -1;
    }
    if (writable && view->readonly) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError,
                     "%s must be a writable buffer, got read-only '%.100s'", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

/* Parse an int in [0, 2**64) (seed / expected hash). */
static int get_u64(PyObject *obj, uint64_t *out, const char *name) {
    if (PyBool_Check(obj) || !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not '%.100s'", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be in [0, 2**64), got %R", name, obj);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* Accept raw bytes (itemsize 1) or 4-byte signed ints in little-endian
 * layout; anything else would be silently misinterpreted. */
static int check_token_format(const Py_buffer *view) {
    const char *fmt = view->format ? view->format : "B", *f = fmt;
    int little = KV_LITTLE_ENDIAN; /* byte order of the items */
    if (*f == '<') little = 1;
    else if (*f == '>' || *f == '!') little = 0;
    if (*f == '<' || *f == '>' || *f == '!' || *f == '@' || *f == '=') f++;
    if (view->itemsize == 1 && (!strcmp(f, "B") || !strcmp(f, "b") || !strcmp(f, "c")))
        return 0;
    if (view->itemsize == 4 && little && (!strcmp(f, "i") || !strcmp(f, "l"))) return 0;
    PyErr_Format(PyExc_TypeError,
                 "tokens must be raw bytes or a little-endian int32 buffer, "
                 "got format '%s' with itemsize %zd",
                 fmt, view->itemsize);
    return -1;
}

/* ---- Python functions -------------------------------------------------- */

PyDoc_STRVAR(chain_hash_doc,
"chain_hash(root, tokens, block_size, extra=b\"\") -> bytes\n\n"
"For each full block i of block_size int32 tokens (a partial tail is\n"
"ignored): id_i = BLAKE2b-128(id_{i-1} || le_bytes(block_i) || extra),\n"
"id_{-1} = root.  Returns the concatenated 16-byte ids.");

static PyObject *kv_chain_hash(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"root", "tokens", "block_size", "extra", NULL};
    PyObject *root_o, *tok_o, *bs_o, *extra_o = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:chain_hash", kwlist,
                                     &root_o, &tok_o, &bs_o, &extra_o)) {
        return NULL;
    }
    if (PyBool_Check(bs_o) || !PyLong_Check(bs_o)) {
        PyErr_Format(PyExc_TypeError, "block_size must be an int, not '%.100s'",
                     Py_TYPE(bs_o)->tp_name);
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(bs_o);
    if (block_size == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "block_size out of range: %R", bs_o);
        return NULL;
    }
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", block_size);
        return NULL;
    }

    Py_buffer root, tok, extra;
    PyObject *result = NULL;
    int have_extra = 0;
    if (get_buffer(root_o, &root, "root", 0) < 0) return NULL;
    if (root.len != B2_OUT) {
        PyErr_Format(PyExc_ValueError, "root must be %d bytes, got %zd", B2_OUT, root.len);
        PyBuffer_Release(&root);
        return NULL;
    }
    if (get_buffer(tok_o, &tok, "tokens", 0) < 0) {
        PyBuffer_Release(&root);
        return NULL;
    }
    if (check_token_format(&tok) < 0) goto done;
    if (tok.len % 4 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "tokens buffer length must be a multiple of 4 (int32), got %zd bytes",
                     tok.len);
        goto done;
    }
    if (extra_o != NULL && extra_o != Py_None) {
        if (get_buffer(extra_o, &extra, "extra", 0) < 0) goto done;
        have_extra = 1;
    }

    Py_ssize_t ntok = tok.len / 4;
    Py_ssize_t nblocks = ntok / block_size;
    result = PyBytes_FromStringAndSize(NULL, nblocks * B2_OUT);
    if (result == NULL || nblocks == 0) goto done;
    {
        uint8_t rootcopy[B2_OUT];
        memcpy(rootcopy, root.buf, B2_OUT);
        const uint8_t *tp = (const uint8_t *)tok.buf;
        size_t tb = (size_t)block_size * 4; /* <= tok.len: cannot overflow */
        const uint8_t *ep = have_extra ? (const uint8_t *)extra.buf : NULL;
        size_t el = have_extra ? (size_t)extra.len : 0;
        uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
        RELEASE_GIL_IF(tok.len + (Py_ssize_t)el >= GIL_RELEASE_BYTES);
        b2_chain(rootcopy, tp, tb, (size_t)nblocks, ep, el, out);
        REACQUIRE_GIL();
    }
done:
    if (have_extra) PyBuffer_Release(&extra);
    PyBuffer_Release(&tok);
    PyBuffer_Release(&root);
    return result;
}

PyDoc_STRVAR(blake2b16_doc,
"blake2b16(data) -> bytes\n\n"
"Unkeyed BLAKE2b with a 16-byte digest (hashlib.blake2b(data, digest_size=16)).");

static PyObject *kv_blake2b16(PyObject *self, PyObject *arg) {
    Py_buffer data;
    if (get_buffer(arg, &data, "data", 0) < 0) return NULL;
    uint8_t out[B2_OUT];
    b2_state s;
    b2_init16(&s);
    RELEASE_GIL_IF(data.len >= GIL_RELEASE_BYTES);
    b2_update(&s, (const uint8_t *)data.buf, (size_t)data.len);
    REACQUIRE_GIL();
    b2_final16(&s, out);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, B2_OUT);
}

static uint64_t xxh64_view(const Py_buffer *v, uint64_t seed) {
    RELEASE_GIL_IF(v->len >= GIL_RELEASE_BYTES);
    uint64_t h = xxh64_buf((const uint8_t *)v->buf, (size_t)v->len, seed);
    REACQUIRE_GIL();
    return h;
}

PyDoc_STRVAR(xxh64_doc,
"xxh64(data, seed=0) -> int\n\n"
"XXH64 of data (same as xxhash.xxh64_intdigest(data, seed)).");

static PyObject *kv_xxh64(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "seed", NULL};
    PyObject *data_o, *seed_o = NULL;
    uint64_t seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:xxh64", kwlist, &data_o, &seed_o))
        return NULL;
    if (seed_o != NULL && get_u64(seed_o, &seed, "seed") < 0) return NULL;
    Py_buffer data;
    if (get_buffer(data_o, &data, "data", 0) < 0) return NULL;
    uint64_t h = xxh64_view(&data, seed);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(verify_checksum_doc,
"verify_checksum(data, expected, seed=0) -> bool\n\n"
"True when xxh64(data, seed) == expected.");

static PyObject *kv_verify_checksum(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "expected", "seed", NULL};
    PyObject *data_o, *exp_o, *seed_o = NULL;
    uint64_t seed = 0, expected;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:verify_checksum", kwlist,
                                     &data_o, &exp_o, &seed_o)) {
        return NULL;
    }
    if (get_u64(exp_o, &expected, "expected") < 0) return NULL;
    if (seed_o != NULL && get_u64(seed_o, &seed, "seed") < 0) return NULL;
    Py_buffer data;
    if (get_buffer(data_o, &data, "data", 0) < 0) return NULL;
    uint64_t h = xxh64_view(&data, seed);
    PyBuffer_Release(&data);
    return PyBool_FromLong(h == expected);
}

/* copy_checksum (with_hash) and copy_nt share everything but the hash. */
static PyObject *do_copy(PyObject *args, PyObject *kwargs, int with_hash) {
    static char *kw_hash[] = {"dst", "src", "seed", NULL};
    static char *kw_copy[] = {"dst", "src", NULL};
    PyObject *dst_o, *src_o, *seed_o = NULL;
    uint64_t seed = 0, h = 0;
    int ok = with_hash ? PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:copy_checksum", kw_hash,
                                                     &dst_o, &src_o, &seed_o)
                       : PyArg_ParseTupleAndKeywords(args, kwargs, "OO:copy_nt", kw_copy,
                                                     &dst_o, &src_o);
    if (!ok) return NULL;
    if (seed_o != NULL && get_u64(seed_o, &seed, "seed") < 0) return NULL;
    Py_buffer dst, src;
    if (get_buffer(dst_o, &dst, "dst", 1) < 0) return NULL;
    if (get_buffer(src_o, &src, "src", 0) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len < src.len) {
        PyErr_Format(PyExc_ValueError, "dst is too small: %zd bytes < %zd bytes of src",
                     dst.len, src.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    uint8_t *d = (uint8_t *)dst.buf;
    const uint8_t *sp = (const uint8_t *)src.buf;
    size_t n = (size_t)src.len;
    RELEASE_GIL_IF(src.len >= GIL_RELEASE_BYTES);
    if (ranges_overlap(d, n, sp, n)) {
        /* Hash the original bytes before any of them is overwritten. */
        if (with_hash) h = xxh64_buf(sp, n, seed);
        memmove(d, sp, n);
    } else if (with_hash) {
        h = copy_hash(d, sp, n, seed);
    } else {
        copy_plain_or_nt(d, sp, n);
    }
    REACQUIRE_GIL();
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (!with_hash) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(copy_checksum_doc,
"copy_checksum(dst, src, seed=0) -> int\n\n"
"Copy src into the start of dst (len(dst) >= len(src)) and return\n"
"xxh64(src, seed), hashing and copying in one pass with streaming stores.");

static PyObject *kv_copy_checksum(PyObject *self, PyObject *args, PyObject *kwargs) {
    return do_copy(args, kwargs, 1);
}

PyDoc_STRVAR(copy_nt_doc,
"copy_nt(dst, src) -> None\n\n"
"Copy src into the start of dst with non-temporal stores (memcpy for small\n"
"or overlapping buffers).");

static PyObject *kv_copy_nt(PyObject *self, PyObject *args, PyObject *kwargs) {
    return do_copy(args, kwargs, 0);
}

PyDoc_STRVAR(set_simd_doc,
"set_simd(enabled) -> bool\n\n"
"Use the AVX2 BLAKE2b compression when enabled and the CPU has AVX2 (the\n"
"default at import); False selects the portable scalar code.  Digests are\n"
"identical either way (the tests compare both paths).  Returns whether the\n"
"AVX2 code is now in use.");

static PyObject *kv_set_simd(PyObject *self, PyObject *arg) {
    int enabled = PyObject_IsTrue(arg);
    if (enabled < 0) return NULL;
    kv_use_avx2 = enabled && kv_cpu_avx2();
    return PyBool_FromLong(kv_use_avx2);
}

static PyMethodDef kv_methods[] = {
    {"chain_hash", (PyCFunction)(void (*)(void))kv_chain_hash,
     METH_VARARGS | METH_KEYWORDS, chain_hash_doc},
    {"blake2b16", (PyCFunction)kv_blake2b16, METH_O, blake2b16_doc},
    {"xxh64", (PyCFunction)(void (*)(void))kv_xxh64, METH_VARARGS | METH_KEYWORDS,
     xxh64_doc},
    {"copy_checksum", (PyCFunction)(void (*)(void))kv_copy_checksum,
     METH_VARARGS | METH_KEYWORDS, copy_checksum_doc},
    {"copy_nt", (PyCFunction)(void (*)(void))kv_copy_nt, METH_VARARGS | METH_KEYWORDS,
     copy_nt_doc},
    {"verify_checksum", (PyCFunction)(void (*)(void))kv_verify_checksum,
     METH_VARARGS | METH_KEYWORDS, verify_checksum_doc},
    {"set_simd", (PyCFunction)kv_set_simd, METH_O, set_simd_doc},
    {NULL, NULL, 0, NULL},
};

static int kv_exec(PyObject *m) {
    kv_use_avx2 = kv_cpu_avx2();
    if (PyModule_AddObjectRef(m, "HAVE_AVX2", kv_use_avx2 ? Py_True : Py_False) < 0) return -1;
    if (PyModule_AddIntConstant(m, "BLOCK_ID_BYTES", B2_OUT) < 0) return -1;
    if (PyModule_AddObjectRef(m, "HAVE_SSE2", KV_HAVE_SSE2 ? Py_True : Py_False) < 0) return -1;
    if (PyModule_AddIntConstant(m, "NT_MIN_BYTES", (long)NT_MIN_BYTES) < 0) return -1;
    return 0;
}

static PyModuleDef_Slot kv_slots[] = {{Py_mod_exec, kv_exec}, {0, NULL}};

static struct PyModuleDef kv_module = {
    PyModuleDef_HEAD_INIT, "kvstore._native",
    "Native BLAKE2b-128 chain hashing, XXH64 and streaming copy+checksum.",
    0, kv_methods, kv_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModuleDef_Init(&kv_module); }
