/* Batches of copy+XXH64 jobs over threads (see batch.h). */
#include "batch.h"

#include <pthread.h>

#include "copy.h"
#include "xxh64.h"

#define KV_MAX_THREADS 64

typedef struct {
    kv_job *jobs;
    size_t count;
} kv_share;

static void run_job(kv_job *j) {
    if (j->dst == NULL) {
        j->digest = xxh64_buf(j->src, j->n, j->seed);
    } else if (ranges_overlap(j->dst, j->n, j->src, j->n)) {
        /* Hash the original bytes before any of them is overwritten. */
        j->digest = xxh64_buf(j->src, j->n, j->seed);
        memmove(j->dst, j->src, j->n);
    } else {
        j->digest = copy_hash(j->dst, j->src, j->n, j->seed);
    }
}

static void *run_share(void *arg) {
    kv_share *s = (kv_share *)arg;
    for (size_t i = 0; i < s->count; i++) run_job(&s->jobs[i]);
    return NULL;
}

/* Cut jobs into at most `parts` contiguous runs of about total/parts bytes each;
 * returns the number of runs (>= 1 when count >= 1). */
static int split(kv_job *jobs, size_t count, int parts, kv_share *out) {
    size_t total = 0;
    for (size_t i = 0; i < count; i++) total += jobs[i].n;
    int made = 0;
    size_t start = 0, acc = 0;
    for (size_t i = 0; i < count; i++) {
        acc += jobs[i].n;
        /* Close run `made` once it reaches its share of the bytes seen so far. */
        if (made < parts - 1 && acc * (size_t)parts >= total * (size_t)(made + 1)) {
            out[made].jobs = jobs + start;
            out[made].count = i + 1 - start;
            made++;
            start = i + 1;
        }
    }
    if (start < count || made == 0) {
        out[made].jobs = jobs + start;
        out[made].count = count - start;
        made++;
    }
    return made;
}

int kv_run_jobs(kv_job *jobs, size_t count, int threads) {
    if (threads > KV_MAX_THREADS) threads = KV_MAX_THREADS;
    if (threads > (int)count) threads = (int)count;
    if (threads <= 1) {
        kv_share all = {jobs, count};
        run_share(&all);
        return 1;
    }
    kv_share shares[KV_MAX_THREADS];
    pthread_t tids[KV_MAX_THREADS];
    int started[KV_MAX_THREADS] = {0};
    int parts = split(jobs, count, threads, shares);
    for (int k = 1; k < parts; k++)
        started[k] = pthread_create(&tids[k], NULL, run_share, &shares[k]) == 0;
    run_share(&shares[0]);
    int ran = 1;
    for (int k = 1; k < parts; k++) {
        if (started[k]) {
            pthread_join(tids[k], NULL);
            ran++;
        } else {
            run_share(&shares[k]); /* no thread to be had: do it here */
        }
    }
    return ran;
}
