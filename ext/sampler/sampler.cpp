/* lightning_ooc._sampler: node-wise uniform neighbour sampling over an in-edge CSC.
 *
 * The graph is given as `indptr` (int64, N + 1 entries, in memory) and
 * `indices` (int32 or int64, usually a read-only memory map): the sources of
 * the edges into node v are indices[indptr[v] : indptr[v + 1]].
 *
 * One call samples one minibatch. Starting from the seeds, hop h picks, for
 * every node of the previous hop's frontier, `fanouts[h]` in-neighbours
 * (all of them for -1), uniformly with or without replacement. Nodes are
 * de-duplicated and given local ids in order of first appearance, hop by
 * hop, seeds first; edges come out grouped by hop, then by target, in PyG's
 * message-passing convention (row 0 = source neighbour, row 1 = target).
 *
 * No state is shared between calls or threads: each call seeds its own
 * random stream (xoshiro256** through splitmix64, so the same seed gives the
 * same sample on any thread) and works in its thread's workspace (the node
 * map, open addressing sized to the batch, and the scratch arrays; kept for
 * the thread's next call so its memory stays warm, up to 512 MiB). The GIL
 * is released for the whole sampling, so several threads sample at once.
 * Output arrays are handed to Python as buffer objects that own their memory
 * (no copy on the way out).
 *
 * Each hop runs in three passes, so that each pass can prefetch the random
 * memory accesses of the items a few steps ahead: (A) read the degree of
 * each frontier node and choose edge positions, (B) read the sources at
 * those positions, (C) map the sources to local ids.
 *
 * The pieces shared with the heterogeneous sampler (hetero.cpp, several node
 * and edge types) live in core.h: the growable arrays, the node map and the
 * choice of a target's in-edges; the output buffer type is in outbuf.cpp.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core.h"
#include "hetero.h"
#include "negative.h"
#include "outbuf.h"
#include "pybuf.h"
#include "rng.h"

namespace {

using namespace looc;  // core.h, outbuf.h, pybuf.h, rng.h

/* Everything a call needs besides its outputs. Each thread keeps one between
 * calls (warm memory, no page faults), up to kKeepBytes. */
struct Workspace {
    NodeMap map;
    Vec n_id, pos, col, row, scratch, batch;
    size_t bytes() const {
        return map.bytes() +
               (size_t)(n_id.cap + pos.cap + col.cap + row.cap + scratch.cap + batch.cap) * sizeof(int64_t);
    }
    void reset_vectors() { n_id.n = pos.n = col.n = row.n = scratch.n = batch.n = 0; }
    void release() {
        map.release();
        batch.free_memory();
        n_id.free_memory();
        pos.free_memory();
        col.free_memory();
        row.free_memory();
        scratch.free_memory();
    }
};

thread_local Workspace tls_workspace;

/* Out of line, so the compiler passes the address around instead of looking
 * the thread-local up again (through __tls_get_addr) inside the hot loops. */
__attribute__((noinline)) Workspace *thread_workspace() { return &tls_workspace; }

/* ---------------------------------------------------------------- the sampler */

struct Request {
    const int64_t *indptr;
    int64_t num_nodes;
    const void *indices;
    int64_t indices_len;
    int index_size;  // 4 or 8
    const int64_t *seeds;
    int64_t num_seeds;
    const int64_t *fanouts;
    int num_hops;
    bool replace;
    uint64_t rng_seed;
    bool want_e_id;
    const int64_t *labels;  // nullptr: no labels wanted
    bool disjoint;             // one subgraph per seed (always, when temporal)
    Times times;               // temporal sampling, when times.on()
    const int64_t *seed_time;  // per seed (temporal)
};

