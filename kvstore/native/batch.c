/* Batches of copy+XXH64 jobs over threads (see batch.h). */
#define _GNU_SOURCE /* process_vm_readv */
#include "batch.h"

#include <errno.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/uio.h>
#endif

#include "copy.h"
#include "xxh64.h"

/* Bytes a thread claims at once: whole jobs, at least one.  Big enough that the
 * shared counter is touched rarely (once per 2 MiB block), small enough that a
 * thread the scheduler stalls leaves little behind for the others to wait on. */
#define KV_CLAIM_BYTES (256u << 10)

/* Bytes read from another process per process_vm_readv call (512 KiB, L2 per core
 * here: 256 KiB to 1 MiB measured alike through the noise), hashed right
 * after it lands, while it is still in this core's L2 (1 MiB here), so the hash does not
 * read the bytes from memory a second time. */
#ifndef KV_CMA_PIECE
#define KV_CMA_PIECE ((size_t)512 << 10)
#endif

/* dst[0..n) = process pid's src[0..n) (cross-memory attach: the kernel copies from the
 * other process's pages, no mapping of them here), hashed piece by piece; j->err set
 * (and the digest left 0) when a read fails. */
_Static_assert(KV_CMA_PIECE % 32 == 0, "pieces but the last must be whole XXH64 stripes");

static void run_remote_job(kv_job *j) {
#ifndef __linux__
    j->err = ENOSYS; /* cross-memory attach is Linux's */
    return;
#else
    xx_state s;
    xx_init(&s, j->seed);
    uintptr_t src = (uintptr_t)j->src;
    for (size_t done = 0; done < j->n;) {
        size_t want = j->n - done < KV_CMA_PIECE ? j->n - done : KV_CMA_PIECE;
        for (size_t got = 0; got < want;) {
            struct iovec local = {j->dst + done + got, want - got};
            struct iovec remote = {(void *)(src + done + got), want - got};
            ssize_t k = process_vm_readv(j->pid, &local, 1, &remote, 1, 0);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) { /* 0: the remote range ends early (partly unmapped) */
                j->err = k < 0 ? errno : EFAULT;
                return;
            }
            got += (size_t)k;
        }
        xx_stripes(&s, j->dst + done, want / 32); /* pieces but the last: whole stripes */
        done += want;
    }
    j->digest = xx_finish(&s, (uint64_t)j->n, j->dst + (j->n / 32) * 32);
#endif
}

static void run_job(kv_job *j) {
    if (j->pid > 0) {
        run_remote_job(j);
    } else if (j->dst == NULL) {
        j->digest = xxh64_buf(j->src, j->n, j->seed);
    } else if (ranges_overlap(j->dst, j->n, j->src, j->n)) {
        /* Hash the original bytes before any of them is overwritten. */
        j->digest = xxh64_buf(j->src, j->n, j->seed);
        memmove(j->dst, j->src, j->n);
    } else {
        j->digest = copy_hash(j->dst, j->src, j->n, j->seed);
    }
}

static uint64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void *run_queue(void *arg) {
    kv_queue *q = (kv_queue *)arg;
    for (;;) {
        size_t i = __atomic_fetch_add(&q->next, q->step, __ATOMIC_RELAXED);
        if (i >= q->count) break;
        size_t end = i + q->step < q->count ? i + q->step : q->count;
        for (; i < end; i++) {
            /* ~20 ns a job (vDSO), against the microseconds a job takes */
            if (q->deadline_ns && monotonic_ns() >= q->deadline_ns) {
                q->jobs[i].err = ETIMEDOUT; /* not run: its buffers are left as they were */
                continue;
            }
            run_job(&q->jobs[i]);
        }
    }
    return NULL;
}

static kv_queue make_queue(kv_job *jobs, size_t count) {
    size_t total = 0;
    for (size_t i = 0; i < count; i++) total += jobs[i].n;
    size_t mean = count ? total / count : 0;
    kv_queue q = {jobs, count, mean >= KV_CLAIM_BYTES ? 1 : KV_CLAIM_BYTES / (mean + 1) + 1, 0,
                  0};
    return q;
}

int kv_run_jobs(kv_job *jobs, size_t count, int threads) {
    if (threads > KV_MAX_THREADS) threads = KV_MAX_THREADS;
    if (threads > (int)count) threads = (int)count;
    kv_queue q = make_queue(jobs, count);
    if (threads <= 1) {
        run_queue(&q);
        return 1;
    }
    pthread_t tids[KV_MAX_THREADS];
    int started = 0;
    for (int k = 1; k < threads; k++) {
        if (pthread_create(&tids[started], NULL, run_queue, &q) != 0) break;
        started++; /* a thread that cannot be had leaves its claims to the others */
    }
    run_queue(&q);
    for (int k = 0; k < started; k++) pthread_join(tids[k], NULL);
    return started + 1;
}

/* The last thread out tells the caller's event loop. */
static void finished_one(kv_async *a, int n) {
    if (__atomic_sub_fetch(&a->running, n, __ATOMIC_ACQ_REL) != 0) return;
    uint64_t one = 1;
    while (write(a->efd, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
}

static void *run_async(void *arg) {
    kv_async *a = (kv_async *)arg;
    run_queue(&a->q);
    finished_one(a, 1);
    return NULL;
}

int kv_start_jobs(kv_async *a, kv_job *jobs, size_t count, int threads, int efd,
                  uint64_t deadline_ns) {
    if (threads > KV_MAX_THREADS) threads = KV_MAX_THREADS;
    if (threads > (int)count) threads = (int)count;
    if (threads < 1) threads = 1;
    a->q = make_queue(jobs, count);
    a->q.deadline_ns = deadline_ns;
    a->efd = efd;
    a->started = 0;
    a->running = threads; /* before any thread can finish */
    for (int k = 0; k < threads; k++) {
        if (pthread_create(&a->tids[k], NULL, run_async, a) != 0) break;
        a->started++;
    }
    if (a->started == 0) return 0; /* no thread to be had: nothing ran, efd untouched */
    if (a->started < threads) finished_one(a, threads - a->started); /* theirs: the others' */
    return a->started;
}

void kv_join_jobs(kv_async *a) {
    for (int k = 0; k < a->started; k++) pthread_join(a->tids[k], NULL);
    a->started = 0;
}
