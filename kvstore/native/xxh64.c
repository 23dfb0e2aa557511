/* XXH64 over a buffer (see xxh64.h). */
#include "xxh64.h"

void xx_stripes(xx_state *s, const uint8_t *p, size_t n) {
    uint64_t v1 = s->v[0], v2 = s->v[1], v3 = s->v[2], v4 = s->v[3];
    for (; n >= 2; n -= 2, p += 64) {
        KV_PREFETCH(p + PREFETCH_AHEAD);
        XX_STRIPE(p);
        XX_STRIPE(p + 32);
    }
    if (n) XX_STRIPE(p);
    s->v[0] = v1; s->v[1] = v2; s->v[2] = v3; s->v[3] = v4;
}

uint64_t xx_finish(const xx_state *s, uint64_t total, const uint8_t *tail) {
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

uint64_t xxh64_buf(const uint8_t *p, size_t n, uint64_t seed) {
    xx_state s;
    xx_init(&s, seed);
    size_t stripes = n / 32;
    xx_stripes(&s, p, stripes);
    return xx_finish(&s, (uint64_t)n, p + stripes * 32);
}
