/* nccl.cu - the engine's own NCCL communicator: all-gather, reduce-scatter
 * and all-reduce enqueued straight on the caller's stream (or, for an
 * asynchronous call, on the communicator's side stream joined back by an
 * event), without a process group's per-call work objects.
 *
 * NCCL is the library the process already has (PyTorch loads it), found at
 * run time with dlopen: nothing of NCCL is needed to build, and a process
 * without it gets a clear error. The few declarations used are NCCL's C ABI,
 * unchanged since NCCL 2.0.
 *
 * Timeouts. Creating a communicator waits for every rank: it runs on a
 * helper thread and the caller waits at most `timeout_s` (then
 * TEC_ERR_TIMEOUT naming the group). A collective waits on its peers on the
 * GPU, where nothing on the host blocks: a watchdog thread per communicator
 * follows each enqueued collective by an event and, if one has not finished
 * `timeout_s` after it was enqueued, reports which collective (kind, number,
 * group) on stderr and ends the process. It also follows each NCCL call
 * itself, which can block on the host (NCCL connects to the peers on an
 * algorithm's first use) and ends the process the same way (what PyTorch's NCCL process group
 * does by default: the results of a collective that never finished would be
 * wrong silently). Collectives enqueued during CUDA graph capture are not
 * followed (their events cannot be queried); the watchdog thread relaxes
 * its own capture mode so that its queries never break another thread's
 * capture.
 *
 * Exercised by tests/test_engine_nccl.py (one rank, one GPU) and, with two
 * ranks, by tests/distributed/run_engine_collectives.py. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_common.h"

namespace {

/* ------------------------------------------------- NCCL's C ABI, as used */

typedef struct ncclComm *ncclComm_t;
typedef struct {
    char internal[TEC_NCCL_ID_BYTES];
} ncclUniqueId;
typedef int ncclResult_t; /* 0: ncclSuccess */
enum { kNcclFloat16 = 6, kNcclFloat32 = 7, kNcclBfloat16 = 9 };
enum { kNcclSum = 0 };

struct nccl_lib {
    ncclResult_t (*get_version)(int *);
    ncclResult_t (*get_unique_id)(ncclUniqueId *);
    ncclResult_t (*comm_init_rank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*comm_destroy)(ncclComm_t);
    ncclResult_t (*comm_abort)(ncclComm_t);
    const char *(*error_string)(ncclResult_t);
    ncclResult_t (*all_gather)(const void *, void *, size_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*reduce_scatter)(const void *, void *, size_t, int, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*all_reduce)(const void *, void *, size_t, int, int, ncclComm_t, cudaStream_t);
    int version;
};

nccl_lib g_lib;
pthread_once_t g_lib_once = PTHREAD_ONCE_INIT;
char g_lib_error[512];

void load_lib(void)
{
    const char *path = getenv("TEC_NCCL_LIBRARY");
    if (!path || !*path)
        path = "libnccl.so.2";
    /* The copy the process has loaded (PyTorch's) first: one NCCL. */
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!h)
        h = dlopen(path, RTLD_NOW);
    if (!h) {
        snprintf(g_lib_error, sizeof g_lib_error, "cannot load NCCL (%s): %s", path, dlerror());
        return;
    }
    nccl_lib l;
    memset(&l, 0, sizeof l);
#define TEC_NCCL_SYM(field, name)                                                                          \
    if (!(*(void **)&l.field = dlsym(h, name))) {                                                       \
        snprintf(g_lib_error, sizeof g_lib_error, "%s has no %s", path, name);                          \
        return;                                                                                         \
    }
    TEC_NCCL_SYM(get_version, "ncclGetVersion");
    TEC_NCCL_SYM(get_unique_id, "ncclGetUniqueId");
    TEC_NCCL_SYM(comm_init_rank, "ncclCommInitRank");
    TEC_NCCL_SYM(comm_destroy, "ncclCommDestroy");
    TEC_NCCL_SYM(comm_abort, "ncclCommAbort");
    TEC_NCCL_SYM(error_string, "ncclGetErrorString");
    TEC_NCCL_SYM(all_gather, "ncclAllGather");
    TEC_NCCL_SYM(reduce_scatter, "ncclReduceScatter");
    TEC_NCCL_SYM(all_reduce, "ncclAllReduce");
#undef TEC_NCCL_SYM
    /* 2.10 (code 21000; bfloat16). Codes before 2.9 were 2xyz: all smaller. */
    if (l.get_version(&l.version) != 0 || l.version < 21000) {
        snprintf(g_lib_error, sizeof g_lib_error, "%s: NCCL version code %d is older than 2.10", path, l.version);
        return;
    }
    g_lib = l;
}

