/* shm_transport.c - the CPU transport of tec_comm: shared memory regions
 * without names (memfd_create: nothing in /dev/shm, so nothing can outlive
 * the processes however they end; peers open them through /proc/<pid>/fd
 * while the owner keeps the descriptor open; reserved at creation so a lack
 * of memory is an error, not a SIGBUS),
 * flags as C11 atomics in the region, and a comm thread as the "copy
 * engine" executing the comm stream's FIFO. Exercised by tests/test_comm*.py
 * and tests/distributed/run_gemm_with_overlap.py. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../error.h"
#include "../transport.h"
#include "cpu_dtype.h"
#include "cpu_fp8.h"

enum { OP_COPY, OP_SIGNAL, OP_WAIT, OP_EVREC, OP_EVWAIT, OP_REDUCE };
enum { QCAP = 512 };

typedef struct {
    int kind;
    void *dst;
    const void *src;
    size_t bytes;
    uint64_t value;
    int event;
    double timeout;
    tec_wait_site site;
    /* reduce */
    const void *srcs[TEC_COMM_MAX_RANKS];
    int nsrc;
    int64_t rows, cols;
    tec_dtype dtype;
    const void *bias;
    int fp8;             /* FP8 sources (tec_reduce_fp8) */
    tec_reduce_fp8 fp8_src;
} op_t;

/* What a peer needs to open a region: the owner's pid and descriptor, and
 * what identifies the file (its inode), checked after opening. */
typedef struct {
    uint64_t bytes;
    int64_t uid;
    int64_t pid;
    uint64_t pid_ns;
    uint64_t dev, ino;
    int32_t fd;
    int32_t pad;
} shm_handle;

struct tec_transport {
    int rank, size;
    size_t bytes;
    int fd; /* the region's descriptor, open until every peer opened it (-1 after) */
    uint64_t dev, ino;
    void *base;
    void *peer[TEC_COMM_MAX_RANKS];

    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    op_t *ring;
    uint64_t head, tail; /* tail: next to run; head: next free (under mu) */
    int running;         /* the thread is executing an op popped from the ring */
    atomic_int stop;

    atomic_int err; /* sticky tec_status of the comm thread (or a failed wait) */
    char errmsg[1024];

    atomic_uint_fast64_t ev_done[TEC_COMM_NEVENTS];
    uint64_t ev_target[TEC_COMM_NEVENTS];
};

static void *const COMM_STREAM_TAG = (void *)&tec_shm_transport;
static int is_comm(tec_transport *t, void *stream) { (void)t; return stream == COMM_STREAM_TAG; }

/* ------------------------------------------------------------ waiting */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Spin, then yield, then sleep (we may share 2 cores with 8 threads). */
static void backoff(unsigned *n)
{
    unsigned k = (*n)++;
    if (k < 64) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    } else if (k < 256) {
        sched_yield();
    } else {
        struct timespec ts = {0, k < 2048 ? 20000 : 200000};
        nanosleep(&ts, NULL);
    }
}

static void set_err(tec_transport *t, tec_status st, const char *msg)
{
    int expected = 0;
    pthread_mutex_lock(&t->mu);
    if (atomic_load(&t->err) == 0) {
        snprintf(t->errmsg, sizeof t->errmsg, "%s", msg);
        atomic_compare_exchange_strong(&t->err, &expected, (int)st);
    }
    pthread_mutex_unlock(&t->mu);
}

static tec_status get_err(tec_transport *t)
{
    int e = atomic_load(&t->err);
    if (!e)
        return TEC_OK;
    pthread_mutex_lock(&t->mu);
    tec_status st = tec_set_error((tec_status)e, "%s", t->errmsg);
    pthread_mutex_unlock(&t->mu);
    return st;
}

