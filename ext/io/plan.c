/* Batch planning: ids -> sorted distinct rows -> aligned, merged extents.
 *
 * The ids are split into chunks of chunk_rows consecutive output positions.
 * Each distinct id is read once, by the chunk of its first occurrence (its
 * owner chunk); its later occurrences in other chunks are copied from the
 * first one when their chunk completes. Extents are built per chunk, in id
 * order, so chunk 0's reads are issued (and usually finish) first.
 */
#include "looc_io.h" /* first: it defines _GNU_SOURCE */

#include <stdlib.h>
#include <string.h>


#define RADIX_BITS 11
#define RADIX_SIZE (1 << RADIX_BITS)

static void insertion_sort(looc_pair *a, int64_t n) {
    for (int64_t i = 1; i < n; i++) {
        looc_pair x = a[i];
        int64_t k = i - 1;
        while (k >= 0 && a[k].id > x.id) {
            a[k + 1] = a[k];
            k--;
        }
        a[k + 1] = x;
    }
}

/* Stable LSD radix sort by id (ids are >= 0 and <= maxkey). Returns 0 or -1 (no memory). */
static int sort_pairs(looc_pair *a, int64_t n, uint64_t maxkey) {
    if (n <= 48) {
        insertion_sort(a, n);
        return 0;
    }
    looc_pair *tmp = malloc((size_t)n * sizeof(looc_pair));
    int64_t *cnt = malloc(RADIX_SIZE * sizeof(int64_t));
    if (!tmp || !cnt) {
        free(tmp);
        free(cnt);
        return -1;
    }
    int bits = 64 - __builtin_clzll(maxkey | 1);
    looc_pair *src = a, *dst = tmp;
    for (int shift = 0; shift < bits; shift += RADIX_BITS) {
        memset(cnt, 0, RADIX_SIZE * sizeof(int64_t));
        for (int64_t i = 0; i < n; i++) cnt[((uint64_t)src[i].id >> shift) & (RADIX_SIZE - 1)]++;
        int trivial = 0;
        int64_t sum = 0;
        for (int d = 0; d < RADIX_SIZE; d++) {
            if (cnt[d] == n) trivial = 1;
            int64_t c = cnt[d];
            cnt[d] = sum;
            sum += c;
        }
        if (trivial) continue;
        for (int64_t i = 0; i < n; i++) dst[cnt[((uint64_t)src[i].id >> shift) & (RADIX_SIZE - 1)]++] = src[i];
        looc_pair *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(looc_pair));
    free(tmp);
    free(cnt);
    return 0;
}

void looc_plan_free(looc_job *j) {
    free(j->pairs);
    free(j->groups);
    free(j->order);
    free(j->ext);
    free(j->chunk_ext_begin);
    free(j->remaining);
    free(j->copies);
    free(j->copy_begin);
    j->pairs = NULL;
    j->groups = NULL;
    j->order = NULL;
    j->ext = NULL;
    j->chunk_ext_begin = NULL;
    j->remaining = NULL;
    j->copies = NULL;
    j->copy_begin = NULL;
}

static inline uint64_t round_down(uint64_t x, uint64_t a) { return x / a * a; }
static inline uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

