/* lightning_ooc._io: CPython bindings of the feature reader.
 *
 *   probe(path) -> dict                  alignment, file system, whether O_DIRECT reads work
 *   uring_probe() -> (bool, str)         can this process create an io_uring
 *   Reader(path, row_bytes, num_rows, engine, direct, queue_depth, max_io, merge_gap, workers, offset)
 *   Reader.submit(ids_obj, ids_ptr, n, out_obj, out_ptr, out_nbytes, chunk_rows) -> Job
 *   Job.wait(chunk=-1, timeout=-1.0) -> bool    raises ReadError(kind, errno, offset, length, got, message)
 *   transfer(fd, write, offset, addr, nbytes, engine="uring", queue_depth=32, chunk=1<<20) -> int
 *                                        raises ReadError / WriteError (same arguments)
 *   fd_is_direct(fd) -> bool             whether fd is open with O_DIRECT
 *
 * Buffers cross as integer addresses; submit keeps ids_obj and out_obj alive
 * until the job has ended. The GIL is released while validating ids, while
 * waiting, and while opening / closing; reads run on the reader's own threads.
 * transfer runs on the calling thread (and helpers it starts) with the GIL
 * released throughout; the caller keeps addr alive until it returns.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "looc_io.h"

static PyObject *ReadError;
static PyObject *WriteError;

/* ------------------------------------------------------------------ Job */

typedef struct {
    PyObject_HEAD
    looc_job *job;
    PyObject *keep_ids;
    PyObject *keep_out;
} JobObject;

static void wait_released(looc_job *j, int64_t chunk, double timeout, int *ok) {
    Py_BEGIN_ALLOW_THREADS
    *ok = looc_job_wait(j, chunk, timeout);
    Py_END_ALLOW_THREADS
}

static void Job_dealloc(JobObject *self) {
    if (self->job) {
        int ok;
        wait_released(self->job, -1, -1.0, &ok); /* the reader threads may still write into out */
        looc_job_unref(self->job);
    }
    Py_XDECREF(self->keep_ids);
    Py_XDECREF(self->keep_out);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *raise_job_error(looc_job *j) {
    PyObject *args = Py_BuildValue("(iiKKKs)", j->err_kind, j->err_errno, (unsigned long long)j->err_offset,
                                   (unsigned long long)j->err_length, (unsigned long long)j->err_got, j->err_msg);
    if (args) {
        PyErr_SetObject(ReadError, args);
        Py_DECREF(args);
    }
    return NULL;
}

static PyObject *Job_wait(JobObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"chunk", "timeout", NULL};
    long long chunk = -1;
    double timeout = -1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|Ld", kwlist, &chunk, &timeout)) return NULL;
    looc_job *j = self->job;
    if (chunk >= j->nchunks) chunk = -1;
    int ok;
    wait_released(j, chunk, timeout, &ok);
    if (!ok) Py_RETURN_FALSE;
    pthread_mutex_lock(&j->mu);
    int failed = j->err_kind != LOOC_ERR_NONE, reached = chunk >= 0 && j->chunks_done > chunk;
    pthread_mutex_unlock(&j->mu);
    if (failed && !reached) return raise_job_error(j);
    Py_RETURN_TRUE;
}

static PyObject *Job_stats(JobObject *self, PyObject *noargs) {
    looc_job *j = self->job;
    pthread_mutex_lock(&j->mu);
    int done = j->state == LOOC_JOB_DONE;
    double seconds = done ? j->t_end - j->t_submit : 0.0, io_seconds = done && j->t_start ? j->t_end - j->t_start : 0.0;
    long long unique = j->unique_rows, n_ext = j->n_ext;
    pthread_mutex_unlock(&j->mu);
    return Py_BuildValue("{s:L,s:L,s:K,s:K,s:K,s:L,s:d,s:d,s:O}", "rows", (long long)j->n, "unique_rows", unique,
                         "bytes_requested", (unsigned long long)unique * j->row_bytes, "bytes_read",
                         (unsigned long long)atomic_load(&j->bytes_read), "num_ios",
                         (unsigned long long)atomic_load(&j->num_ios), "extents", n_ext, "seconds", seconds,
                         "io_seconds", io_seconds, "done", done ? Py_True : Py_False);
}

