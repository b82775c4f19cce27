/* Bulk transfers: one contiguous file range read into, or written from, the
 * caller's memory. There is no staging copy (the point is to move hundreds of
 * MB at device speed), so with O_DIRECT the caller's offset, length and
 * address must meet the file's alignment; module.c checks them first.
 *
 * io_uring: a ring of queue_depth entries made for the call and torn down at
 * its end (a transfer moves hundreds of MB, so set-up and tear-down are noise,
 * and a ring per call needs no locking between callers). Fill an SQE for
 * every free slot in one loop, submit them and wait for one completion in one
 * io_uring_enter, reap completions in batches, refill. Neither the file nor
 * the memory is registered: at 1 MiB requests the per-request fd lookup and
 * page pinning are small next to the transfer, and registering hundreds of
 * MB of buffers would run into RLIMIT_MEMLOCK.
 *
 * threads: up to queue_depth threads (at most LOOC_BULK_MAX_THREADS), the
 * caller's among them, take chunks in order from a shared counter and loop
 * pread / pwrite over each.
 *
 * Both: -EAGAIN / -EINTR are retried a few times; a partial transfer goes on
 * from where it stopped, except with O_DIRECT from an unaligned position (a
 * read that stops there has met the end of the file); a read that returns 0
 * before the end of its request means the file is shorter than the range
 * ("short"), and a write that returns 0 made no progress and fails the same
 * way. After the first failure nothing new is issued, and what is in flight
 * is waited for before returning: it targets the caller's memory.
 */
#include "looc_io.h" /* first: it defines _GNU_SOURCE */

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


#define MAX_RETRIES 16
#define HELPER_STACK (256 * 1024)

/* One request: bytes [off, off + len) of the transfer, done of them moved. */
typedef struct {
    uint64_t off;
    uint64_t len;
    uint64_t done;
    int retries;
} request;

static void bulk_fail(looc_bulk_error *e, pthread_mutex_t *mu, int kind, int err, uint64_t offset, uint64_t length,
                      uint64_t got, const char *fmt, ...) __attribute__((format(printf, 8, 9)));

/* Record the first failure (mu: held while recording when several threads may fail at once). */
static void bulk_fail(looc_bulk_error *e, pthread_mutex_t *mu, int kind, int err, uint64_t offset, uint64_t length,
                      uint64_t got, const char *fmt, ...) {
    if (mu) pthread_mutex_lock(mu);
    if (e->kind == LOOC_ERR_NONE) {
        e->kind = kind;
        e->err = err;
        e->offset = offset;
        e->length = length;
        e->got = got;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
    }
    if (mu) pthread_mutex_unlock(mu);
}

static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

/* Account for one completion of rq (res: bytes moved, or -errno).
 * Returns 0 when the request is complete, 1 when its remainder must be issued again,
 * -1 when it failed (recorded in e). */
static int advance(const looc_bulk *b, request *rq, int64_t res, looc_bulk_error *e, pthread_mutex_t *mu) {
    const char *verb = b->write ? "write" : "read";
    if (res < 0) {
        int err = (int)-res;
        if ((err == EAGAIN || err == EINTR) && rq->retries++ < MAX_RETRIES) return 1;
        uint64_t at = b->offset + rq->off + rq->done;
        bulk_fail(e, mu, LOOC_ERR_IO, err, at, rq->len - rq->done, rq->done,
                  "%s of %llu bytes at offset %llu failed: %s", verb, (unsigned long long)(rq->len - rq->done),
                  (unsigned long long)at, strerror(err));
        return -1;
    }
    rq->done += (uint64_t)res;
    if (rq->done >= rq->len) return 0;
    uint64_t at = b->offset + rq->off + rq->done;
    if (res == 0 || (b->direct && at % b->align)) {
        if (!b->write)
            bulk_fail(e, mu, LOOC_ERR_SHORT, EIO, at, rq->len - rq->done, rq->done,
                      "short read: reading %llu bytes at offset %llu stopped after %llu bytes: the file ends at or "
                      "before offset %llu, inside the range [%llu, %llu) asked for (shorter than expected)",
                      (unsigned long long)rq->len, (unsigned long long)(b->offset + rq->off),
                      (unsigned long long)rq->done, (unsigned long long)at, (unsigned long long)b->offset,
                      (unsigned long long)(b->offset + b->nbytes));
        else
            bulk_fail(e, mu, LOOC_ERR_SHORT, EIO, at, rq->len - rq->done, rq->done,
                      "short write: writing %llu bytes at offset %llu stopped after %llu bytes (%s)",
                      (unsigned long long)rq->len, (unsigned long long)(b->offset + rq->off),
                      (unsigned long long)rq->done,
                      res == 0 ? "the kernel accepted nothing more" : "O_DIRECT cannot go on from an unaligned offset");
        return -1;
    }
    rq->retries = 0;
    return 1;
}