struct Result {
    /* Outputs, malloc'd; whoever holds them frees them. */
    int64_t *n_id = nullptr, *edge_index = nullptr, *e_id = nullptr, *y = nullptr, *batch = nullptr;
    int64_t num_nodes = 0, num_edges = 0;
    int64_t hop_nodes[65];
    int64_t hop_edges[64];
    int64_t bad_at = 0, bad_value = 0;  // which seed / node was wrong
    Result() = default;
    Result(const Result &) = delete;
    Result &operator=(const Result &) = delete;
    ~Result() {
        std::free(n_id);
        std::free(edge_index);
        std::free(e_id);
        std::free(y);
        std::free(batch);
    }
};

template <typename Index>
Status sample_in(const Request &q, Workspace &w, Result &r) {
    const int64_t N = q.num_nodes;
    const int64_t *indptr = q.indptr;
    const Index *indices = (const Index *)q.indices;
    Rng rng(q.rng_seed);
    NodeMap &map = w.map;
    Vec &ids = w.n_id, &pos = w.pos, &col = w.col, &row = w.row;

    const int64_t B = q.num_seeds;
    /* Disjoint: a node's key is (its seed's position) x N + id, so each seed's subgraph has nodes of its own. */
    const bool disjoint = q.disjoint;
    const int64_t max_keys = disjoint ? (B > 0 && N > INT64_MAX / 4 / B ? INT64_MAX / 4 : N * (B > 0 ? B : 1)) : N;
    Vec &batch = w.batch;
    map.begin();
    if (!ids.reserve(B > 0 ? 2 * B : 1) || !map.ensure(2 * B + 16, max_keys)) return NO_MEMORY;
    if (disjoint && !batch.reserve(B > 0 ? 2 * B : 1)) return NO_MEMORY;
    for (int64_t i = 0; i < B; i++) {
        const int64_t s = q.seeds[i];
        if (s < 0 || s >= N) {
            r.bad_at = i;
            r.bad_value = s;
            return BAD_SEED;
        }
        bool inserted;
        map.get_or_insert(disjoint ? i * N + s : s, i, &inserted);  // a repeated seed maps to its first place
        ids.p[ids.n++] = s;
        if (disjoint) batch.p[batch.n++] = i;
    }
    r.hop_nodes[0] = B;
    const Times &tm = q.times;
    const bool temporal = tm.on();

    int64_t fb = 0, fe = B;  // frontier: local ids [fb, fe)
    for (int h = 0; h < q.num_hops; h++) {
        const int64_t k = q.fanouts[h];
        const int64_t eb = pos.n;
        /* A: degrees -> edge positions, and the target of each edge. */
        for (int64_t t = fb; t < fe; t++) {
            if (t + 8 < fe) __builtin_prefetch(&indptr[ids.p[t + 8]], 0, 1);
            const int64_t v = ids.p[t];
            const int64_t start = indptr[v], end = indptr[v + 1];
            if (start < 0 || end < start || end > q.indices_len) {
                r.bad_value = v;
                return BAD_INDPTR;
            }
            int64_t lo = start, hi = end;
            if (temporal && k != 0 && hi > lo) {
                const Status st = temporal_range(tm, indices, N, q.seed_time[batch.p[t]], k, lo, hi, &r.bad_at);
                if (st != OK) {
                    r.bad_value = st == BAD_TIME_ORDER ? v : (int64_t)indices[r.bad_at];
                    return st;
                }
            }
            const int64_t before = pos.n;
            if (!choose(rng, pos, lo, hi - lo, k, q.replace, w.scratch)) return NO_MEMORY;
            if (!col.reserve(pos.n)) return NO_MEMORY;
            for (int64_t j = before; j < pos.n; j++) col.p[j] = t;
            col.n = pos.n;
        }
        const int64_t ee = pos.n;
        /* B: sources at those positions. */
        if (!row.reserve(ee)) return NO_MEMORY;
        const int64_t *pp = pos.p;
        int64_t *rp = row.p;
        for (int64_t i = eb; i < ee; i++) {
            if (i + kPrefetch < ee) __builtin_prefetch(&indices[pp[i + kPrefetch]], 0, 0);
            const int64_t u = (int64_t)indices[pp[i]];
            if (u < 0 || u >= N) {
                r.bad_at = pp[i];
                r.bad_value = u;
                return BAD_INDEX;
            }
            rp[i] = u;
        }
        row.n = ee;
        /* C: sources -> local ids, new nodes appended in order of first appearance. */
        if (!map.ensure(ids.n + (ee - eb), max_keys) || !ids.reserve(ids.n + (ee - eb))) return NO_MEMORY;
        int64_t *np_ = ids.p;
        int64_t n = ids.n;
        if (!disjoint) {
            for (int64_t i = eb; i < ee; i++) {
                if (i + kPrefetch < ee) map.prefetch(rp[i + kPrefetch]);
                bool inserted;
                const int64_t u = rp[i];
                const int64_t local = map.get_or_insert(u, n, &inserted);
                if (inserted) np_[n++] = u;
                rp[i] = local;
            }
        } else {  /* the key carries the target's seed: a node reached from two seeds is two nodes */
            if (!batch.reserve(ids.n + (ee - eb))) return NO_MEMORY;
            int64_t *bp = batch.p;
            const int64_t *cp = col.p;
            for (int64_t i = eb; i < ee; i++) {
                bool inserted;
                const int64_t u = rp[i], b = bp[cp[i]];
                const int64_t local = map.get_or_insert(b * N + u, n, &inserted);
                if (inserted) {
                    np_[n] = u;
                    bp[n++] = b;
                }
                rp[i] = local;
            }
            batch.n = n;
        }
        ids.n = n;
        r.hop_edges[h] = ee - eb;
        r.hop_nodes[h + 1] = n - fe;
        fb = fe;
        fe = n;
    }

    /* Outputs: fresh buffers the caller will own. */
    const int64_t n = ids.n, E = pos.n;
    r.num_nodes = n;
    r.num_edges = E;
    if (!(r.n_id = copy_out(ids.p, n))) return NO_MEMORY;
    if (!(r.edge_index = (int64_t *)std::malloc((size_t)(E > 0 ? 2 * E : 1) * sizeof(int64_t)))) return NO_MEMORY;
    if (E) {
        std::memcpy(r.edge_index, row.p, (size_t)E * sizeof(int64_t));
        std::memcpy(r.edge_index + E, col.p, (size_t)E * sizeof(int64_t));
    }
    if (q.want_e_id && !(r.e_id = copy_out(pos.p, E))) return NO_MEMORY;
    if (disjoint && !(r.batch = copy_out(batch.p, n))) return NO_MEMORY;
    if (q.labels) {
        if (!(r.y = (int64_t *)std::malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t)))) return NO_MEMORY;
        const int64_t *nid = ids.p;
        for (int64_t i = 0; i < n; i++) {
            if (i + kPrefetch < n) __builtin_prefetch(&q.labels[nid[i + kPrefetch]], 0, 0);
            r.y[i] = q.labels[nid[i]];
        }
    }
    return OK;
}

