/*
 * kvstore._native -- hot-path primitives for the KV-cache store.
 *
 *   chain_hash(root, tokens, block_size, extra=b"") -> bytes
 *   blake2b16(data) -> bytes
 *   xxh64(data, seed=0) -> int
 *   copy_checksum(dst, src, seed=0) -> int
 *   copy_nt(dst, src) -> None
 *   verify_checksum(data, expected, seed=0) -> bool
 *   copy_checksum_many(dsts, srcs, threads=1, seed=0) -> list[int]
 *   xxh64_many(bufs, threads=1, seed=0) -> list[int]
 *   copy_checksum_start(dsts, srcs, threads=1, seed=0) -> CopyJob
 *                                (copy_checksum_many in the background)
 *   IdTable(seed)                 (idtable.c: the router index's id table)
 *   paged_scatter(caches, block_ids, blocks, block_size, kv_heads, row_bytes)
 *   paged_gather(...)             (paged.c: vLLM's paged CPU KV cache)
 *   set_simd(enabled) -> bool    (AVX2 or scalar BLAKE2b; HAVE_AVX2 says
 *                                 whether this CPU and build have AVX2)
 *
 * BLAKE2b follows RFC 7693 (sequential mode, unkeyed, 16-byte digest).
 * XXH64 follows the xxHash specification.  Both are written from the specs;
 * the Python front-ends (kvstore/hashing.py, kvstore/checksum.py) hold the
 * reference definitions and the tests check bit-identity against hashlib and
 * the xxhash package.
 *
 * Every function accepts any C-contiguous object exporting the buffer
 * protocol and releases the GIL while it works on large inputs.
 *
 * This file is the CPython glue (argument checks, the GIL, the module); the
 * kernels live beside it: blake2b.c / blake2b_avx2.c, xxh64.c, copy.c,
 * batch.c (many buffers in one call, over threads) and paged.c (with its glue).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "batch.h"
#include "blake2b.h"
#include "copy.h"
#include "idtable.h"
#include "paged.h"
#include "xxh64.h"

#if PY_BIG_ENDIAN == KV_LITTLE_ENDIAN
#error "common.h's byte order disagrees with CPython's PY_BIG_ENDIAN"
#endif

/* Inputs at least this large are processed with the GIL released. */
#define GIL_RELEASE_BYTES ((Py_ssize_t)16 * 1024)
#define RELEASE_GIL_IF(big) PyThreadState *ts_ = (big) ? PyEval_SaveThread() : NULL
#define REACQUIRE_GIL() if (ts_) PyEval_RestoreThread(ts_)

/* ---- Argument helpers -------------------------------------------------- */

/* Get a C-contiguous buffer view of obj.  Returns 0 on success, -1 with an
 * exception set (TypeError: not a buffer / not writable; ValueError: not
 * contiguous or the exporter refused). */
static int get_buffer(PyObject *obj, Py_buffer *view, const char *name, int writable) {
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a bytes-like object (buffer protocol), not '%.100s'",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_Format(PyExc_ValueError, "%s: cannot export buffer: %S", name,
                         value ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous buffer", name);
        return -1;
    }
    if (writable && view->readonly) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError,
                     "%s must be a writable buffer, got read-only '%.100s'", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

int kv_get_buffer(PyObject *obj, Py_buffer *view, const char *name, int writable) {
    return get_buffer(obj, view, name, writable);
}

