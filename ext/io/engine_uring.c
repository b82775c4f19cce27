/* The io_uring engine: one ring per worker thread.
 *
 * Set-up: a ring of queue_depth entries (single issuer + cooperative task
 * work where the kernel has them), the file registered, and one staging slot per
 * in-flight read, all slots registered as one fixed buffer. Either
 * registration may be refused (old kernel, RLIMIT_MEMLOCK): the engine then
 * uses the plain fd / plain reads and says so in its note.
 *
 * Serve: fill SQEs for every free slot in one loop, submit them and wait for
 * at least one completion in one io_uring_enter, reap completions in batches,
 * copy each finished extent's rows out, refill. When a job has issued all its
 * reads, the next queued job is planned and fills the slots its predecessor
 * frees, so the queue stays full across consecutive gathers. A read that
 * returns short is continued where the alignment allows; one that ends before
 * the rows it covers fails its job with the offset; other jobs go on.
 */
#include "looc_io.h" /* first: it defines _GNU_SOURCE */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>


#ifdef LOOC_HAVE_LIBURING
#include <liburing.h>

#ifndef IORING_SETUP_SINGLE_ISSUER
#define IORING_SETUP_SINGLE_ISSUER (1U << 12)
#endif
#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif

#define MAX_RETRIES 16

typedef struct {
    looc_job *job;
    int64_t ext;
    uint64_t done;
    int retries;
} slot_state;

typedef struct {
    struct io_uring ring;
    int reg_files;
    int reg_bufs;
    char *staging;
    size_t staging_bytes;
    int nslots;
    slot_state *slots;
    int *free_slots;
    int nfree;
    unsigned inflight;
    int broken; /* the ring failed in a way that may leave reads in flight */
    struct io_uring_cqe **cqes;
} uring_ctx;

/* Also used by bulk.c, whose rings live for one transfer. */
int looc_ring_init(struct io_uring *ring, unsigned entries, unsigned *flags_out) {
    /* Single issuer + cooperative task work measured best on a busy 2-core VM (deferred task work
     * was ~8% slower at queue depth 32); each flag is dropped where the kernel does not know it. */
    static const unsigned tries[] = {
        IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN,
        IORING_SETUP_COOP_TASKRUN,
        0,
    };
    int rc = -EINVAL;
    for (size_t i = 0; i < sizeof tries / sizeof tries[0]; i++) {
        struct io_uring_params p;
        memset(&p, 0, sizeof p);
        p.flags = tries[i];
        rc = io_uring_queue_init_params(entries, ring, &p);
        if (rc == 0) {
            *flags_out = tries[i];
            return 0;
        }
        if (rc != -EINVAL) return rc; /* ENOMEM, EPERM (io_uring_disabled), ENOSYS, ...: flags do not matter */
    }
    return rc;
}

int looc_uring_probe(char *msg, size_t msglen) {
    struct io_uring ring;
    unsigned flags = 0;
    int rc = looc_ring_init(&ring, 4, &flags);
    if (rc < 0) {
        snprintf(msg, msglen, "io_uring_setup failed: %s%s", strerror(-rc),
                 rc == -EPERM ? " (disabled by kernel.io_uring_disabled or a sandbox)" : "");
        return rc;
    }
    io_uring_queue_exit(&ring);
    snprintf(msg, msglen, "io_uring available");
    return 0;
}

static void ctx_free(uring_ctx *c, int ring_up) {
    if (ring_up) io_uring_queue_exit(&c->ring); /* also drops the registrations */
    if (c->staging) munmap(c->staging, c->staging_bytes);
    free(c->slots);
    free(c->free_slots);
    free(c->cqes);
    free(c);
}

