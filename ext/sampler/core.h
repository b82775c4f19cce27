/* The pieces both native neighbour samplers share (sampler.cpp: one node and
 * edge type; hetero.cpp: several): a growable int64 array, the node id ->
 * local id map, the choice of a target's in-edges (the same random draws in
 * both), and the status codes of a sampling call. Each sampler keeps its own
 * per-thread workspace built from these.
 *
 * Nothing here is shared between calls or threads; whoever owns an object
 * uses it from one thread at a time.
 */
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <sys/mman.h>

#include "rng.h"

namespace looc {

constexpr int64_t kPrefetch = 64;      // look-ahead of the gather passes
constexpr int64_t kSmallFanout = 32;   // Floyd's algorithm with a linear membership scan up to here
constexpr int64_t kMaxFanout = ((int64_t)1 << 31) - 1;  // a larger count would overflow the arrays' sizes

/* ---------------------------------------------------------------- growable int64 array */

struct Vec {
    int64_t *p = nullptr;
    int64_t n = 0, cap = 0;
    Vec() = default;
    Vec(const Vec &) = delete;
    Vec &operator=(const Vec &) = delete;
    Vec(Vec &&o) noexcept : p(o.p), n(o.n), cap(o.cap) {
        o.p = nullptr;
        o.n = o.cap = 0;
    }
    ~Vec() { std::free(p); }
    bool reserve(int64_t want) {
        if (want <= cap) return true;
        if (want > ((int64_t)1 << 58)) return false;  // its byte size would overflow: out of memory
        int64_t c = cap ? cap : 1024;
        while (c < want) c *= 2;
        void *q = std::realloc(p, (size_t)c * sizeof(int64_t));
        if (!q) return false;
        p = (int64_t *)q;
        cap = c;
        return true;
    }
    inline bool push(int64_t v) {
        if (n == cap && !reserve(n + 1)) return false;
        p[n++] = v;
        return true;
    }
    void free_memory() {
        std::free(p);
        p = nullptr;
        n = cap = 0;
    }
};

/* ---------------------------------------------------------------- node id -> local id */

/* Open addressing with linear probing, at most half full. A slot belongs to
 * the current call when its tag holds the table's current epoch, so a table
 * kept from call to call needs no clearing (it is wiped once every 65535
 * calls, when the 16-bit epoch wraps). */
struct NodeMap {
    struct Slot {
        int64_t key;
        uint64_t tag;  // epoch << 48 | local id
    };
    static constexpr int kValueBits = 48;
    static constexpr uint64_t kValueMask = ((uint64_t)1 << kValueBits) - 1;
    Slot *slots = nullptr;
    uint64_t mask = 0;
    int shift = 64;
    uint64_t epoch = 0;  // in [1, 65535] once begin() ran

    NodeMap() = default;
    NodeMap(const NodeMap &) = delete;
    NodeMap &operator=(const NodeMap &) = delete;
    ~NodeMap() { std::free(slots); }

    static inline uint64_t hash(int64_t key) { return (uint64_t)key * 0x9E3779B97F4A7C15ull; }
    inline uint64_t home(int64_t key) const { return hash(key) >> shift; }
    size_t bytes() const { return slots ? (mask + 1) * sizeof(Slot) : 0; }