static tec_status do_wait(tec_transport *t, const uint64_t *flag, uint64_t value, double timeout, tec_wait_site s)
{
    _Atomic uint64_t *f = (_Atomic uint64_t *)flag;
    const double deadline = now_s() + timeout;
    unsigned n = 0;
    for (;;) {
        uint64_t seen = atomic_load_explicit(f, memory_order_acquire);
        if (tec_flag_epoch(seen) > tec_flag_epoch(value))
            return TEC_OK;
        if (tec_flag_epoch(seen) == tec_flag_epoch(value)) {
            if ((uint32_t)seen == (uint32_t)value)
                return TEC_OK;
            char msg[768];
            tec_format_wait_error(msg, sizeof msg, TEC_ERR_INVALID_ARG, s, timeout, seen, value);
            return tec_set_error(TEC_ERR_INVALID_ARG, "%s", msg);
        }
        if (atomic_load(&t->stop))
            return tec_set_error(TEC_ERR_CLOSED, "communicator '%s' was closed during a wait", s.comm);
        if ((n & 63) == 0 && now_s() > deadline) {
            char msg[768];
            tec_format_wait_error(msg, sizeof msg, TEC_ERR_TIMEOUT, s, timeout, seen, value);
            return tec_set_error(TEC_ERR_TIMEOUT, "%s", msg);
        }
        if ((n & 63) == 0 && atomic_load(&t->err))
            return get_err(t);
        backoff(&n);
    }
}

/* Row r of source i as float32 into dst: decoded and scaled FP8 bytes, or
 * the reduce's dtype. */
static void load_src_row(float *dst, const op_t *o, int i, int64_t r)
{
    if (!o->fp8) {
        tec_load_row(dst, (const char *)o->srcs[i] + (size_t)r * (size_t)o->cols * tec_dtype_size(o->dtype), o->cols,
                     o->dtype);
        return;
    }
    const uint8_t *q = (const uint8_t *)o->srcs[i] + (size_t)r * (size_t)o->cols;
    float sinv;
    memcpy(&sinv, (const char *)o->srcs[i] + o->fp8_src.scale_inv_offset, sizeof sinv);
    for (int64_t j = 0; j < o->cols; j++)
        dst[j] = fp8_decode(q[j], o->fp8_src.format) * sinv;
}

static tec_status do_reduce(const op_t *o)
{
    const int64_t rows = o->rows, cols = o->cols;
    const size_t es = tec_dtype_size(o->dtype);
    float *acc = malloc((size_t)cols * 2 * sizeof(float));
    if (!acc)
        return tec_set_error(TEC_ERR_NO_MEMORY, "reduce: no memory for %lld floats", (long long)cols * 2);
    float *tmp = acc + cols;
    for (int64_t r = 0; r < rows; r++) {
        const size_t off = (size_t)r * (size_t)cols * es;
        load_src_row(acc, o, 0, r);
        for (int i = 1; i < o->nsrc; i++) {
            load_src_row(tmp, o, i, r);
            for (int64_t j = 0; j < cols; j++) acc[j] += tmp[j];
        }
        if (o->bias) {
            tec_load_row(tmp, o->bias, cols, o->dtype);
            for (int64_t j = 0; j < cols; j++) acc[j] += tmp[j];
        }
        tec_store_row((char *)o->dst + off, acc, cols, o->dtype);
    }
    free(acc);
    return TEC_OK;
}

static void ev_set(tec_transport *t, int ev, uint64_t target)
{
    uint64_t cur = atomic_load(&t->ev_done[ev]);
    while (cur < target && !atomic_compare_exchange_weak(&t->ev_done[ev], &cur, target)) {
    }
}

