/* Copies between kvstore blocks and vLLM's paged CPU KV cache (paged.c): its
 * per-layer (num_blocks, kv_heads, 2, block_size, head_dim) layout, one memcpy per
 * head_dim row, the GIL released. */
#ifndef KV_NATIVE_PAGED_H
#define KV_NATIVE_PAGED_H

#include <Python.h>

/* Adds paged_scatter and paged_gather to the module; -1 with an exception set. */
int kv_add_paged(PyObject *m);

#endif
