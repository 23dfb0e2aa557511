/* The IdTable's layout and probe, shared by idtable.c (the type, events'
 * batch operations) and idwalk.c (the route's prefix walk). */
#ifndef KV_NATIVE_IDTABLE_IMPL_H
#define KV_NATIVE_IDTABLE_IMPL_H

#include <Python.h>

#include "common.h"

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

static inline uint64_t idt_mix(const IdTable *t, uint64_t a, uint64_t b) {
    uint64_t x = (a ^ t->s0) + (b ^ t->s1) * 0x9E3779B97F4A7C15ULL;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* Slot holding (a, b), or the empty slot where it would go. */
static inline size_t idt_find(const IdTable *t, uint64_t a, uint64_t b) {
    size_t m = t->cap - 1, i = idt_mix(t, a, b) & m;
    for (;;) {
        const slot_t *s = &t->slots[i];
        if (!s->v || (s->a == a && s->b == b)) return i;
        i = (i + 1) & m;
    }
}

static inline uint32_t idt_lookup(const IdTable *t, const uint8_t *id) {
    uint64_t a = load64_le(id), b = load64_le(id + 8);
    return t->slots[idt_find(t, a, b)].v;
}

static inline void idt_prefetch(const IdTable *t, const uint8_t *id) {
    KV_PREFETCH(&t->slots[idt_mix(t, load64_le(id), load64_le(id + 8)) & (t->cap - 1)]);
}

/* A buffer of 4-byte unsigned ints (idtable.c); -1 with TypeError otherwise. */
int kv_u32_view(PyObject *obj, Py_buffer *view, const char *name);

/* idwalk.c's method, listed in idtable.c's method table. */
PyObject *kv_idt_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