tec_status lib(const nccl_lib **out)
{
    pthread_once(&g_lib_once, load_lib);
    if (!g_lib.all_gather)
        return TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED, "engine collectives: %s", g_lib_error);
    *out = &g_lib;
    return TEC_OK;
}

#define TEC_NCCL_FAIL(r, what) \
    TEC_CUDA_FAIL(TEC_ERR_NCCL, "%s: NCCL error %d (%s)", (what), (int)(r), g_lib.error_string(r))

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A condition variable on CLOCK_MONOTONIC (a wall-clock jump moves no deadline). */
void cond_init(pthread_cond_t *cv)
{
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
}

struct timespec deadline(double after_s)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    const double t = (double)ts.tv_nsec * 1e-9 + after_s;
    ts.tv_sec += (time_t)t;
    ts.tv_nsec = (long)((t - (double)(time_t)t) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec += 1;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

const char *op_name(int op)
{
    switch (op) {
    case TEC_NCCL_ALL_GATHER: return "all-gather";
    case TEC_NCCL_REDUCE_SCATTER: return "reduce-scatter";
    default: return "all-reduce";
    }
}

constexpr int kRing = 64; /* collectives followed at once (older ones: overwritten) */

struct slot {
    cudaEvent_t ev;
    unsigned long long seq;
    double t; /* when it was enqueued */
    int op, pending;
};

} /* namespace */

struct tec_nccl {
    const nccl_lib *lib;
    ncclComm_t comm;
    int device, nranks, rank;
    double timeout_s;
    char label[160];
    cudaStream_t side;   /* asynchronous calls */
    cudaEvent_t fork;    /* the caller's stream -> side */
    slot ring[kRing];
    unsigned long long seq;
    pthread_mutex_t lock; /* ring and stop, between the callers and the watchdog */
    pthread_mutex_t issue; /* one enqueue at a time: an NCCL communicator is not thread-safe */
    pthread_cond_t wake;
    pthread_t watchdog;
    int watching, stop, closed;
    double in_call_since; /* > 0 while an NCCL call runs (under lock) */
    int in_call_op;
};

