/* The pread engine: a pool of queue_depth threads per worker, each with one
 * staging slot, taking extents in plan order from a shared counter. Used where
 * io_uring is missing or disabled; also serves buffered reads when asked. */
#include "looc_io.h" /* first: it defines _GNU_SOURCE */

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>


#define HELPER_STACK (256 * 1024)
#define MAX_RETRIES 16

typedef struct threads_ctx threads_ctx;

typedef struct {
    threads_ctx *pool;
    int index;
    pthread_t thread;
} helper;

struct threads_ctx {
    looc_reader *r;
    int nhelpers; /* threads besides the worker itself */
    int started;
    helper *helpers;
    char *staging;
    size_t staging_bytes;
    pthread_mutex_t mu;
    pthread_cond_t cv_start, cv_done;
    looc_job *job;
    uint64_t gen;
    int want;   /* helpers with index < want take part in this job */
    int active; /* helpers still working on it */
    int quit;
};

/* Read one extent into buf; 0 on success, -1 after failing the job. */
static int read_extent(const looc_reader *r, looc_job *j, const looc_extent *e, char *buf) {
    uint64_t done = 0;
    int retries = 0;
    while (done < e->need) {
        if (done && (done % r->align) != 0) { /* O_DIRECT cannot continue from here: end of file */
            looc_fail_short(j, e, done);
            return -1;
        }
        atomic_fetch_add(&j->num_ios, 1);
        ssize_t got = pread(r->fd, buf + done, e->length - done, (off_t)(e->offset + done));
        if (got < 0) {
            if ((errno == EINTR || errno == EAGAIN) && retries++ < MAX_RETRIES) continue;
            looc_fail_io(j, errno, e->offset + done, e->length - done);
            return -1;
        }
        if (got == 0) {
            looc_fail_short(j, e, done);
            return -1;
        }
        atomic_fetch_add(&j->bytes_read, (unsigned long long)got);
        done += (uint64_t)got;
    }
    return 0;
}

static void work(const looc_reader *r, looc_job *j, char *buf) {
    while (!atomic_load(&j->stop)) {
        int64_t k = atomic_fetch_add(&j->next_ext, 1);
        if (k >= j->n_ext) break;
        const looc_extent *e = &j->ext[k];
        if (read_extent(r, j, e, buf) < 0) break;
        looc_copy_extent(j, e, buf);
        looc_extent_done(j, e);
    }
}

static void *helper_main(void *arg) {
    helper *h = arg;
    threads_ctx *p = h->pool;
    char *buf = p->staging + (size_t)(h->index + 1) * p->r->slot_size;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->gen == seen && !p->quit) pthread_cond_wait(&p->cv_start, &p->mu);
        if (p->quit) break;
        seen = p->gen;
        if (h->index >= p->want) continue;
        looc_job *j = p->job;
        pthread_mutex_unlock(&p->mu);
        work(p->r, j, buf);
        pthread_mutex_lock(&p->mu);
        if (--p->active == 0) pthread_cond_signal(&p->cv_done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void pool_stop(threads_ctx *p) {
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    pthread_cond_broadcast(&p->cv_start);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->started; i++) pthread_join(p->helpers[i].thread, NULL);
    p->started = 0;
}

static void pool_free(threads_ctx *p) {
    if (p->staging) munmap(p->staging, p->staging_bytes);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_start);
    pthread_cond_destroy(&p->cv_done);
    free(p->helpers);
    free(p);
}

int looc_threads_init(looc_worker *w, char *msg) {
    looc_reader *r = w->r;
    threads_ctx *p = calloc(1, sizeof *p);
    if (!p) {
        snprintf(msg, LOOC_MSG, "out of memory");
        return -ENOMEM;
    }
    p->r = r;
    p->nhelpers = r->queue_depth - 1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_start, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    p->helpers = calloc((size_t)(p->nhelpers > 0 ? p->nhelpers : 1), sizeof(helper));
    p->staging_bytes = (size_t)r->queue_depth * r->slot_size;
    p->staging = mmap(NULL, p->staging_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p->staging == MAP_FAILED) p->staging = NULL;
    if (!p->helpers || !p->staging) {
        snprintf(msg, LOOC_MSG, "cannot allocate %zu bytes of staging memory", p->staging_bytes);
        pool_free(p);
        return -ENOMEM;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, HELPER_STACK);
    int err = 0;
    for (int i = 0; i < p->nhelpers; i++) { /* signals are already blocked in this thread */
        p->helpers[i].pool = p;
        p->helpers[i].index = i;
        err = pthread_create(&p->helpers[i].thread, &attr, helper_main, &p->helpers[i]);
        if (err) break;
        p->started++;
    }
    pthread_attr_destroy(&attr);
    if (err) {
        snprintf(msg, LOOC_MSG, "cannot start %d pread threads: %s", p->nhelpers, strerror(err));
        pool_stop(p);
        pool_free(p);
        return -err;
    }
    snprintf(msg, LOOC_MSG, "%d pread threads; staging %zu bytes", r->queue_depth, p->staging_bytes);
    w->ctx = p;
    return 0;
}

void looc_threads_run(looc_worker *w, looc_job *j) {
    threads_ctx *p = w->ctx;
    int64_t extra = j->n_ext - 1;
    int want = extra < p->nhelpers ? (int)extra : p->nhelpers;
    if (want > 0) {
        pthread_mutex_lock(&p->mu);
        p->job = j;
        p->want = want;
        p->active = want;
        p->gen++;
        pthread_cond_broadcast(&p->cv_start);
        pthread_mutex_unlock(&p->mu);
    }
    work(p->r, j, p->staging);
    if (want > 0) {
        pthread_mutex_lock(&p->mu);
        while (p->active > 0) pthread_cond_wait(&p->cv_done, &p->mu);
        p->job = NULL;
        pthread_mutex_unlock(&p->mu);
    }
}

void looc_threads_fini(looc_worker *w) {
    threads_ctx *p = w->ctx;
    if (!p) return;
    pool_stop(p);
    pool_free(p);
    w->ctx = NULL;
}