/* ------------------------------------------------------------------ io_uring */

#ifdef LOOC_HAVE_LIBURING
#include <liburing.h>

static void prep(const looc_bulk *b, struct io_uring_sqe *sqe, const request *rq, int s) {
    char *mem = b->addr + rq->off + rq->done;
    unsigned len = (unsigned)(rq->len - rq->done);
    uint64_t off = b->offset + rq->off + rq->done;
    if (b->write)
        io_uring_prep_write(sqe, b->fd, mem, len, off);
    else
        io_uring_prep_read(sqe, b->fd, mem, len, off);
    io_uring_sqe_set_data64(sqe, (uint64_t)s);
}

int looc_bulk_uring(const looc_bulk *b, looc_bulk_error *e) {
    memset(e, 0, sizeof *e);
    if (b->nbytes == 0) return 0;
    uint64_t nreq = (b->nbytes + b->chunk - 1) / b->chunk;
    int nslots = (uint64_t)b->queue_depth < nreq ? b->queue_depth : (int)nreq;
    request *rq = calloc((size_t)nslots, sizeof *rq);
    int *free_slots = malloc((size_t)nslots * sizeof(int));
    struct io_uring_cqe **cqes = malloc((size_t)nslots * sizeof(struct io_uring_cqe *));
    if (!rq || !free_slots || !cqes) {
        e->setup = 1;
        bulk_fail(e, NULL, LOOC_ERR_NOMEM, ENOMEM, b->offset, b->nbytes, 0, "out of memory for %d requests", nslots);
        goto out;
    }
    struct io_uring ring;
    unsigned flags = 0;
    int rc = looc_ring_init(&ring, (unsigned)nslots, &flags);
    if (rc < 0) {
        e->setup = 1;
        bulk_fail(e, NULL, LOOC_ERR_RING, -rc, b->offset, b->nbytes, 0, "io_uring_setup failed: %s%s", strerror(-rc),
                  rc == -EPERM ? " (disabled by kernel.io_uring_disabled or a sandbox)" : "");
        goto out;
    }
    for (int i = 0; i < nslots; i++) free_slots[i] = nslots - 1 - i;
    int nfree = nslots, failed = 0, enter_failures = 0;
    unsigned inflight = 0; /* requests in the ring, submitted or queued for the next submit */
    uint64_t next = 0;     /* first byte of the transfer not yet given to a request */
    for (;;) {
        while (!failed && nfree > 0 && next < b->nbytes) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
            if (!sqe) break;
            int s = free_slots[--nfree];
            rq[s] = (request){.off = next, .len = min_u64(b->chunk, b->nbytes - next)};
            next += rq[s].len;
            prep(b, sqe, &rq[s], s);
            inflight++;
        }
        if (inflight == 0) break;
        /* submit everything queued and wait for at least one completion: one syscall */
        rc = io_uring_submit_and_wait(&ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            /* issue nothing new; keep entering to collect what is in flight (it targets the caller's memory) */
            bulk_fail(e, NULL, LOOC_ERR_RING, -rc, b->offset + next, b->nbytes - next, 0, "io_uring_enter failed: %s",
                      strerror(-rc));
            failed = 1;
            if (++enter_failures > MAX_RETRIES) {
                /* The requests in flight target the caller's memory: collect them before returning (waiting up
                 * to a second at a time), so that nothing lands there after this call. */
                unsigned waits = 0;
                while (inflight > 0 && waits < 60) {
                    struct io_uring_cqe *cqe = NULL;
                    struct __kernel_timespec ts = {.tv_sec = 1, .tv_nsec = 0};
                    int w = io_uring_wait_cqe_timeout(&ring, &cqe, &ts);
                    if (w == 0 && cqe) {
                        io_uring_cqe_seen(&ring, cqe);
                        inflight--;
                    } else {
                        waits++;
                    }
                }
                size_t len = strlen(e->msg);
                snprintf(e->msg + len, sizeof e->msg - len, "; the ring stopped taking requests%s",
                         inflight ? " and requests were still in flight after 60 s" : "");
                break;
            }
        }
        unsigned got;
        while ((got = io_uring_peek_batch_cqe(&ring, cqes, (unsigned)nslots)) > 0) {
            for (unsigned i = 0; i < got; i++) {
                int s = (int)io_uring_cqe_get_data64(cqes[i]);
                int r = advance(b, &rq[s], cqes[i]->res, e, NULL);
                if (r == 1 && !failed) {
                    /* SQ space is guaranteed: at most nslots requests exist and the ring has nslots entries */
                    struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
                    if (sqe) {
                        prep(b, sqe, &rq[s], s);
                        continue;
                    }
                    bulk_fail(e, NULL, LOOC_ERR_RING, EBUSY, b->offset + rq[s].off + rq[s].done,
                              rq[s].len - rq[s].done, rq[s].done, "io_uring submission queue unexpectedly full");
                }
                if (r != 0) failed = 1;
                free_slots[nfree++] = s;
                inflight--;
            }
            io_uring_cq_advance(&ring, got);
        }
    }
    io_uring_queue_exit(&ring);
