/* lightning_ooc._sampler.sample_hetero: node-wise uniform neighbour sampling
 * over a heterogeneous graph, as PyG's NeighborLoader does it on a HeteroData
 * (pyg-lib's hetero_neighbor_sample and torch-sparse's, not disjoint, not
 * temporal).
 *
 * The graph has T node types, each with its own ids [0, num_nodes[t]), and R
 * relations (edge types). Relation r runs from node type src[r] to dst[r] and
 * is given as the in-edge CSC of its targets: the sources (ids of src[r]) of
 * the edges into target v are indices[indptr[v] : indptr[v + 1]].
 *
 * One call samples one minibatch. Each node type has a list of sampled nodes;
 * the seeds (of the input type) come first, a repeated seed keeping its first
 * place. At hop h the frontier of every node type is fixed first: the nodes
 * it gained at hop h - 1 (the seeds at hop 0). Then, relation by relation in
 * the given order, each frontier node of the relation's target type gets
 * fanouts[r][h] of its in-edges (all of them for -1, none for 0), uniformly
 * with or without replacement; each source joins its own type's list when it
 * is new there (in order of first appearance), and the edge is emitted as
 * (row = source local id, col = target local id, e_id = CSC position). A node
 * reached during hop h is a frontier node of hop h + 1 only, whichever
 * relation reached it. Edges of a relation come out grouped by hop, then by
 * target in frontier order.
 *
 * As in the homogeneous sampler (sampler.cpp, whose pieces this one shares
 * through core.h): each call seeds its own random stream, so the same seed
 * gives the same sample on any thread; it works in its thread's workspace
 * (one node map for all types, keyed by type << 48 | id, and per-type and
 * per-relation arrays, kept warm for the thread's next call up to 512 MiB);
 * the GIL is released for the whole sampling; each relation's step runs in
 * three prefetching passes (choose edge positions, read their sources, map
 * the sources to local ids). A corrupt CSC is an error naming the relation,
 * never an out-of-range read.
 */
#include "hetero.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "core.h"
#include "outbuf.h"
#include "pybuf.h"
#include "rng.h"