/* Run one op; on the comm thread failures become the sticky error. */
static tec_status run_op(tec_transport *t, const op_t *o)
{
    switch (o->kind) {
    case OP_COPY:
        memcpy(o->dst, o->src, o->bytes);
        atomic_thread_fence(memory_order_release);
        return TEC_OK;
    case OP_SIGNAL:
        atomic_store_explicit((_Atomic uint64_t *)o->dst, o->value, memory_order_release);
        return TEC_OK;
    case OP_WAIT:
        return do_wait(t, o->src, o->value, o->timeout, o->site);
    case OP_EVREC:
        ev_set(t, o->event, o->value);
        return TEC_OK;
    case OP_EVWAIT: {
        unsigned n = 0;
        while (atomic_load(&t->ev_done[o->event]) < o->value) {
            if (atomic_load(&t->err))
                return get_err(t);
            if (atomic_load(&t->stop))
                return tec_set_error(TEC_ERR_CLOSED, "transport closed");
            backoff(&n);
        }
        /* The records run even after a failure: report it here. */
        return get_err(t);
    }
    case OP_REDUCE:
        if (o->rows && !o->dst)
            return tec_set_error(TEC_ERR_INVALID_ARG, "reduce: no output");
        return do_reduce(o);
    }
    return tec_set_error(TEC_ERR_INTERNAL, "unknown comm op %d", o->kind);
}

static void *comm_thread(void *arg)
{
    tec_transport *t = arg;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (t->tail == t->head && !atomic_load(&t->stop))
            pthread_cond_wait(&t->work, &t->mu);
        if (atomic_load(&t->stop))
            break;
        op_t o = t->ring[t->tail % QCAP];
        t->running = 1;
        pthread_mutex_unlock(&t->mu);
        /* After a failure only event records run, so waiters wake up. */
        if (!atomic_load(&t->err) || o.kind == OP_EVREC) {
            tec_status st = run_op(t, &o);
            if (st != TEC_OK)
                set_err(t, st, tec_last_error());
        }
        pthread_mutex_lock(&t->mu);
        t->tail++;
        t->running = 0;
        pthread_cond_broadcast(&t->idle);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

static tec_status enqueue(tec_transport *t, const op_t *o)
{
    pthread_mutex_lock(&t->mu);
    while (t->head - t->tail >= QCAP)
        pthread_cond_wait(&t->idle, &t->mu);
    t->ring[t->head % QCAP] = *o;
    t->head++;
    pthread_cond_signal(&t->work);
    pthread_mutex_unlock(&t->mu);
    return TEC_OK;
}

static tec_status submit(tec_transport *t, const op_t *o, void *stream)
{
    if (is_comm(t, stream))
        return enqueue(t, o);
    return run_op(t, o);
}

/* ------------------------------------------------------------ interface */

static void shm_unmap_peers(tec_transport *t)
{
    for (int i = 0; i < t->size; i++) {
        if (i != t->rank && t->peer[i])
            munmap(t->peer[i], t->bytes);
        t->peer[i] = NULL;
    }
}

static void shm_destroy(tec_transport *t)
{
    if (!t)
        return;
    if (t->thread_started) {
        pthread_mutex_lock(&t->mu);
        atomic_store(&t->stop, 1);
        pthread_cond_broadcast(&t->work);
        pthread_mutex_unlock(&t->mu);
        pthread_join(t->thread, NULL);
    }
    shm_unmap_peers(t);
    if (t->base)
        munmap(t->base, t->bytes);
    if (t->fd >= 0)
        close(t->fd);
    pthread_cond_destroy(&t->work);
    pthread_cond_destroy(&t->idle);
    pthread_mutex_destroy(&t->mu);
    free(t->ring);
    free(t);
}

/* ----------------------------------------------------- regions
 *
 * A region is a memfd: it has no name, so no process that dies, however it
 * dies and at whatever point of the set-up, leaves anything behind; the
 * kernel frees it with the last mapping or descriptor. Peers open it as
 * /proc/<owner pid>/fd/<fd> while the owner holds the descriptor (until
 * tec_comm_release_handle, after every peer mapped it), which needs the
 * ranks in one pid namespace under one user, as a job's local ranks are. */

static unsigned long long pid_namespace(void)
{
    struct stat sb;
    return stat("/proc/self/ns/pid", &sb) == 0 ? (unsigned long long)sb.st_ino : 0ull;
}

/* Bytes this process may still take: MemAvailable, and the room left under
 * the cgroup's memory.max where there is one; 0 where neither is known. */
static unsigned long long memory_room(void)
{
    unsigned long long room = 0, kb, lim, cur;
    char line[256];
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
                room = kb * 1024ull;
        fclose(f);
    }
    f = fopen("/sys/fs/cgroup/memory.max", "r");
    if (f) {
        if (fscanf(f, "%llu", &lim) == 1) {
            FILE *g = fopen("/sys/fs/cgroup/memory.current", "r");
            if (g) {
                if (fscanf(g, "%llu", &cur) == 1) {
                    unsigned long long left = lim > cur ? lim - cur : 0;
                    if (!room || left < room)
                        room = left;
                }
                fclose(g);
            }
        }
        fclose(f);
    }
    return room;
}

