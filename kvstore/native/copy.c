/* Copy kernels (see copy.h). */
#include "copy.h"
#include "xxh64.h"

#if KV_HAVE_SSE2
#include <emmintrin.h>

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

/* One pass over src: every 64-byte step hashes two XXH64 stripes and
 * streams the same (L1-hot) bytes into dst.  The hash is latency-bound on
 * its multiply chains, which leaves issue slots for the loads and the
 * non-temporal stores, so the two overlap instead of running back to back.
 * Hash stripes are aligned to src; the copy is aligned to dst and runs
 * ahead of the hash by `head` (< 16) bytes. */
uint64_t copy_hash(uint8_t *dst, const uint8_t *src, size_t n, uint64_t seed) {
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