namespace {

using namespace looc;  // core.h, outbuf.h, pybuf.h, rng.h

constexpr int kIdBits = NodeMap::kValueBits;  // a node map key is type << kIdBits | id
constexpr int kMaxTypes = 1 << 15;            // so that a key stays a positive int64
constexpr Py_ssize_t kMaxRelations = 1 << 16;
constexpr int kMaxHops = 64;

struct Relation {
    const int64_t *indptr;
    const void *indices;
    int64_t indices_len;
    int index_size;  // 4 or 8
    int src, dst;    // node types of the sources and of the targets
    int64_t fanouts[kMaxHops];
    Times times;     // temporal sampling, when times.on()
};

struct Request {
    std::vector<int64_t> num_nodes;   // per node type
    std::vector<Relation> relations;  // in sampling order
    std::vector<std::string> names;   // per relation, for error messages
    const int64_t *seeds = nullptr;
    int64_t num_seeds = 0;
    int input_type = 0;
    int num_hops = 0;
    bool replace = false;
    uint64_t rng_seed = 0;
    bool want_e_id = false;
    bool disjoint = false;              // one subgraph per seed (always, when temporal)
    const int64_t *seed_time = nullptr;  // per seed (temporal)
    std::vector<int64_t> offset;        // disjoint: node keys are seed x total + offset[type] + id
    int64_t total_nodes = 0;
};

struct Result {
    /* Outputs, malloc'd; whoever holds them frees them. */
    std::vector<int64_t *> n_id, batch;         // per node type
    std::vector<int64_t> num_nodes;             // per node type
    std::vector<int64_t *> edge_index, e_id;    // per relation; edge_index holds row 0 then row 1
    std::vector<int64_t> num_edges;             // per relation
    std::vector<int64_t> hop_nodes, hop_edges;  // [t * (hops + 1) + h], [r * hops + h]
    int bad_relation = -1;                      // which relation, seed and node were wrong
    int64_t bad_at = 0, bad_value = 0;
    Result() = default;
    Result(const Result &) = delete;
    Result &operator=(const Result &) = delete;
    ~Result() {
        for (int64_t *p : n_id) std::free(p);
        for (int64_t *p : batch) std::free(p);
        for (int64_t *p : edge_index) std::free(p);
        for (int64_t *p : e_id) std::free(p);
    }
};

/* Everything a call needs besides its outputs; each thread keeps one between calls, up to kKeepBytes. */
struct Workspace {
    NodeMap map;
    std::vector<Vec> ids, batch;     // per node type: the global ids of its sampled nodes, by local id; their seeds
    std::vector<Vec> pos, col, row;  // per relation: CSC positions, target and source local ids
    Vec scratch;
    size_t bytes() const {
        size_t b = map.bytes() + (size_t)scratch.cap * sizeof(int64_t);
        for (const auto *vs : {&ids, &batch, &pos, &col, &row})
            for (const Vec &v : *vs) b += (size_t)v.cap * sizeof(int64_t);
        return b;
    }
    /* Empty arrays for `types` node types and `relations` relations (may throw std::bad_alloc). */
    void reset(size_t types, size_t relations) {
        if (ids.size() < types) ids.resize(types);
        if (batch.size() < types) batch.resize(types);
        for (auto *vs : {&pos, &col, &row})
            if (vs->size() < relations) vs->resize(relations);
        for (auto *vs : {&ids, &batch, &pos, &col, &row})
            for (Vec &v : *vs) v.n = 0;
        scratch.n = 0;
    }
    void release() {
        map.release();
        for (auto *vs : {&ids, &batch, &pos, &col, &row}) std::vector<Vec>().swap(*vs);
        scratch.free_memory();
    }
};

thread_local Workspace tls_workspace;

/* Out of line, as in sampler.cpp: the hot loops get the address, not a thread-local lookup. */
__attribute__((noinline)) Workspace *thread_workspace() { return &tls_workspace; }

/* One relation's share of hop h: sample the in-edges of the frontier [fb, fe) of its target type. */
template <typename Index>
Status sample_relation(const Request &q, int r, int h, int64_t fb, int64_t fe, Rng &rng, Workspace &w,
                       int64_t &total, int64_t max_keys, Result &res) {
    const Relation &rel = q.relations[r];
    const int64_t k = rel.fanouts[h];
    const int64_t *indptr = rel.indptr;
    const Index *indices = (const Index *)rel.indices;
    Vec &pos = w.pos[r], &col = w.col[r], &row = w.row[r];
    const int64_t eb = pos.n;
    /* A: degrees -> edge positions, and the target of each edge. */
    if (k != 0) {
        const int64_t *tid = w.ids[rel.dst].p;  // not written to before pass C
        const int64_t *tbatch = w.batch[rel.dst].p;
        const bool temporal = rel.times.on();
        for (int64_t t = fb; t < fe; t++) {
            if (t + 8 < fe) __builtin_prefetch(&indptr[tid[t + 8]], 0, 1);
            const int64_t v = tid[t];
            const int64_t start = indptr[v], end = indptr[v + 1];
            if (start < 0 || end < start || end > rel.indices_len) {
                res.bad_relation = r;
                res.bad_value = v;
                return BAD_INDPTR;
            }
            int64_t lo = start, hi = end;
            if (temporal && hi > lo) {
                const Status st = temporal_range(rel.times, indices, q.num_nodes[rel.src], q.seed_time[tbatch[t]], k,
                                                 lo, hi, &res.bad_at);
                if (st != OK) {
                    res.bad_relation = r;
                    res.bad_value = st == BAD_TIME_ORDER ? v : (int64_t)indices[res.bad_at];
                    return st;
                }
            }
            const int64_t before = pos.n;
            if (!choose(rng, pos, lo, hi - lo, k, q.replace, w.scratch)) return NO_MEMORY;
            if (!col.reserve(pos.n)) return NO_MEMORY;
            for (int64_t j = before; j < pos.n; j++) col.p[j] = t;
            col.n = pos.n;
        }
    }
    const int64_t ee = pos.n;
    res.hop_edges[(size_t)r * q.num_hops + h] = ee - eb;
    if (ee == eb) return OK;
    /* B: sources at those positions. */
    const int64_t S = q.num_nodes[rel.src];
    if (!row.reserve(ee)) return NO_MEMORY;
    const int64_t *pp = pos.p;
    int64_t *rp = row.p;
    for (int64_t i = eb; i < ee; i++) {
        if (i + kPrefetch < ee) __builtin_prefetch(&indices[pp[i + kPrefetch]], 0, 0);
        const int64_t u = (int64_t)indices[pp[i]];
        if (u < 0 || u >= S) {
            res.bad_relation = r;
            res.bad_at = pp[i];
            res.bad_value = u;
            return BAD_INDEX;
        }
        rp[i] = u;
    }
    row.n = ee;
    /* C: sources -> local ids of the source type, new nodes appended in order of first appearance. */
    Vec &sid = w.ids[rel.src];
    if (!w.map.ensure(total + (ee - eb), max_keys) || !sid.reserve(sid.n + (ee - eb))) return NO_MEMORY;
    NodeMap &map = w.map;
    int64_t *sp = sid.p;
    int64_t n = sid.n;
    if (!q.disjoint) {
        const int64_t tag = (int64_t)rel.src << kIdBits;
        for (int64_t i = eb; i < ee; i++) {
            if (i + kPrefetch < ee) map.prefetch(tag | rp[i + kPrefetch]);
            bool inserted;
            const int64_t u = rp[i];
            const int64_t local = map.get_or_insert(tag | u, n, &inserted);
            if (inserted) sp[n++] = u;
            rp[i] = local;
        }
    } else {  /* the key carries the target's seed: a node reached from two seeds is two nodes */
        Vec &sb = w.batch[rel.src];
        if (!sb.reserve(sid.n + (ee - eb))) return NO_MEMORY;
        const int64_t *tb = w.batch[rel.dst].p, *cp = col.p;
        const int64_t base = q.offset[rel.src], M = q.total_nodes;
        for (int64_t i = eb; i < ee; i++) {
            bool inserted;
            const int64_t u = rp[i], b = tb[cp[i]];
            const int64_t local = map.get_or_insert(b * M + base + u, n, &inserted);
            if (inserted) {
                sp[n] = u;
                sb.p[n++] = b;
            }
            rp[i] = local;
        }
        sb.n = n;
    }
    total += n - sid.n;
    sid.n = n;
    return OK;
}

Status sample_in(const Request &q, Workspace &w, Result &res) {
    const size_t T = q.num_nodes.size(), R = q.relations.size();
    const int H = q.num_hops;
    Rng rng(q.rng_seed);
    w.reset(T, R);
    res.hop_nodes.assign(T * (H + 1), 0);
    res.hop_edges.assign(R * H, 0);
    std::vector<int64_t> fb(T, 0), fe(T, 0);  // frontier of each type: local ids [fb, fe)
    int64_t max_keys = 0;
    for (int64_t n : q.num_nodes) max_keys += n;
    if (q.disjoint) max_keys = q.num_seeds > 0 && max_keys > INT64_MAX / 4 / q.num_seeds ? INT64_MAX / 4
                                                                                        : max_keys * (q.num_seeds > 0 ? q.num_seeds : 1);

    /* Seeds: the first nodes of the input type. */
    const int64_t B = q.num_seeds, N = q.num_nodes[q.input_type];
    Vec &seed_ids = w.ids[q.input_type];
    Vec &seed_batch = w.batch[q.input_type];
    w.map.begin();
    if (!seed_ids.reserve(B > 0 ? 2 * B : 1) || !w.map.ensure(2 * B + 16, max_keys)) return NO_MEMORY;
    if (q.disjoint && !seed_batch.reserve(B > 0 ? 2 * B : 1)) return NO_MEMORY;
    const int64_t tag = (int64_t)q.input_type << kIdBits;
    for (int64_t i = 0; i < B; i++) {
        const int64_t s = q.seeds[i];
        if (s < 0 || s >= N) {
            res.bad_at = i;
            res.bad_value = s;
            return BAD_SEED;
        }
        bool inserted;
        /* a repeated seed keeps its place; it maps to the first (disjoint: each seed its own subgraph) */
        w.map.get_or_insert(q.disjoint ? i * q.total_nodes + q.offset[q.input_type] + s : (tag | s), i, &inserted);
        seed_ids.p[seed_ids.n++] = s;
        if (q.disjoint) seed_batch.p[seed_batch.n++] = i;
    }
    int64_t total = B;
    res.hop_nodes[(size_t)q.input_type * (H + 1)] = B;
    fe[q.input_type] = B;

    for (int h = 0; h < H; h++) {
        for (size_t r = 0; r < R; r++) {
            const Relation &rel = q.relations[r];
            const Status st = rel.index_size == 4
                                  ? sample_relation<int32_t>(q, (int)r, h, fb[rel.dst], fe[rel.dst], rng, w, total,
                                                             max_keys, res)
                                  : sample_relation<int64_t>(q, (int)r, h, fb[rel.dst], fe[rel.dst], rng, w, total,
                                                             max_keys, res);
            if (st != OK) return st;
        }
        for (size_t t = 0; t < T; t++) {  // what each type gained is its next frontier
            res.hop_nodes[t * (H + 1) + h + 1] = w.ids[t].n - fe[t];
            fb[t] = fe[t];
            fe[t] = w.ids[t].n;
        }
    }

    /* Outputs: fresh buffers the caller will own. */
    res.n_id.assign(T, nullptr);
    res.batch.assign(T, nullptr);
    res.num_nodes.assign(T, 0);
    res.edge_index.assign(R, nullptr);
    res.e_id.assign(R, nullptr);
    res.num_edges.assign(R, 0);
    for (size_t t = 0; t < T; t++) {
        const Vec &ids = w.ids[t];
        res.num_nodes[t] = ids.n;
        if (!(res.n_id[t] = copy_out(ids.p, ids.n))) return NO_MEMORY;
        if (q.disjoint && !(res.batch[t] = copy_out(w.batch[t].p, ids.n))) return NO_MEMORY;
    }
    for (size_t r = 0; r < R; r++) {
        const int64_t E = w.pos[r].n;
        res.num_edges[r] = E;
        int64_t *ei = (int64_t *)std::malloc((size_t)(E > 0 ? 2 * E : 1) * sizeof(int64_t));
        if (!(res.edge_index[r] = ei)) return NO_MEMORY;
        if (E) {
            std::memcpy(ei, w.row[r].p, (size_t)E * sizeof(int64_t));
            std::memcpy(ei + E, w.col[r].p, (size_t)E * sizeof(int64_t));
        }
        if (q.want_e_id && !(res.e_id[r] = copy_out(w.pos[r].p, E))) return NO_MEMORY;
    }
    return OK;
}

/* Sample one minibatch with this thread's workspace (runs without the GIL). */
Status sample(const Request &q, Result &res) {
    Workspace &w = *thread_workspace();
    Status st;
    try {
        st = sample_in(q, w, res);
    } catch (const std::bad_alloc &) {
        st = NO_MEMORY;
    }
    if (st != OK || w.bytes() > kKeepBytes) w.release();
    return st;
}

/* ---------------------------------------------------------------- Python: sample_hetero() */

/* A new reference, released when it goes. */
struct Ref {
    PyObject *o;
    explicit Ref(PyObject *obj) : o(obj) {}
    Ref(const Ref &) = delete;
    Ref &operator=(const Ref &) = delete;
    ~Ref() { Py_XDECREF(o); }
};

/* `o` as a sequence of at most `max_len` ints in [lo, hi), into `out`; false with a Python error set. */
bool parse_ints(PyObject *o, const char *what, int64_t lo, int64_t hi, Py_ssize_t max_len, std::vector<int64_t> &out) {
    Ref seq(PySequence_Fast(o, "expected a sequence of ints"));
    if (!seq.o) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.o);
    if (n > max_len) {
        PyErr_Format(PyExc_ValueError, "%s: at most %zd entries, got %zd", what, max_len, n);
        return false;
    }
    out.reserve((size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        const long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq.o, i));
        if (v == -1 && PyErr_Occurred()) return false;
        if (v < lo || v >= hi) {
            PyErr_Format(PyExc_ValueError, "%s: entry %zd is %lld, outside [%lld, %lld)", what, i, v, (long long)lo,
                         (long long)hi);
            return false;
        }
        out.push_back(v);
    }
    return true;
}