int looc_uring_init(looc_worker *w, char *msg) {
    looc_reader *r = w->r;
    uring_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(msg, LOOC_MSG, "out of memory");
        return -ENOMEM;
    }
    c->nslots = r->queue_depth;
    c->slots = calloc((size_t)c->nslots, sizeof(slot_state));
    c->free_slots = malloc((size_t)c->nslots * sizeof(int));
    c->cqes = malloc((size_t)c->nslots * sizeof(struct io_uring_cqe *));
    c->staging_bytes = (size_t)c->nslots * r->slot_size;
    c->staging = mmap(NULL, c->staging_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (c->staging == MAP_FAILED) c->staging = NULL;
    if (!c->slots || !c->free_slots || !c->cqes || !c->staging) {
        snprintf(msg, LOOC_MSG, "cannot allocate %zu bytes of staging memory", c->staging_bytes);
        ctx_free(c, 0);
        return -ENOMEM;
    }
    for (int i = 0; i < c->nslots; i++) c->free_slots[i] = c->nslots - 1 - i;
    c->nfree = c->nslots;

    unsigned flags = 0;
    int rc = looc_ring_init(&c->ring, (unsigned)r->queue_depth, &flags);
    if (rc < 0) {
        snprintf(msg, LOOC_MSG, "io_uring_setup failed: %s%s", strerror(-rc),
                 rc == -EPERM ? " (disabled by kernel.io_uring_disabled or a sandbox)" : "");
        ctx_free(c, 0);
        return rc;
    }
    int frc = io_uring_register_files(&c->ring, &r->fd, 1);
    c->reg_files = frc == 0;
    struct iovec iov = {.iov_base = c->staging, .iov_len = c->staging_bytes};
    int brc = io_uring_register_buffers(&c->ring, &iov, 1);
    c->reg_bufs = brc == 0;
    snprintf(msg, LOOC_MSG, "ring flags 0x%x; file %s; staging %zu bytes %s", flags,
             c->reg_files ? "registered" : "not registered", c->staging_bytes,
             c->reg_bufs ? "registered" : "not registered");
    if (!c->reg_bufs) {
        size_t len = strlen(msg);
        snprintf(msg + len, LOOC_MSG - len, " (%s)", strerror(-brc));
    }
    if (w->index == 0) {
        r->reg_files = c->reg_files;
        r->reg_bufs = c->reg_bufs;
        r->ring_flags = flags;
    }
    w->ctx = c;
    return 0;
}

void looc_uring_fini(looc_worker *w) {
    uring_ctx *c = w->ctx;
    if (!c) return;
    ctx_free(c, 1);
    w->ctx = NULL;
}

static void prep_read(uring_ctx *c, const looc_reader *r, struct io_uring_sqe *sqe, int s) {
    const slot_state *sl = &c->slots[s];
    const looc_extent *e = &sl->job->ext[sl->ext];
    char *buf = c->staging + (size_t)s * r->slot_size + sl->done;
    unsigned len = (unsigned)(e->length - sl->done);
    uint64_t off = e->offset + sl->done;
    int fd = c->reg_files ? 0 : r->fd;
    if (c->reg_bufs)
        io_uring_prep_read_fixed(sqe, fd, buf, len, off, 0);
    else
        io_uring_prep_read(sqe, fd, buf, len, off);
    if (c->reg_files) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, (uint64_t)s);
}

/* The jobs this worker has reads in flight for, oldest first. */
typedef struct {
    looc_job *head, *tail;
    looc_job *filling; /* the job whose reads are being issued, or NULL */
} job_list;

static void list_append(job_list *l, looc_job *j) {
    j->anext = NULL;
    if (l->tail)
        l->tail->anext = j;
    else
        l->head = j;
    l->tail = j;
}

static void list_remove(job_list *l, looc_job *j) {
    looc_job **pp = &l->head, *prev = NULL;
    while (*pp && *pp != j) {
        prev = *pp;
        pp = &(*pp)->anext;
    }
    if (!*pp) return;
    *pp = j->anext;
    if (l->tail == j) l->tail = prev;
}

/* A job ends when it has nothing left to issue and nothing in flight. */
static void maybe_end(job_list *l, looc_job *j) {
    if (j->inflight == 0 && j != l->filling) {
        list_remove(l, j);
        looc_job_end(j);
    }
}

static void release_slot(uring_ctx *c, job_list *l, int s) {
    looc_job *j = c->slots[s].job;
    c->slots[s].job = NULL;
    c->free_slots[c->nfree++] = s;
    c->inflight--;
    j->inflight--;
    maybe_end(l, j);
}

/* Queue the rest of slot s's extent again; SQ space is guaranteed (sq entries >= slots). */
static void resubmit(uring_ctx *c, const looc_reader *r, job_list *l, int s) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(&c->ring);
    if (!sqe) { /* cannot happen with sq entries >= slots; fail rather than hang */
        looc_job *j = c->slots[s].job;
        looc_job_fail(j, LOOC_ERR_RING, EBUSY, j->ext[c->slots[s].ext].offset, 0, 0,
                      "io_uring submission queue unexpectedly full");
        release_slot(c, l, s);
        return;
    }
    atomic_fetch_add(&c->slots[s].job->num_ios, 1);
    prep_read(c, r, sqe, s);
}

static void handle_cqe(uring_ctx *c, const looc_reader *r, job_list *l, struct io_uring_cqe *cqe) {
    int s = (int)io_uring_cqe_get_data64(cqe);
    slot_state *sl = &c->slots[s];
    looc_job *j = sl->job;
    const looc_extent *e = &j->ext[sl->ext];
    int res = cqe->res;
    if (res < 0) {
        if ((res == -EAGAIN || res == -EINTR) && sl->retries++ < MAX_RETRIES && !atomic_load(&j->stop)) {
            resubmit(c, r, l, s);
            return;
        }
        looc_fail_io(j, -res, e->offset + sl->done, e->length - sl->done);
        release_slot(c, l, s);
        return;
    }
    atomic_fetch_add(&j->bytes_read, (unsigned long long)res);
    sl->done += (uint64_t)res;
    if (sl->done >= e->need) {
        looc_copy_extent(j, e, c->staging + (size_t)s * r->slot_size);
        looc_extent_done(j, e);
        release_slot(c, l, s);
        return;
    }
    /* short: end of file, or a partial read the kernel may complete if asked again */
    if (res == 0 || (sl->done % r->align) != 0 || atomic_load(&j->stop)) {
        looc_fail_short(j, e, sl->done);
        release_slot(c, l, s);
        return;
    }
    sl->retries = 0;
    resubmit(c, r, l, s);
}

