/* Shared by every source of kvstore._native: fixed-width types, byte order,
 * little-endian loads/stores, rotates and prefetch.  No CPython here: the
 * hash and copy kernels build and read without Python.h. */
#ifndef KV_NATIVE_COMMON_H
#define KV_NATIVE_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* module.c checks that this agrees with CPython's PY_BIG_ENDIAN. */
#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && \
    __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define KV_LITTLE_ENDIAN 0
#else
#define KV_LITTLE_ENDIAN 1
#endif

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

#endif /* KV_NATIVE_COMMON_H */