static tec_status shm_create(tec_transport **out, int device, int rank, int size, size_t bytes)
{
    *out = NULL;
    tec_status st = TEC_OK;
    tec_transport *t = calloc(1, sizeof *t);
    if (!t)
        return tec_set_error(TEC_ERR_NO_MEMORY, "shm transport: no memory");
    t->fd = -1;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->work, NULL);
    pthread_cond_init(&t->idle, NULL);
    t->rank = rank;
    t->size = size;
    t->bytes = bytes;
    t->ring = calloc(QCAP, sizeof(op_t));
    if (!t->ring) {
        st = tec_set_error(TEC_ERR_NO_MEMORY, "shm transport: no memory for the comm queue");
        goto fail;
    }
    /* Reserving the pages of a region larger than the memory left would
     * first push everything else out (or call the OOM killer): refuse it. */
    const unsigned long long room = memory_room();
    if (room && bytes > room) {
        st = tec_set_error(TEC_ERR_NO_MEMORY,
                           "shm transport: a region of %zu bytes (%.1f MiB) is more than the memory available "
                           "(%.1f MiB): use a smaller buffer",
                           bytes, (double)bytes / (1024.0 * 1024.0), (double)room / (1024.0 * 1024.0));
        goto fail;
    }
    t->fd = memfd_create("tec-region", MFD_CLOEXEC);
    TEC_ERRNO_CHECK_GOTO(t->fd >= 0, st, fail, "shm transport: memfd_create");
    TEC_ERRNO_CHECK_GOTO(ftruncate(t->fd, (off_t)bytes) == 0, st, fail, "shm transport: sizing a region to %zu bytes",
                         bytes);
    /* Reserve the pages now: a sparse region that later finds no memory
     * kills the first process that writes to it with SIGBUS.
     * posix_fallocate returns its error number. */
    {
        int e = posix_fallocate(t->fd, 0, (off_t)bytes);
        if (e) {
            st = tec_set_error(e == ENOSPC || e == EFBIG || e == ENOMEM ? TEC_ERR_NO_MEMORY : tec_errno_status(e),
                               "shm transport: reserving a region of %zu bytes (%.1f MiB): %s", bytes,
                               (double)bytes / (1024.0 * 1024.0), strerror(e));
            goto fail;
        }
    }
    struct stat sb;
    TEC_ERRNO_CHECK_GOTO(fstat(t->fd, &sb) == 0, st, fail, "shm transport: fstat of a region");
    t->dev = (uint64_t)sb.st_dev;
    t->ino = (uint64_t)sb.st_ino;
    t->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, t->fd, 0);
    if (t->base == MAP_FAILED)
        t->base = NULL;
    TEC_ERRNO_CHECK_GOTO(t->base, st, fail, "shm transport: mmap of %zu bytes", bytes);
    t->peer[rank] = t->base;
    errno = pthread_create(&t->thread, NULL, comm_thread, t); /* returns its error number */
    TEC_ERRNO_CHECK_GOTO(errno == 0, st, fail, "shm transport: cannot start the comm thread");
    t->thread_started = 1;
    *out = t;
    return TEC_OK;
fail:
    shm_destroy(t);
    return st;
}

