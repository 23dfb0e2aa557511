/* Many buffers in one call: copy+XXH64 (or XXH64 alone) of a batch of blocks,
 * split over threads.  A batch of 2 MiB blocks moved by one thread is bound by
 * XXH64's multiplies (about 4 bytes a cycle), below what one core's copy and
 * the memory bus can do, so the agent uses both cores for one transfer; doing
 * it here, with no GIL and no Python per block, costs one thread start per
 * extra thread instead of a hand-off per block through a Python pool. */
#ifndef KV_NATIVE_BATCH_H
#define KV_NATIVE_BATCH_H

#include <pthread.h>

#include "common.h"

#define KV_MAX_THREADS 64

typedef struct {
    uint8_t *dst;       /* NULL: hash only */
    const uint8_t *src; /* pid > 0: an address in process pid, not in this one */
    size_t n;
    uint64_t seed;
    uint64_t digest;    /* out */
    int pid;            /* > 0: read src from process pid (cross-memory attach) */
    int err;            /* out: errno of the read that failed (pid > 0), ETIMEDOUT when the
                         * job was not run, its queue's deadline passed; 0 otherwise */
} kv_job;

/* Run every job (dst[0..n) = src[0..n) and digest = xxh64(src, seed); ranges of one
 * job may overlap; with pid > 0 the bytes are read from that process's src, in pieces
 * that stay in this core's cache while they are hashed) on up to `threads` threads: the calling one and threads - 1
 * started here, each claiming the next unclaimed jobs (about 256 KiB, at least one
 * job) until none is left, so a thread delayed by a busy core costs the batch
 * little.  A thread that cannot be started leaves its claims to the others.
 * Returns how many threads ran (>= 1). */
int kv_run_jobs(kv_job *jobs, size_t count, int threads);

/* The jobs of one batch, handed out in claims of `step` jobs by a shared counter:
 * a thread that runs late or slow (its core busy with another process) simply
 * takes fewer of them, where a fixed split would make the whole batch wait for
 * its share. */
typedef struct {
    kv_job *jobs;
    size_t count;
    size_t step;
    size_t next; /* first job not claimed yet (atomic) */
    uint64_t deadline_ns; /* CLOCK_MONOTONIC; 0: none. A job not begun by then is not run */
} kv_queue;

/* A batch run in the background, for a caller that waits on an event loop rather
 * than on a thread: no thread of the caller's takes part and none has to be woken
 * to hand the batch over or back.  The last thread to finish writes 1 (8 bytes) to
 * `efd`, an eventfd the caller polls. */
typedef struct {
    kv_queue q;
    pthread_t tids[KV_MAX_THREADS];
    int started; /* threads to join */
    int running; /* threads not finished yet (atomic) */
    int efd;
} kv_async;

/* Start the jobs on up to `threads` new threads and return how many started; `efd`
 * is written once, when every job is done.  0: no thread could be started, nothing
 * ran and `efd` stays unwritten (the caller runs the batch some other way).
 * kv_join_jobs must follow a start that returned more than 0. */
int kv_start_jobs(kv_async *a, kv_job *jobs, size_t count, int threads, int efd,
                  uint64_t deadline_ns);

/* Wait for the threads kv_start_jobs started (after its write to efd, or to block
 * until then). */
void kv_join_jobs(kv_async *a);

#endif /* KV_NATIVE_BATCH_H */