/* One relation tuple (indptr, indices, src_type, dst_type, fanouts, name) into q; false with a Python error set. */
bool parse_relation(PyObject *item, Py_ssize_t r, Buffers &bufs, Request &q) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 6 || PyTuple_GET_SIZE(item) > 7) {
        PyErr_Format(PyExc_TypeError, "relations[%zd]: expected a tuple (indptr, indices, src_type, dst_type, "
                     "fanouts, name[, edge_time])", r);
        return false;
    }
    PyObject *o_indptr, *o_indices, *o_fanouts, *o_name, *o_edge_time = Py_None;
    int src, dst;
    if (!PyArg_ParseTuple(item, "OOiiOU|O", &o_indptr, &o_indices, &src, &dst, &o_fanouts, &o_name, &o_edge_time))
        return false;
    const char *name = PyUnicode_AsUTF8(o_name);
    if (!name) return false;
    q.names.emplace_back(name);
    const int T = (int)q.num_nodes.size();
    if (src < 0 || src >= T || dst < 0 || dst >= T) {
        PyErr_Format(PyExc_ValueError, "relation %s: node types %d -> %d, but there are %d node types", name, src,
                     dst, T);
        return false;
    }
    std::vector<int64_t> fanouts;
    if (!parse_ints(o_fanouts, "fanouts", -1, kMaxFanout + 1, kMaxHops, fanouts)) return false;
    if ((int)fanouts.size() != q.num_hops) {
        PyErr_Format(PyExc_ValueError, "relation %s: %zu fanouts for %d hops", name, fanouts.size(), q.num_hops);
        return false;
    }
    Py_buffer *b_indptr = bufs.get(o_indptr, "indptr", false);
    if (!b_indptr) return false;
    Py_buffer *b_indices = bufs.get(o_indices, "indices", true);
    if (!b_indices) return false;
    if (b_indptr->shape[0] != q.num_nodes[dst] + 1) {
        PyErr_Format(PyExc_ValueError, "relation %s: indptr holds %zd entries; its target type has %lld nodes, so it "
                     "needs %lld", name, b_indptr->shape[0], (long long)q.num_nodes[dst],
                     (long long)q.num_nodes[dst] + 1);
        return false;
    }
    Relation rel;
    rel.indptr = (const int64_t *)b_indptr->buf;
    rel.indices = b_indices->buf;
    rel.indices_len = b_indices->shape[0];
    rel.index_size = (int)b_indices->itemsize;
    rel.src = src;
    rel.dst = dst;
    rel.times = Times();
    if (o_edge_time != Py_None) {
        Py_buffer *b_time = bufs.get(o_edge_time, "edge_time", false);
        if (!b_time) return false;
        if (b_time->shape[0] != rel.indices_len) {
            PyErr_Format(PyExc_ValueError, "relation %s: edge_time holds %zd entries for %zd edges", name,
                         b_time->shape[0], (Py_ssize_t)rel.indices_len);
            return false;
        }
        rel.times.edge = (const int64_t *)b_time->buf;
    }
    std::memset(rel.fanouts, 0, sizeof rel.fanouts);
    for (size_t h = 0; h < fanouts.size(); h++) rel.fanouts[h] = fanouts[h];
    q.relations.push_back(rel);
    return true;
}

