/* lightning_ooc._native: build facts and capability probes.
 *
 * Tells Python whether liburing was linked in and whether this kernel lets
 * the process create an io_uring (it may be compiled in but disabled through
 * /proc/sys/kernel/io_uring_disabled, or blocked by a seccomp sandbox).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <string.h>

#ifdef LOOC_HAVE_LIBURING
#include <liburing.h>
#endif

static PyObject *build_info(PyObject *self, PyObject *noargs) {
#ifdef LOOC_HAVE_LIBURING
    int have = 1;
#ifdef IO_URING_VERSION_MAJOR
    int major = IO_URING_VERSION_MAJOR, minor = IO_URING_VERSION_MINOR;
#else
    int major = 2, minor = 0; /* liburing < 2.4 has no version macros */
#endif
#else
    int have = 0, major = 0, minor = 0;
#endif
    return Py_BuildValue("{s:O,s:(ii),s:s}", "liburing", have ? Py_True : Py_False,
                         "liburing_version", major, minor, "compiler", __VERSION__);
}

/* Returns (ok, reason). */
static PyObject *probe_io_uring(PyObject *self, PyObject *noargs) {
#ifdef LOOC_HAVE_LIBURING
    struct io_uring ring;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = io_uring_queue_init(4, &ring, 0);
    if (rc == 0) io_uring_queue_exit(&ring);
    Py_END_ALLOW_THREADS
    if (rc == 0) return Py_BuildValue("(Os)", Py_True, "io_uring available");
    return Py_BuildValue("(Os)", Py_False, strerror(-rc));
#else
    return Py_BuildValue("(Os)", Py_False, "built without liburing");
#endif
}

static PyMethodDef methods[] = {
    {"build_info", build_info, METH_NOARGS, "Facts about how the extension was built."},
    {"probe_io_uring", probe_io_uring, METH_NOARGS,
     "Try to create a small io_uring; return (ok, reason)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "Build facts and capability probes.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