/* Sample one minibatch with this thread's workspace (runs without the GIL). */
Status sample(const Request &q, Result &r) {
    Workspace &w = *thread_workspace();
    w.reset_vectors();
    Status st = q.index_size == 4 ? sample_in<int32_t>(q, w, r) : sample_in<int64_t>(q, w, r);
    if (st != OK || w.bytes() > kKeepBytes) w.release();
    return st;
}

/* ---------------------------------------------------------------- Python: sample() */

/* sample()'s arguments, as parsed. */
struct Args {
    PyObject *indptr, *indices, *seeds, *fanouts, *labels = Py_None;
    int replace = 0, return_e_id = 0, disjoint = 0, last = 0;
    unsigned long long rng_seed = 0;
    PyObject *node_time = Py_None, *edge_time = Py_None, *seed_time = Py_None;
    long long time_window = -1;
};

/* Read `o_fanouts` (at most 64 counts >= -1) into `fanouts`; false with a Python error set. */
bool parse_fanouts(PyObject *o_fanouts, int64_t *fanouts, Py_ssize_t *hops) {
    PyObject *seq = PySequence_Fast(o_fanouts, "fanouts must be a sequence of ints");
    if (!seq) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > 64) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "at most 64 hops");
        return false;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long f = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (f == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return false;
        }
        if (f < -1 || f > kMaxFanout) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "fanout of hop %zd is %lld; use a count in [0, %lld], or -1 for all neighbours",
                         i, f, (long long)kMaxFanout);
            return false;
        }
        fanouts[i] = f;
    }
    Py_DECREF(seq);
    *hops = n;
    return true;
}