namespace {

/* The watchdog's end of the process (justified in the header comment):
 * `what` says whether the collective never finished on the GPU or its NCCL
 * call never returned on the host. */
void fire(tec_nccl *c, const char *what, int op, unsigned long long seq, double waited)
{
    fprintf(stderr,
            "transformer_engine_c: NCCL %s #%llu of %s (rank %d of %d, cuda:%d): %s %.1f s ago (timeout %.1f s): a "
            "peer rank stopped, or called another collective. Ending this process: the collective's results "
            "would be wrong.\n",
            op_name(op), seq, c->label, c->rank, c->nranks, c->device, what, waited, c->timeout_s);
    fflush(stderr);
    _exit(1);
}

void *watch(void *arg)
{
    tec_nccl *c = (tec_nccl *)arg;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    tec_cuda_ignore(cudaSetDevice(c->device));
    tec_cuda_ignore(cudaThreadExchangeStreamCaptureMode(&mode));
    const double period = c->timeout_s / 8 < 0.1 ? c->timeout_s / 8 : 0.1;
    pthread_mutex_lock(&c->lock);
    while (!c->stop) {
        const struct timespec until = deadline(period);
        pthread_cond_timedwait(&c->wake, &c->lock, &until);
        if (c->stop)
            break;
        const double now = now_s();
        if (c->in_call_since > 0 && now - c->in_call_since > c->timeout_s)
            fire(c, "its NCCL call has not returned (NCCL waits there for the peers to connect), made", c->in_call_op,
                 c->seq + 1, now - c->in_call_since);
        for (int i = 0; i < kRing; i++) {
            slot *s = &c->ring[i];
            if (!s->pending)
                continue;
            cudaError_t e = cudaEventQuery(s->ev);
            if (e == cudaErrorNotReady) {
                if (now - s->t > c->timeout_s)
                    fire(c, "has not finished, enqueued", s->op, s->seq, now - s->t);
                continue;
            }
            tec_cuda_ignore(e); /* done (or failed: the next CUDA call reports it) */
            s->pending = 0;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

/* Communicator creation on a helper thread, so that the caller's wait has
 * a deadline. `abandoned` and `done` under `lock`; the last one out frees. */
struct init_job {
    const nccl_lib *lib;
    ncclUniqueId id;
    int device, nranks, rank;
    ncclComm_t comm;
    ncclResult_t result;
    cudaError_t cuda;
    pthread_mutex_t lock;
    pthread_cond_t done_cv;
    int done, abandoned;
};

void *init_thread(void *arg)
{
    init_job *j = (init_job *)arg;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed; /* its allocations must not break a capture */
    j->cuda = cudaSetDevice(j->device);
    if (j->cuda == cudaSuccess)
        j->cuda = cudaThreadExchangeStreamCaptureMode(&mode);
    ncclComm_t comm = NULL;
    ncclResult_t r = 1;
    if (j->cuda == cudaSuccess)
        r = j->lib->comm_init_rank(&comm, j->nranks, j->id, j->rank);
    else
        (void)cudaGetLastError();
    pthread_mutex_lock(&j->lock);
    j->comm = comm;
    j->result = r;
    j->done = 1;
    const int abandoned = j->abandoned;
    pthread_cond_signal(&j->done_cv);
    pthread_mutex_unlock(&j->lock);
    if (abandoned) { /* the caller timed out and left: clean up here */
        if (r == 0 && comm)
            j->lib->comm_destroy(comm);
        pthread_mutex_destroy(&j->lock);
        pthread_cond_destroy(&j->done_cv);
        free(j);
    }
    return NULL;
}

tec_status init_comm(const nccl_lib *l, int device, const unsigned char *id, int nranks, int rank, double timeout_s,
                     const char *label, ncclComm_t *out)
{
    init_job *j = (init_job *)calloc(1, sizeof *j);
    if (!j)
        return TEC_CUDA_FAIL(TEC_ERR_NO_MEMORY, "engine collectives: out of host memory");
    j->lib = l;
    memcpy(j->id.internal, id, TEC_NCCL_ID_BYTES);
    j->device = device;
    j->nranks = nranks;
    j->rank = rank;
    pthread_mutex_init(&j->lock, NULL);
    cond_init(&j->done_cv);
    pthread_t th;
    if (pthread_create(&th, NULL, init_thread, j) != 0) {
        pthread_mutex_destroy(&j->lock);
        pthread_cond_destroy(&j->done_cv);
        free(j);
        return TEC_CUDA_FAIL(TEC_ERR_SYSTEM, "engine collectives: cannot start the NCCL init thread");
    }
    pthread_detach(th);
    const struct timespec until = deadline(timeout_s);
    pthread_mutex_lock(&j->lock);
    while (!j->done)
        if (pthread_cond_timedwait(&j->done_cv, &j->lock, &until) != 0 && !j->done)
            break;
    if (!j->done) {
        j->abandoned = 1; /* the thread frees it when NCCL returns */
        pthread_mutex_unlock(&j->lock);
        return TEC_CUDA_FAIL(TEC_ERR_TIMEOUT,
                             "creating the NCCL communicator of %s (rank %d of %d, cuda:%d): not every rank "
                             "joined within %.1f s",
                             label, rank, nranks, device, timeout_s);
    }
    pthread_mutex_unlock(&j->lock);
    const ncclResult_t r = j->result;
    const cudaError_t ce = j->cuda;
    *out = j->comm;
    pthread_mutex_destroy(&j->lock);
    pthread_cond_destroy(&j->done_cv);
    free(j);
    if (ce != cudaSuccess)
        return TEC_CUDA_FAIL(tec_cuda_status(ce), "engine collectives: cannot use cuda:%d: %s", device,
                             cudaGetErrorString(ce));
    if (r != 0)
        return TEC_NCCL_FAIL(r, "ncclCommInitRank");
    return TEC_OK;
}

/* The communicator goes first, while the watchdog still runs: destroying it
 * waits for its unfinished collectives, which the watchdog bounds. */
void release(tec_nccl *c, int abort_comm)
{
    if (c->comm) {
        if (abort_comm)
            c->lib->comm_abort(c->comm);
        else
            c->lib->comm_destroy(c->comm);
        c->comm = NULL;
    }
    if (c->watching) {
        pthread_mutex_lock(&c->lock);
        c->stop = 1;
        pthread_cond_signal(&c->wake);
        pthread_mutex_unlock(&c->lock);
        pthread_join(c->watchdog, NULL);
        c->watching = 0;
    }
    for (int i = 0; i < kRing; i++)
        if (c->ring[i].ev)
            tec_cuda_ignore(cudaEventDestroy(c->ring[i].ev));
    if (c->fork)
        tec_cuda_ignore(cudaEventDestroy(c->fork));
    if (c->side)
        tec_cuda_ignore(cudaStreamDestroy(c->side));
    memset(c->ring, 0, sizeof c->ring);
    c->fork = NULL;
    c->side = NULL;
}

int nccl_dtype(tec_dtype dt)
{
    return dt == TEC_F32 ? kNcclFloat32 : dt == TEC_BF16 ? kNcclBfloat16 : kNcclFloat16;
}

} /* namespace */

/* ============================================================ entry points */

tec_status tec_cuda_nccl_unique_id(unsigned char *id)
{
    const nccl_lib *l;
    tec_status s = lib(&l);
    if (s != TEC_OK)
        return s;
    ncclUniqueId u;
    const ncclResult_t r = l->get_unique_id(&u);
    if (r != 0)
        return TEC_NCCL_FAIL(r, "ncclGetUniqueId");
    memcpy(id, u.internal, TEC_NCCL_ID_BYTES);
    return TEC_OK;
}

tec_status tec_cuda_nccl_create(int device, const unsigned char *id, int nranks, int rank, double timeout_s,
                                const char *label, tec_nccl **out)
{
    const nccl_lib *l;
    tec_status s = lib(&l);
    if (s != TEC_OK)
        return s;
    TEC_CUDA_ENTER(device);
    tec_nccl *c = (tec_nccl *)calloc(1, sizeof *c);
    if (!c)
        return TEC_CUDA_FAIL(TEC_ERR_NO_MEMORY, "engine collectives: out of host memory");
    c->lib = l;
    c->device = device;
    c->nranks = nranks;
    c->rank = rank;
    c->timeout_s = timeout_s;
    snprintf(c->label, sizeof c->label, "%s", label && *label ? label : "a process group");
    pthread_mutex_init(&c->lock, NULL);
    pthread_mutex_init(&c->issue, NULL);
    cond_init(&c->wake);
    TEC_CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking), s, fail);
    TEC_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&c->fork, cudaEventDisableTiming), s, fail);
    for (int i = 0; i < kRing; i++)
        TEC_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&c->ring[i].ev, cudaEventDisableTiming), s, fail);
    if ((s = init_comm(l, device, id, nranks, rank, timeout_s, c->label, &c->comm)) != TEC_OK)
        goto fail;
    if (pthread_create(&c->watchdog, NULL, watch, c) != 0) {
        s = TEC_CUDA_FAIL(TEC_ERR_SYSTEM, "engine collectives: cannot start the watchdog thread");
        goto fail;
    }
    c->watching = 1;
    *out = c;
    return TEC_OK;