static PyObject *Job_get_chunks_done(JobObject *self, void *closure) {
    pthread_mutex_lock(&self->job->mu);
    long long c = self->job->chunks_done;
    pthread_mutex_unlock(&self->job->mu);
    return PyLong_FromLongLong(c);
}

static PyObject *Job_get_num_chunks(JobObject *self, void *closure) { return PyLong_FromLongLong(self->job->nchunks); }

static PyObject *Job_get_done(JobObject *self, void *closure) {
    pthread_mutex_lock(&self->job->mu);
    int done = self->job->state == LOOC_JOB_DONE;
    pthread_mutex_unlock(&self->job->mu);
    return PyBool_FromLong(done);
}

static PyMethodDef Job_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))Job_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(chunk=-1, timeout=-1.0) -> bool: block until chunk (or all) is done; False on timeout."},
    {"stats", (PyCFunction)Job_stats, METH_NOARGS, "Counters of this read."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Job_getset[] = {
    {"chunks_done", (getter)Job_get_chunks_done, NULL, "chunks [0, chunks_done) are complete", NULL},
    {"num_chunks", (getter)Job_get_num_chunks, NULL, "number of chunks", NULL},
    {"done", (getter)Job_get_done, NULL, "whether the job has ended (successfully or not)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lightning_ooc._io.Job",
    .tp_basicsize = sizeof(JobObject),
    .tp_dealloc = (destructor)Job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One gather in flight (made by Reader.submit).",
    .tp_methods = Job_methods,
    .tp_getset = Job_getset,
};

/* ------------------------------------------------------------------ Reader */

typedef struct {
    PyObject_HEAD
    looc_reader r;
    int opened;
    int close_started;
} ReaderObject;

static PyObject *Reader_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", "row_bytes", "num_rows", "engine", "direct", "queue_depth", "max_io", "merge_gap",
                             "workers", "offset", NULL};
    PyObject *path_obj;
    unsigned long long row_bytes, num_rows, max_io = 128 * 1024, merge_gap = 0, offset = 0;
    const char *engine = "uring";
    int direct = 1, qd = 128, workers = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&KK|spiKKiK", kwlist, PyUnicode_FSConverter, &path_obj, &row_bytes,
                                     &num_rows, &engine, &direct, &qd, &max_io, &merge_gap, &workers, &offset))
        return NULL;
    int eng;
    if (strcmp(engine, "uring") == 0)
        eng = LOOC_ENGINE_URING;
    else if (strcmp(engine, "threads") == 0)
        eng = LOOC_ENGINE_THREADS;
    else {
        Py_DECREF(path_obj);
        return PyErr_Format(PyExc_ValueError, "engine must be 'uring' or 'threads', not '%s'", engine);
    }
    if (row_bytes == 0 || row_bytes > (1ULL << 30) || qd < 1 || qd > LOOC_MAX_QUEUE_DEPTH || workers < 1 ||
        workers > 64 || max_io > (1ULL << 30) || merge_gap > (1ULL << 30)) {
        Py_DECREF(path_obj);
        return PyErr_Format(PyExc_ValueError,
                            "bad reader parameters: row_bytes=%llu (1..2^30), queue_depth=%d (1..%d), workers=%d "
                            "(1..64), max_io=%llu, merge_gap=%llu (<= 2^30)",
                            row_bytes, qd, LOOC_MAX_QUEUE_DEPTH, workers, max_io, merge_gap);
    }
    ReaderObject *self = (ReaderObject *)type->tp_alloc(type, 0);
    if (!self) {
        Py_DECREF(path_obj);
        return NULL;
    }
    const char *path = PyBytes_AS_STRING(path_obj);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = looc_reader_open(&self->r, path, direct, eng, row_bytes, offset, num_rows, qd, max_io, merge_gap, workers);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyObject *exc_args = Py_BuildValue("(isN)", -rc, self->r.init_msg, PyUnicode_DecodeFSDefault(path));
        if (exc_args) {
            PyErr_SetObject(PyExc_OSError, exc_args);
            Py_DECREF(exc_args);
        }
        Py_DECREF(path_obj);
        pthread_mutex_destroy(&self->r.mu);
        pthread_cond_destroy(&self->r.cv);
        Py_TYPE(self)->tp_free((PyObject *)self);
        return NULL;
    }
    Py_DECREF(path_obj);
    self->opened = 1;
    return (PyObject *)self;
}