/* Parse an int in [0, 2**64) (seed / expected hash). */
static int get_u64(PyObject *obj, uint64_t *out, const char *name) {
    if (PyBool_Check(obj) || !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not '%.100s'", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be in [0, 2**64), got %R", name, obj);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* Accept raw bytes (itemsize 1) or 4-byte signed ints in little-endian
 * layout; anything else would be silently misinterpreted. */
static int check_token_format(const Py_buffer *view) {
    const char *fmt = view->format ? view->format : "B", *f = fmt;
    int little = KV_LITTLE_ENDIAN; /* byte order of the items */
    if (*f == '<') little = 1;
    else if (*f == '>' || *f == '!') little = 0;
    if (*f == '<' || *f == '>' || *f == '!' || *f == '@' || *f == '=') f++;
    if (view->itemsize == 1 && (!strcmp(f, "B") || !strcmp(f, "b") || !strcmp(f, "c")))
        return 0;
    if (view->itemsize == 4 && little && (!strcmp(f, "i") || !strcmp(f, "l"))) return 0;
    PyErr_Format(PyExc_TypeError,
                 "tokens must be raw bytes or a little-endian int32 buffer, "
                 "got format '%s' with itemsize %zd",
                 fmt, view->itemsize);
    return -1;
}

/* ---- Python functions -------------------------------------------------- */

PyDoc_STRVAR(chain_hash_doc,
"chain_hash(root, tokens, block_size, extra=b\"\") -> bytes\n\n"
"For each full block i of block_size int32 tokens (a partial tail is\n"
"ignored): id_i = BLAKE2b-128(id_{i-1} || le_bytes(block_i) || extra),\n"
"id_{-1} = root.  Returns the concatenated 16-byte ids.");

static PyObject *kv_chain_hash(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"root", "tokens", "block_size", "extra", NULL};
    PyObject *root_o, *tok_o, *bs_o, *extra_o = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:chain_hash", kwlist,
                                     &root_o, &tok_o, &bs_o, &extra_o)) {
        return NULL;
    }
    if (PyBool_Check(bs_o) || !PyLong_Check(bs_o)) {
        PyErr_Format(PyExc_TypeError, "block_size must be an int, not '%.100s'",
                     Py_TYPE(bs_o)->tp_name);
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(bs_o);
    if (block_size == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "block_size out of range: %R", bs_o);
        return NULL;
    }
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", block_size);
        return NULL;
    }

    Py_buffer root, tok, extra;
    PyObject *result = NULL;
    int have_extra = 0;
    if (get_buffer(root_o, &root, "root", 0) < 0) return NULL;
    if (root.len != B2_OUT) {
        PyErr_Format(PyExc_ValueError, "root must be %d bytes, got %zd", B2_OUT, root.len);
        PyBuffer_Release(&root);
        return NULL;
    }
    if (get_buffer(tok_o, &tok, "tokens", 0) < 0) {
        PyBuffer_Release(&root);
        return NULL;
    }
    if (check_token_format(&tok) < 0) goto done;
    if (tok.len % 4 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "tokens buffer length must be a multiple of 4 (int32), got %zd bytes",
                     tok.len);
        goto done;
    }
    if (extra_o != NULL && extra_o != Py_None) {
        if (get_buffer(extra_o, &extra, "extra", 0) < 0) goto done;
        have_extra = 1;
    }

    Py_ssize_t ntok = tok.len / 4;
    Py_ssize_t nblocks = ntok / block_size;
    result = PyBytes_FromStringAndSize(NULL, nblocks * B2_OUT);
    if (result == NULL || nblocks == 0) goto done;
    {
        uint8_t rootcopy[B2_OUT];
        memcpy(rootcopy, root.buf, B2_OUT);
        const uint8_t *tp = (const uint8_t *)tok.buf;
        size_t tb = (size_t)block_size * 4; /* <= tok.len: cannot overflow */
        const uint8_t *ep = have_extra ? (const uint8_t *)extra.buf : NULL;
        size_t el = have_extra ? (size_t)extra.len : 0;
        uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
        RELEASE_GIL_IF(tok.len + (Py_ssize_t)el >= GIL_RELEASE_BYTES);
        b2_chain(rootcopy, tp, tb, (size_t)nblocks, ep, el, out);
        REACQUIRE_GIL();
    }
done:
    if (have_extra) PyBuffer_Release(&extra);
    PyBuffer_Release(&tok);
    PyBuffer_Release(&root);
    return result;
}

PyDoc_STRVAR(blake2b16_doc,
"blake2b16(data) -> bytes\n\n"
"Unkeyed BLAKE2b with a 16-byte digest (hashlib.blake2b(data, digest_size=16)).");

static PyObject *kv_blake2b16(PyObject *self, PyObject *arg) {
    Py_buffer data;
    if (get_buffer(arg, &data, "data", 0) < 0) return NULL;
    uint8_t out[B2_OUT];
    b2_state s;
    b2_init16(&s);
    RELEASE_GIL_IF(data.len >= GIL_RELEASE_BYTES);
    b2_update(&s, (const uint8_t *)data.buf, (size_t)data.len);
    REACQUIRE_GIL();
    b2_final16(&s, out);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, B2_OUT);
}

static uint64_t xxh64_view(const Py_buffer *v, uint64_t seed) {
    RELEASE_GIL_IF(v->len >= GIL_RELEASE_BYTES);
    uint64_t h = xxh64_buf((const uint8_t *)v->buf, (size_t)v->len, seed);
    REACQUIRE_GIL();
    return h;
}

