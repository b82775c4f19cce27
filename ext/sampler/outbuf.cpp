/* lightning_ooc._sampler.Buffer: the int64 arrays the samplers return, owning their memory. */
#include "outbuf.h"

#include <cstdlib>

namespace {

struct BufferObject {
    PyObject_HEAD
    int64_t *data;
    Py_ssize_t len;
    Py_ssize_t shape[1];
    Py_ssize_t exports;
};

void buffer_dealloc(PyObject *self) {
    std::free(((BufferObject *)self)->data);
    Py_TYPE(self)->tp_free(self);
}

int buffer_get(PyObject *self, Py_buffer *view, int flags) {
    BufferObject *b = (BufferObject *)self;
    b->shape[0] = b->len;
    view->obj = Py_NewRef(self);
    view->buf = b->data;
    view->len = b->len * (Py_ssize_t)sizeof(int64_t);
    view->readonly = 0;
    view->itemsize = sizeof(int64_t);
    view->format = (flags & PyBUF_FORMAT) ? (char *)"q" : nullptr;
    view->ndim = 1;
    view->shape = (flags & PyBUF_ND) ? b->shape : nullptr;
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &view->itemsize : nullptr;
    view->suboffsets = nullptr;
    view->internal = nullptr;
    b->exports++;
    return 0;
}

void buffer_release(PyObject *self, Py_buffer *) { ((BufferObject *)self)->exports--; }

Py_ssize_t buffer_length(PyObject *self) { return ((BufferObject *)self)->len; }

PyBufferProcs buffer_procs = {buffer_get, buffer_release};
PySequenceMethods buffer_sequence = {buffer_length};

PyTypeObject BufferType = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace

namespace looc {

PyObject *wrap(int64_t *data, Py_ssize_t len) {
    BufferObject *b = PyObject_New(BufferObject, &BufferType);
    if (!b) {
        std::free(data);
        return nullptr;
    }
    b->data = data;
    b->len = len;
    b->exports = 0;
    return (PyObject *)b;
}

int add_buffer_type(PyObject *module) {
    BufferType.tp_name = "lightning_ooc._sampler.Buffer";
    BufferType.tp_basicsize = sizeof(BufferObject);
    BufferType.tp_flags = Py_TPFLAGS_DEFAULT;
    BufferType.tp_doc = "A 1-D int64 array owned by the sampler's output (buffer protocol).";
    BufferType.tp_dealloc = buffer_dealloc;
    BufferType.tp_as_buffer = &buffer_procs;
    BufferType.tp_as_sequence = &buffer_sequence;
    if (PyType_Ready(&BufferType) < 0) return -1;
    return PyModule_AddObjectRef(module, "Buffer", (PyObject *)&BufferType);
}

}  // namespace looc