out:
    free(rq);
    free(free_slots);
    free(cqes);
    return e->kind == LOOC_ERR_NONE ? 0 : -1;
}

#else /* built without liburing */

int looc_bulk_uring(const looc_bulk *b, looc_bulk_error *e) {
    memset(e, 0, sizeof *e);
    e->setup = 1;
    bulk_fail(e, NULL, LOOC_ERR_RING, ENOSYS, b->offset, b->nbytes, 0,
              "lightning_ooc._io was built without liburing (install liburing-dev and rebuild), so the io_uring "
              "engine is unavailable; use engine='threads'");
    return -1;
}

#endif

/* ------------------------------------------------------------------ threads */

typedef struct {
    const looc_bulk *b;
    looc_bulk_error *e;
    pthread_mutex_t mu;
    uint64_t nreq;
    atomic_ullong next; /* next chunk to take */
    atomic_int stop;    /* set on the first failure */
} pool;

static void *run_chunks(void *arg) {
    pool *p = arg;
    const looc_bulk *b = p->b;
    while (!atomic_load(&p->stop)) {
        uint64_t k = atomic_fetch_add(&p->next, 1);
        if (k >= p->nreq) break;
        request rq = {.off = k * b->chunk};
        rq.len = min_u64(b->chunk, b->nbytes - rq.off);
        for (;;) {
            char *mem = b->addr + rq.off + rq.done;
            size_t len = (size_t)(rq.len - rq.done);
            off_t at = (off_t)(b->offset + rq.off + rq.done);
            ssize_t got = b->write ? pwrite(b->fd, mem, len, at) : pread(b->fd, mem, len, at);
            int r = advance(b, &rq, got < 0 ? -(int64_t)errno : (int64_t)got, p->e, &p->mu);
            if (r == 0) break;
            if (r < 0) {
                atomic_store(&p->stop, 1);
                return NULL;
            }
            if (atomic_load(&p->stop)) return NULL;
        }
    }
    return NULL;
}

int looc_bulk_threads(const looc_bulk *b, looc_bulk_error *e) {
    memset(e, 0, sizeof *e);
    if (b->nbytes == 0) return 0;
    pool p = {.b = b, .e = e, .nreq = (b->nbytes + b->chunk - 1) / b->chunk};
    pthread_mutex_init(&p.mu, NULL);
    atomic_init(&p.next, 0);
    atomic_init(&p.stop, 0);
    uint64_t want = min_u64(min_u64((uint64_t)b->queue_depth, LOOC_BULK_MAX_THREADS), p.nreq);
    pthread_t helpers[LOOC_BULK_MAX_THREADS];
    int started = 0;
    if (want > 1) {
        /* helpers never take signals: those belong to the Python main thread */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, HELPER_STACK);
        /* a helper that cannot start only lowers the parallelism: the caller's thread takes its chunks */
        for (uint64_t i = 0; i + 1 < want; i++) {
            if (pthread_create(&helpers[started], &attr, run_chunks, &p) != 0) break;
            started++;
        }
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    run_chunks(&p);
    for (int i = 0; i < started; i++) pthread_join(helpers[i], NULL);
    pthread_mutex_destroy(&p.mu);
    return e->kind == LOOC_ERR_NONE ? 0 : -1;
}
