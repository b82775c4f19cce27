/* The reader: the file, its alignment, the job queue and the worker threads. */
#include "looc_io.h" /* first: it defines _GNU_SOURCE */

#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>


#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#endif

double looc_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------ errors */

void looc_job_fail(looc_job *j, int kind, int err, uint64_t offset, uint64_t length, uint64_t got, const char *fmt,
                   ...) {
    pthread_mutex_lock(&j->mu);
    if (j->err_kind == LOOC_ERR_NONE) {
        j->err_kind = kind;
        j->err_errno = err;
        j->err_offset = offset;
        j->err_length = length;
        j->err_got = got;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(j->err_msg, sizeof j->err_msg, fmt, ap);
        va_end(ap);
    }
    atomic_store(&j->stop, 1);
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

void looc_fail_short(looc_job *j, const looc_extent *e, uint64_t done) {
    uint64_t at = e->offset + done;
    looc_job_fail(j, LOOC_ERR_SHORT, EIO, at, e->need - done, done,
                  "short read: a read of %llu bytes at offset %llu returned only %llu; the file ends at or before "
                  "offset %llu (row %llu), so it is shorter than its metadata says (truncated or replaced while open?)",
                  (unsigned long long)e->length, (unsigned long long)e->offset, (unsigned long long)done,
                  (unsigned long long)at, (unsigned long long)(at < j->base ? 0 : (at - j->base) / j->row_bytes));
}

void looc_fail_io(looc_job *j, int err, uint64_t offset, uint64_t length) {
    looc_job_fail(j, LOOC_ERR_IO, err, offset, length, 0, "read of %llu bytes at offset %llu failed: %s",
                  (unsigned long long)length, (unsigned long long)offset, strerror(err));
}

/* --------------------------------------------------------------- alignment */

static uint64_t read_sysfs_u64(const char *path) {
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    unsigned long long v = 0;
    if (fscanf(f, "%llu", &v) != 1) v = 0;
    fclose(f);
    return v;
}

/* Logical block size of the block device that holds the file (0 if none / unknown). */
static uint64_t device_logical_block(int fd, const struct stat *st, char *source, size_t slen) {
    unsigned int ss = 0;
    if (S_ISBLK(st->st_mode)) {
        if (ioctl(fd, BLKSSZGET, &ss) == 0 && ss) {
            snprintf(source, slen, "BLKSSZGET");
            return ss;
        }
        return 0;
    }
    unsigned maj = major(st->st_dev), min = minor(st->st_dev);
    if (maj == 0) return 0; /* anonymous device: tmpfs, overlay, btrfs subvolume, ... */
    char p[128];
    snprintf(p, sizeof p, "/sys/dev/block/%u:%u/queue/logical_block_size", maj, min);
    uint64_t v = read_sysfs_u64(p);
    if (!v) { /* a partition: the queue belongs to the whole disk */
        snprintf(p, sizeof p, "/sys/dev/block/%u:%u/../queue/logical_block_size", maj, min);
        v = read_sysfs_u64(p);
    }
    if (v) {
        snprintf(source, slen, "sysfs queue/logical_block_size of %u:%u", maj, min);
        return v;
    }
    snprintf(p, sizeof p, "/dev/block/%u:%u", maj, min);
    int bfd = open(p, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (bfd >= 0) {
        if (ioctl(bfd, BLKSSZGET, &ss) == 0 && ss) {
            snprintf(source, slen, "BLKSSZGET on %s", p);
            close(bfd);
            return ss;
        }
        close(bfd);
    }
    return 0;
}

static int pow2_in(uint64_t v, uint64_t lo, uint64_t hi) { return v >= lo && v <= hi && (v & (v - 1)) == 0; }

void looc_query_align(int fd, int direct, looc_align_info *out) {
    memset(out, 0, sizeof *out);
    struct stat st;
    if (fstat(fd, &st) == 0) out->logical_block = device_logical_block(fd, &st, out->logical_source, sizeof out->logical_source);
    if (!direct) {
        out->align = 1;
        out->mem_align = 1;
        snprintf(out->source, sizeof out->source, "buffered reads need no alignment");
        return;
    }
    struct statx sx;
    memset(&sx, 0, sizeof sx);
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
        sx.stx_dio_offset_align) {
        out->align = sx.stx_dio_offset_align;
        out->mem_align = sx.stx_dio_mem_align ? sx.stx_dio_mem_align : sx.stx_dio_offset_align;
        snprintf(out->source, sizeof out->source, "statx(STATX_DIOALIGN)");
        return;
    }
    if (out->logical_block) {
        out->align = out->mem_align = out->logical_block;
        snprintf(out->source, sizeof out->source, "%s", out->logical_source);
        return;
    }
    struct statvfs vfs;
    if (fstatvfs(fd, &vfs) == 0 && pow2_in(vfs.f_bsize, 512, 65536)) {
        out->align = out->mem_align = vfs.f_bsize;
        snprintf(out->source, sizeof out->source, "fstatvfs f_bsize (no block device behind the file)");
        return;
    }
    out->align = out->mem_align = 4096;
    snprintf(out->source, sizeof out->source, "default 4096 (the device could not be queried)");
}

/* --------------------------------------------------------------- jobs */

looc_job *looc_job_new(void) {
    looc_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    atomic_init(&j->refs, 1);
    pthread_mutex_init(&j->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    j->state = LOOC_JOB_QUEUED;
    return j;
}

void looc_job_ref(looc_job *j) { atomic_fetch_add(&j->refs, 1); }

void looc_job_unref(looc_job *j) {
    if (atomic_fetch_sub(&j->refs, 1) != 1) return;
    looc_plan_free(j);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

static void job_finish(looc_job *j) {
    looc_plan_free(j);
    pthread_mutex_lock(&j->mu);
    j->state = LOOC_JOB_DONE;
    j->t_end = looc_now();
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* Wait until chunk `chunk` (or, for chunk < 0, the whole job) is done.
 * Returns 1 when it is done or the job ended (check err_kind), 0 on timeout. */
int looc_job_wait(looc_job *j, int64_t chunk, double timeout) {
    struct timespec deadline;
    if (timeout >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        double t = (double)deadline.tv_sec + 1e-9 * deadline.tv_nsec + timeout;
        deadline.tv_sec = (time_t)t;
        deadline.tv_nsec = (long)((t - (double)deadline.tv_sec) * 1e9);
    }
    int ok = 1;
    pthread_mutex_lock(&j->mu);
    while (j->state != LOOC_JOB_DONE && (chunk < 0 || j->chunks_done <= chunk)) {
        if (timeout < 0) {
            pthread_cond_wait(&j->cv, &j->mu);
        } else if (pthread_cond_timedwait(&j->cv, &j->mu, &deadline) == ETIMEDOUT) {
            ok = j->state == LOOC_JOB_DONE || (chunk >= 0 && j->chunks_done > chunk);
            break;
        }
    }
    pthread_mutex_unlock(&j->mu);
    return ok;
}

/* --------------------------------------------------------------- workers */

/* Take the next queued job; with block, wait for one (NULL once the reader is closing). */
looc_job *looc_reader_pop(looc_reader *r, int block) {
    pthread_mutex_lock(&r->mu);
    while (block && !r->head && !r->closing) pthread_cond_wait(&r->cv, &r->mu);
    looc_job *j = r->head;
    if (j) {
        r->head = j->next;
        if (!r->head) r->tail = NULL;
        j->next = NULL;
    }
    pthread_mutex_unlock(&r->mu);
    return j;
}

/* Plan a job. Returns 1 if it has reads to do, 0 if it is already complete (or failed). */
int looc_job_begin(looc_reader *r, looc_job *j) {
    pthread_mutex_lock(&j->mu);
    j->state = LOOC_JOB_RUNNING;
    pthread_mutex_unlock(&j->mu);
    j->t_start = looc_now();
    if (looc_plan(j, r->align, r->merge_gap, r->slot_size) < 0) {
        looc_job_fail(j, LOOC_ERR_NOMEM, ENOMEM, 0, 0, 0, "out of memory while planning a batch of %lld ids",
                      (long long)j->n);
        return 0;
    }
    pthread_mutex_lock(&j->mu);
    looc_advance_locked(j); /* chunks that hold only duplicates of earlier chunks */
    pthread_mutex_unlock(&j->mu);
    j->issued = 0;
    j->inflight = 0;
    return j->n_ext > 0;
}

/* Mark a job done, wake its waiters, drop the worker's reference. */
void looc_job_end(looc_job *j) {
    job_finish(j);
    looc_job_unref(j);
}

static void *worker_main(void *arg) {
    looc_worker *w = arg;
    looc_reader *r = w->r;
    char msg[LOOC_MSG] = "";
    int rc = r->engine == LOOC_ENGINE_URING ? looc_uring_init(w, msg) : looc_threads_init(w, msg);

    pthread_mutex_lock(&r->mu);
    if (rc < 0 && !r->init_err) {
        r->init_err = rc;
        snprintf(r->init_msg, sizeof r->init_msg, "%s", msg);
    }
    if (rc == 0 && w->index == 0) snprintf(r->engine_note, sizeof r->engine_note, "%s", msg);
    r->ninit++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (rc < 0) return NULL;
    /* if another worker failed to start, the reader is closed at once and the loops below end */
    if (r->engine == LOOC_ENGINE_URING) {
        looc_uring_serve(w); /* keeps the ring full across consecutive jobs */
        looc_uring_fini(w);
    } else {
        looc_job *j;
        while ((j = looc_reader_pop(r, 1)) != NULL) {
            if (looc_job_begin(r, j)) looc_threads_run(w, j);
            looc_job_end(j);
        }
        looc_threads_fini(w);
    }
    return NULL;
}

static void stop_workers(looc_reader *r) {
    pthread_mutex_lock(&r->mu);
    r->closing = 1;
    looc_job *j = r->head;
    r->head = r->tail = NULL;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    while (j) { /* queued, never started */
        looc_job *next = j->next;
        looc_job_fail(j, LOOC_ERR_CLOSED, EBADF, 0, 0, 0, "the reader was closed before this read started");
        job_finish(j);
        looc_job_unref(j);
        j = next;
    }
    for (int i = 0; i < r->nworkers; i++)
        if (r->workers[i].started) pthread_join(r->workers[i].thread, NULL);
}

int looc_reader_open(looc_reader *r, const char *path, int direct, int engine, uint64_t row_bytes, uint64_t base,
                     uint64_t num_rows, int queue_depth, uint64_t max_io, uint64_t merge_gap, int nworkers) {
    memset(r, 0, sizeof *r);
    r->fd = -1;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    snprintf(r->path, sizeof r->path, "%s", path);
    r->direct = direct;
    r->engine = engine;
    r->row_bytes = row_bytes;
    r->base = base;
    r->num_rows = num_rows;
    r->queue_depth = queue_depth;
    r->max_io = max_io;
    r->merge_gap = merge_gap;
    r->nworkers = nworkers;

    r->fd = open(path, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (r->fd < 0) {
        int e = errno;
        snprintf(r->init_msg, sizeof r->init_msg, "cannot open%s: %s", direct ? " with O_DIRECT" : "", strerror(e));
        r->closed = 1;
        return -e;
    }
    looc_align_info ai;
    looc_query_align(r->fd, direct, &ai);
    r->align = ai.align;
    r->mem_align = ai.mem_align;
    snprintf(r->align_source, sizeof r->align_source, "%s", ai.source);
    /* a slot holds the largest merged read, and at least one row's aligned cover */
    uint64_t row_cover = (row_bytes + r->align - 1) / r->align * r->align + r->align;
    uint64_t slot = max_io > row_cover ? max_io : row_cover;
    r->slot_size = (slot + 4095) / 4096 * 4096;
    if (r->merge_gap % r->align) r->merge_gap = (r->merge_gap + r->align - 1) / r->align * r->align;

    r->workers = calloc((size_t)nworkers, sizeof(looc_worker));
    if (!r->workers) {
        close(r->fd);
        r->fd = -1;
        r->closed = 1;
        snprintf(r->init_msg, sizeof r->init_msg, "out of memory");
        return -ENOMEM;
    }
    /* workers never take signals: those belong to the Python main thread */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = 0;
    for (int i = 0; i < nworkers; i++) {
        r->workers[i].r = r;
        r->workers[i].index = i;
        int e = pthread_create(&r->workers[i].thread, NULL, worker_main, &r->workers[i]);
        if (e) {
            rc = -e;
            snprintf(r->init_msg, sizeof r->init_msg, "cannot start a reader thread: %s", strerror(e));
            break;
        }
        r->workers[i].started = 1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);

    int started = 0;
    for (int i = 0; i < nworkers; i++) started += r->workers[i].started;
    pthread_mutex_lock(&r->mu);
    while (r->ninit < started) pthread_cond_wait(&r->cv, &r->mu);
    if (!rc && r->init_err) rc = r->init_err;
    if (rc && !r->init_err) r->init_err = rc; /* tell running workers to quit */
    pthread_mutex_unlock(&r->mu);
    if (rc) {
        stop_workers(r);
        free(r->workers);
        r->workers = NULL;
        close(r->fd);
        r->fd = -1;
        r->closed = 1;
    }
    return rc;
}

int looc_reader_submit(looc_reader *r, looc_job *j) {
    pthread_mutex_lock(&r->mu);
    if (r->closing) {
        pthread_mutex_unlock(&r->mu);
        return -EBADF;
    }
    looc_job_ref(j); /* the queue's reference, dropped by the worker */
    j->next = NULL;
    j->t_submit = looc_now();
    if (r->tail)
        r->tail->next = j;
    else
        r->head = j;
    r->tail = j;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return 0;
}

/* Fails queued jobs, lets running ones finish, joins the workers, closes the file. Idempotent. */
void looc_reader_close(looc_reader *r) {
    if (r->closed) return;
    r->closed = 1;
    stop_workers(r);
    free(r->workers);
    r->workers = NULL;
    if (r->fd >= 0) close(r->fd);
    r->fd = -1;
}
