/*
 * IdTable: 16-byte block id -> uint32 value (the router's interned holder-mask
 * ids; 0 means absent), an open-addressing hash table with linear probing and
 * backward-shift deletion.  20 bytes a slot, grown at 70% load, so 29-57 bytes
 * per id instead of ~100 for a dict of bytes keys (router/index.py).
 *
 * The slot is chosen by a keyed mix of the id (seed from the caller), so ids an
 * agent was made to store cannot be crafted to collide in the router.
 *
 * Methods work on packed ids (concatenated 16-byte ids, as events carry them):
 *   get(packed, i) -> int             value of the i-th id
 *   distinct(packed) -> list[int]     sorted distinct values of the ids (0: absent)
 *   transition(packed, old, new) -> list[int]
 *       for each id whose value is old[j] (old sorted): set new[j] (0 deletes);
 *       returns how many ids had each old value.  An id repeated in packed meets
 *       its new value the second time, so transitions must be idempotent.
 *   walk(packed, cls) -> list[int]    the prefix walk (see kv_walk)
 *   used(n) -> bytes                  flags: value v < n is held by some id
 *   remap(trans)                      every value v becomes trans[v] (0 deletes)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "common.h"
#include "idtable.h"

#define MIN_CAP ((size_t)1024)

typedef struct __attribute__((packed)) {
    uint64_t a, b;
    uint32_t v; /* 0: empty */
} slot_t;

typedef struct {
    PyObject_HEAD
    slot_t *slots;
    size_t cap; /* power of two */
    size_t len;
    uint64_t s0, s1;
} IdTable;

static inline uint64_t mix(const IdTable *t, uint64_t a, uint64_t b) {
    uint64_t x = (a ^ t->s0) + (b ^ t->s1) * 0x9E3779B97F4A7C15ULL;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* Slot holding (a, b), or the empty slot where it would go. */
static inline size_t find(const IdTable *t, uint64_t a, uint64_t b) {
    size_t m = t->cap - 1, i = mix(t, a, b) & m;
    for (;;) {
        const slot_t *s = &t->slots[i];
        if (!s->v || (s->a == a && s->b == b)) return i;
        i = (i + 1) & m;
    }
}

static inline uint32_t lookup(const IdTable *t, const uint8_t *id) {
    uint64_t a = load64_le(id), b = load64_le(id + 8);
    return t->slots[find(t, a, b)].v;
}

static int resize(IdTable *t, size_t cap) {
    slot_t *old = t->slots, *fresh = PyMem_Calloc(cap, sizeof(slot_t));
    if (!fresh) {
        PyErr_NoMemory();
        return -1;
    }
    size_t old_cap = t->cap;
    t->slots = fresh;
    t->cap = cap;
    for (size_t i = 0; i < old_cap; i++) {
        if (old[i].v) t->slots[find(t, old[i].a, old[i].b)] = old[i];
    }
    PyMem_Free(old);
    return 0;
}

/* Remove the entry at slot i, shifting later entries of its cluster back so
 * every entry stays reachable from its home slot without tombstones. */
static void delete_at(IdTable *t, size_t i) {
    size_t m = t->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & m;
        if (!t->slots[j].v) break;
        size_t k = mix(t, t->slots[j].a, t->slots[j].b) & m;
        /* j's entry may move to i unless its home k lies cyclically in (i, j]. */
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    t->slots[i].v = 0;
    t->len--;
}

static int check_packed(const Py_buffer *view) {
    if (view->len % 16) {
        PyErr_Format(PyExc_ValueError, "packed ids length must be a multiple of 16, got %zd",
                     view->len);
        return -1;
    }
    return 0;
}

static int get_packed(PyObject *obj, Py_buffer *view) {
    if (kv_get_buffer(obj, view, "packed", 0) < 0) return -1;
    if (check_packed(view) < 0) {
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int get_u32_array(PyObject *obj, Py_buffer *view, const char *name) {
    if (kv_get_buffer(obj, view, name, 0) < 0) return -1;
    if (view->itemsize != 4 || view->len % 4) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s must be a buffer of 4-byte unsigned ints", name);
        return -1;
    }
    return 0;
}

/* ---- type --------------------------------------------------------------- */

static PyObject *idt_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"seed", NULL};
    Py_buffer seed;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*:IdTable", kwlist, &seed)) return NULL;
    if (seed.len != 16) {
        PyBuffer_Release(&seed);
        PyErr_SetString(PyExc_ValueError, "seed must be 16 bytes");
        return NULL;
    }
    IdTable *t = (IdTable *)type->tp_alloc(type, 0);
    if (!t) {
        PyBuffer_Release(&seed);
        return NULL;
    }
    t->s0 = load64_le(seed.buf);
    t->s1 = load64_le((const uint8_t *)seed.buf + 8);
    PyBuffer_Release(&seed);
    t->cap = MIN_CAP;
    t->len = 0;
    t->slots = PyMem_Calloc(t->cap, sizeof(slot_t));
    if (!t->slots) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    return (PyObject *)t;
}