static tec_status shm_local_handle(tec_transport *t, void *out, size_t *len)
{
    if (t->fd < 0)
        return tec_set_error(TEC_ERR_INVALID_ARG, "shm transport: the region's handle was released already");
    shm_handle h;
    memset(&h, 0, sizeof h);
    h.bytes = t->bytes;
    h.uid = (int64_t)getuid();
    h.pid = (int64_t)getpid();
    h.pid_ns = pid_namespace();
    h.dev = t->dev;
    h.ino = t->ino;
    h.fd = t->fd;
    memcpy(out, &h, sizeof h);
    *len = sizeof h;
    return TEC_OK;
}

static tec_status shm_map_peers(tec_transport *t, const void *const *handles, const size_t *lens, void **bases)
{
    const unsigned long long ns = pid_namespace();
    for (int i = 0; i < t->size; i++) {
        if (i == t->rank) {
            bases[i] = t->base;
            continue;
        }
        shm_handle h;
        if (lens[i] != sizeof h) {
            shm_unmap_peers(t);
            return tec_set_error(TEC_ERR_INVALID_ARG, "shm transport: rank %d's handle has %zu bytes", i, lens[i]);
        }
        memcpy(&h, handles[i], sizeof h);
        if (h.pid_ns != ns || h.uid != (int64_t)getuid()) {
            shm_unmap_peers(t);
            return tec_set_error(TEC_ERR_INVALID_ARG,
                                 "shm transport: rank %d runs in another pid namespace or as another user; the CPU "
                                 "transport needs the ranks of a group on one host, in one pid namespace, as one user",
                                 i);
        }
        char path[64];
        snprintf(path, sizeof path, "/proc/%lld/fd/%d", (long long)h.pid, (int)h.fd);
        int fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd < 0) {
            int e = errno;
            shm_unmap_peers(t);
            return tec_set_error(tec_errno_status(e), "shm transport: opening rank %d's region (%s): %s (not on this "
                                 "host, or not allowed to read that process's descriptors?)", i, path, strerror(e));
        }
        struct stat sb;
        if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_dev != h.dev || (uint64_t)sb.st_ino != h.ino ||
            (size_t)sb.st_size < t->bytes) {
            close(fd);
            shm_unmap_peers(t);
            return tec_set_error(TEC_ERR_INVALID_ARG,
                                 "shm transport: %s is not rank %d's region of %zu bytes", path, i, t->bytes);
        }
        void *p = mmap(NULL, t->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        int e = errno;
        close(fd);
        if (p == MAP_FAILED) {
            shm_unmap_peers(t);
            return tec_set_error(tec_errno_status(e), "shm transport: mapping rank %d's region: %s", i, strerror(e));
        }
        t->peer[i] = p;
        bases[i] = p;
    }
    return TEC_OK;
}

static tec_status shm_release_handle(tec_transport *t)
{
    if (t->fd >= 0)
        close(t->fd);
    t->fd = -1;
    return TEC_OK;
}

static void *shm_comm_stream(tec_transport *t) { (void)t; return COMM_STREAM_TAG; }

static tec_status shm_copy(tec_transport *t, void *dst, const void *src, size_t bytes, void *stream)
{
    op_t o = {.kind = OP_COPY, .dst = dst, .src = src, .bytes = bytes};
    return submit(t, &o, stream);
}

static tec_status shm_signal(tec_transport *t, uint64_t *flag, uint64_t value, void *stream)
{
    op_t o = {.kind = OP_SIGNAL, .dst = flag, .value = value};
    return submit(t, &o, stream);
}

static tec_status shm_wait(tec_transport *t, const uint64_t *flag, uint64_t value, double timeout, tec_wait_site s,
                           void *stream)
{
    op_t o = {.kind = OP_WAIT, .src = flag, .value = value, .timeout = timeout, .site = s};
    tec_status st = submit(t, &o, stream);
    if (st != TEC_OK && !is_comm(t, stream))
        set_err(t, st, tec_last_error());
    return st;
}

static tec_status shm_event_record(tec_transport *t, int ev, void *stream)
{
    if (ev < 0 || ev >= TEC_COMM_NEVENTS)
        return tec_set_error(TEC_ERR_INVALID_ARG, "shm transport: event %d out of range", ev);
    op_t o = {.kind = OP_EVREC, .event = ev, .value = ++t->ev_target[ev]};
    return submit(t, &o, stream);
}