PyDoc_STRVAR(xxh64_doc,
"xxh64(data, seed=0) -> int\n\n"
"XXH64 of data (same as xxhash.xxh64_intdigest(data, seed)).");

static PyObject *kv_xxh64(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "seed", NULL};
    PyObject *data_o, *seed_o = NULL;
    uint64_t seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:xxh64", kwlist, &data_o, &seed_o))
        return NULL;
    if (seed_o != NULL && get_u64(seed_o, &seed, "seed") < 0) return NULL;
    Py_buffer data;
    if (get_buffer(data_o, &data, "data", 0) < 0) return NULL;
    uint64_t h = xxh64_view(&data, seed);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(verify_checksum_doc,
"verify_checksum(data, expected, seed=0) -> bool\n\n"
"True when xxh64(data, seed) == expected.");

static PyObject *kv_verify_checksum(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "expected", "seed", NULL};
    PyObject *data_o, *exp_o, *seed_o = NULL;
    uint64_t seed = 0, expected;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:verify_checksum", kwlist,
                                     &data_o, &exp_o, &seed_o)) {
        return NULL;
    }
    if (get_u64(exp_o, &expected, "expected") < 0) return NULL;
    if (seed_o != NULL && get_u64(seed_o, &seed, "seed") < 0) return NULL;
    Py_buffer data;
    if (get_buffer(data_o, &data, "data", 0) < 0) return NULL;
    uint64_t h = xxh64_view(&data, seed);
    PyBuffer_Release(&data);
    return PyBool_FromLong(h == expected);
}

