/* lightning_ooc._sampler.negatives: negative edges for link prediction over an in-edge CSC.
 *
 * The two kinds of PyG's NegativeSampling:
 *
 * - binary: `n` random (source, destination) pairs, labelled 0 beside the
 *   batch's positives;
 * - triplet: for every positive (src[i], dst[i]), `amount` random
 *   destinations that pair with src[i].
 *
 * Nodes are drawn uniformly, or in proportion to their degree: a source in
 * proportion to its out-degree (the source of a uniformly drawn edge,
 * indices[e]) and a destination to its in-degree (the target of a uniformly
 * drawn edge: the v with indptr[v] <= e < indptr[v + 1]). With `strict`, a
 * pair that is an edge of the graph, or one of the batch's positives (and,
 * for a triplet, a destination equal to the positive's own), is drawn again,
 * up to `max_tries` times; the pairs still not strict after that are kept
 * and counted, so the shapes never change. An edge (s, d) is looked up by a
 * binary search for s among the sorted sources of d's in-edges.
 *
 * Each call seeds its own stream (rng.h), so a seed gives the same negatives
 * on any thread; the GIL is released while drawing. A corrupt graph is an
 * error, never an out-of-range read: indptr must run from 0 to len(indices)
 * (the caller checks once that it never decreases), every source drawn from
 * indices and every range of indptr looked up are checked.
 */
#include "negative.h"

#include <algorithm>
#include <cstdint>
#include <new>
#include <utility>
#include <vector>

#include "pybuf.h"
#include "rng.h"

namespace {

using looc::Buffers;
using looc::Rng;

enum Status { OK, NO_MEMORY, BAD_NODE, BAD_INDPTR, BAD_INDEX };

struct Graph {
    const int64_t *indptr;
    int64_t num_nodes;
    const void *indices;
    int64_t num_edges;  // entries of indices
    int index_size;

    inline int64_t source(int64_t e) const {
        return index_size == 4 ? (int64_t)((const int32_t *)indices)[e] : ((const int64_t *)indices)[e];
    }
    /* Whether s -> d is an edge: s among the sorted sources of d's in-edges. */
    inline bool has_edge(int64_t s, int64_t d) const {
        const int64_t lo = indptr[d], hi = indptr[d + 1];
        if (index_size == 4) {
            const int32_t *p = (const int32_t *)indices;
            return std::binary_search(p + lo, p + hi, (int32_t)s);
        }
        const int64_t *p = (const int64_t *)indices;
        return std::binary_search(p + lo, p + hi, s);
    }
};

struct Draw {
    const Graph &g;
    Rng rng;
    bool degree;
    inline int64_t source() {
        return degree ? g.source((int64_t)rng.below((uint64_t)g.num_edges)) : (int64_t)rng.below((uint64_t)g.num_nodes);
    }
    inline int64_t destination() {
        if (!degree) return (int64_t)rng.below((uint64_t)g.num_nodes);
        const int64_t e = (int64_t)rng.below((uint64_t)g.num_edges);
        // the last v with indptr[v] <= e: nodes without in-edges share their indptr with the next one
        return (int64_t)(std::upper_bound(g.indptr, g.indptr + g.num_nodes + 1, e) - g.indptr) - 1;
    }
};

struct Request {
    Graph g;
    const int64_t *src, *dst;  // the positives
    int64_t num_pos;
    int64_t *out_src, *out_dst;
    int64_t num_out;
    bool triplet, degree, strict;
    uint64_t rng_seed;
    int64_t max_tries;
    // filled on failure
    int64_t bad_at = -1, bad_value = -1;
};

Status check(Request &q) {
    for (int64_t i = 0; i < q.num_pos; i++) {
        for (const int64_t *a : {q.src, q.dst}) {
            if (a[i] < 0 || a[i] >= q.g.num_nodes) {
                q.bad_at = i;
                q.bad_value = a[i];
                return BAD_NODE;
            }
        }
    }
    return OK;
}

Status draw(Request &q, int64_t *unresolved) {
    Status st = check(q);
    if (st != OK) return st;
    std::vector<std::pair<int64_t, int64_t>> positives;
    if (q.strict) {
        try {
            positives.reserve((size_t)q.num_pos);
        } catch (const std::bad_alloc &) {
            return NO_MEMORY;
        }
        for (int64_t i = 0; i < q.num_pos; i++) positives.emplace_back(q.src[i], q.dst[i]);
        std::sort(positives.begin(), positives.end());
    }
    const Graph &g = q.g;
    auto bad_range = [&](int64_t d) { return g.indptr[d] < 0 || g.indptr[d] > g.indptr[d + 1] || g.indptr[d + 1] > g.num_edges; };
    auto taken = [&](int64_t s, int64_t d, int64_t own) {  // not a strict negative
        return d == own || std::binary_search(positives.begin(), positives.end(), std::make_pair(s, d)) || g.has_edge(s, d);
    };
    Draw rnd{g, Rng(q.rng_seed), q.degree};
    auto bad_source = [&](int64_t s) {  // a degree-weighted source is read from indices: check it
        if (s >= 0 && s < g.num_nodes) return false;
        q.bad_value = s;
        return true;
    };
    int64_t left = 0;
    const int64_t amount = q.triplet ? q.num_out / std::max<int64_t>(q.num_pos, 1) : 1;
    for (int64_t k = 0; k < q.num_out; k++) {
        const int64_t i = q.triplet ? k / amount : -1;
        int64_t s = q.triplet ? q.src[i] : rnd.source(), d = rnd.destination();
        const int64_t own = q.triplet ? q.dst[i] : -1;
        if (!q.triplet && bad_source(s)) return BAD_INDEX;
        if (q.strict) {
            int64_t tries = 0;
            for (;;) {
                if (bad_range(d)) {
                    q.bad_value = d;
                    return BAD_INDPTR;
                }
                if (!taken(s, d, own)) break;
                if (++tries > q.max_tries) {
                    left++;
                    break;
                }
                if (!q.triplet && bad_source(s = rnd.source())) return BAD_INDEX;
                d = rnd.destination();
            }
        }
        if (!q.triplet) q.out_src[k] = s;
        q.out_dst[k] = d;
    }
    *unresolved = left;
    return OK;
}

}  // namespace

