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
 *   prefix(packed, cls, off, mem, names) -> dict   the route's walk (idwalk.c)
 *   used(n) -> bytes                  flags: value v < n is held by some id
 *   remap(trans)                      every value v becomes trans[v] (0 deletes)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "idtable.h"
#include "idtable_impl.h"

#include <sys/mman.h>

#define MIN_CAP ((size_t)1024)

/* Tables of this size or more live in their own 2 MiB-aligned mapping with
 * MADV_HUGEPAGE: every probe of a route lands on a random slot, and with 4 KiB
 * pages each one also missed the TLB (a two-level page walk under a
 * hypervisor), most of a big table's probe time.  Smaller ones stay on
 * PyMem.  Both are counted by tracemalloc (the mapping under its own domain),
 * so bench_router's bytes per entry still sees the whole table. */
#define HUGE_BYTES ((size_t)2 << 20)
#define TRACE_DOMAIN 0x6b76 /* "kv" */

/* Rounded to 4 KiB pages, not to huge ones: the tail past the last 2 MiB line
 * keeps small pages rather than holding up to 2 MiB nobody uses. */
static size_t map_bytes(size_t cap) {
    size_t n = cap * sizeof(slot_t);
    return (n + 4095) & ~(size_t)4095;
}

static slot_t *alloc_slots(size_t cap) {
    size_t bytes = cap * sizeof(slot_t);
    if (bytes < HUGE_BYTES) return PyMem_Calloc(cap, sizeof(slot_t));
    size_t len = map_bytes(cap);
    /* Over-map by one huge page and trim, so the table starts on a 2 MiB line. */
    uint8_t *raw = mmap(NULL, len + HUGE_BYTES, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    uintptr_t at = ((uintptr_t)raw + HUGE_BYTES - 1) & ~(uintptr_t)(HUGE_BYTES - 1);
    size_t head = at - (uintptr_t)raw;
    if (head) munmap(raw, head);
    if (HUGE_BYTES - head) munmap((uint8_t *)at + len, HUGE_BYTES - head);
#ifdef MADV_HUGEPAGE
    (void)madvise((void *)at, len, MADV_HUGEPAGE); /* advice: 4 KiB pages still work */
#endif
    (void)PyTraceMalloc_Track(TRACE_DOMAIN, at, len);
    return (slot_t *)at;
}

static void free_slots(slot_t *slots, size_t cap) {
    if (!slots) return;
    if (cap * sizeof(slot_t) < HUGE_BYTES) {
        PyMem_Free(slots);
        return;
    }
    (void)PyTraceMalloc_Untrack(TRACE_DOMAIN, (uintptr_t)slots);
    munmap(slots, map_bytes(cap));
}

static int resize(IdTable *t, size_t cap) {
    slot_t *old = t->slots, *fresh = alloc_slots(cap);
    if (!fresh) {
        PyErr_NoMemory();
        return -1;
    }
    size_t old_cap = t->cap;
    t->slots = fresh;
    t->cap = cap;
    for (size_t i = 0; i < old_cap; i++) {
        if (old[i].v) t->slots[idt_find(t, old[i].a, old[i].b)] = old[i];
    }
    free_slots(old, old_cap);
    return 0;
}

/* Remove the entry at slot i, shifting later entries of its cluster back so
 * every entry stays reachable from its home slot without tombstones. */
static void delete_at(IdTable *t, size_t i) {
    size_t m = t->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & m;
        if (!t->slots[j].v) break;
        size_t k = idt_mix(t, t->slots[j].a, t->slots[j].b) & m;
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

int kv_u32_view(PyObject *obj, Py_buffer *view, const char *name) {
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
    t->slots = alloc_slots(t->cap);
    if (!t->slots) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    return (PyObject *)t;
}

static void idt_dealloc(IdTable *t) {
    free_slots(t->slots, t->cap);
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
            idt_lookup(t, (const uint8_t *)PyBytes_AS_STRING(args[0]) + 16 * i));
    }
    Py_buffer view;
    if (get_packed(args[0], &view) < 0) return NULL;
    PyObject *out = NULL;
    if (i < 0 || i >= view.len / 16) PyErr_SetString(PyExc_IndexError, "id index out of range");
    else out = PyLong_FromUnsignedLong(idt_lookup(t, (const uint8_t *)view.buf + 16 * i));
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
        uint32_t v = idt_lookup(t, p + 16 * i);
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
    size_t i = idt_find(t, a, b);
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
            i = idt_find(t, a, b);
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
    if (kv_u32_view(arg, &tv, "trans") < 0) return NULL;
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
        slot_t *old = t->slots, *fresh = alloc_slots(cap);
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
            t->slots[idt_find(t, s.a, s.b)] = s;
            t->len++;
        }
        free_slots(old, old_cap);
    } else {
        for (size_t i = 0; i < t->cap; i++) {
            uint32_t v = t->slots[i].v;
            if (v) t->slots[i].v = tr[v];
        }
    }
    return PyLong_FromSize_t(removed);
}

static PyObject *idt_nbytes(IdTable *t, void *closure) {
    size_t n = t->cap * sizeof(slot_t);
    return PyLong_FromSize_t((n < HUGE_BYTES ? n : map_bytes(t->cap)) + sizeof(IdTable));
}

static PyMethodDef idt_methods[] = {
    {"get", (PyCFunction)(void (*)(void))idt_get, METH_FASTCALL, "get(packed, i) -> int"},
    {"distinct", (PyCFunction)idt_distinct, METH_O, "distinct(packed) -> list[int]"},
    {"transition", (PyCFunction)idt_transition, METH_VARARGS,
     "transition(packed, old, new) -> list[int]"},
    {"prefix", (PyCFunction)(void (*)(void))kv_idt_prefix, METH_FASTCALL,
     "prefix(packed, cls, off, mem, names) -> dict (idwalk.c)"},
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