/* Raise the Python exception that describes a failed call; returns nullptr. */
PyObject *raise_status(Status st, const Request &q, const Result &res) {
    const char *name = res.bad_relation >= 0 ? q.names[res.bad_relation].c_str() : "";
    switch (st) {
    case OK:
        break;
    case NO_MEMORY:
        return PyErr_NoMemory();
    case BAD_SEED:
        PyErr_Format(PyExc_IndexError, "seed %lld (position %lld) is not a node id of the input type; ids lie in "
                     "[0, %lld)", (long long)res.bad_value, (long long)res.bad_at,
                     (long long)q.num_nodes[q.input_type]);
        break;
    case BAD_INDPTR:
        PyErr_Format(PyExc_ValueError, "corrupt graph: relation %s: indptr of node %lld gives a range outside the "
                     "%lld indices", name, (long long)res.bad_value,
                     (long long)q.relations[res.bad_relation].indices_len);
        break;
    case BAD_INDEX:
        PyErr_Format(PyExc_ValueError, "corrupt graph: relation %s: indices[%lld] = %lld is not a node id of its "
                     "source type, in [0, %lld)", name, (long long)res.bad_at, (long long)res.bad_value,
                     (long long)q.num_nodes[q.relations[res.bad_relation].src]);
        break;
    case BAD_TIME_ORDER:
        PyErr_Format(PyExc_ValueError, "neighbours not in time order: relation %s: the in-edges of node %lld (from "
                     "position %lld) are not sorted by %s time", name, (long long)res.bad_value,
                     (long long)res.bad_at, q.relations[res.bad_relation].times.edge ? "edge" : "source node");
        break;
    }
    return nullptr;
}