static tec_status shm_event_wait(tec_transport *t, int ev, void *stream)
{
    if (ev < 0 || ev >= TEC_COMM_NEVENTS)
        return tec_set_error(TEC_ERR_INVALID_ARG, "shm transport: event %d out of range", ev);
    op_t o = {.kind = OP_EVWAIT, .event = ev, .value = t->ev_target[ev]};
    return submit(t, &o, stream);
}

static tec_status shm_reduce(tec_transport *t, void *out, const void *const *srcs, int nsrc, int64_t rows,
                             int64_t cols, tec_dtype dtype, const void *bias, const tec_reduce_fp8 *fp8, void *stream)
{
    if (nsrc < 1 || nsrc > TEC_COMM_MAX_RANKS)
        return tec_set_error(TEC_ERR_INVALID_ARG, "shm transport: reduce of %d sources", nsrc);
    if (fp8 && fp8->format != TEC_FP8_E4M3 && fp8->format != TEC_FP8_E5M2)
        return tec_set_error(TEC_ERR_INVALID_ARG, "shm transport: reduce of FP8 format %d", (int)fp8->format);
    op_t o = {.kind = OP_REDUCE, .dst = out, .nsrc = nsrc, .rows = rows, .cols = cols, .dtype = dtype, .bias = bias,
              .fp8 = fp8 != NULL};
    if (fp8)
        o.fp8_src = *fp8;
    for (int i = 0; i < nsrc; i++)
        o.srcs[i] = srcs[i];
    return submit(t, &o, stream);
}

static tec_status shm_check(tec_transport *t) { return get_err(t); }

static tec_status shm_synchronize(tec_transport *t, void *stream)
{
    if (is_comm(t, stream)) {
        pthread_mutex_lock(&t->mu);
        while (t->tail != t->head)
            pthread_cond_wait(&t->idle, &t->mu);
        pthread_mutex_unlock(&t->mu);
    }
    return get_err(t);
}

/* Epochs are the core's (host flags): `epochs` is not read, and an ADVANCE
 * step (device-epoch transports only) is refused. */
static tec_status shm_flags(tec_transport *t, const tec_flag_step *steps, int n, double timeout, uint64_t *epochs,
                            void *stream)
{
    (void)epochs;
    if (n < 0 || n > TEC_FLAG_STEPS_MAX || (n && !steps))
        return tec_set_error(TEC_ERR_INVALID_ARG, "shm transport: flags: %d steps (0..%d)", n, TEC_FLAG_STEPS_MAX);
    for (int i = 0; i < n; i++) {
        if (steps[i].kind != TEC_STEP_SIGNAL && steps[i].kind != TEC_STEP_WAIT)
            return tec_set_error(TEC_ERR_INVALID_ARG, "shm transport: flags: step %d of kind %d", i, steps[i].kind);
        tec_status st = steps[i].kind == TEC_STEP_WAIT
                            ? shm_wait(t, steps[i].flag, steps[i].value, timeout, steps[i].site, stream)
                            : shm_signal(t, steps[i].flag, steps[i].value, stream);
        if (st != TEC_OK)
            return st;
    }
    return TEC_OK;
}

const tec_transport_ops tec_shm_transport = {
    .abi_version = TEC_TRANSPORT_ABI,
    .name = "shm",
    .caps = TEC_TRANSPORT_HOST_FLAGS, /* compute-stream calls run on the calling thread */
    .create = shm_create,
    .destroy = shm_destroy,
    .local_handle = shm_local_handle,
    .map_peers = shm_map_peers,
    .release_handle = shm_release_handle,
    .unmap_peers = shm_unmap_peers,
    .comm_stream = shm_comm_stream,
    .copy = shm_copy,
    .signal = shm_signal,
    .wait = shm_wait,
    .event_record = shm_event_record,
    .event_wait = shm_event_wait,
    .reduce = shm_reduce,
    .synchronize = shm_synchronize,
    .check = shm_check,
    .flags = shm_flags,
};
