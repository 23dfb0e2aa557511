/* BLAKE2b-128 (RFC 7693: sequential mode, unkeyed, 16-byte digest) and the
 * block-id chain built on it.  blake2b.c holds the portable code and picks
 * the compression at run time; blake2b_avx2.c holds the AVX2 compression. */
#ifndef KV_NATIVE_BLAKE2B_H
#define KV_NATIVE_BLAKE2B_H

#include "common.h"

#define B2_BLOCK 128
#define B2_OUT 16

typedef struct {
    uint64_t h[8];
    uint64_t t0, t1;
    size_t buflen;
    uint8_t buf[B2_BLOCK];
} b2_state;

void b2_init16(b2_state *s);
void b2_update(b2_state *s, const uint8_t *in, size_t inlen);
void b2_final16(b2_state *s, uint8_t out[B2_OUT]);

/* ids[i] = BLAKE2b-128(ids[i-1] || tokens[i*tb : (i+1)*tb] || extra), ids[-1] = root. */
void b2_chain(const uint8_t root[B2_OUT], const uint8_t *tok, size_t tb, size_t nblocks,
              const uint8_t *extra, size_t el, uint8_t *out);

/* Use the AVX2 compression when enabled and this CPU and build have it, else
 * the scalar one.  Returns whether AVX2 is now in use.  Every path computes
 * identical digests, so a change while another thread hashes only changes
 * its speed. */
int b2_use_avx2(int enabled);

#endif /* KV_NATIVE_BLAKE2B_H */