PyObject *looc_py_negatives(PyObject *, PyObject *args, PyObject *kwargs) {
    static const char *kwlist[] = {"indptr", "indices", "src", "dst", "out_src", "out_dst", "triplet", "degree",
                                   "strict", "rng_seed", "max_tries", nullptr};
    PyObject *o_indptr, *o_indices, *o_src, *o_dst, *o_out_src, *o_out_dst;
    int triplet = 0, degree = 0, strict = 0;
    unsigned long long rng_seed = 0;
    long long max_tries = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOpppKL", (char **)kwlist, &o_indptr, &o_indices, &o_src,
                                     &o_dst, &o_out_src, &o_out_dst, &triplet, &degree, &strict, &rng_seed,
                                     &max_tries))
        return nullptr;
    Buffers bufs;
    Py_buffer *b_indptr = bufs.get(o_indptr, "indptr", false);
    Py_buffer *b_indices = b_indptr ? bufs.get(o_indices, "indices", true) : nullptr;
    Py_buffer *b_src = b_indices ? bufs.get(o_src, "src", false) : nullptr;
    Py_buffer *b_dst = b_src ? bufs.get(o_dst, "dst", false) : nullptr;
    Py_buffer *b_out_dst = b_dst ? bufs.get(o_out_dst, "out_dst", false, true) : nullptr;
    if (!b_out_dst) return nullptr;
    Py_buffer *b_out_src = nullptr;
    if (!triplet && !(b_out_src = bufs.get(o_out_src, "out_src", false, true))) return nullptr;

    Request q;
    q.g = Graph{(const int64_t *)b_indptr->buf, b_indptr->shape[0] - 1, b_indices->buf, b_indices->shape[0],
                (int)b_indices->itemsize};
    q.src = (const int64_t *)b_src->buf;
    q.dst = (const int64_t *)b_dst->buf;
    q.num_pos = b_src->shape[0];
    q.out_src = b_out_src ? (int64_t *)b_out_src->buf : nullptr;
    q.out_dst = (int64_t *)b_out_dst->buf;
    q.num_out = b_out_dst->shape[0];
    q.triplet = triplet != 0;
    q.degree = degree != 0;
    q.strict = strict != 0;
    q.rng_seed = rng_seed;
    q.max_tries = max_tries;
    if (q.g.num_nodes < 1) {
        PyErr_SetString(PyExc_ValueError, "negatives need a graph of at least one node");
        return nullptr;
    }
    if (b_dst->shape[0] != q.num_pos) {
        PyErr_Format(PyExc_ValueError, "src holds %zd positives but dst %zd", q.num_pos, b_dst->shape[0]);
        return nullptr;
    }
    if (q.g.indptr[0] != 0 || q.g.indptr[q.g.num_nodes] != q.g.num_edges) {
        PyErr_Format(PyExc_ValueError, "corrupt graph: indptr runs from %lld to %lld but indices hold %lld entries",
                     (long long)q.g.indptr[0], (long long)q.g.indptr[q.g.num_nodes], (long long)q.g.num_edges);
        return nullptr;
    }
    if (q.triplet && (q.num_pos == 0 ? q.num_out != 0 : q.num_out % q.num_pos != 0)) {
        PyErr_Format(PyExc_ValueError, "triplet: out_dst holds %zd entries, not a multiple of the %zd positives",
                     q.num_out, q.num_pos);
        return nullptr;
    }
    if (!q.triplet && b_out_src->shape[0] != q.num_out) {
        PyErr_Format(PyExc_ValueError, "binary: out_src holds %zd entries but out_dst %zd", b_out_src->shape[0],
                     q.num_out);
        return nullptr;
    }
    if (q.degree && q.g.num_edges == 0 && q.num_out > 0) {
        PyErr_SetString(PyExc_ValueError, "degree-weighted negatives need a graph with edges");
        return nullptr;
    }
    if (q.max_tries < 0) {
        PyErr_SetString(PyExc_ValueError, "max_tries must be >= 0");
        return nullptr;
    }
    int64_t unresolved = 0;
    Status st;
    Py_BEGIN_ALLOW_THREADS
    try {
        st = draw(q, &unresolved);
    } catch (const std::bad_alloc &) {
        st = NO_MEMORY;
    }
    Py_END_ALLOW_THREADS
    switch (st) {
    case OK:
        return PyLong_FromLongLong(unresolved);
    case NO_MEMORY:
        return PyErr_NoMemory();
    case BAD_NODE:
        return PyErr_Format(PyExc_IndexError, "positive edge %lld holds node %lld, not a node id in [0, %lld)",
                            (long long)q.bad_at, (long long)q.bad_value, (long long)q.g.num_nodes);
    case BAD_INDEX:
        return PyErr_Format(PyExc_ValueError, "corrupt graph: indices hold %lld, not a node id in [0, %lld)",
                            (long long)q.bad_value, (long long)q.g.num_nodes);
    case BAD_INDPTR:
        return PyErr_Format(PyExc_ValueError, "corrupt graph: indptr of node %lld gives a range outside the %lld "
                            "indices", (long long)q.bad_value, (long long)q.g.num_edges);
    }
    return nullptr;
}