/* copy_checksum (with_hash) and copy_nt share everything but the hash. */
static PyObject *do_copy(PyObject *args, PyObject *kwargs, int with_hash) {
    static char *kw_hash[] = {"dst", "src", "seed", NULL};
    static char *kw_copy[] = {"dst", "src", NULL};
    PyObject *dst_o, *src_o, *seed_o = NULL;
    uint64_t seed = 0, h = 0;
    int ok = with_hash ? PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:copy_checksum", kw_hash,
                                                     &dst_o, &src_o, &seed_o)
                       : PyArg_ParseTupleAndKeywords(args, kwargs, "OO:copy_nt", kw_copy,
                                                     &dst_o, &src_o);
    if (!ok) return NULL;
    if (seed_o != NULL && get_u64(seed_o, &seed, "seed") < 0) return NULL;
    Py_buffer dst, src;
    if (get_buffer(dst_o, &dst, "dst", 1) < 0) return NULL;
    if (get_buffer(src_o, &src, "src", 0) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len < src.len) {
        PyErr_Format(PyExc_ValueError, "dst is too small: %zd bytes < %zd bytes of src",
                     dst.len, src.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    uint8_t *d = (uint8_t *)dst.buf;
    const uint8_t *sp = (const uint8_t *)src.buf;
    size_t n = (size_t)src.len;
    RELEASE_GIL_IF(src.len >= GIL_RELEASE_BYTES);
    if (ranges_overlap(d, n, sp, n)) {
        /* Hash the original bytes before any of them is overwritten. */
        if (with_hash) h = xxh64_buf(sp, n, seed);
        memmove(d, sp, n);
    } else if (with_hash) {
        h = copy_hash(d, sp, n, seed);
    } else {
        copy_plain_or_nt(d, sp, n);
    }
    REACQUIRE_GIL();
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (!with_hash) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(copy_checksum_doc,
"copy_checksum(dst, src, seed=0) -> int\n\n"
"Copy src into the start of dst (len(dst) >= len(src)) and return\n"
"xxh64(src, seed), hashing and copying in one pass with streaming stores: each\n"
"word is loaded once, so the digest is of exactly the bytes copied even while\n"
"another process writes to either buffer.");

static PyObject *kv_copy_checksum(PyObject *self, PyObject *args, PyObject *kwargs) {
    return do_copy(args, kwargs, 1);
}

PyDoc_STRVAR(copy_nt_doc,
"copy_nt(dst, src) -> None\n\n"
"Copy src into the start of dst with non-temporal stores (memcpy for small\n"
"or overlapping buffers).");

static PyObject *kv_copy_nt(PyObject *self, PyObject *args, PyObject *kwargs) {
    return do_copy(args, kwargs, 0);
}

/* ---- Batches ------------------------------------------------------------ */

/* The buffers of a batch call: views[0..count) of srcs (and dsts), released together. */
typedef struct {
    Py_buffer *src, *dst; /* dst NULL: hash only */
    kv_job *jobs;
    Py_ssize_t count, held; /* held: views of src (and dst) acquired so far */
} kv_batch;

static void batch_release(kv_batch *b) {
    for (Py_ssize_t i = 0; i < b->held; i++) {
        PyBuffer_Release(&b->src[i]);
        if (b->dst) PyBuffer_Release(&b->dst[i]);
    }
    PyMem_Free(b->src);
    PyMem_Free(b->dst);
    PyMem_Free(b->jobs);
}

/* Acquire every view (dst_seq may be NULL) and fill b->jobs; -1 with an exception set,
 * naming the offending item, and nothing held. */
static int batch_acquire(kv_batch *b, PyObject *src_seq, PyObject *dst_seq, uint64_t seed) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(src_seq);
    memset(b, 0, sizeof(*b));
    b->count = n;
    b->src = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    b->jobs = PyMem_Calloc(n ? n : 1, sizeof(kv_job));
    if (dst_seq) b->dst = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (!b->src || !b->jobs || (dst_seq && !b->dst)) {
        batch_release(b);
        PyErr_NoMemory();
        return -1;
    }
    const char *sname = dst_seq ? "srcs" : "bufs";
    char name[48];
    for (Py_ssize_t i = 0; i < n; i++) {
        snprintf(name, sizeof(name), "%s[%zd]", sname, i);
        if (get_buffer(PySequence_Fast_GET_ITEM(src_seq, i), &b->src[i], name, 0) < 0) break;
        kv_job *j = &b->jobs[i];
        j->src = (const uint8_t *)b->src[i].buf;
        j->n = (size_t)b->src[i].len;
        j->seed = seed;
        if (dst_seq) {
            snprintf(name, sizeof(name), "dsts[%zd]", i);
            if (get_buffer(PySequence_Fast_GET_ITEM(dst_seq, i), &b->dst[i], name, 1) < 0) {
                PyBuffer_Release(&b->src[i]);
                break;
            }
            b->held = i + 1;
            if (b->dst[i].len < b->src[i].len) {
                PyErr_Format(PyExc_ValueError,
                             "dsts[%zd] is too small: %zd bytes < %zd bytes of srcs[%zd]", i,
                             b->dst[i].len, b->src[i].len, i);
                break;
            }
            j->dst = (uint8_t *)b->dst[i].buf;
        }
        b->held = i + 1;
    }
    if (PyErr_Occurred()) {
        batch_release(b);
        return -1;
    }
    return 0;
}

/* Run the jobs of `b` on `threads` threads, the GIL released for big batches; the
 * digests as a list. */
static PyObject *batch_run(kv_batch *b, int threads) {
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < b->count; i++) total += (Py_ssize_t)b->jobs[i].n;
    RELEASE_GIL_IF(total >= GIL_RELEASE_BYTES);
    kv_run_jobs(b->jobs, (size_t)b->count, total >= GIL_RELEASE_BYTES ? threads : 1);
    REACQUIRE_GIL();
    PyObject *out = PyList_New(b->count);
    for (Py_ssize_t i = 0; out && i < b->count; i++) {
        PyObject *d = PyLong_FromUnsignedLongLong(b->jobs[i].digest);
        if (!d) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, d);
    }
    return out;
}