int looc_plan(looc_job *j, uint64_t align, uint64_t merge_gap, uint64_t max_len) {
    const int64_t n = j->n, cr = j->chunk_rows, nc = j->nchunks;
    const uint64_t rb = j->row_bytes;
    int64_t *chunk_groups = NULL, *cursor = NULL;
    if (n == 0) return 0;

    j->pairs = malloc((size_t)n * sizeof(looc_pair));
    j->chunk_ext_begin = malloc((size_t)(nc + 1) * sizeof(int64_t));
    j->remaining = malloc((size_t)nc * sizeof(atomic_llong));
    j->copy_begin = calloc((size_t)nc + 1, sizeof(int64_t));
    chunk_groups = calloc((size_t)nc + 1, sizeof(int64_t));
    cursor = malloc((size_t)(nc + 1) * sizeof(int64_t));
    if (!j->pairs || !j->chunk_ext_begin || !j->remaining || !j->copy_begin || !chunk_groups || !cursor) goto nomem;

    /* 1. (id, pos) sorted by id, stable */
    int sorted = 1;
    uint64_t maxkey = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t id = j->ids[i];
        j->pairs[i].id = id;
        j->pairs[i].pos = i;
        if ((uint64_t)id > maxkey) maxkey = (uint64_t)id;
        if (i && id < j->ids[i - 1]) sorted = 0;
    }
    if (!sorted && sort_pairs(j->pairs, n, maxkey) < 0) goto nomem;

    /* 2. distinct ids, their owner chunk, duplicates per chunk */
    int64_t ng = 1;
    for (int64_t i = 1; i < n; i++) ng += j->pairs[i].id != j->pairs[i - 1].id;
    j->groups = malloc((size_t)ng * sizeof(looc_group));
    j->order = malloc((size_t)ng * sizeof(int64_t));
    j->ext = malloc((size_t)ng * sizeof(looc_extent));
    if (!j->groups || !j->order || !j->ext) goto nomem;
    int64_t g = -1, ncopies = 0;
    for (int64_t i = 0; i < n; i++) {
        const looc_pair *p = &j->pairs[i];
        int64_t c = p->pos / cr;
        if (i == 0 || p->id != j->pairs[i - 1].id) {
            g++;
            j->groups[g].id = p->id;
            j->groups[g].begin = i;
            j->groups[g].n_owner = 0;
            j->groups[g].chunk = c;
            chunk_groups[c]++;
        }
        if (c == j->groups[g].chunk) {
            j->groups[g].n_owner++;
        } else {
            j->copy_begin[c]++;
            ncopies++;
        }
    }
    j->ngroups = ng;
    j->unique_rows = ng;

    /* 3. groups ordered by (owner chunk, id): a stable counting sort by chunk */
    int64_t sum = 0;
    for (int64_t c = 0; c < nc; c++) {
        cursor[c] = sum;
        sum += chunk_groups[c];
        chunk_groups[c] = cursor[c]; /* now: first index of chunk c in order[] */
    }
    chunk_groups[nc] = ng;
    for (int64_t k = 0; k < ng; k++) j->order[cursor[j->groups[k].chunk]++] = k;

    /* 4. copies of duplicates that lie outside their owner chunk, grouped by destination chunk */
    if (ncopies) {
        j->copies = malloc((size_t)ncopies * sizeof(looc_copy));
        if (!j->copies) goto nomem;
    }
    sum = 0;
    for (int64_t c = 0; c <= nc; c++) {
        int64_t k = j->copy_begin[c];
        j->copy_begin[c] = sum;
        cursor[c] = sum;
        sum += k;
    }
    for (int64_t k = 0; k < ng; k++) {
        const looc_group *gr = &j->groups[k];
        int64_t end = (k + 1 < ng) ? j->groups[k + 1].begin : n;
        int64_t src = j->pairs[gr->begin].pos;
        for (int64_t i = gr->begin + gr->n_owner; i < end; i++) {
            int64_t dst = j->pairs[i].pos;
            looc_copy *cp = &j->copies[cursor[dst / cr]++];
            cp->dst = dst;
            cp->src = src;
        }
    }

    /* 5. extents per chunk: aligned cover of each row, merged when touching or within merge_gap */
    int64_t ne = 0;
    for (int64_t c = 0; c < nc; c++) {
        j->chunk_ext_begin[c] = ne;
        for (int64_t k = chunk_groups[c]; k < chunk_groups[c + 1]; k++) {
            uint64_t start = j->base + (uint64_t)j->groups[j->order[k]].id * rb, end = start + rb;
            uint64_t a0 = round_down(start, align), a1 = round_up(end, align);
            if (ne > j->chunk_ext_begin[c]) {
                looc_extent *e = &j->ext[ne - 1];
                uint64_t eend = e->offset + e->length;
                uint64_t nend = a1 > eend ? a1 : eend;
                if (a0 <= eend + merge_gap && nend - e->offset <= max_len) {
                    e->length = nend - e->offset;
                    e->need = end - e->offset;
                    e->last = k + 1;
                    continue;
                }
            }
            looc_extent *e = &j->ext[ne++];
            e->offset = a0;
            e->length = a1 - a0;
            e->need = end - a0;
            e->first = k;
            e->last = k + 1;
            e->chunk = c;
        }
        atomic_init(&j->remaining[c], ne - j->chunk_ext_begin[c]);
    }
    j->chunk_ext_begin[nc] = ne;
    j->n_ext = ne;
    atomic_store(&j->next_ext, 0);
    free(chunk_groups);
    free(cursor);
    return 0;

nomem:
    free(chunk_groups);
    free(cursor);
    looc_plan_free(j);
    return -1;
}

/* Copy the rows of a finished extent from its staging buffer to their output positions. */
void looc_copy_extent(looc_job *j, const looc_extent *e, const char *buf) {
    const uint64_t rb = j->row_bytes;
    for (int64_t k = e->first; k < e->last; k++) {
        const looc_group *g = &j->groups[j->order[k]];
        const char *src = buf + (j->base + (uint64_t)g->id * rb - e->offset);
        for (int64_t i = g->begin; i < g->begin + g->n_owner; i++)
            memcpy(j->out + (uint64_t)j->pairs[i].pos * rb, src, rb);
    }
}

/* Chunks complete in order: chunk c is done when its extents are, and chunks before it.
 * Its duplicate rows (copies from earlier chunks) are filled here. Caller holds j->mu. */
void looc_advance_locked(looc_job *j) {
    const uint64_t rb = j->row_bytes;
    int64_t before = j->chunks_done;
    while (j->chunks_done < j->nchunks && atomic_load(&j->remaining[j->chunks_done]) == 0) {
        int64_t c = j->chunks_done;
        for (int64_t k = j->copy_begin[c]; k < j->copy_begin[c + 1]; k++)
            memcpy(j->out + (uint64_t)j->copies[k].dst * rb, j->out + (uint64_t)j->copies[k].src * rb, rb);
        j->chunks_done++;
    }
    if (j->chunks_done != before) pthread_cond_broadcast(&j->cv);
}

void looc_extent_done(looc_job *j, const looc_extent *e) {
    if (atomic_fetch_sub(&j->remaining[e->chunk], 1) == 1) {
        pthread_mutex_lock(&j->mu);
        looc_advance_locked(j);
        pthread_mutex_unlock(&j->mu);
    }
}