/* A new list of Python ints. */
PyObject *int_list(const int64_t *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, x);
    }
    return out;
}

/* Move `bufs` (malloc'd, `len[i]` items each, times `factor`) into a new list of Buffer objects; the buffers
 * are taken over (set to nullptr) even on failure. */
PyObject *buffer_list(std::vector<int64_t *> &bufs, const std::vector<int64_t> &len, int64_t factor) {
    PyObject *out = PyList_New((Py_ssize_t)bufs.size());
    for (size_t i = 0; i < bufs.size(); i++) {
        int64_t *data = bufs[i];
        bufs[i] = nullptr;
        if (!out) {
            std::free(data);
            continue;
        }
        PyObject *b = wrap(data, (Py_ssize_t)(len[i] * factor));
        if (!b) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, b);
    }
    return out;
}

/* The tuple sample_hetero() returns for a successful call; the buffer objects take over the outputs. */
PyObject *to_python(const Request &q, Result &res) {
    const size_t T = q.num_nodes.size(), R = q.relations.size();
    const Py_ssize_t H = q.num_hops;
    PyObject *n_id = buffer_list(res.n_id, res.num_nodes, 1);
    PyObject *edge_index = buffer_list(res.edge_index, res.num_edges, 2);
    PyObject *e_id = q.want_e_id ? buffer_list(res.e_id, res.num_edges, 1) : Py_NewRef(Py_None);
    PyObject *batch = q.disjoint ? buffer_list(res.batch, res.num_nodes, 1) : Py_NewRef(Py_None);
    PyObject *hop_nodes = PyList_New((Py_ssize_t)T), *hop_edges = PyList_New((Py_ssize_t)R);
    PyObject *out = nullptr;
    bool ok = n_id && edge_index && e_id && batch && hop_nodes && hop_edges;
    for (size_t t = 0; t < T && ok; t++) {
        PyObject *v = int_list(&res.hop_nodes[t * (H + 1)], H + 1);
        ok = v != nullptr;
        if (ok) PyList_SET_ITEM(hop_nodes, (Py_ssize_t)t, v);
    }
    for (size_t r = 0; r < R && ok; r++) {
        PyObject *v = int_list(H ? &res.hop_edges[r * H] : nullptr, H);
        ok = v != nullptr;
        if (ok) PyList_SET_ITEM(hop_edges, (Py_ssize_t)r, v);
    }
    if (ok) out = PyTuple_Pack(6, n_id, edge_index, e_id, hop_nodes, hop_edges, batch);
    Py_XDECREF(batch);
    Py_XDECREF(n_id);
    Py_XDECREF(edge_index);
    Py_XDECREF(e_id);
    Py_XDECREF(hop_nodes);
    Py_XDECREF(hop_edges);
    return out;
}