/* Borrow the arrays of `a` into `bufs` (which holds them until it goes) and describe the call in `q`;
 * false with a Python error set. */
bool make_request(const Args &a, const int64_t *fanouts, Py_ssize_t hops, Buffers &bufs, Request &q) {
    Py_buffer *b_indptr = bufs.get(a.indptr, "indptr", false);
    if (!b_indptr) return false;
    Py_buffer *b_indices = bufs.get(a.indices, "indices", true);
    if (!b_indices) return false;
    Py_buffer *b_seeds = bufs.get(a.seeds, "seeds", false);
    if (!b_seeds) return false;
    Py_buffer *b_labels = nullptr;
    if (a.labels != Py_None && !(b_labels = bufs.get(a.labels, "labels", false))) return false;
    Py_buffer *b_node_time = nullptr, *b_edge_time = nullptr, *b_seed_time = nullptr;
    if (a.node_time != Py_None && !(b_node_time = bufs.get(a.node_time, "node_time", false))) return false;
    if (a.edge_time != Py_None && !(b_edge_time = bufs.get(a.edge_time, "edge_time", false))) return false;
    if (a.seed_time != Py_None && !(b_seed_time = bufs.get(a.seed_time, "seed_time", false))) return false;

    q.indptr = (const int64_t *)b_indptr->buf;
    q.num_nodes = b_indptr->shape[0] - 1;
    q.indices = b_indices->buf;
    q.indices_len = b_indices->shape[0];
    q.index_size = (int)b_indices->itemsize;
    q.seeds = (const int64_t *)b_seeds->buf;
    q.num_seeds = b_seeds->shape[0];
    q.fanouts = fanouts;
    q.num_hops = (int)hops;
    q.replace = a.replace != 0;
    q.rng_seed = a.rng_seed;
    q.want_e_id = a.return_e_id != 0;
    q.labels = b_labels ? (const int64_t *)b_labels->buf : nullptr;
    q.times = Times();
    q.times.node = b_node_time ? (const int64_t *)b_node_time->buf : nullptr;
    q.times.edge = b_edge_time ? (const int64_t *)b_edge_time->buf : nullptr;
    q.times.window = a.time_window;
    q.times.last = a.last != 0;
    q.seed_time = b_seed_time ? (const int64_t *)b_seed_time->buf : nullptr;
    q.disjoint = a.disjoint != 0 || q.times.on();
    if (b_node_time && b_edge_time) {
        PyErr_SetString(PyExc_ValueError, "give node_time or edge_time, not both");
        return false;
    }
    if (b_node_time && b_node_time->shape[0] != b_indptr->shape[0] - 1) {
        PyErr_Format(PyExc_ValueError, "node_time holds %zd entries for %zd nodes", b_node_time->shape[0],
                     b_indptr->shape[0] - 1);
        return false;
    }
    if (b_edge_time && b_edge_time->shape[0] != b_indices->shape[0]) {
        PyErr_Format(PyExc_ValueError, "edge_time holds %zd entries for %zd edges", b_edge_time->shape[0],
                     b_indices->shape[0]);
        return false;
    }
    if (q.times.on() && !b_seed_time) {
        PyErr_SetString(PyExc_ValueError, "temporal sampling needs seed_time, the time of each seed");
        return false;
    }
    if (b_seed_time && b_seed_time->shape[0] != b_seeds->shape[0]) {
        PyErr_Format(PyExc_ValueError, "seed_time holds %zd entries for %zd seeds", b_seed_time->shape[0],
                     b_seeds->shape[0]);
        return false;
    }
    if (q.disjoint && q.num_seeds > 0 && q.num_nodes > 0 && q.num_seeds > INT64_MAX / 2 / q.num_nodes) {
        PyErr_SetString(PyExc_ValueError, "too many seeds for one disjoint call on a graph this large");
        return false;
    }
    if (q.num_nodes >= ((int64_t)1 << NodeMap::kValueBits)) {
        PyErr_SetString(PyExc_ValueError, "graphs of 2^48 nodes or more are not supported");
        return false;
    }
    if (q.num_nodes < 0) {
        PyErr_SetString(PyExc_ValueError, "indptr must hold num_nodes + 1 >= 1 entries");
        return false;
    }
    if (b_labels && b_labels->shape[0] != q.num_nodes) {
        PyErr_Format(PyExc_ValueError, "labels hold %zd entries for %lld nodes", b_labels->shape[0],
                     (long long)q.num_nodes);
        return false;
    }
    return true;
}