static void reader_close(ReaderObject *self) {
    if (!self->opened || self->close_started) return;
    self->close_started = 1;
    Py_BEGIN_ALLOW_THREADS
    looc_reader_close(&self->r);
    Py_END_ALLOW_THREADS
}

static void Reader_dealloc(ReaderObject *self) {
    reader_close(self);
    if (self->opened) {
        pthread_mutex_destroy(&self->r.mu);
        pthread_cond_destroy(&self->r.cv);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Reader_close(ReaderObject *self, PyObject *noargs) {
    reader_close(self);
    Py_RETURN_NONE;
}

/* First position whose id is outside [0, num_rows), or -1. */
static int64_t first_bad_id(const int64_t *ids, int64_t n, uint64_t num_rows) {
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)ids[i] >= num_rows) return i;
    return -1;
}

static PyObject *Reader_submit(ReaderObject *self, PyObject *args) {
    PyObject *ids_obj, *out_obj;
    unsigned long long ids_ptr, out_ptr, out_nbytes;
    long long n, chunk_rows;
    if (!PyArg_ParseTuple(args, "OKLOKKL", &ids_obj, &ids_ptr, &n, &out_obj, &out_ptr, &out_nbytes, &chunk_rows))
        return NULL;
    looc_reader *r = &self->r;
    if (self->close_started) return PyErr_Format(PyExc_ValueError, "%s: the reader is closed", r->path);
    if (n < 0) return PyErr_Format(PyExc_ValueError, "negative id count %lld", n);
    if (n > 0 && (!ids_ptr || !out_ptr)) return PyErr_Format(PyExc_ValueError, "null buffer address");
    if ((unsigned long long)n > out_nbytes / r->row_bytes)
        return PyErr_Format(PyExc_ValueError, "destination holds %llu bytes, %lld rows of %llu bytes need %llu",
                            out_nbytes, n, (unsigned long long)r->row_bytes, (unsigned long long)n * r->row_bytes);
    const int64_t *ids = (const int64_t *)(uintptr_t)ids_ptr;
    int64_t bad;
    if (n > 4096) {
        Py_BEGIN_ALLOW_THREADS
        bad = first_bad_id(ids, n, r->num_rows);
        Py_END_ALLOW_THREADS
    } else {
        bad = first_bad_id(ids, n, r->num_rows);
    }
    if (bad >= 0) {
        PyObject *a = Py_BuildValue("(LL)", (long long)bad, (long long)ids[bad]);
        if (a) {
            PyErr_SetObject(PyExc_IndexError, a);
            Py_DECREF(a);
        }
        return NULL;
    }
    looc_job *j = looc_job_new();
    if (!j) return PyErr_NoMemory();
    j->ids = ids;
    j->n = n;
    j->out = (char *)(uintptr_t)out_ptr;
    j->row_bytes = r->row_bytes;
    j->base = r->base;
    j->chunk_rows = chunk_rows > 0 ? chunk_rows : (n > 0 ? n : 1);
    j->nchunks = n ? (n + j->chunk_rows - 1) / j->chunk_rows : 0;
    JobObject *jo = PyObject_New(JobObject, &JobType);
    if (!jo) {
        looc_job_unref(j);
        return NULL;
    }
    jo->job = j;
    Py_INCREF(ids_obj);
    jo->keep_ids = ids_obj;
    Py_INCREF(out_obj);
    jo->keep_out = out_obj;
    int rc = looc_reader_submit(r, j);
    if (rc < 0) {
        /* never queued: mark it ended so dealloc does not wait */
        j->state = LOOC_JOB_DONE;
        Py_DECREF(jo);
        return PyErr_Format(PyExc_ValueError, "%s: the reader is closed", r->path);
    }
    return (PyObject *)jo;
}

