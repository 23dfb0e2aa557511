/* BLAKE2b-128 (RFC 7693): the portable compression, the streaming state and
 * the block-id chain.  Written from the RFC; kvstore/hashing.py holds the
 * reference definition and tests/test_native.py checks bit-identity with
 * hashlib on both compressions. */
#include "blake2b_impl.h"

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

/* Nonzero: use the AVX2 compression.  Set by b2_use_avx2 (at import, from
 * the CPU, and by set_simd()). */
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

int b2_use_avx2(int enabled) {
    kv_use_avx2 = enabled && b2_cpu_avx2();
    return kv_use_avx2;
}

void b2_init16(b2_state *s) {
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
void b2_update(b2_state *s, const uint8_t *in, size_t inlen) {
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

void b2_final16(b2_state *s, uint8_t out[B2_OUT]) {
    b2_count(s, s->buflen);
    memset(s->buf + s->buflen, 0, B2_BLOCK - s->buflen);
    b2_compress(s->h, s->buf, s->t0, s->t1, 1);
    store64_le(out, s->h[0]);
    store64_le(out + 8, s->h[1]);
}

void b2_chain(const uint8_t root[B2_OUT], const uint8_t *tok, size_t tb, size_t nblocks,
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