static int get_threads(PyObject *obj, int *out) {
    if (obj == NULL) {
        *out = 1;
        return 0;
    }
    if (PyBool_Check(obj) || !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "threads must be an int, not '%.100s'",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    long v = PyLong_AsLong(obj);
    if ((v == -1 && PyErr_Occurred()) || v < 1 || v > 64) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "threads must be in [1, 64], got %R", obj);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* The arguments of a batch call, checked, and every view acquired into `b` (dsts_o
 * NULL: hash only): 0, or -1 with an exception set and nothing held. */
static int batch_from_args(kv_batch *b, PyObject *srcs_o, PyObject *dsts_o,
                           PyObject *threads_o, PyObject *seed_o, int *threads) {
    uint64_t seed = 0;
    if (get_threads(threads_o, threads) < 0) return -1;
    if (seed_o != NULL && get_u64(seed_o, &seed, "seed") < 0) return -1;
    PyObject *srcs = PySequence_Fast(srcs_o, dsts_o ? "srcs must be a sequence of buffers"
                                                    : "bufs must be a sequence of buffers");
    if (!srcs) return -1;
    PyObject *dsts = NULL;
    int rc = -1;
    if (dsts_o) {
        dsts = PySequence_Fast(dsts_o, "dsts must be a sequence of buffers");
        if (!dsts) goto done;
        if (PySequence_Fast_GET_SIZE(dsts) != PySequence_Fast_GET_SIZE(srcs)) {
            PyErr_Format(PyExc_ValueError, "%zd dsts for %zd srcs",
                         PySequence_Fast_GET_SIZE(dsts), PySequence_Fast_GET_SIZE(srcs));
            goto done;
        }
    }
    rc = batch_acquire(b, srcs, dsts, seed); /* the views hold their exporters */
done:
    Py_XDECREF(dsts);
    Py_DECREF(srcs);
    return rc;
}

/* copy_checksum_many (dsts given) and xxh64_many share everything but the copy. */
static PyObject *do_many(PyObject *srcs_o, PyObject *dsts_o, PyObject *threads_o,
                         PyObject *seed_o) {
    int threads;
    kv_batch b;
    if (batch_from_args(&b, srcs_o, dsts_o, threads_o, seed_o, &threads) < 0) return NULL;
    PyObject *out = batch_run(&b, threads);
    batch_release(&b);
    return out;
}

PyDoc_STRVAR(copy_checksum_many_doc,
"copy_checksum_many(dsts, srcs, threads=1, seed=0) -> list[int]\n\n"
"copy_checksum(dsts[i], srcs[i], seed) for every i, in one call with the GIL\n"
"released, split over up to `threads` threads (this one and threads - 1 started\n"
"for the call) by contiguous runs of about equal bytes.");

static PyObject *kv_copy_checksum_many(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dsts", "srcs", "threads", "seed", NULL};
    PyObject *dsts_o, *srcs_o, *threads_o = NULL, *seed_o = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OO:copy_checksum_many", kwlist,
                                     &dsts_o, &srcs_o, &threads_o, &seed_o))
        return NULL;
    return do_many(srcs_o, dsts_o, threads_o, seed_o);
}

PyDoc_STRVAR(xxh64_many_doc,
"xxh64_many(bufs, threads=1, seed=0) -> list[int]\n\n"
"xxh64(bufs[i], seed) for every i, split over threads like copy_checksum_many.");

static PyObject *kv_xxh64_many(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"bufs", "threads", "seed", NULL};
    PyObject *bufs_o, *threads_o = NULL, *seed_o = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO:xxh64_many", kwlist, &bufs_o,
                                     &threads_o, &seed_o))
        return NULL;
    return do_many(bufs_o, NULL, threads_o, seed_o);
}

/* ---- A batch in the background ------------------------------------------ */

/* copy_checksum_start's handle: the views of the batch stay held, and the batch's
 * threads run, until result() (or the handle's end) joins them. */
typedef struct {
    PyObject_HEAD
    kv_batch b;
    kv_async a;
    int efd;               /* -1 once result() has closed it */
    int joined;            /* the threads are joined (under `lock`) */
    pthread_mutex_t lock;  /* one joiner at a time: result() may be called from threads */
    PyObject *digests;     /* result() once computed */
    pid_t pid;             /* the process that started the threads */
} CopyJobObject;

/* In a child forked while the job ran the threads do not exist (and the copies there
 * are incomplete): nothing to join, no result to give. */
static int job_forked(CopyJobObject *self) { return getpid() != self->pid; }

/* Wait for the threads (the GIL released: they may still be copying). Another caller
 * joining meanwhile is waited for, not joined twice. */
static void job_join(CopyJobObject *self) {
    if (job_forked(self)) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    if (!self->joined) {
        kv_join_jobs(&self->a);
        self->joined = 1;
    }
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
}