/* Raise the Python exception that describes a failed call; returns nullptr. */
PyObject *raise_status(Status st, const Request &q, const Result &r) {
    switch (st) {
    case OK:
        break;
    case NO_MEMORY:
        return PyErr_NoMemory();
    case BAD_SEED:
        PyErr_Format(PyExc_IndexError, "seed %lld (position %lld) is not a node id; ids lie in [0, %lld)",
                     (long long)r.bad_value, (long long)r.bad_at, (long long)q.num_nodes);
        break;
    case BAD_INDPTR:
        PyErr_Format(PyExc_ValueError, "corrupt graph: indptr of node %lld gives a range outside the %lld indices",
                     (long long)r.bad_value, (long long)q.indices_len);
        break;
    case BAD_INDEX:
        PyErr_Format(PyExc_ValueError, "corrupt graph: indices[%lld] = %lld is not a node id in [0, %lld)",
                     (long long)r.bad_at, (long long)r.bad_value, (long long)q.num_nodes);
        break;
    case BAD_TIME_ORDER:
        PyErr_Format(PyExc_ValueError, "neighbours not in time order: the in-edges of node %lld (from position %lld) "
                     "are not sorted by %s time", (long long)r.bad_value, (long long)r.bad_at,
                     q.times.edge ? "edge" : "source node");
        break;
    }
    return nullptr;
}

/* The tuple sample() returns for a successful call; the buffer objects take over the outputs of `r`. */
PyObject *to_python(Result &r, Py_ssize_t hops) {
    const int64_t E = r.num_edges;
    PyObject *edge_index = wrap(r.edge_index, 2 * E);
    PyObject *n_id = wrap(r.n_id, r.num_nodes);
    PyObject *e_id = r.e_id ? wrap(r.e_id, E) : Py_NewRef(Py_None);
    PyObject *y = r.y ? wrap(r.y, r.num_nodes) : Py_NewRef(Py_None);
    PyObject *batch = r.batch ? wrap(r.batch, r.num_nodes) : Py_NewRef(Py_None);
    r.edge_index = r.n_id = r.e_id = r.y = r.batch = nullptr;  // owned by the buffer objects now
    PyObject *hop_nodes = PyList_New(hops + 1), *hop_edges = PyList_New(hops);
    PyObject *out = nullptr;
    if (edge_index && n_id && e_id && y && batch && hop_nodes && hop_edges) {
        bool ok = true;
        for (Py_ssize_t i = 0; i <= hops && ok; i++) {
            PyObject *v = PyLong_FromLongLong(r.hop_nodes[i]);
            ok = v != nullptr;
            if (ok) PyList_SET_ITEM(hop_nodes, i, v);
        }
        for (Py_ssize_t i = 0; i < hops && ok; i++) {
            PyObject *v = PyLong_FromLongLong(r.hop_edges[i]);
            ok = v != nullptr;
            if (ok) PyList_SET_ITEM(hop_edges, i, v);
        }
        if (ok) out = PyTuple_Pack(7, n_id, edge_index, e_id, y, hop_nodes, hop_edges, batch);
    }
    Py_XDECREF(batch);
    Py_XDECREF(edge_index);
    Py_XDECREF(n_id);
    Py_XDECREF(e_id);
    Py_XDECREF(y);
    Py_XDECREF(hop_nodes);
    Py_XDECREF(hop_edges);
    return out;
}