#define R_GET_U64(name, expr)                                                 \
    static PyObject *Reader_get_##name(ReaderObject *self, void *closure) {  \
        return PyLong_FromUnsignedLongLong((unsigned long long)(expr));      \
    }
R_GET_U64(block_size, self->r.align)
R_GET_U64(mem_align, self->r.mem_align)
R_GET_U64(slot_size, self->r.slot_size)
R_GET_U64(max_io, self->r.slot_size)
R_GET_U64(merge_gap, self->r.merge_gap)
R_GET_U64(queue_depth, self->r.queue_depth)
R_GET_U64(workers, self->r.nworkers)
R_GET_U64(row_bytes, self->r.row_bytes)
R_GET_U64(offset, self->r.base)
R_GET_U64(num_rows, self->r.num_rows)
R_GET_U64(ring_flags, self->r.ring_flags)

static PyObject *Reader_get_direct(ReaderObject *self, void *c) { return PyBool_FromLong(self->r.direct); }
static PyObject *Reader_get_closed(ReaderObject *self, void *c) { return PyBool_FromLong(self->close_started); }
static PyObject *Reader_get_registered_files(ReaderObject *self, void *c) { return PyBool_FromLong(self->r.reg_files); }
static PyObject *Reader_get_registered_buffers(ReaderObject *self, void *c) { return PyBool_FromLong(self->r.reg_bufs); }
static PyObject *Reader_get_block_source(ReaderObject *self, void *c) { return PyUnicode_FromString(self->r.align_source); }
static PyObject *Reader_get_engine_note(ReaderObject *self, void *c) { return PyUnicode_FromString(self->r.engine_note); }
static PyObject *Reader_get_engine(ReaderObject *self, void *c) {
    return PyUnicode_FromString(self->r.engine == LOOC_ENGINE_URING ? "uring" : "threads");
}

static PyMethodDef Reader_methods[] = {
    {"submit", (PyCFunction)Reader_submit, METH_VARARGS,
     "submit(ids_obj, ids_ptr, n, out_obj, out_ptr, out_nbytes, chunk_rows) -> Job"},
    {"close", (PyCFunction)Reader_close, METH_NOARGS, "Finish running reads, fail queued ones, release everything."},
    {NULL, NULL, 0, NULL},
};

#define G(name, doc) {#name, (getter)Reader_get_##name, NULL, doc, NULL}
static PyGetSetDef Reader_getset[] = {
    G(block_size, "alignment of file offsets and lengths of reads (1 when buffered)"),
    G(block_source, "where the alignment came from"),
    G(mem_align, "buffer alignment O_DIRECT requires"),
    G(slot_size, "staging bytes per in-flight read"),
    G(max_io, "largest single read (a merged extent), bytes"),
    G(merge_gap, "largest gap between extents that are merged, bytes"),
    G(queue_depth, "reads in flight per worker"),
    G(workers, "worker threads, each with its own ring or pread pool"),
    G(row_bytes, "bytes per row"),
    G(offset, "file offset of row 0"),
    G(num_rows, "rows in the file"),
    G(ring_flags, "io_uring setup flags in use"),
    G(direct, "whether the file is open with O_DIRECT"),
    G(closed, "whether close() was called"),
    G(registered_files, "whether the ring uses a registered file"),
    G(registered_buffers, "whether the ring reads into registered buffers"),
    G(engine_note, "what the engine set up"),
    G(engine, "'uring' or 'threads'"),
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lightning_ooc._io.Reader",
    .tp_basicsize = sizeof(ReaderObject),
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Native row reader over one file (see lightning_ooc.io.FeatureReader).",
    .tp_methods = Reader_methods,
    .tp_getset = Reader_getset,
    .tp_new = Reader_new,
};