fail:
    release(c, 1);
    pthread_mutex_destroy(&c->lock);
    pthread_mutex_destroy(&c->issue);
    pthread_cond_destroy(&c->wake);
    free(c);
    return s;
}

/* `count` elements: per rank for all-gather's input and reduce-scatter's
 * output, the whole tensor for all-reduce. With `async`, the collective
 * runs on the side stream after `stream`'s work so far (on `stream` itself
 * while it is being captured: the shared side stream must never join a
 * capture another thread's calls could then fall into); *ticket names it
 * for tec_cuda_nccl_join. */
tec_status tec_cuda_nccl_run(tec_nccl *c, int op, const void *send, void *recv, size_t count, tec_dtype dt,
                             void *stream, int async, uint64_t *ticket)
{
    TEC_CUDA_ENTER(c->device);
    cudaStream_t st = (cudaStream_t)stream;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    const int t = nccl_dtype(dt);
    ncclResult_t r;
    unsigned long long seq = 0;
    tec_status s = TEC_OK;
    /* One call at a time (a forward's thread and autograd's may both call;
     * their order must still match across ranks): NCCL takes one call at a
     * time on a communicator, the side stream's fork event is shared, a ring
     * slot must follow the collective it was recorded after, and close()
     * must not destroy the communicator under a call. */
    pthread_mutex_lock(&c->issue);
    if (c->closed) {
        s = TEC_CUDA_FAIL(TEC_ERR_CLOSED, "engine collectives: the communicator of %s is closed", c->label);
        goto out;
    }
    TEC_CUDA_CHECK_GOTO(cudaStreamIsCapturing(st, &cap), s, out);
    if (async && cap == cudaStreamCaptureStatusNone) {
        TEC_CUDA_CHECK_GOTO(cudaEventRecord(c->fork, st), s, out);
        TEC_CUDA_CHECK_GOTO(cudaStreamWaitEvent(c->side, c->fork, 0), s, out);
        st = c->side;
    }
    pthread_mutex_lock(&c->lock); /* the watchdog follows the call itself too */
    c->in_call_since = now_s();
    c->in_call_op = op;
    pthread_mutex_unlock(&c->lock);
    switch (op) {
    case TEC_NCCL_ALL_GATHER: r = c->lib->all_gather(send, recv, count, t, c->comm, st); break;
    case TEC_NCCL_REDUCE_SCATTER: r = c->lib->reduce_scatter(send, recv, count, t, kNcclSum, c->comm, st); break;
    default: r = c->lib->all_reduce(send, recv, count, t, kNcclSum, c->comm, st); break;
    }
    pthread_mutex_lock(&c->lock);
    c->in_call_since = 0;
    if (r == 0) {
        seq = ++c->seq;
        slot *sl = &c->ring[seq % kRing];
        const cudaError_t e = cudaEventRecord(sl->ev, st);
        if (e == cudaSuccess) {
            sl->seq = seq;
            sl->op = op;
            sl->t = now_s();
            sl->pending = cap == cudaStreamCaptureStatusNone;
        } else {
            (void)cudaGetLastError();
            sl->seq = 0; /* no ticket names this slot now */
            sl->pending = 0;
            s = TEC_CUDA_FAIL(tec_cuda_status(e), "engine collectives: cudaEventRecord: %s", cudaGetErrorString(e));
        }
    }
    pthread_mutex_unlock(&c->lock);
    if (r != 0)
        s = TEC_NCCL_FAIL(r, op == TEC_NCCL_ALL_GATHER ? "ncclAllGather"
                             : op == TEC_NCCL_REDUCE_SCATTER ? "ncclReduceScatter" : "ncclAllReduce");
out:
    pthread_mutex_unlock(&c->issue);
    if (s == TEC_OK && ticket)
        *ticket = seq;
    return s;
}

