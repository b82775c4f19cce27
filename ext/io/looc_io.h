/* lightning_ooc._io: the direct-I/O feature reader (shared declarations).
 *
 * A reader owns one file descriptor (opened O_DIRECT unless buffered) and a
 * few worker threads. Each worker owns its I/O engine: an io_uring (one ring
 * per worker thread, registered file and staging buffers where the kernel
 * allows) or a pool of pread threads. A gather is a job: the worker plans it
 * (sort the ids, drop duplicates, turn rows into aligned extents, merge
 * neighbouring extents), keeps up to queue_depth reads in flight into a
 * bounded staging area, copies each row out of its extent, and signals
 * completion chunk by chunk, in chunk order.
 *
 * A bulk transfer (bulk.c) is simpler: one contiguous range moved between a
 * file and the caller's memory, read or written, cut into equal requests and
 * run to the end on the calling thread (io_uring) or a few threads (pread /
 * pwrite), with no staging copy.
 *
 * Files: plan.c (batch planning), engine_uring.c, engine_threads.c,
 * reader.c (file, alignment probe, job queue, workers), bulk.c (bulk
 * transfers), module.c (CPython).
 */
#ifndef LOOC_IO_H
#define LOOC_IO_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define LOOC_MSG 384
#define LOOC_MAX_QUEUE_DEPTH 4096

#define LOOC_BULK_MAX_THREADS 16
#define LOOC_BULK_MAX_CHUNK (1ULL << 30) /* one request's length must fit an SQE's 32-bit len */

enum { LOOC_ENGINE_URING = 0, LOOC_ENGINE_THREADS = 1 };

/* Why a job failed. */
enum {
    LOOC_ERR_NONE = 0,
    LOOC_ERR_IO = 1,     /* the device / kernel returned an error for a read */
    LOOC_ERR_SHORT = 2,  /* a read ended before the rows it had to cover (file shorter than expected) */
    LOOC_ERR_NOMEM = 3,  /* planning memory could not be allocated */
    LOOC_ERR_CLOSED = 4, /* the reader was closed before the job started */
    LOOC_ERR_RING = 5,   /* io_uring itself failed (submit / wait) */
};

/* The bulk transfer errors use the same kinds; "read" there also means "write". */

enum { LOOC_JOB_QUEUED = 0, LOOC_JOB_RUNNING = 1, LOOC_JOB_DONE = 2 };

/* (id, position in the caller's list), sorted by id, positions ascending within an id. */
typedef struct {
    int64_t id;
    int64_t pos;
} looc_pair;

/* One distinct id. Its positions are pairs[begin .. begin + count); the first
 * n_owner of them lie in the owner chunk (the chunk of its first position) and
 * are filled straight from the staging buffer; the rest are copied from the
 * first position once their chunk is reached. */
typedef struct {
    int64_t id;
    int64_t begin;
    int64_t n_owner;
    int64_t chunk;
} looc_group;

/* One read: [offset, offset + length) aligned; `need` bytes from offset must
 * arrive (the end of its last row); groups order[first .. last). */
typedef struct {
    uint64_t offset;
    uint64_t length;
    uint64_t need;
    int64_t first;
    int64_t last;
    int64_t chunk;
} looc_extent;

typedef struct {
    int64_t dst;
    int64_t src;
} looc_copy;

typedef struct looc_job {
    atomic_int refs;
    struct looc_job *next; /* reader queue link */

    /* input (the caller keeps ids and out alive until the job is done) */
    const int64_t *ids;
    int64_t n;
    char *out;
    uint64_t row_bytes;
    uint64_t base; /* file offset of row 0 (a header before the rows; need not be aligned) */
    int64_t chunk_rows;
    int64_t nchunks;

    /* plan, built by the worker and freed when the job ends */
    looc_pair *pairs;
    looc_group *groups;
    int64_t ngroups;
    int64_t *order;
    looc_extent *ext;
    int64_t n_ext;
    atomic_llong next_ext;      /* thread engine: next extent to take */
    int64_t *chunk_ext_begin;   /* [nchunks + 1] */
    atomic_llong *remaining;    /* extents of each chunk still to finish */
    looc_copy *copies;          /* duplicate rows filled from an earlier chunk */
    int64_t *copy_begin;        /* [nchunks + 1] */

    /* state */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state;
    int64_t chunks_done; /* chunks [0, chunks_done) are complete */
    atomic_int stop;     /* set on the first error: issue nothing new, drain */

    /* first error */
    int err_kind;
    int err_errno;
    uint64_t err_offset;
    uint64_t err_length;
    uint64_t err_got;
    char err_msg[LOOC_MSG];

    /* owned by the io_uring worker that runs the job */
    int64_t issued;             /* extents handed to the ring so far */
    int64_t inflight;           /* of those, still in the ring */
    struct looc_job *anext;     /* the worker's list of jobs with reads in flight */

    /* statistics */
    atomic_ullong bytes_read;
    atomic_ullong num_ios;
    int64_t unique_rows;
    double t_submit, t_start, t_end;
} looc_job;

struct looc_reader;

