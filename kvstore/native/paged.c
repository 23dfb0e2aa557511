/* Copies between kvstore blocks and vLLM's paged CPU KV cache (see paged.h).
 *
 * A kvstore block is (layers, 2 [K, V], block_size, kv_heads, row bytes); vLLM CPU keeps
 * one C-contiguous tensor per layer, (num_blocks, kv_heads, 2, block_size, row bytes)
 * read as bytes (its (num_blocks, kv_heads, block_size, 2 * head_dim) cache, which its
 * kernel reads as K rows then V rows per head).  Per block and layer that is
 * 2 * block_size * kv_heads rows of `row` bytes (head_dim * itemsize) moved between two
 * orders: one memcpy per row, the cache side written (or read) in order.  torch's
 * strided copy of the same permutation runs several times slower (per-row dispatch over
 * a 5-d iterator, pieces kept small so that it stays on one thread). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "common.h"
#include "idtable.h" /* kv_get_buffer */
#include "paged.h"

typedef struct {
    size_t layers, block_size, kv_heads, row;
} paged_geom;

/* One block: `blk` (a kvstore block) <-> block `slot` of every layer cache. */
static void paged_block(const paged_geom *g, uint8_t *const *caches, uint8_t *blk, size_t slot,
                        int to_cache) {
    size_t head_rows = g->block_size * g->row;           /* one head's K (or V) rows */
    size_t cache_block = g->kv_heads * 2 * head_rows;    /* one block of one layer */
    size_t token_stride = g->kv_heads * g->row;          /* in the kvstore block */
    for (size_t l = 0; l < g->layers; l++) {
        uint8_t *c = caches[l] + slot * cache_block;
        uint8_t *b = blk + l * cache_block;
        for (size_t h = 0; h < g->kv_heads; h++) {
            for (size_t kv = 0; kv < 2; kv++) {
                uint8_t *cr = c + (h * 2 + kv) * head_rows;
                uint8_t *br = b + kv * g->block_size * token_stride + h * g->row;
                for (size_t t = 0; t < g->block_size; t++, cr += g->row, br += token_stride) {
                    if (to_cache)
                        memcpy(cr, br, g->row);
                    else
                        memcpy(br, cr, g->row);
                }
            }
        }
    }
}

/* The block ids as size_t, each checked against [0, num_blocks); NULL with an exception. */
static size_t *paged_ids(PyObject *ids_o, size_t num_blocks, Py_ssize_t *count) {
    PyObject *seq = PySequence_Fast(ids_o, "block_ids must be a sequence of ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    size_t *ids = PyMem_Malloc((n ? n : 1) * sizeof(size_t));
    if (!ids) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        /* Any integer (numpy's too: __index__), never a bool. */
        Py_ssize_t v = PyIndex_Check(o) && !PyBool_Check(o) ? PyNumber_AsSsize_t(o, NULL) : -1;
        if (v < 0 || (size_t)v >= num_blocks) {
            if (PyErr_Occurred()) PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "block_ids[%zd] is %R, not a block in [0, %zu)", i, o,
                         num_blocks);
            PyMem_Free(ids);
            Py_DECREF(seq);
            return NULL;
        }
        ids[i] = (size_t)v;
    }
    Py_DECREF(seq);
    *count = n;
    return ids;
}

static int overlaps(const Py_buffer *a, const Py_buffer *b) {
    uintptr_t a0 = (uintptr_t)a->buf, b0 = (uintptr_t)b->buf;
    return a0 < b0 + (size_t)b->len && b0 < a0 + (size_t)a->len;
}