    static Slot *alloc_slots(uint64_t cap) {
        const size_t bytes = cap * sizeof(Slot);
        void *p = nullptr;
        if (bytes >= ((size_t)4 << 20)) {  // large: 2 MiB aligned, ask for huge pages (fewer TLB misses)
            if (posix_memalign(&p, (size_t)2 << 20, bytes) != 0) return nullptr;
#ifdef MADV_HUGEPAGE
            madvise(p, bytes, MADV_HUGEPAGE);
#endif
        } else if (!(p = std::malloc(bytes))) {
            return nullptr;
        }
        std::memset(p, 0, bytes);
        return (Slot *)p;
    }
    /* Start a new call: a fresh epoch. */
    void begin() {
        if (++epoch > 0xFFFF) {
            if (slots) std::memset(slots, 0, bytes());
            epoch = 1;
        }
    }
    /* Room for `entries` keys of this call, at most half full; never more than 2 x max_keys slots. */
    bool ensure(int64_t entries, int64_t max_keys) {
        const uint64_t need = 2 * (uint64_t)(entries < max_keys ? entries : max_keys);
        if (slots && need <= mask + 1) return true;
        int bits = 4;
        while (((uint64_t)1 << bits) < need) bits++;
        Slot *fresh = alloc_slots((uint64_t)1 << bits);
        if (!fresh) return false;
        Slot *old = slots;
        const uint64_t old_cap = slots ? mask + 1 : 0, cur = epoch << kValueBits;
        slots = fresh;
        mask = ((uint64_t)1 << bits) - 1;
        shift = 64 - bits;
        for (uint64_t i = 0; i < old_cap; i++) {
            if ((old[i].tag & ~kValueMask) != cur) continue;
            uint64_t j = home(old[i].key);
            while ((slots[j].tag & ~kValueMask) == cur) j = (j + 1) & mask;
            slots[j] = old[i];
        }
        std::free(old);
        return true;
    }
    void release() {
        std::free(slots);
        slots = nullptr;
        mask = 0;
        shift = 64;
        epoch = 0;
    }
    inline void prefetch(int64_t key) const { __builtin_prefetch(&slots[home(key)], 1, 1); }
    /* Local id of `key`, inserting it with `fresh` if absent (then *inserted = true). */
    inline int64_t get_or_insert(int64_t key, int64_t fresh, bool *inserted) {
        const uint64_t cur = epoch << kValueBits;
        uint64_t j = home(key);
        for (;;) {
            Slot &s = slots[j];
            if ((s.tag & ~kValueMask) != cur) {
                s.key = key;
                s.tag = cur | (uint64_t)fresh;
                *inserted = true;
                return fresh;
            }
            if (s.key == key) {
                *inserted = false;
                return (int64_t)(s.tag & kValueMask);
            }
            j = (j + 1) & mask;
        }
    }
};

/* ---------------------------------------------------------------- status of a sampling call */

enum Status { OK = 0, NO_MEMORY, BAD_SEED, BAD_INDPTR, BAD_INDEX, BAD_TIME_ORDER };

/* A workspace is kept by its thread for the next call up to this size (then freed). */
constexpr size_t kKeepBytes = (size_t)512 << 20;

/* A malloc'd copy of n int64s (at least one slot, so an empty output is not nullptr); nullptr if out of memory. */
inline int64_t *copy_out(const int64_t *src, int64_t n) {
    int64_t *p = (int64_t *)std::malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (p && n > 0) std::memcpy(p, src, (size_t)n * sizeof(int64_t));
    return p;
}

/* ---------------------------------------------------------------- choosing in-edges */

/* Choose the edge positions of one target: its in-edges are [start, start + deg). */
inline bool choose(Rng &rng, Vec &pos, int64_t start, int64_t deg, int64_t k, bool replace, Vec &scratch) {
    if (deg <= 0 || k == 0) return true;
    if (k < 0 || (!replace && k >= deg)) {  // all neighbours
        if (!pos.reserve(pos.n + deg)) return false;
        int64_t *out = pos.p + pos.n;
        for (int64_t j = 0; j < deg; j++) out[j] = start + j;
        pos.n += deg;
        return true;
    }
    if (!pos.reserve(pos.n + k)) return false;
    int64_t *out = pos.p + pos.n;
    if (replace) {
        for (int64_t j = 0; j < k; j++) out[j] = start + (int64_t)rng.below((uint64_t)deg);
    } else if (k <= kSmallFanout) {
        /* Floyd's algorithm: a uniform k-subset of [0, deg) in k draws. */
        int64_t c = 0;
        for (int64_t j = deg - k; j < deg; j++) {
            int64_t t = start + (int64_t)rng.below((uint64_t)j + 1);
            for (int64_t i = 0; i < c; i++) {
                if (out[i] == t) {
                    t = start + j;
                    break;
                }
            }
            out[c++] = t;
        }
    } else if (deg <= 4 * k) {
        /* Selection sampling (Knuth's algorithm S): one pass, at most 4 draws per pick. */
        int64_t c = 0;
        for (int64_t j = 0; j < deg && c < k; j++) {
            if ((int64_t)rng.below((uint64_t)(deg - j)) < k - c) out[c++] = start + j;
        }
    } else {
        /* Floyd's algorithm with a small hash set for membership. */
        int bits = 4;
        while (((int64_t)1 << bits) < 2 * k) bits++;
        const int64_t cap = (int64_t)1 << bits;
        if (!scratch.reserve(cap)) return false;
        int64_t *set = scratch.p;
        std::memset(set, 0xff, (size_t)cap * sizeof(int64_t));
        const uint64_t m = (uint64_t)cap - 1;
        int64_t c = 0;
        for (int64_t j = deg - k; j < deg; j++) {
            int64_t t = (int64_t)rng.below((uint64_t)j + 1);
            uint64_t h = NodeMap::hash(t) >> (64 - bits);
            bool present = false;
            while (set[h] >= 0) {
                if (set[h] == t) {
                    present = true;
                    break;
                }
                h = (h + 1) & m;
            }
            if (present) {  // take j instead; j was never drawn before (draws so far were < j)
                t = j;
                h = NodeMap::hash(t) >> (64 - bits);
                while (set[h] >= 0) h = (h + 1) & m;
            }
            set[h] = t;
            out[c++] = start + t;
        }
    }
    pos.n += k;
    return true;
}

/* ---------------------------------------------------------------- temporal sampling */

/* What temporal sampling needs of a relation, PyG's semantics: an in-edge of a target may be sampled only if
 * its time is at most its seed's time (and, with a window, at least the seed's time minus the window). The
 * time of an edge is its own (edge-level time, by CSC position) or its source node's (node-level time). Each
 * target's in-edges are stored in time order (ties in any order), so the eligible ones are one range, found
 * by two binary searches; "last" keeps the latest `k` of that range, "uniform" samples it uniformly. */
struct Times {
    const int64_t *node = nullptr;  // time of each source node, or
    const int64_t *edge = nullptr;  // time of each edge, by CSC position
    int64_t window = -1;            // < 0: no window
    bool last = false;              // "last" rather than "uniform"
    bool on() const { return node != nullptr || edge != nullptr; }
};

/* The earliest time a window of `window` before `t` admits (no overflow; < 0 window: none). */
inline int64_t window_start(int64_t t, int64_t window) {
    int64_t lo;
    if (window < 0 || __builtin_sub_overflow(t, window, &lo)) return INT64_MIN;
    return lo;
}

/* Narrow the in-edges [lo, hi) of a target to those its seed (of time t) may see, then to the last k of them
 * for "last" (k >= 0). BAD_INDEX (node time of a source id outside [0, num_src); *bad_at its position) and
 * BAD_TIME_ORDER (the range is not in time order; *bad_at its first edge) are errors. */
template <typename Index>
inline Status temporal_range(const Times &tm, const Index *indices, int64_t num_src, int64_t t, int64_t k,
                             int64_t &lo, int64_t &hi, int64_t *bad_at) {
    Status st = OK;
    auto time_at = [&](int64_t j) -> int64_t {
        if (tm.edge) return tm.edge[j];
        const int64_t u = (int64_t)indices[j];
        if (u < 0 || u >= num_src) {
            if (st == OK) *bad_at = j;
            st = BAD_INDEX;
            return 0;
        }
        return tm.node[u];
    };
    if (hi - lo > 1 && time_at(lo) > time_at(hi - 1)) {
        if (st != OK) return st;
        *bad_at = lo;
        return BAD_TIME_ORDER;
    }
    /* upper bound: the first edge later than t */
    int64_t a = lo, b = hi;
    while (a < b) {
        const int64_t m = a + (b - a) / 2;
        if (time_at(m) <= t) a = m + 1;
        else b = m;
    }
    hi = a;
    const int64_t from = window_start(t, tm.window);
    if (from != INT64_MIN) {  /* lower bound: the first edge at or after t - window */
        a = lo, b = hi;
        while (a < b) {
            const int64_t m = a + (b - a) / 2;
            if (time_at(m) < from) a = m + 1;
            else b = m;
        }
        lo = a;
    }
    if (tm.last && k >= 0 && hi - lo > k) lo = hi - k;
    return st;
}

}  // namespace looc