/* `stream` waits (on the device) for the asynchronous collective `ticket`,
 * which must be one of the communicator's last kRing collectives (its slot
 * not yet reused: an error otherwise, not a wait on another collective). */
tec_status tec_cuda_nccl_join(tec_nccl *c, uint64_t ticket, void *stream)
{
    TEC_CUDA_ENTER(c->device);
    tec_status s = TEC_OK;
    pthread_mutex_lock(&c->issue); /* the slot's event is re-recorded under it */
    const slot *sl = &c->ring[ticket % kRing];
    if (c->closed)
        s = TEC_CUDA_FAIL(TEC_ERR_CLOSED, "engine collectives: the communicator of %s is closed", c->label);
    else if (ticket == 0 || sl->seq != ticket)
        s = TEC_CUDA_FAIL(TEC_ERR_INVALID_ARG,
                          "engine collectives: collective #%llu of %s cannot be waited for any more (%d or more "
                          "collectives were issued after it, or it never ran)",
                          (unsigned long long)ticket, c->label, kRing);
    else
        TEC_CUDA_CHECK_GOTO(cudaStreamWaitEvent((cudaStream_t)stream, sl->ev, 0), s, out);
out:
    pthread_mutex_unlock(&c->issue);
    return s;
}

/* Destroy (or abort) the NCCL communicator and stop the watchdog (once);
 * the handle stays valid (every later call fails as closed) until
 * tec_cuda_nccl_free. */
void tec_cuda_nccl_close(tec_nccl *c, int abort_comm)
{
    pthread_mutex_lock(&c->issue);
    if (!c->closed) {
        c->closed = 1;
        tec_cuda_device_scope scope(c->device);
        release(c, abort_comm);
    }
    pthread_mutex_unlock(&c->issue);
}

void tec_cuda_nccl_free(tec_nccl *c)
{
    if (!c)
        return;
    tec_cuda_nccl_close(c, 0);
    pthread_mutex_destroy(&c->lock);
    pthread_mutex_destroy(&c->issue);
    pthread_cond_destroy(&c->wake);
    free(c);
}

int tec_cuda_nccl_version(void)
{
    const nccl_lib *l;
    return lib(&l) == TEC_OK ? l->version : 0;
}

const tec_nccl_ops tec_cuda_nccl = {
    tec_cuda_nccl_unique_id, tec_cuda_nccl_create, tec_cuda_nccl_run, tec_cuda_nccl_join,
    tec_cuda_nccl_close,     tec_cuda_nccl_free,   tec_cuda_nccl_version,
};