/* ------------------------------------------------------------------ module functions */

static const char *fs_name(long magic) {
    switch ((unsigned long)magic) {
    case 0xEF53: return "ext4";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    case 0x858458f6: return "ramfs";
    case 0x794c7630: return "overlayfs";
    case 0x65735546: return "fuse";
    case 0x6969: return "nfs";
    case 0xFF534D42: return "cifs";
    case 0x2FC12FC1: return "zfs";
    case 0xF2F52010: return "f2fs";
    case 0x9fa0: return "proc";
    default: return "unknown";
    }
}

/* probe(path) -> dict: file size, file system, alignment, whether an O_DIRECT read works. */
static PyObject *probe(PyObject *mod, PyObject *arg) {
    PyObject *path_obj;
    if (!PyUnicode_FSConverter(arg, &path_obj)) return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    struct stat st;
    struct statfs sfs;
    int st_rc, sfs_rc, derr = 0, read_tested = 0;
    looc_align_info ai;
    memset(&ai, 0, sizeof ai);
    Py_BEGIN_ALLOW_THREADS
    st_rc = stat(path, &st);
    sfs_rc = statfs(path, &sfs);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (fd < 0) {
        derr = errno;
    } else {
        looc_query_align(fd, 1, &ai);
        if (st_rc == 0 && st.st_size > 0) { /* some file systems accept the flag but refuse the read */
            size_t len = ai.align > 4096 ? ai.align : 4096;
            void *buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (buf != MAP_FAILED) {
                read_tested = 1;
                if (pread(fd, buf, ai.align, 0) < 0) derr = errno;
                munmap(buf, len);
            }
        }
        close(fd);
    }
    Py_END_ALLOW_THREADS
    if (st_rc < 0) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, arg);
        Py_DECREF(path_obj);
        return NULL;
    }
    Py_DECREF(path_obj);
    long magic = sfs_rc == 0 ? (long)sfs.f_type : 0;
    return Py_BuildValue("{s:K,s:s,s:k,s:O,s:O,s:i,s:s,s:K,s:K,s:s,s:K,s:s}", "file_size",
                         (unsigned long long)st.st_size, "fs", fs_name(magic), "fs_magic", (unsigned long)magic,
                         "direct", derr == 0 ? Py_True : Py_False, "direct_read_tested",
                         read_tested ? Py_True : Py_False, "direct_errno", derr, "direct_error",
                         derr ? strerror(derr) : "", "block_size", (unsigned long long)ai.align, "mem_align",
                         (unsigned long long)ai.mem_align, "block_source", ai.source,
                         "device_logical_block_size", (unsigned long long)ai.logical_block, "device_block_source",
                         ai.logical_source);
}

static PyObject *uring_probe(PyObject *mod, PyObject *noargs) {
    char msg[LOOC_MSG];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = looc_uring_probe(msg, sizeof msg);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Os)", rc == 0 ? Py_True : Py_False, msg);
}

static PyObject *build_info(PyObject *mod, PyObject *noargs) {
#ifdef LOOC_HAVE_LIBURING
    PyObject *have = Py_True;
#else
    PyObject *have = Py_False;
#endif
    return Py_BuildValue("{s:O,s:i,s:s}", "liburing", have, "max_queue_depth", LOOC_MAX_QUEUE_DEPTH, "compiler",
                         __VERSION__);
}

