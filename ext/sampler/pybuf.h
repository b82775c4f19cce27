/* Borrowing the 1-D integer arrays that Python hands to the native samplers (buffer protocol). */
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

namespace looc {

struct Buffers {  // releases every Py_buffer it holds
    static constexpr int kInline = 8;
    Py_buffer inline_views[kInline];
    Py_buffer *views = inline_views;
    int capacity = kInline, held = 0;
    Buffers() = default;
    /* Room for `n` arrays: more than kInline live on the heap (if that allocation fails, get() raises
     * MemoryError). Call with the GIL held. */
    explicit Buffers(Py_ssize_t n) {
        if (n > kInline) {
            Py_buffer *heap = (Py_buffer *)PyMem_Malloc((size_t)n * sizeof(Py_buffer));
            if (heap) views = heap;
            capacity = heap ? (int)n : -1;
        }
    }
    Buffers(const Buffers &) = delete;
    Buffers &operator=(const Buffers &) = delete;
    ~Buffers() {
        for (int i = 0; i < held; i++) PyBuffer_Release(&views[i]);
        if (views != inline_views) PyMem_Free(views);
    }
    /* A contiguous 1-D int64 (or, with int32_ok, int32) array; writable when asked. nullptr with a
     * Python error set otherwise. */
    Py_buffer *get(PyObject *obj, const char *name, bool int32_ok, bool writable = false) {
        if (capacity < 0) {
            PyErr_NoMemory();
            return nullptr;
        }
        if (held == capacity) {
            PyErr_SetString(PyExc_RuntimeError, "too many arrays for one call");
            return nullptr;
        }
        Py_buffer *v = &views[held];
        if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
            return nullptr;
        held++;
        const char *f = v->format ? v->format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        const bool is_int = f[1] == '\0' && (*f == 'i' || *f == 'l' || *f == 'q');
        if (!is_int || v->ndim != 1 || !(v->itemsize == 8 || (int32_ok && v->itemsize == 4))) {
            PyErr_Format(PyExc_TypeError, "%s: expected a contiguous 1-D %s array, got format '%s' with %d dims",
                         name, int32_ok ? "int32 or int64" : "int64", v->format ? v->format : "B", v->ndim);
            return nullptr;
        }
        return v;
    }
};

}  // namespace looc