PyObject *py_sample_hetero(PyObject *args, PyObject *kwargs) {
    static const char *kwlist[] = {"num_nodes", "relations", "seeds",     "input_type",  "num_hops",
                                   "replace",   "rng_seed",  "return_e_id", "disjoint", "node_time",
                                   "seed_time", "time_window", "last", nullptr};
    PyObject *o_num_nodes, *o_relations, *o_seeds, *o_node_time = Py_None, *o_seed_time = Py_None;
    int input_type, num_hops, replace, want_e_id, disjoint = 0, last = 0;
    unsigned long long rng_seed;
    long long time_window = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOiipKp|$pOOLp", (char **)kwlist, &o_num_nodes, &o_relations,
                                     &o_seeds, &input_type, &num_hops, &replace, &rng_seed, &want_e_id, &disjoint,
                                     &o_node_time, &o_seed_time, &time_window, &last))
        return nullptr;
    Request q;
    if (!parse_ints(o_num_nodes, "num_nodes", 0, (int64_t)1 << kIdBits, kMaxTypes, q.num_nodes)) return nullptr;
    const int T = (int)q.num_nodes.size();
    if (T == 0) {
        PyErr_SetString(PyExc_ValueError, "num_nodes: at least one node type");
        return nullptr;
    }
    if (input_type < 0 || input_type >= T) {
        PyErr_Format(PyExc_ValueError, "input_type %d is not one of the %d node types", input_type, T);
        return nullptr;
    }
    if (num_hops < 0 || num_hops > kMaxHops) {
        PyErr_Format(PyExc_ValueError, "num_hops must lie in [0, %d], got %d", kMaxHops, num_hops);
        return nullptr;
    }
    q.input_type = input_type;
    q.num_hops = num_hops;
    q.replace = replace != 0;
    q.rng_seed = rng_seed;
    q.want_e_id = want_e_id != 0;

    Ref rels(PySequence_Fast(o_relations, "relations must be a sequence of tuples"));
    if (!rels.o) return nullptr;
    const Py_ssize_t R = PySequence_Fast_GET_SIZE(rels.o);
    if (R > kMaxRelations) {
        PyErr_Format(PyExc_ValueError, "at most %zd relations, got %zd", kMaxRelations, R);
        return nullptr;
    }
    Buffers bufs(3 * R + T + 2);  // the arrays stay borrowed until sampling is over
    q.relations.reserve((size_t)R);
    q.names.reserve((size_t)R);
    for (Py_ssize_t r = 0; r < R; r++)
        if (!parse_relation(PySequence_Fast_GET_ITEM(rels.o, r), r, bufs, q)) return nullptr;
    Py_buffer *b_seeds = bufs.get(o_seeds, "seeds", false);
    if (!b_seeds) return nullptr;
    q.seeds = (const int64_t *)b_seeds->buf;
    q.num_seeds = b_seeds->shape[0];

    /* Temporal: node times per node type (None where a type has none), seed times, window, strategy. */
    std::vector<const int64_t *> node_time((size_t)T, nullptr);
    bool any_node_time = false;
    if (o_node_time != Py_None) {
        Ref times(PySequence_Fast(o_node_time, "node_time must be a sequence (one array or None per node type)"));
        if (!times.o) return nullptr;
        if (PySequence_Fast_GET_SIZE(times.o) != T) {
            PyErr_Format(PyExc_ValueError, "node_time: %zd entries for %d node types", PySequence_Fast_GET_SIZE(times.o),
                         T);
            return nullptr;
        }
        for (int t = 0; t < T; t++) {
            PyObject *o = PySequence_Fast_GET_ITEM(times.o, t);
            if (o == Py_None) continue;
            Py_buffer *b = bufs.get(o, "node_time", false);
            if (!b) return nullptr;
            if (b->shape[0] != q.num_nodes[t]) {
                PyErr_Format(PyExc_ValueError, "node_time of node type %d holds %zd entries for %lld nodes", t,
                             b->shape[0], (long long)q.num_nodes[t]);
                return nullptr;
            }
            node_time[(size_t)t] = (const int64_t *)b->buf;
            any_node_time = true;
        }
    }
    bool temporal = any_node_time;
    for (Relation &rel : q.relations) {
        if (rel.times.edge && any_node_time) {
            PyErr_SetString(PyExc_ValueError, "give node_time or edge times, not both");
            return nullptr;
        }
        if (!rel.times.edge) rel.times.node = node_time[(size_t)rel.src];
        rel.times.window = time_window;
        rel.times.last = last != 0;
        temporal = temporal || rel.times.on();
    }
    if (o_seed_time != Py_None) {
        Py_buffer *b = bufs.get(o_seed_time, "seed_time", false);
        if (!b) return nullptr;
        if (b->shape[0] != q.num_seeds) {
            PyErr_Format(PyExc_ValueError, "seed_time holds %zd entries for %lld seeds", b->shape[0],
                         (long long)q.num_seeds);
            return nullptr;
        }
        q.seed_time = (const int64_t *)b->buf;
    } else if (temporal) {
        PyErr_SetString(PyExc_ValueError, "temporal sampling needs seed_time, the time of each seed");
        return nullptr;
    }
    q.disjoint = disjoint != 0 || temporal;
    q.offset.assign((size_t)T, 0);
    for (int t = 0; t < T; t++) {
        q.offset[(size_t)t] = q.total_nodes;
        q.total_nodes += q.num_nodes[(size_t)t];
    }
    if (q.disjoint && q.num_seeds > 0 && q.total_nodes > 0 && q.num_seeds > INT64_MAX / 2 / q.total_nodes) {
        PyErr_SetString(PyExc_ValueError, "too many seeds for one disjoint call on a graph this large");
        return nullptr;
    }

    Result res;
    Status st;
    Py_BEGIN_ALLOW_THREADS
    st = sample(q, res);
    Py_END_ALLOW_THREADS
    if (st != OK) return raise_status(st, q, res);
    return to_python(q, res);
}

}  // namespace

PyObject *looc_py_sample_hetero(PyObject *, PyObject *args, PyObject *kwargs) {
    try {
        return py_sample_hetero(args, kwargs);
    } catch (const std::bad_alloc &) {  // growing the request's vectors
        return PyErr_NoMemory();
    }
}

void looc_release_hetero_workspace() { thread_workspace()->release(); }