static PyObject *paged_copy(PyObject *args, PyObject *kwargs, int to_cache) {
    static char *kwlist[] = {"caches", "block_ids", "blocks", "block_size", "kv_heads",
                             "row_bytes", NULL};
    PyObject *caches_o, *ids_o, *blocks_o;
    Py_ssize_t bs, heads, row;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOnnn", kwlist, &caches_o, &ids_o,
                                     &blocks_o, &bs, &heads, &row))
        return NULL;
    if (bs <= 0 || heads <= 0 || row <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size, kv_heads and row_bytes must be > 0");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(caches_o, "caches must be a sequence of buffers");
    if (!seq) return NULL;
    Py_ssize_t layers = PySequence_Fast_GET_SIZE(seq);
    paged_geom g = {(size_t)layers, (size_t)bs, (size_t)heads, (size_t)row};
    size_t cache_block = g.kv_heads * 2 * g.block_size * g.row;
    Py_buffer *views = PyMem_Calloc(layers ? layers : 1, sizeof(Py_buffer));
    uint8_t **bases = PyMem_Calloc(layers ? layers : 1, sizeof(uint8_t *));
    Py_buffer blocks = {0};
    size_t *ids = NULL;
    Py_ssize_t held = 0, n = 0, num_blocks = PY_SSIZE_T_MAX;
    PyObject *result = NULL;
    char name[32];
    if (!views || !bases) {
        PyErr_NoMemory();
        goto done;
    }
    if (layers == 0) {
        PyErr_SetString(PyExc_ValueError, "caches is empty");
        goto done;
    }
    for (; held < layers; held++) {
        snprintf(name, sizeof(name), "caches[%zd]", held);
        if (kv_get_buffer(PySequence_Fast_GET_ITEM(seq, held), &views[held], name, to_cache) < 0)
            goto done;
        if ((size_t)views[held].len % cache_block) {
            PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, not whole blocks of %zu", name,
                         views[held].len, cache_block);
            held++;
            goto done;
        }
        bases[held] = (uint8_t *)views[held].buf;
        Py_ssize_t nb = views[held].len / (Py_ssize_t)cache_block;
        if (nb < num_blocks) num_blocks = nb;
    }
    if (kv_get_buffer(blocks_o, &blocks, "blocks", !to_cache) < 0) goto done;
    ids = paged_ids(ids_o, (size_t)num_blocks, &n);
    if (!ids) goto done;
    size_t block_bytes = g.layers * cache_block;
    if ((size_t)blocks.len != (size_t)n * block_bytes) {
        PyErr_Format(PyExc_ValueError, "blocks holds %zd bytes, not %zd blocks of %zu",
                     blocks.len, n, block_bytes);
        goto done;
    }
    for (Py_ssize_t l = 0; l < layers; l++) {
        if (n && overlaps(&views[l], &blocks)) {
            PyErr_Format(PyExc_ValueError, "blocks overlaps caches[%zd]", l);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        paged_block(&g, bases, (uint8_t *)blocks.buf + (size_t)i * block_bytes, ids[i],
                    to_cache);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    if (blocks.obj) PyBuffer_Release(&blocks);
    for (Py_ssize_t l = 0; l < held; l++) PyBuffer_Release(&views[l]);
    PyMem_Free(ids);
    PyMem_Free(bases);
    PyMem_Free(views);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(paged_scatter_doc,
"paged_scatter(caches, block_ids, blocks, block_size, kv_heads, row_bytes) -> None\n\n"
"Write blocks, C-contiguous (n, layers, 2, block_size, kv_heads, row_bytes) bytes, into\n"
"block block_ids[i] of each layer's cache in caches (writable C-contiguous buffers of\n"
"(num_blocks, kv_heads, 2, block_size, row_bytes) bytes). Every id and size is checked\n"
"first (ValueError); the GIL is released while copying.");

static PyObject *kv_paged_scatter(PyObject *self, PyObject *args, PyObject *kwargs) {
    return paged_copy(args, kwargs, 1);
}

PyDoc_STRVAR(paged_gather_doc,
"paged_gather(caches, block_ids, blocks, block_size, kv_heads, row_bytes) -> None\n\n"
"paged_scatter's inverse: read block block_ids[i] of every layer cache into blocks[i]\n"
"(blocks writable).");

static PyObject *kv_paged_gather(PyObject *self, PyObject *args, PyObject *kwargs) {
    return paged_copy(args, kwargs, 0);
}

static PyMethodDef paged_methods[] = {
    {"paged_scatter", (PyCFunction)(void (*)(void))kv_paged_scatter,
     METH_VARARGS | METH_KEYWORDS, paged_scatter_doc},
    {"paged_gather", (PyCFunction)(void (*)(void))kv_paged_gather,
     METH_VARARGS | METH_KEYWORDS, paged_gather_doc},
    {NULL, NULL, 0, NULL},
};

int kv_add_paged(PyObject *m) { return PyModule_AddFunctions(m, paged_methods); }