static void job_dealloc(CopyJobObject *self) {
    job_join(self);
    pthread_mutex_destroy(&self->lock);
    if (self->b.src) batch_release(&self->b);
    if (self->efd >= 0) close(self->efd);
    Py_XDECREF(self->digests);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *job_fileno(CopyJobObject *self, PyObject *unused) {
    if (self->efd < 0) {
        PyErr_SetString(PyExc_ValueError, "the job's result was taken: no descriptor left");
        return NULL;
    }
    return PyLong_FromLong(self->efd);
}

static PyObject *job_done(CopyJobObject *self, PyObject *unused) {
    return PyBool_FromLong(self->digests != NULL ||
                           __atomic_load_n(&self->a.running, __ATOMIC_ACQUIRE) == 0);
}

static PyObject *job_result(CopyJobObject *self, PyObject *unused) {
    if (self->digests == NULL && job_forked(self)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "the copy job was started in another process (before a fork)");
        return NULL;
    }
    if (self->digests == NULL) job_join(self);
    if (self->digests == NULL) {
        /* PyList_New may collect garbage, and a finalizer may call result() meanwhile:
         * look again before taking the batch. Filling the list (ints, not tracked by
         * the collector) runs no Python; the result is published and the batch and the
         * descriptor taken over before anything is released, since releasing a buffer
         * can run Python (its owner's end) that calls here again. */
        PyObject *out = PyList_New(self->b.count);
        if (!out) return NULL;
        if (self->digests != NULL) {
            Py_DECREF(out);
        } else {
            for (Py_ssize_t i = 0; i < self->b.count; i++) {
                PyObject *d;
                if (self->b.jobs[i].err == ETIMEDOUT) { /* not run: the deadline passed */
                    d = Py_None;
                    Py_INCREF(d);
                } else {
                    d = PyLong_FromUnsignedLongLong(self->b.jobs[i].digest);
                }
                if (!d) {
                    Py_DECREF(out);
                    return NULL;
                }
                PyList_SET_ITEM(out, i, d);
            }
            kv_batch b = self->b;
            int efd = self->efd;
            memset(&self->b, 0, sizeof(self->b));
            self->efd = -1;
            self->digests = out;
            if (efd >= 0) close(efd);
            batch_release(&b);
        }
    }
    Py_INCREF(self->digests);
    return self->digests;
}

static PyMethodDef job_methods[] = {
    {"fileno", (PyCFunction)job_fileno, METH_NOARGS,
     "fileno() -> int: an eventfd, readable once every job is done (until result())."},
    {"done", (PyCFunction)job_done, METH_NOARGS, "done() -> bool: every job has finished."},
    {"result", (PyCFunction)job_result, METH_NOARGS,
     "result() -> list[int | None]: the digests, in order (None: a copy not made, its\n"
     "deadline had passed); waits for the threads (GIL released), then releases the\n"
     "buffers and closes the descriptor. Later calls return the same."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CopyJobType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore._native.CopyJob",
    .tp_basicsize = sizeof(CopyJobObject),
    .tp_dealloc = (destructor)job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A copy_checksum_start batch running in the background.",
    .tp_methods = job_methods,
};

PyDoc_STRVAR(copy_checksum_start_doc,
"copy_checksum_start(dsts, srcs, threads=1, seed=0, deadline_ns=0) -> CopyJob\n\n"
"copy_checksum_many, run in the background on `threads` threads started for it (none\n"
"of them the caller's): returns at once (None, nothing copied, when no thread could\n"
"be started). The job's fileno() (an eventfd) becomes\n"
"readable when every copy is done; result() then gives the digests. The buffers stay\n"
"held (and must not be reused) until result() or the job's end, which wait for the\n"
"threads. Argument errors are raised here, before anything is copied. `deadline_ns`\n"
"(CLOCK_MONOTONIC, 0: none): a copy not begun by then is not made (its dst left as\n"
"it was, its digest None); one under way runs to its end.");

static PyObject *kv_copy_checksum_start(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dsts", "srcs", "threads", "seed", "deadline_ns", NULL};
    PyObject *dsts_o, *srcs_o, *threads_o = NULL, *seed_o = NULL, *deadline_o = NULL;
    uint64_t deadline_ns = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OOO:copy_checksum_start", kwlist,
                                     &dsts_o, &srcs_o, &threads_o, &seed_o, &deadline_o))
        return NULL;
    if (deadline_o != NULL && get_u64(deadline_o, &deadline_ns, "deadline_ns") < 0) return NULL;
    CopyJobObject *job = PyObject_New(CopyJobObject, &CopyJobType);
    if (!job) return NULL;
    memset(&job->b, 0, sizeof(job->b));
    job->a.started = 0;
    job->a.running = 0;
    job->joined = 1; /* nothing to join until started */
    pthread_mutex_init(&job->lock, NULL);
    job->digests = NULL;
    job->pid = getpid();
    job->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (job->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(job);
        return NULL;
    }
    int threads;
    if (batch_from_args(&job->b, srcs_o, dsts_o, threads_o, seed_o, &threads) < 0) {
        memset(&job->b, 0, sizeof(job->b));
        Py_DECREF(job);
        return NULL;
    }
    int started;
    Py_BEGIN_ALLOW_THREADS
    started = kv_start_jobs(&job->a, job->b.jobs, (size_t)job->b.count, threads, job->efd,
                            deadline_ns);
    Py_END_ALLOW_THREADS
    if (started == 0) { /* no thread to be had: the caller copies in the foreground */
        Py_DECREF(job);
        Py_RETURN_NONE;
    }
    job->joined = 0;
    return (PyObject *)job;
}

