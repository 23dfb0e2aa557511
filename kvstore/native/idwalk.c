/*
 * IdTable.prefix: the route's walk along a prompt (router/index.py).
 *
 * prefix(packed, cls, off, mem, names) -> dict[name, int]
 *   packed  the prompt's 16-byte block ids, in prefix order
 *   cls     uint32 per table value: its class (holder set without tiers)
 *   off     uint32 per class, plus one: class c's holders are mem[off[c]:off[c+1]]
 *   mem     uint32 holder slots, ascending within a class
 *   names   list: slot -> node name (None: a free slot, skipped)
 * Returns, for every holder of id 0, how many leading ids it holds.
 *
 * Holder sets only lose nodes along a prompt on prefix-consistent stores, so
 * the ids' classes form runs; each point where the class changes is found by
 * a K-ary search (K-1 probes a round, their slots fetched together so the
 * cache misses of a big table overlap) instead of a scan: a few rounds per
 * change point, whatever the table's size or the node count.  The holders
 * the next class lacks end there; the walk stops when none is left.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "idtable.h"
#include "idtable_impl.h"

#ifndef WAYS
#define WAYS 8 /* K: probes per round + 1 (4-16 measured alike) */
#endif
#define STACK_SET 64 /* holder sets up to this size live on the stack */

typedef struct {
    const IdTable *t;
    const uint8_t *p;
    Py_ssize_t n;
    const uint32_t *cls, *off, *mem;
    size_t ncls, noff, nmem;
} walk_t;

/* The class of id i, or -1 with an exception. */
static inline long class_at(const walk_t *w, Py_ssize_t i) {
    uint32_t v = idt_lookup(w->t, w->p + 16 * i);
    if (v >= w->ncls) {
        PyErr_Format(PyExc_ValueError, "value %u has no class (cls has %zu)", v, w->ncls);
        return -1;
    }
    return w->cls[v];
}

/* First index past lo (whose class is cur) where the class differs, found by
 * a K-ary search over (lo, n); n when none does.  -1 with an exception. */
static Py_ssize_t next_change(const walk_t *w, Py_ssize_t lo, long cur, long *nxt) {
    Py_ssize_t hi = w->n;
    while (hi - lo > 1) {
        Py_ssize_t pts[WAYS - 1];
        int k = 0;
        for (int j = 1; j < WAYS; j++) {
            Py_ssize_t q = lo + (Py_ssize_t)(((hi - lo) * (int64_t)j) / WAYS);
            if (q > lo && q < hi && (k == 0 || q > pts[k - 1])) pts[k++] = q;
        }
        for (int j = 0; j < k; j++) idt_prefetch(w->t, w->p + 16 * pts[j]);
        Py_ssize_t new_lo = lo, new_hi = hi;
        for (int j = 0; j < k; j++) {
            long c = class_at(w, pts[j]);
            if (c < 0) return -1;
            if (c != cur) {
                new_hi = pts[j];
                break;
            }
            new_lo = pts[j];
        }
        lo = new_lo;
        hi = new_hi;
    }
    if (hi < w->n) {
        *nxt = class_at(w, hi);
        if (*nxt < 0) return -1;
    } else {
        *nxt = 0;
    }
    return hi;
}

static int members(const walk_t *w, long c, const uint32_t **m, size_t *k) {
    if ((size_t)c + 1 >= w->noff || w->off[c] > w->off[c + 1] || w->off[c + 1] > w->nmem) {
        PyErr_Format(PyExc_ValueError, "class %ld has no holders in off/mem", c);
        return -1;
    }
    *m = w->mem + w->off[c];
    *k = w->off[c + 1] - w->off[c];
    return 0;
}

/* out[names[s]] = hi for each slot s of cur (ascending) missing from next's
 * holders; cur keeps the others.  -1 with an exception. */
static int drop(uint32_t *cur, size_t *ncur, const uint32_t *nm, size_t nn, Py_ssize_t hi,
                PyObject *names, PyObject *out) {
    size_t keep = 0, j = 0;
    for (size_t i = 0; i < *ncur; i++) {
        uint32_t s = cur[i];
        while (j < nn && nm[j] < s) j++;
        if (j < nn && nm[j] == s) {
            cur[keep++] = s;
            continue;
        }
        if ((Py_ssize_t)s >= PyList_GET_SIZE(names)) {
            PyErr_Format(PyExc_ValueError, "slot %u has no name", s);
            return -1;
        }
        PyObject *name = PyList_GET_ITEM(names, s);
        if (name == Py_None) continue; /* a held slot is a live one: never None */
        PyObject *len = PyLong_FromSsize_t(hi);
        int rc = len ? PyDict_SetItem(out, name, len) : -1;
        Py_XDECREF(len);
        if (rc < 0) return -1;
    }
    *ncur = keep;
    return 0;
}

static PyObject *walk_prefix(walk_t *w, PyObject *names) {
    PyObject *out = PyDict_New();
    if (!out || !w->n) return out;
    long cur = class_at(w, 0);
    if (cur < 0) goto fail;
    const uint32_t *m;
    size_t ncur;
    if (members(w, cur, &m, &ncur) < 0) goto fail;
    uint32_t stack[STACK_SET], *set = ncur <= STACK_SET ? stack : PyMem_Malloc(ncur * 4);
    if (!set) {
        PyErr_NoMemory();
        goto fail;
    }
    memcpy(set, m, ncur * 4);
    Py_ssize_t lo = 0;
    while (ncur) {
        long nxt;
        Py_ssize_t hi = next_change(w, lo, cur, &nxt);
        size_t nn = 0;
        if (hi < 0 || (nxt && members(w, nxt, &m, &nn) < 0) ||
            drop(set, &ncur, m, nn, hi, names, out) < 0) {
            if (set != stack) PyMem_Free(set);
            goto fail;
        }
        lo = hi;
        cur = nxt;
    }
    if (set != stack) PyMem_Free(set);
    return out;
fail:
    Py_XDECREF(out);
    return NULL;
}

PyObject *kv_idt_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "prefix(packed, cls, off, mem, names) takes 5 arguments");
        return NULL;
    }
    if (!PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "names must be a list");
        return NULL;
    }
    Py_buffer pv, views[3];
    static const char *what[3] = {"cls", "off", "mem"};
    if (kv_get_buffer(args[0], &pv, "packed", 0) < 0) return NULL;
    if (pv.len % 16) {
        PyBuffer_Release(&pv);
        PyErr_Format(PyExc_ValueError, "packed ids length must be a multiple of 16, got %zd",
                     pv.len);
        return NULL;
    }
    int got = 0;
    PyObject *out = NULL;
    for (; got < 3; got++) {
        if (kv_u32_view(args[1 + got], &views[got], what[got]) < 0) goto done;
    }
    walk_t w = {
        (const IdTable *)self, pv.buf,           pv.len / 16,          views[0].buf,
        views[1].buf,          views[2].buf,     (size_t)views[0].len / 4,
        (size_t)views[1].len / 4, (size_t)views[2].len / 4,
    };
    out = walk_prefix(&w, args[4]);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyBuffer_Release(&pv);
    return out;
}