/* ------------------------------------------------------------------ bulk transfers */

/* ReadError / WriteError(kind, errno, offset, length, got, message). */
static PyObject *raise_bulk_error(int write, const looc_bulk_error *e) {
    PyObject *args = Py_BuildValue("(iiKKKs)", e->kind, e->err, (unsigned long long)e->offset,
                                   (unsigned long long)e->length, (unsigned long long)e->got, e->msg);
    if (args) {
        PyErr_SetObject(write ? WriteError : ReadError, args);
        Py_DECREF(args);
    }
    return NULL;
}

static PyObject *transfer(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"fd", "write", "offset", "addr", "nbytes", "engine", "queue_depth", "chunk", NULL};
    int fd, write, qd = 32;
    long long offset, nbytes, chunk = 1LL << 20;
    unsigned long long addr;
    const char *engine = "uring";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ipLKL|siL", kwlist, &fd, &write, &offset, &addr, &nbytes, &engine,
                                     &qd, &chunk))
        return NULL;
    int eng;
    if (strcmp(engine, "uring") == 0)
        eng = LOOC_ENGINE_URING;
    else if (strcmp(engine, "threads") == 0)
        eng = LOOC_ENGINE_THREADS;
    else
        return PyErr_Format(PyExc_ValueError, "engine must be 'uring' or 'threads', not '%s'", engine);
    if (offset < 0 || nbytes < 0 || offset > LLONG_MAX - nbytes)
        return PyErr_Format(PyExc_ValueError,
                            "offset %lld and nbytes %lld must be >= 0 with a sum that fits in 63 bits", offset, nbytes);
    if (chunk < 1 || (unsigned long long)chunk > LOOC_BULK_MAX_CHUNK || qd < 1 || qd > LOOC_MAX_QUEUE_DEPTH)
        return PyErr_Format(PyExc_ValueError, "chunk=%lld must be in 1..%llu and queue_depth=%d in 1..%d", chunk,
                            (unsigned long long)LOOC_BULK_MAX_CHUNK, qd, LOOC_MAX_QUEUE_DEPTH);
    if (nbytes > 0 && !addr) return PyErr_Format(PyExc_ValueError, "null memory address for %lld bytes", nbytes);
    looc_bulk_error err;
    memset(&err, 0, sizeof err);
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) {
        /* reported like a failed transfer, so callers see one error path with errno and offset */
        err.kind = LOOC_ERR_IO;
        err.err = errno;
        err.offset = (uint64_t)offset;
        err.length = (uint64_t)nbytes;
        snprintf(err.msg, sizeof err.msg, "%s of %lld bytes at offset %lld: fd %d cannot be used: %s",
                 write ? "write" : "read", nbytes, offset, fd, strerror(err.err));
        return raise_bulk_error(write, &err);
    }
    looc_bulk b = {.fd = fd, .write = write, .direct = (fl & O_DIRECT) != 0, .align = 1, .offset = (uint64_t)offset,
                   .addr = (char *)(uintptr_t)addr, .nbytes = (uint64_t)nbytes, .chunk = (uint64_t)chunk,
                   .queue_depth = qd};
    if (b.direct) {
        /* the kernel would refuse each request with EINVAL part-way through; say what is wrong up front */
        looc_align_info ai;
        looc_query_align(fd, 1, &ai);
        b.align = ai.align;
        const char *what = NULL;
        unsigned long long bad = 0, need = ai.align;
        if (offset % ai.align)
            what = "offset", bad = (unsigned long long)offset;
        else if (nbytes % ai.align)
            what = "nbytes", bad = (unsigned long long)nbytes;
        else if (chunk % ai.align)
            what = "chunk", bad = (unsigned long long)chunk;
        else if (addr % ai.mem_align)
            what = "memory address", bad = addr, need = ai.mem_align;
        if (what)
            return PyErr_Format(PyExc_ValueError,
                                "fd %d is open with O_DIRECT, which needs file offsets, lengths and chunk sizes that "
                                "are multiples of %llu bytes and memory aligned to %llu bytes (%s): %s %llu is not a "
                                "multiple of %llu",
                                fd, (unsigned long long)ai.align, (unsigned long long)ai.mem_align, ai.source, what,
                                bad, need);
    }
    if (nbytes == 0) return PyLong_FromLong(0);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = eng == LOOC_ENGINE_URING ? looc_bulk_uring(&b, &err) : looc_bulk_threads(&b, &err);
    Py_END_ALLOW_THREADS
    if (rc == 0) return PyLong_FromLongLong(nbytes);
    if (err.setup) {
        /* nothing was transferred: an OSError (not a ReadError / WriteError) so callers can pick another engine */
        if (err.kind == LOOC_ERR_NOMEM) return PyErr_Format(PyExc_MemoryError, "%s", err.msg);
        PyObject *a = Py_BuildValue("(is)", err.err, err.msg);
        if (a) {
            PyErr_SetObject(PyExc_OSError, a);
            Py_DECREF(a);
        }
        return NULL;
    }
    return raise_bulk_error(write, &err);
}