PyObject *py_sample(PyObject *, PyObject *args, PyObject *kwargs) {
    static const char *kwlist[] = {"indptr",   "indices",   "seeds",     "fanouts",   "replace",
                                   "rng_seed", "return_e_id", "labels",  "disjoint",  "node_time",
                                   "edge_time", "seed_time", "time_window", "last", nullptr};
    Args a;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOpKp|O$pOOOLp", (char **)kwlist, &a.indptr, &a.indices,
                                     &a.seeds, &a.fanouts, &a.replace, &a.rng_seed, &a.return_e_id, &a.labels,
                                     &a.disjoint, &a.node_time, &a.edge_time, &a.seed_time, &a.time_window, &a.last))
        return nullptr;
    int64_t fanouts[64];
    Py_ssize_t hops = 0;
    if (!parse_fanouts(a.fanouts, fanouts, &hops)) return nullptr;
    Buffers bufs;  // the arrays stay borrowed until sampling is over
    Request q;
    if (!make_request(a, fanouts, hops, bufs, q)) return nullptr;

    Result r;
    Status st;
    Py_BEGIN_ALLOW_THREADS
    st = sample(q, r);
    Py_END_ALLOW_THREADS
    if (st != OK) return raise_status(st, q, r);
    return to_python(r, hops);
}

PyObject *py_release_workspace(PyObject *, PyObject *) {
    thread_workspace()->release();
    looc_release_hetero_workspace();
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"sample", (PyCFunction)(void (*)(void))py_sample, METH_VARARGS | METH_KEYWORDS,
     "sample(indptr, indices, seeds, fanouts, replace, rng_seed, return_e_id, labels=None, *, disjoint=False,\n"
     "       node_time=None, edge_time=None, seed_time=None, time_window=-1, last=False)\n"
     "--\n\n"
     "Sample one minibatch. Returns (n_id, edge_index, e_id, y, num_sampled_nodes, num_sampled_edges, batch):\n"
     "int64 buffers (edge_index holds row 0 then row 1, 2 x E items; e_id / y are None unless asked for),\n"
     "two lists of per-hop counts, and the seed of each node (disjoint or temporal; else None).\n"
     "Temporal (node_time or edge_time, with seed_time): an in-edge is eligible when its time is at most\n"
     "its seed's (and at least seed time - time_window when time_window >= 0); last=True keeps the latest\n"
     "fanout of them. Each target's in-edges must be in time order. The GIL is released while sampling."},
    {"sample_hetero", (PyCFunction)(void (*)(void))looc_py_sample_hetero, METH_VARARGS | METH_KEYWORDS,
     LOOC_SAMPLE_HETERO_DOC},
    {"negatives", (PyCFunction)(void (*)(void))looc_py_negatives, METH_VARARGS | METH_KEYWORDS, LOOC_NEGATIVES_DOC},
    {"release_workspace", py_release_workspace, METH_NOARGS,
     "Free the calling thread's sampling workspaces (kept between calls, at most 512 MiB each)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sampler", "Native uniform neighbour samplers (homogeneous and heterogeneous) and negative sampler over in-edge CSCs.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__sampler(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return nullptr;
    if (looc::add_buffer_type(m) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
