/* The sampler's outputs as Python objects: a 1-D int64 buffer that owns its
 * malloc'd memory (buffer protocol), handed out without a copy. */
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>

namespace looc {

/* Wrap `data` (malloc'd, `len` int64 items) in a Buffer object; takes ownership even on failure
 * (then returns nullptr with a Python error set). */
PyObject *wrap(int64_t *data, Py_ssize_t len);

/* Ready the Buffer type and add it to `module` as `Buffer`; -1 with a Python error set on failure. */
int add_buffer_type(PyObject *module);

}  // namespace looc