static void idt_dealloc(IdTable *t) {
    PyMem_Free(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t idt_len(IdTable *t) { return (Py_ssize_t)t->len; }

static PyObject *idt_get(IdTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "get(packed, i) takes 2 arguments");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (PyBytes_CheckExact(args[0])) { /* the route's hot path */
        Py_ssize_t n = PyBytes_GET_SIZE(args[0]) / 16;
        if (i < 0 || i >= n) {
            PyErr_SetString(PyExc_IndexError, "id index out of range");
            return NULL;
        }
        return PyLong_FromUnsignedLong(
            lookup(t, (const uint8_t *)PyBytes_AS_STRING(args[0]) + 16 * i));
    }
    Py_buffer view;
    if (get_packed(args[0], &view) < 0) return NULL;
    PyObject *out = NULL;
    if (i < 0 || i >= view.len / 16) PyErr_SetString(PyExc_IndexError, "id index out of range");
    else out = PyLong_FromUnsignedLong(lookup(t, (const uint8_t *)view.buf + 16 * i));
    PyBuffer_Release(&view);
    return out;
}

static int cmp_u32(const void *x, const void *y) {
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    return (a > b) - (a < b);
}

static PyObject *idt_distinct(IdTable *t, PyObject *arg) {
    Py_buffer view;
    if (get_packed(arg, &view) < 0) return NULL;
    size_t n = (size_t)view.len / 16, k = 0;
    uint32_t *vals = PyMem_Malloc((n ? n : 1) * sizeof(uint32_t));
    if (!vals) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    /* A batch holds few distinct values: a small direct-mapped cache of those seen
     * keeps most repeats out of the sort. */
    uint32_t seen[256] = {0}; /* value + 1; 0: empty */
    const uint8_t *p = view.buf;
    for (size_t i = 0; i < n; i++) {
        uint32_t v = lookup(t, p + 16 * i);
        if (seen[v & 255] == v + 1) continue;
        seen[v & 255] = v + 1;
        vals[k++] = v;
    }
    PyBuffer_Release(&view);
    n = k;
    qsort(vals, n, sizeof(uint32_t), cmp_u32);
    PyObject *out = PyList_New(0);
    for (size_t i = 0; out && i < n; i++) {
        if (i && vals[i] == vals[i - 1]) continue;
        PyObject *v = PyLong_FromUnsignedLong(vals[i]);
        if (!v || PyList_Append(out, v) < 0) Py_CLEAR(out);
        Py_XDECREF(v);
    }
    PyMem_Free(vals);
    return out;
}

/* A list of ints in [0, 2**32) into a malloc'ed array; -1 with an exception. */
static int u32_list(PyObject *lst, uint32_t **out, Py_ssize_t *n, const char *name) {
    if (!PyList_Check(lst)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of ints", name);
        return -1;
    }
    *n = PyList_GET_SIZE(lst);
    *out = PyMem_Malloc((*n ? *n : 1) * sizeof(uint32_t));
    if (!*out) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PyList_GET_ITEM(lst, i));
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: value out of range", name);
            PyMem_Free(*out);
            return -1;
        }
        (*out)[i] = (uint32_t)v;
    }
    return 0;
}