PyDoc_STRVAR(buffer_addresses_doc,
"buffer_addresses(bufs) -> list[int]\n\n"
"The address of the first byte of each of `bufs` (C-contiguous buffers, read-only\n"
"ones too), as cma_read_checksum takes them from another process: ~0.1 us a buffer,\n"
"where numpy's __array_interface__ costs ~2.");

static PyObject *kv_buffer_addresses(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "bufs must be a sequence of buffers");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    char name[48];
    for (Py_ssize_t i = 0; out && i < n; i++) {
        Py_buffer view;
        snprintf(name, sizeof(name), "bufs[%zd]", i);
        if (get_buffer(PySequence_Fast_GET_ITEM(seq, i), &view, name, 0) < 0) {
            Py_CLEAR(out);
            break;
        }
        PyObject *a = PyLong_FromVoidPtr(view.buf);
        PyBuffer_Release(&view);
        if (!a) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, a);
    }
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(cma_read_checksum_doc,
"cma_read_checksum(pid, dsts, addresses, threads=1, seed=0) -> list[int]\n\n"
"Fill each of dsts[i] (writable buffers) with the len(dsts[i]) bytes at address\n"
"addresses[i] of process `pid` (process_vm_readv: the kernel copies from that\n"
"process's pages; it needs the right to ptrace it) and return the XXH64 (`seed`) of\n"
"each, hashed in pieces as they land, with the GIL released, split over up to\n"
"`threads` threads like copy_checksum_many.  OSError (errno EPERM, ESRCH, EFAULT ...)\n"
"when a read fails: then the dsts hold anything and no digest is returned.");

static PyObject *kv_cma_read_checksum(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"pid", "dsts", "addresses", "threads", "seed", NULL};
    int pid, threads;
    PyObject *dsts_o, *addrs_o, *threads_o = NULL, *seed_o = NULL;
    uint64_t seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOO|OO:cma_read_checksum", kwlist, &pid,
                                     &dsts_o, &addrs_o, &threads_o, &seed_o))
        return NULL;
    if (pid <= 0) {
        PyErr_Format(PyExc_ValueError, "pid must be > 0, got %d", pid);
        return NULL;
    }
    if (get_threads(threads_o, &threads) < 0) return NULL;
    if (seed_o != NULL && get_u64(seed_o, &seed, "seed") < 0) return NULL;
    PyObject *dsts = PySequence_Fast(dsts_o, "dsts must be a sequence of buffers");
    if (!dsts) return NULL;
    PyObject *addrs = PySequence_Fast(addrs_o, "addresses must be a sequence of ints");
    if (!addrs) {
        Py_DECREF(dsts);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(dsts), held = 0;
    Py_buffer *views = NULL;
    kv_job *jobs = NULL;
    if (PySequence_Fast_GET_SIZE(addrs) != n) {
        PyErr_Format(PyExc_ValueError, "%zd addresses for %zd dsts",
                     PySequence_Fast_GET_SIZE(addrs), n);
        goto done;
    }
    views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    jobs = PyMem_Calloc(n ? n : 1, sizeof(kv_job));
    if (!views || !jobs) {
        PyErr_NoMemory();
        goto done;
    }
    char name[48];
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t addr;
        snprintf(name, sizeof(name), "addresses[%zd]", i);
        if (get_u64(PySequence_Fast_GET_ITEM(addrs, i), &addr, name) < 0) goto done;
        snprintf(name, sizeof(name), "dsts[%zd]", i);
        if (get_buffer(PySequence_Fast_GET_ITEM(dsts, i), &views[i], name, 1) < 0) goto done;
        held = i + 1;
        jobs[i].dst = (uint8_t *)views[i].buf;
        jobs[i].src = (const uint8_t *)(uintptr_t)addr;
        jobs[i].n = (size_t)views[i].len;
        jobs[i].seed = seed;
        jobs[i].pid = pid;
    }
    Py_BEGIN_ALLOW_THREADS
    kv_run_jobs(jobs, (size_t)n, threads);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (jobs[i].err) {
            errno = jobs[i].err;
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *d = PyLong_FromUnsignedLongLong(jobs[i].digest);
        if (!d) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, d);
    }
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(jobs);
    Py_DECREF(addrs);
    Py_DECREF(dsts);
    return out;
}