/* Issue reads of the filling job into free slots; take the next job when it has issued everything. */
static int fill(uring_ctx *c, looc_reader *r, job_list *l) {
    for (;;) {
        if (!l->filling) {
            if (!c->nfree) return 0;
            int idle = c->inflight == 0 && !l->head;
            looc_job *j = looc_reader_pop(r, idle);
            if (!j) return idle ? -1 : 0; /* -1: closing and nothing left */
            if (c->broken) {
                looc_job_fail(j, LOOC_ERR_RING, EIO, 0, 0, 0,
                              "this reader's io_uring failed earlier; close the reader and open a new one");
                looc_job_end(j);
                continue;
            }
            if (!looc_job_begin(r, j)) {
                looc_job_end(j);
                continue;
            }
            list_append(l, j);
            l->filling = j;
        }
        looc_job *j = l->filling;
        unsigned queued = 0;
        while (c->nfree > 0 && j->issued < j->n_ext && !atomic_load(&j->stop)) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&c->ring);
            if (!sqe) break;
            int s = c->free_slots[--c->nfree];
            c->slots[s].job = j;
            c->slots[s].ext = j->issued++;
            c->slots[s].done = 0;
            c->slots[s].retries = 0;
            prep_read(c, r, sqe, s);
            c->inflight++;
            j->inflight++;
            queued++;
        }
        atomic_fetch_add(&j->num_ios, queued);
        if (j->issued < j->n_ext && !atomic_load(&j->stop)) return 0; /* slots full */
        l->filling = NULL;
        maybe_end(l, j);
    }
}

/* io_uring_enter itself failed: fail every job in flight, drain the ring if it still answers. */
static void ring_failed(uring_ctx *c, const looc_reader *r, job_list *l, int err) {
    for (looc_job *j = l->head; j; j = j->anext)
        looc_job_fail(j, LOOC_ERR_RING, err, 0, 0, 0, "io_uring_enter failed: %s", strerror(err));
    l->filling = NULL;
    while (c->inflight > 0) {
        struct io_uring_cqe *cqe;
        if (io_uring_wait_cqe(&c->ring, &cqe) < 0) {
            c->broken = 1;
            break;
        }
        handle_cqe(c, r, l, cqe);
        io_uring_cqe_seen(&c->ring, cqe);
    }
    if (c->broken) {
        /* reads may still land in staging (ours, never the caller's memory); nothing reads it again */
        for (int i = 0; i < c->nslots; i++) {
            c->slots[i].job = NULL;
            c->free_slots[i] = i;
        }
        c->nfree = c->nslots;
        c->inflight = 0;
        while (l->head) {
            looc_job *j = l->head;
            l->head = j->anext;
            looc_job_end(j);
        }
        l->tail = NULL;
        return;
    }
    for (looc_job *j = l->head, *next; j; j = next) {
        next = j->anext;
        maybe_end(l, j);
    }
}

void looc_uring_serve(looc_worker *w) {
    uring_ctx *c = w->ctx;
    looc_reader *r = w->r;
    job_list l = {NULL, NULL, NULL};
    for (;;) {
        if (fill(c, r, &l) < 0) break;
        if (c->inflight == 0) continue;
        /* submit everything queued and wait for at least one completion: one syscall */
        int rc = io_uring_submit_and_wait(&c->ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            ring_failed(c, r, &l, -rc);
            continue;
        }
        /* reap in batches */
        unsigned got;
        while ((got = io_uring_peek_batch_cqe(&c->ring, c->cqes, (unsigned)c->nslots)) > 0) {
            for (unsigned i = 0; i < got; i++) handle_cqe(c, r, &l, c->cqes[i]);
            io_uring_cq_advance(&c->ring, got);
        }
    }
}

#else /* built without liburing */

int looc_uring_probe(char *msg, size_t msglen) {
    snprintf(msg, msglen, "built without liburing (install liburing-dev and rebuild)");
    return -ENOSYS;
}
int looc_uring_init(looc_worker *w, char *msg) {
    (void)w;
    snprintf(msg, LOOC_MSG, "built without liburing (install liburing-dev and rebuild)");
    return -ENOSYS;
}
void looc_uring_serve(looc_worker *w) { (void)w; }
void looc_uring_fini(looc_worker *w) { (void)w; }

#endif