static PyObject *fd_is_direct(PyObject *mod, PyObject *arg) {
    int fd = PyObject_AsFileDescriptor(arg);
    if (fd < 0) return NULL;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong((fl & O_DIRECT) != 0);
}

static PyMethodDef module_methods[] = {
    {"probe", probe, METH_O, "probe(path) -> dict: file system, alignment, whether O_DIRECT reads work."},
    {"uring_probe", uring_probe, METH_NOARGS, "uring_probe() -> (ok, reason): can this process set up an io_uring."},
    {"build_info", build_info, METH_NOARGS, "How the module was built."},
    {"transfer", (PyCFunction)(void (*)(void))transfer, METH_VARARGS | METH_KEYWORDS,
     "transfer(fd, write, offset, addr, nbytes, engine='uring', queue_depth=32, chunk=1<<20) -> int: move nbytes "
     "between file bytes [offset, offset + nbytes) and memory at addr, in chunk-byte requests with queue_depth in "
     "flight, the GIL released; raises ReadError / WriteError(kind, errno, offset, length, got, message), OSError "
     "when the engine cannot start (nothing moved), ValueError for bad or misaligned (O_DIRECT) arguments."},
    {"fd_is_direct", fd_is_direct, METH_O, "fd_is_direct(fd) -> bool: whether fd is open with O_DIRECT."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_io", "Native direct-I/O feature reader.", -1,
                                        module_methods};

PyMODINIT_FUNC PyInit__io(void) {
    if (PyType_Ready(&ReaderType) < 0 || PyType_Ready(&JobType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    ReadError = PyErr_NewException("lightning_ooc._io.ReadError", PyExc_RuntimeError, NULL);
    WriteError = PyErr_NewException("lightning_ooc._io.WriteError", PyExc_RuntimeError, NULL);
    Py_INCREF(&ReaderType);
    Py_INCREF(&JobType);
    if (!ReadError || !WriteError || PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0 ||
        PyModule_AddObject(m, "Job", (PyObject *)&JobType) < 0 || PyModule_AddObject(m, "ReadError", ReadError) < 0 ||
        PyModule_AddObject(m, "WriteError", WriteError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "ERR_IO", LOOC_ERR_IO);
    PyModule_AddIntConstant(m, "ERR_SHORT", LOOC_ERR_SHORT);
    PyModule_AddIntConstant(m, "ERR_NOMEM", LOOC_ERR_NOMEM);
    PyModule_AddIntConstant(m, "ERR_CLOSED", LOOC_ERR_CLOSED);
    PyModule_AddIntConstant(m, "ERR_RING", LOOC_ERR_RING);
    return m;
}
