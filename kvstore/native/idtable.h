/* The router index's id table (idtable.c) and the buffer helper it shares with
 * module.c. */
#ifndef KV_NATIVE_IDTABLE_H
#define KV_NATIVE_IDTABLE_H

#include <Python.h>

/* module.c's get_buffer: a C-contiguous view, -1 with an exception set. */
int kv_get_buffer(PyObject *obj, Py_buffer *view, const char *name, int writable);

/* Adds the IdTable type to the module; -1 with an exception set. */
int kv_add_idtable(PyObject *m);

#endif