typedef struct {
    struct looc_reader *r;
    int index;
    pthread_t thread;
    int started;
    void *ctx; /* engine state, owned by the worker thread */
} looc_worker;

typedef struct looc_reader {
    int fd;
    int direct;
    int engine;
    char path[PATH_MAX];
    uint64_t row_bytes;
    uint64_t base; /* file offset of row 0 */
    uint64_t num_rows;
    uint64_t align;     /* file offset / length alignment of reads (1 when buffered) */
    uint64_t mem_align; /* buffer alignment for O_DIRECT */
    char align_source[192];
    uint64_t max_io;
    uint64_t merge_gap;
    uint64_t slot_size; /* staging bytes per in-flight read; also the largest merged read */
    int queue_depth;
    int nworkers;
    looc_worker *workers;

    pthread_mutex_t mu;
    pthread_cond_t cv;      /* queue changes, worker init */
    looc_job *head, *tail;
    int closing;
    int closed;
    int ninit;
    int init_err;           /* first worker init failure (-errno) */
    char init_msg[LOOC_MSG];

    /* what worker 0's engine set up, for diagnostics */
    int reg_files;
    int reg_bufs;
    unsigned ring_flags;
    char engine_note[LOOC_MSG];
} looc_reader;

/* Device facts for a path or an open fd. */
typedef struct {
    uint64_t align;
    uint64_t mem_align;
    char source[192];
    uint64_t logical_block; /* of the block device behind the file, 0 if unknown */
    char logical_source[160];
} looc_align_info;

/* One bulk transfer: [offset, offset + nbytes) of fd <-> addr, in requests of chunk bytes. */
typedef struct {
    int fd;
    int write;          /* 0: file -> memory, 1: memory -> file */
    int direct;         /* fd has O_DIRECT: a partial transfer can only go on from an aligned position */
    uint64_t align;     /* file offset alignment when direct, else 1 */
    uint64_t offset;
    char *addr;
    uint64_t nbytes;
    uint64_t chunk;     /* 1 .. LOOC_BULK_MAX_CHUNK, a multiple of align */
    int queue_depth;    /* requests in flight (io_uring entries, or threads up to LOOC_BULK_MAX_THREADS) */
} looc_bulk;

/* What stopped a bulk transfer (the first failure; later ones are dropped). */
typedef struct {
    int kind;           /* LOOC_ERR_*; LOOC_ERR_NONE when it succeeded */
    int setup;          /* 1: the engine could not start (ring, memory); nothing was transferred */
    int err;            /* errno */
    uint64_t offset;    /* first file byte of the failing request not transferred */
    uint64_t length;    /* bytes of that request still to go */
    uint64_t got;       /* bytes of that request that were transferred */
    char msg[LOOC_MSG];
} looc_bulk_error;

/* plan.c */
int looc_plan(looc_job *j, uint64_t align, uint64_t merge_gap, uint64_t max_len);
void looc_plan_free(looc_job *j);
void looc_copy_extent(looc_job *j, const looc_extent *e, const char *buf);
void looc_extent_done(looc_job *j, const looc_extent *e);
void looc_advance_locked(looc_job *j);

/* reader.c */
double looc_now(void);
void looc_job_fail(looc_job *j, int kind, int err, uint64_t offset, uint64_t length, uint64_t got, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
void looc_fail_short(looc_job *j, const looc_extent *e, uint64_t done);
void looc_fail_io(looc_job *j, int err, uint64_t offset, uint64_t length);
void looc_query_align(int fd, int direct, looc_align_info *out);
int looc_reader_open(looc_reader *r, const char *path, int direct, int engine, uint64_t row_bytes, uint64_t base,
                     uint64_t num_rows, int queue_depth, uint64_t max_io, uint64_t merge_gap, int nworkers);
int looc_reader_submit(looc_reader *r, looc_job *j);
looc_job *looc_reader_pop(looc_reader *r, int block);
int looc_job_begin(looc_reader *r, looc_job *j);
void looc_job_end(looc_job *j);
void looc_reader_close(looc_reader *r);
looc_job *looc_job_new(void);
void looc_job_ref(looc_job *j);
void looc_job_unref(looc_job *j);
int looc_job_wait(looc_job *j, int64_t chunk, double timeout);

/* engines: init returns 0 or -errno with a message in msg */
int looc_uring_init(looc_worker *w, char *msg);
void looc_uring_serve(looc_worker *w);
void looc_uring_fini(looc_worker *w);
int looc_uring_probe(char *msg, size_t msglen);
#ifdef LOOC_HAVE_LIBURING
struct io_uring;
int looc_ring_init(struct io_uring *ring, unsigned entries, unsigned *flags_out);
#endif
int looc_threads_init(looc_worker *w, char *msg);
void looc_threads_run(looc_worker *w, looc_job *j);
void looc_threads_fini(looc_worker *w);

/* bulk.c: run a transfer to its end (or first failure) on the calling thread; 0, or -1 with *e filled.
 * Memory and file stay untouched by the engine once it returns, failed or not. */
int looc_bulk_uring(const looc_bulk *b, looc_bulk_error *e);
int looc_bulk_threads(const looc_bulk *b, looc_bulk_error *e);

#endif