PyDoc_STRVAR(set_simd_doc,
"set_simd(enabled) -> bool\n\n"
"Use the AVX2 BLAKE2b compression when enabled and the CPU has AVX2 (the\n"
"default at import); False selects the portable scalar code.  Digests are\n"
"identical either way (the tests compare both paths).  Returns whether the\n"
"AVX2 code is now in use.");

static PyObject *kv_set_simd(PyObject *self, PyObject *arg) {
    int enabled = PyObject_IsTrue(arg);
    if (enabled < 0) return NULL;
    return PyBool_FromLong(b2_use_avx2(enabled));
}

static PyMethodDef kv_methods[] = {
    {"chain_hash", (PyCFunction)(void (*)(void))kv_chain_hash,
     METH_VARARGS | METH_KEYWORDS, chain_hash_doc},
    {"blake2b16", (PyCFunction)kv_blake2b16, METH_O, blake2b16_doc},
    {"xxh64", (PyCFunction)(void (*)(void))kv_xxh64, METH_VARARGS | METH_KEYWORDS,
     xxh64_doc},
    {"copy_checksum", (PyCFunction)(void (*)(void))kv_copy_checksum,
     METH_VARARGS | METH_KEYWORDS, copy_checksum_doc},
    {"copy_nt", (PyCFunction)(void (*)(void))kv_copy_nt, METH_VARARGS | METH_KEYWORDS,
     copy_nt_doc},
    {"verify_checksum", (PyCFunction)(void (*)(void))kv_verify_checksum,
     METH_VARARGS | METH_KEYWORDS, verify_checksum_doc},
    {"copy_checksum_many", (PyCFunction)(void (*)(void))kv_copy_checksum_many,
     METH_VARARGS | METH_KEYWORDS, copy_checksum_many_doc},
    {"xxh64_many", (PyCFunction)(void (*)(void))kv_xxh64_many, METH_VARARGS | METH_KEYWORDS,
     xxh64_many_doc},
    {"copy_checksum_start", (PyCFunction)(void (*)(void))kv_copy_checksum_start,
     METH_VARARGS | METH_KEYWORDS, copy_checksum_start_doc},
    {"buffer_addresses", (PyCFunction)kv_buffer_addresses, METH_O, buffer_addresses_doc},
    {"cma_read_checksum", (PyCFunction)(void (*)(void))kv_cma_read_checksum,
     METH_VARARGS | METH_KEYWORDS, cma_read_checksum_doc},
    {"set_simd", (PyCFunction)kv_set_simd, METH_O, set_simd_doc},
    {NULL, NULL, 0, NULL},
};

static int kv_exec(PyObject *m) {
    int have_avx2 = b2_use_avx2(1);
    if (PyModule_AddObjectRef(m, "HAVE_AVX2", have_avx2 ? Py_True : Py_False) < 0) return -1;
    if (PyModule_AddIntConstant(m, "BLOCK_ID_BYTES", B2_OUT) < 0) return -1;
    if (PyModule_AddObjectRef(m, "HAVE_SSE2", KV_HAVE_SSE2 ? Py_True : Py_False) < 0) return -1;
    if (PyModule_AddIntConstant(m, "NT_MIN_BYTES", (long)NT_MIN_BYTES) < 0) return -1;
    if (PyType_Ready(&CopyJobType) < 0) return -1;
    if (PyModule_AddObjectRef(m, "CopyJob", (PyObject *)&CopyJobType) < 0) return -1;
    if (kv_add_idtable(m) < 0) return -1;
    if (kv_add_paged(m) < 0) return -1;
    return 0;
}

static PyModuleDef_Slot kv_slots[] = {{Py_mod_exec, kv_exec}, {0, NULL}};

static struct PyModuleDef kv_module = {
    PyModuleDef_HEAD_INIT, "kvstore._native",
    "Native BLAKE2b-128 chain hashing, XXH64 and streaming copy+checksum.",
    0, kv_methods, kv_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModuleDef_Init(&kv_module); }
