/* Row aggregation over edges for blocked layer-wise inference (lightning_ooc.infer.layers).
 *
 * scatter_rows(acc, src, s, d, ...) adds (or folds by maximum) row src[s[e] - s_base] into
 * row acc[d[e] - d_base] for every edge e, in edge order, as torch's index_add_ / scatter_reduce_
 * ("amax", include_self) do, without first gathering every edge's message into a temporary.
 * When the targets come sorted (a bucket of a destination-sorted graph), the edges are split
 * between threads at target boundaries: each target row is written by one thread, in edge order,
 * so the result is the same bit for bit whatever the number of threads.
 *
 * Every index is checked before anything is written: an out-of-range id raises IndexError and
 * leaves acc as it was. The GIL is released while adding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

struct View {
    Py_buffer buf{};
    bool held = false;
    ~View() {
        if (held) PyBuffer_Release(&buf);
    }
};

const char *bare(const char *f) {
    if (!f) return "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return f;
}

/* A C-contiguous 2-D float32 array. */
bool get_rows(PyObject *obj, const char *name, bool writable, View &v) {
    if (PyObject_GetBuffer(obj, &v.buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return false;
    v.held = true;
    if (std::strcmp(bare(v.buf.format), "f") != 0 || v.buf.ndim != 2) {
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous 2-D float32 array, got format '%s' with %d dims",
                     name, v.buf.format ? v.buf.format : "B", v.buf.ndim);
        return false;
    }
    return true;
}

/* A contiguous 1-D int32 or int64 array. */
bool get_ids(PyObject *obj, const char *name, View &v) {
    if (PyObject_GetBuffer(obj, &v.buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return false;
    v.held = true;
    const char *f = bare(v.buf.format);
    const bool is_int = f[1] == '\0' && (*f == 'i' || *f == 'l' || *f == 'q');
    if (!is_int || v.buf.ndim != 1 || !(v.buf.itemsize == 8 || v.buf.itemsize == 4)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous 1-D int32 or int64 array, got format '%s' with %d dims",
                     name, v.buf.format ? v.buf.format : "B", v.buf.ndim);
        return false;
    }
    return true;
}

inline int64_t id_at(const View &v, Py_ssize_t i) {
    return v.buf.itemsize == 8 ? static_cast<const int64_t *>(v.buf.buf)[i]
                               : static_cast<const int32_t *>(v.buf.buf)[i];
}

struct Job {
    float *acc;
    const float *src;
    const View *s, *d;
    int64_t acc_cols, src_cols, s_base, d_base, col, count_col;
    bool max;
};

template <typename I, bool Max>
void add_range(const Job &j, const I *s, const I *d, Py_ssize_t lo, Py_ssize_t hi) {
    const int64_t w = j.src_cols;
    for (Py_ssize_t e = lo; e < hi; e++) {
        float *out = j.acc + (int64_t(d[e]) - j.d_base) * j.acc_cols;
        const float *__restrict in = j.src + (int64_t(s[e]) - j.s_base) * w;
        float *__restrict o = out + j.col;
        if (Max) {
            for (int64_t k = 0; k < w; k++) {
                const float x = in[k];
                o[k] = (x > o[k] || std::isnan(x)) ? x : o[k];
            }
        } else {
            for (int64_t k = 0; k < w; k++) o[k] += in[k];
        }
        if (j.count_col >= 0) out[j.count_col] += 1.0f;
    }
}

template <typename I>
void run_range(const Job &j, Py_ssize_t lo, Py_ssize_t hi) {
    const I *s = static_cast<const I *>(j.s->buf.buf), *d = static_cast<const I *>(j.d->buf.buf);
    if (j.max)
        add_range<I, true>(j, s, d, lo, hi);
    else
        add_range<I, false>(j, s, d, lo, hi);
}

void run(const Job &j, Py_ssize_t lo, Py_ssize_t hi) {
    if (j.s->buf.itemsize == 8)
        run_range<int64_t>(j, lo, hi);
    else
        run_range<int32_t>(j, lo, hi);
}

PyObject *py_scatter_rows(PyObject *, PyObject *args, PyObject *kwargs) {
    static const char *kwlist[] = {"acc", "src", "s", "d", "s_base", "d_base", "col", "count_col", "reduce",
                                   "threads", nullptr};
    PyObject *acc_o, *src_o, *s_o, *d_o;
    long long s_base = 0, d_base = 0, col = 0, count_col = -1;
    const char *reduce = "sum";
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|LLLLsi", (char **)kwlist, &acc_o, &src_o, &s_o, &d_o,
                                     &s_base, &d_base, &col, &count_col, &reduce, &threads))
        return nullptr;
    const bool max = std::strcmp(reduce, "max") == 0;
    if (!max && std::strcmp(reduce, "sum") != 0) {
        PyErr_Format(PyExc_ValueError, "reduce: 'sum' or 'max', not '%s'", reduce);
        return nullptr;
    }
    View acc, src, s, d;
    if (!get_rows(acc_o, "acc", true, acc) || !get_rows(src_o, "src", false, src) || !get_ids(s_o, "s", s) ||
        !get_ids(d_o, "d", d))
        return nullptr;
    const Py_ssize_t E = s.buf.shape[0];
    if (d.buf.shape[0] != E || s.buf.itemsize != d.buf.itemsize) {
        PyErr_Format(PyExc_ValueError, "s and d: expected the same length and dtype, got %zd and %zd items",
                     (Py_ssize_t)E, (Py_ssize_t)d.buf.shape[0]);
        return nullptr;
    }
    const int64_t acc_rows = acc.buf.shape[0], acc_cols = acc.buf.shape[1];
    const int64_t src_rows = src.buf.shape[0], src_cols = src.buf.shape[1];
    if (col < 0 || col + src_cols > acc_cols || count_col >= acc_cols ||
        (count_col >= col && count_col < col + src_cols)) {
        PyErr_Format(PyExc_ValueError,
                     "columns: %lld source columns from column %lld (count column %lld) do not fit %lld "
                     "accumulator columns",
                     (long long)src_cols, col, count_col, (long long)acc_cols);
        return nullptr;
    }
    Job j{static_cast<float *>(acc.buf.buf), static_cast<const float *>(src.buf.buf), &s, &d, acc_cols, src_cols,
          s_base, d_base, col, count_col, max};
    // check every id, and whether the targets come sorted, before anything is written
    Py_ssize_t bad = -1;
    bool sorted = true;
    Py_BEGIN_ALLOW_THREADS
    int64_t prev = INT64_MIN;
    for (Py_ssize_t e = 0; e < E; e++) {
        const int64_t si = id_at(s, e) - s_base, di = id_at(d, e) - d_base;
        if (si < 0 || si >= src_rows || di < 0 || di >= acc_rows) {
            bad = e;
            break;
        }
        sorted = sorted && di >= prev;
        prev = di;
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError,
                     "edge %zd: source %lld (of %lld rows from %lld) or target %lld (of %lld rows from %lld) is "
                     "out of range",
                     bad, (long long)id_at(s, bad), (long long)src_rows, s_base, (long long)id_at(d, bad),
                     (long long)acc_rows, d_base);
        return nullptr;
    }
    int t = threads < 1 ? 1 : threads;
    if (!sorted || E < 4096 * (Py_ssize_t)t) t = 1;
    Py_BEGIN_ALLOW_THREADS
    if (t == 1) {
        run(j, 0, E);
    } else {
        // cut the edges into t ranges at target boundaries: each target row has one writer
        std::vector<Py_ssize_t> cut(t + 1, E);
        cut[0] = 0;
        for (int k = 1; k < t; k++) {
            Py_ssize_t c = std::max(cut[k - 1], E * k / t);
            while (c > 0 && c < E && id_at(d, c) == id_at(d, c - 1)) c++;
            cut[k] = c;
        }
        std::vector<std::thread> pool;
        for (int k = 1; k < t; k++) {
            try {
                pool.emplace_back(run, std::cref(j), cut[k], cut[k + 1]);
            } catch (...) {  // no thread to be had: this range on the calling thread
                run(j, cut[k], cut[k + 1]);
            }
        }
        run(j, cut[0], cut[1]);
        for (auto &th : pool) th.join();
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"scatter_rows", (PyCFunction)(void (*)(void))py_scatter_rows, METH_VARARGS | METH_KEYWORDS,
     "scatter_rows(acc, src, s, d, s_base=0, d_base=0, col=0, count_col=-1, reduce='sum', threads=1)\n"
     "--\n\n"
     "For every edge e in order: acc[d[e] - d_base, col:col + W] += src[s[e] - s_base] (reduce='sum') or the\n"
     "element-wise maximum (reduce='max', NaN wins), and acc[d[e] - d_base, count_col] += 1 when count_col >= 0.\n"
     "acc: writable C-contiguous float32 [R, A]; src: float32 [S, W]; s, d: 1-D int32 or int64 of one dtype.\n"
     "Every id is checked first (IndexError, acc unchanged). Sorted targets are split between `threads`\n"
     "threads at target boundaries (the same result bit for bit). The GIL is released."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                      "Native CPU kernels of layer-wise inference: edge aggregation into row accumulators.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