static Py_ssize_t bsearch_u32(const uint32_t *a, Py_ssize_t n, uint32_t v) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (a[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return (lo < n && a[lo] == v) ? lo : -1;
}

static int apply_one(IdTable *t, uint64_t a, uint64_t b, const uint32_t *old, const uint32_t *new,
                     Py_ssize_t nold, Py_ssize_t *counts) {
    size_t i = find(t, a, b);
    Py_ssize_t j = bsearch_u32(old, nold, t->slots[i].v);
    if (j < 0) return 0; /* a repeated id, already moved to its new value */
    counts[j]++;
    uint32_t nv = new[j];
    if (nv == t->slots[i].v) return 0;
    if (!nv) {
        delete_at(t, i);
    } else if (t->slots[i].v) {
        t->slots[i].v = nv;
    } else {
        if ((t->len + 1) * 10 > t->cap * 7) {
            if (resize(t, t->cap * 2) < 0) return -1;
            i = find(t, a, b);
        }
        t->slots[i].a = a;
        t->slots[i].b = b;
        t->slots[i].v = nv;
        t->len++;
    }
    return 0;
}

static PyObject *idt_transition(IdTable *t, PyObject *args) {
    PyObject *packed_o, *old_o, *new_o;
    if (!PyArg_ParseTuple(args, "OOO:transition", &packed_o, &old_o, &new_o)) return NULL;
    uint32_t *old = NULL, *new = NULL;
    Py_ssize_t nold, nnew, *counts = NULL;
    PyObject *out = NULL;
    Py_buffer view;
    if (get_packed(packed_o, &view) < 0) return NULL;
    if (u32_list(old_o, &old, &nold, "old") < 0) goto done;
    if (u32_list(new_o, &new, &nnew, "new") < 0) goto done;
    if (nold != nnew) {
        PyErr_SetString(PyExc_ValueError, "old and new must have the same length");
        goto done;
    }
    for (Py_ssize_t j = 1; j < nold; j++) {
        if (old[j] <= old[j - 1]) {
            PyErr_SetString(PyExc_ValueError, "old must be sorted and distinct");
            goto done;
        }
    }
    counts = PyMem_Calloc(nold ? nold : 1, sizeof(Py_ssize_t));
    if (!counts) {
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *p = view.buf;
    for (Py_ssize_t i = 0; i < view.len / 16; i++) {
        if (apply_one(t, load64_le(p + 16 * i), load64_le(p + 16 * i + 8), old, new, nold,
                      counts) < 0)
            goto done;
    }
    out = PyList_New(nold);
    for (Py_ssize_t j = 0; out && j < nold; j++) {
        PyObject *c = PyLong_FromSsize_t(counts[j]);
        if (!c) Py_CLEAR(out);
        else PyList_SET_ITEM(out, j, c);
    }
done:
    PyBuffer_Release(&view);
    PyMem_Free(old);
    PyMem_Free(new);
    PyMem_Free(counts);
    return out;
}

static inline void prefetch_id(const IdTable *t, const uint8_t *p, Py_ssize_t i) {
    const uint8_t *id = p + 16 * i;
    KV_PREFETCH(&t->slots[mix(t, load64_le(id), load64_le(id + 8)) & (t->cap - 1)]);
}

/* The class (cls[value]) of the i-th id, or -1 with an exception. */
static inline long class_of(const IdTable *t, const uint8_t *p, Py_ssize_t i, const uint32_t *cls,
                            size_t ncls) {
    uint32_t v = lookup(t, p + 16 * i);
    if (v >= ncls) {
        PyErr_Format(PyExc_ValueError, "value %u has no class (cls has %zu)", v, ncls);
        return -1;
    }
    return cls[v];
}

/* walk(packed, cls) -> [c0, hi1, c1, hi2, c2, ...]: c0 is the class of id 0,
 * then each point hi where the class changes, found by bisection, with the
 * class there (0 at the end of the prompt).  Ends at the first class 0.  The
 * bisection is exact when a prompt's classes form runs, as holder sets do on
 * prefix-consistent stores (they only lose nodes along a prompt). */
static PyObject *idt_walk(IdTable *t, PyObject *args) {
    PyObject *packed_o, *cls_o;
    if (!PyArg_ParseTuple(args, "OO:walk", &packed_o, &cls_o)) return NULL;
    Py_buffer view, cv;
    if (get_packed(packed_o, &view) < 0) return NULL;
    if (get_u32_array(cls_o, &cv, "cls") < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint8_t *p = view.buf;
    const uint32_t *cls = cv.buf;
    size_t ncls = (size_t)cv.len / 4;
    Py_ssize_t n = view.len / 16, lo = 0;
    long seq[2 * 64 + 1];
    PyObject *out = PyList_New(0);
    long cur = n ? class_of(t, p, 0, cls, ncls) : 0;
    int k = 0;
    if (cur < 0) goto fail;
    seq[k++] = cur;
    while (cur > 0) {
        Py_ssize_t hi = n;
        while (hi - lo > 1) {
            Py_ssize_t mid = (lo + hi) >> 1;
            /* Each probe is a cache miss in a big table: fetch both possible next
             * probes' slots while this one waits, so the misses overlap. */
            prefetch_id(t, p, (lo + mid) >> 1);
            prefetch_id(t, p, (mid + hi) >> 1);
            long c = class_of(t, p, mid, cls, ncls);
            if (c < 0) goto fail;
            if (c == cur) lo = mid;
            else hi = mid;
        }
        long nxt = hi < n ? class_of(t, p, hi, cls, ncls) : 0;
        if (nxt < 0) goto fail;
        seq[k++] = (long)hi;
        seq[k++] = nxt;
        if (k > 2 * 64 - 1) { /* flush: a prompt with many drop points */
            for (int j = 0; j < k; j++) {
                PyObject *x = PyLong_FromLong(seq[j]);
                if (!x || PyList_Append(out, x) < 0) {
                    Py_XDECREF(x);
                    goto fail;
                }
                Py_DECREF(x);
            }
            k = 0;
        }
        lo = hi;
        cur = nxt;
    }
    for (int j = 0; j < k; j++) {
        PyObject *x = PyLong_FromLong(seq[j]);
        if (!x || PyList_Append(out, x) < 0) {
            Py_XDECREF(x);
            goto fail;
        }
        Py_DECREF(x);
    }
    PyBuffer_Release(&view);
    PyBuffer_Release(&cv);
    return out;
fail:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    PyBuffer_Release(&cv);
    return NULL;
}

static PyObject *idt_used(IdTable *t, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "n must be >= 0");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (!out) return NULL;
    char *f = PyBytes_AS_STRING(out);
    memset(f, 0, (size_t)n);
    for (size_t i = 0; i < t->cap; i++) {
        uint32_t v = t->slots[i].v;
        if (v && v < (size_t)n) f[v] = 1;
    }
    return out;
}

static PyObject *idt_remap(IdTable *t, PyObject *arg) {
    Py_buffer tv;
    if (get_u32_array(arg, &tv, "trans") < 0) return NULL;
    const uint32_t *tr = tv.buf;
    size_t ntr = (size_t)tv.len / 4, removed = 0;
    for (size_t i = 0; i < t->cap; i++) {
        uint32_t v = t->slots[i].v;
        if (v && v >= ntr) {
            PyBuffer_Release(&tv);
            PyErr_Format(PyExc_ValueError, "value %u is not in trans (%zu values)", v, ntr);
            return NULL;
        }
    }
    for (size_t i = 0; i < t->cap; i++) {
        uint32_t v = t->slots[i].v;
        if (v && !tr[v]) removed++;
    }
    PyBuffer_Release(&tv);
    if (removed) {
        /* Rebuild rather than delete in place: deleting while scanning would
         * shift entries across the scan position. */
        size_t cap = t->cap;
        size_t live = t->len - removed;
        while (cap > MIN_CAP && live * 10 < cap * 7 / 4) cap >>= 1; /* shrink below 17.5% */
        slot_t *old = t->slots, *fresh = PyMem_Calloc(cap, sizeof(slot_t));
        if (!fresh) return PyErr_NoMemory();
        size_t old_cap = t->cap;
        t->slots = fresh;
        t->cap = cap;
        t->len = 0;
        for (size_t i = 0; i < old_cap; i++) {
            uint32_t v = old[i].v;
            if (!v || !tr[v]) continue;
            slot_t s = old[i];
            s.v = tr[v];
            t->slots[find(t, s.a, s.b)] = s;
            t->len++;
        }
        PyMem_Free(old);
    } else {
        for (size_t i = 0; i < t->cap; i++) {
            uint32_t v = t->slots[i].v;
            if (v) t->slots[i].v = tr[v];
        }
    }
    return PyLong_FromSize_t(removed);
}

static PyObject *idt_nbytes(IdTable *t, void *closure) {
    return PyLong_FromSize_t(t->cap * sizeof(slot_t) + sizeof(IdTable));
}

static PyMethodDef idt_methods[] = {
    {"get", (PyCFunction)(void (*)(void))idt_get, METH_FASTCALL, "get(packed, i) -> int"},
    {"distinct", (PyCFunction)idt_distinct, METH_O, "distinct(packed) -> list[int]"},
    {"transition", (PyCFunction)idt_transition, METH_VARARGS,
     "transition(packed, old, new) -> list[int]"},
    {"walk", (PyCFunction)idt_walk, METH_VARARGS, "walk(packed, cls) -> list[int]"},
    {"used", (PyCFunction)idt_used, METH_O, "used(n) -> bytes"},
    {"remap", (PyCFunction)idt_remap, METH_O, "remap(trans) -> int (ids removed)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef idt_getset[] = {
    {"nbytes", (getter)idt_nbytes, NULL, "bytes the table holds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods idt_as_seq = {.sq_length = (lenfunc)idt_len};

static PyTypeObject IdTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstore._native.IdTable",
    .tp_basicsize = sizeof(IdTable),
    .tp_dealloc = (destructor)idt_dealloc,
    .tp_as_sequence = &idt_as_seq,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "16-byte id -> uint32 value hash table (router/index.py)",
    .tp_methods = idt_methods,
    .tp_getset = idt_getset,
    .tp_new = idt_new,
};

int kv_add_idtable(PyObject *m) {
    if (PyType_Ready(&IdTableType) < 0) return -1;
    return PyModule_AddObjectRef(m, "IdTable", (PyObject *)&IdTableType);
}
