/* XXH64, from the xxHash specification; tests/test_native.py checks it
 * against the xxhash package.  The round primitives are inline here because
 * the fused copy+hash loop in copy.c runs them on its own accumulators. */
#ifndef KV_NATIVE_XXH64_H
#define KV_NATIVE_XXH64_H

#include "common.h"

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
void xx_stripes(xx_state *s, const uint8_t *p, size_t n);
/* total: length of the whole input; tail: its last total % 32 bytes. */
uint64_t xx_finish(const xx_state *s, uint64_t total, const uint8_t *tail);
/* XXH64 of p[0..n) (xxhash.xxh64_intdigest). */
uint64_t xxh64_buf(const uint8_t *p, size_t n, uint64_t seed);

#endif /* KV_NATIVE_XXH64_H */
