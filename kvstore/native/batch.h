/* Many buffers in one call: copy+XXH64 (or XXH64 alone) of a batch of blocks,
 * split over threads.  A batch of 2 MiB blocks moved by one thread is bound by
 * XXH64's multiplies (about 4 bytes a cycle), below what one core's copy and
 * the memory bus can do, so the agent uses both cores for one transfer; doing
 * it here, with no GIL and no Python per block, costs one thread start per
 * extra thread instead of a hand-off per block through a Python pool. */
#ifndef KV_NATIVE_BATCH_H
#define KV_NATIVE_BATCH_H

#include "common.h"

typedef struct {
    uint8_t *dst;       /* NULL: hash only */
    const uint8_t *src;
    size_t n;
    uint64_t seed;
    uint64_t digest;    /* out */
} kv_job;

/* Run every job (dst[0..n) = src[0..n) and digest = xxh64(src, seed); ranges of one
 * job may overlap) on up to `threads` threads: the calling one and threads - 1
 * started here, each claiming the next unclaimed jobs (about 256 KiB, at least one
 * job) until none is left, so a thread delayed by a busy core costs the batch
 * little.  A thread that cannot be started leaves its claims to the others.
 * Returns how many threads ran (>= 1). */
int kv_run_jobs(kv_job *jobs, size_t count, int threads);

#endif /* KV_NATIVE_BATCH_H */
