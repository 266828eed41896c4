/* The overlap schedules of csrc/core/comm.c against a mock transport and backend, on
 * the CPU, in one process: built with comm.c, comm_lifetime.c, tec.c and error.c and run by
 * tests/test_comm_schedule.py. Prints "PASS comm_schedule_test" and exits 0.
 *
 * The mock runs every rank's comm stream and compute stream as queues that a seeded
 * random scheduler drains in any order the ops' dependencies allow (flag waits, event
 * waits): the loosest ordering a real asynchronous device may show. Each scenario
 * (AG+GEMM, GEMM+RS, acquire + a direct write, bulk AG, bulk RS; tp 1..4; with either
 * capability set, i.e. the CUDA and the CPU issue orders) runs over many seeds with
 * fresh data every step, and every output is checked against a float64 reference.
 * Failures: a rank that never arrives (its peers' waits time out, reported with the
 * step and peer, and the absent peer named where flags are host memory), and
 * mismatched shapes across ranks (the tag check). Negative check: a mock that ignores
 * waits must be caught by the same output checks. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "error.h"
#include "transport.h"

static int failures;
#define CHECK(cond, ...)                                                                          \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                           \
            printf(__VA_ARGS__);                                                                  \
            printf("\n");                                                                         \
            failures++;                                                                           \
        }                                                                                         \
    } while (0)

/* ================================================================ streams */

enum { K_COPY, K_SIGNAL, K_WAIT, K_EVREC, K_EVWAIT, K_REDUCE, K_GEMM, K_ADVANCE };
enum { QMAX = 1024, NRANKS = TEC_COMM_MAX_RANKS };

typedef struct {
    int kind;
    void *dst;
    const void *src;
    size_t bytes;
    uint64_t *flag;
    uint64_t value;
    uint64_t *epochs; /* device epochs: value's epoch is read from here when the op runs */
    int epoch_ref;    /* TEC_EPOCH_* */
    double timeout;
    tec_wait_site site;
    int event;
    uint64_t ticket;
    const void *srcs[NRANKS];
    int nsrc;
    int64_t rows, cols;
    const void *bias;
    tec_gemm_args g;
} op_t;

typedef struct mock_stream {
    struct tec_transport *owner;
    op_t q[QMAX];
    int head, tail;
} mock_stream;

struct tec_transport {
    int rank, size;
    size_t bytes;
    unsigned char *base;
    mock_stream M, S; /* the comm stream and the rank's compute stream */
    uint64_t ev_issued[TEC_COMM_NEVENTS], ev_done[TEC_COMM_NEVENTS];
    int failed; /* tec_status of the first failed wait (sticky) */
    uint64_t seen, want;
    double timeout;
    tec_wait_site site;
};

static tec_transport *g_rank[NRANKS]; /* the mock's "IPC": rank -> transport */
static int g_ignore_waits;             /* the negative check: waits never hold anything back */
static int g_quiet;                    /* negative checks: failures expected, not reported */
static uint64_t g_rng = 1;

/* "CUDA graph capture": while g_capturing, enqueued ops are recorded
 * instead of queued; replay() enqueues the recording again, as a graph
 * launch runs the captured nodes again (event edges kept, by re-issuing
 * records and waits in capture order; flag values exactly as captured). */
enum { CAPMAX = 4096 };
static struct {
    mock_stream *s;
    op_t o;
} g_cap[CAPMAX];
static int g_ncap, g_capturing;

static uint64_t rng(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

static tec_status push(void *stream, const op_t *o)
{
    mock_stream *s = stream;
    if (!s)
        return tec_set_error(TEC_ERR_INVALID_ARG, "mock: no stream");
    if (g_capturing) {
        if (g_ncap == CAPMAX)
            return tec_set_error(TEC_ERR_INTERNAL, "mock: capture full");
        g_cap[g_ncap].s = s;
        g_cap[g_ncap++].o = *o;
        return TEC_OK;
    }
    if (s->tail == QMAX)
        return tec_set_error(TEC_ERR_INTERNAL, "mock: stream queue full");
    s->q[s->tail++] = *o;
    return TEC_OK;
}

/* ------------------------------------------------------------- executing */

/* A flag op's value when it runs: with device epochs, its epoch comes from
 * the rank's EPOCH words now (transport.h); 0 for a CONSUMED wait before
 * anything was published (nothing to wait for). */
static uint64_t value_now(const op_t *o)
{
    if (!o->epochs)
        return o->value;
    const uint64_t e = o->epoch_ref == TEC_EPOCH_PUBLISHED ? o->epochs[1] : o->epochs[0] + 1;
    return e ? tec_flag_value(e, (uint32_t)o->value) : 0;
}

static void run_gemm(const tec_gemm_args *g)
{
    const float *A = g->a, *B = g->b, *bias = g->bias;
    float *C = g->c;
    for (int64_t i = 0; i < g->m; i++)
        for (int64_t j = 0; j < g->n; j++) {
            float acc = 0.0f;
            for (int64_t p = 0; p < g->k; p++)
                acc += A[i * g->lda + p] * (g->transb ? B[j * g->ldb + p] : B[p * g->ldb + j]);
            if (bias)
                acc += bias[j];
            C[i * g->ldc + j] = g->accumulate ? C[i * g->ldc + j] + acc : acc;
        }
}

/* Can the head of s run now? (a flag or event wait that holds) */
static int runnable(mock_stream *s)
{
    if (s->head == s->tail)
        return 0;
    const op_t *o = &s->q[s->head];
    tec_transport *t = s->owner;
    if (o->kind == K_WAIT)
        return g_ignore_waits || t->failed ||
               tec_flag_epoch(__atomic_load_n(o->flag, __ATOMIC_ACQUIRE)) >= tec_flag_epoch(value_now(o));
    if (o->kind == K_EVWAIT)
        return t->ev_done[o->event] >= o->ticket;
    return 1;
}

static void record_failure(tec_transport *t, int st, const op_t *o, uint64_t seen)
{
    if (t->failed)
        return;
    t->failed = st;
    t->seen = seen;
    t->want = value_now(o);
    t->timeout = o->timeout;
    t->site = o->site;
}

static void execute(mock_stream *s)
{
    op_t *o = &s->q[s->head++];
    tec_transport *t = s->owner;
    switch (o->kind) {
    case K_COPY: memcpy(o->dst, o->src, o->bytes); break;
    case K_SIGNAL:
        if (!t->failed) /* a broken transport signals nothing (peers then time out) */
            __atomic_store_n(o->flag, value_now(o), __ATOMIC_RELEASE);
        break;
    case K_WAIT: {
        const uint64_t seen = __atomic_load_n(o->flag, __ATOMIC_ACQUIRE), want = value_now(o);
        if (!g_ignore_waits && !t->failed && tec_flag_epoch(seen) == tec_flag_epoch(want) &&
            (uint32_t)seen != (uint32_t)want)
            record_failure(t, TEC_ERR_INVALID_ARG, o, seen);
        break;
    }
    case K_ADVANCE:
        o->epochs[0]++;
        if (o->value)
            o->epochs[1] = o->epochs[0];
        break;
    case K_EVREC: t->ev_done[o->event] = o->ticket; break;
    case K_EVWAIT: break;
    case K_REDUCE: {
        float *out = o->dst;
        const float *bias = o->bias;
        for (int64_t i = 0; i < o->rows * o->cols; i++) {
            float acc = 0.0f;
            for (int p = 0; p < o->nsrc; p++)
                acc += ((const float *)o->srcs[p])[i];
            out[i] = acc + (bias ? bias[i % o->cols] : 0.0f);
        }
        break;
    }
    case K_GEMM: run_gemm(&o->g); break;
    }
    if (s->head == s->tail)
        s->head = s->tail = 0;
}

/* Drain every rank's streams in a random order the dependencies allow. When
 * nothing can run, the first blocked flag wait times out (as a GPU wait
 * kernel would after its deadline). Returns 0 if an event wait can never
 * complete (a schedule bug). */
static int drain(void)
{
    mock_stream *ready[2 * NRANKS];
    for (;;) {
        int n = 0, pending = 0;
        for (int r = 0; r < NRANKS; r++) {
            tec_transport *t = g_rank[r];
            if (!t)
                continue;
            mock_stream *both[2] = {&t->M, &t->S};
            for (int i = 0; i < 2; i++) {
                pending += both[i]->head != both[i]->tail;
                if (runnable(both[i]))
                    ready[n++] = both[i];
            }
        }
        if (!pending)
            return 1;
        if (n) {
            execute(ready[rng() % (uint64_t)n]);
            continue;
        }
        int timed_out = 0;
        for (int r = 0; r < NRANKS && !timed_out; r++) {
            tec_transport *t = g_rank[r];
            if (!t)
                continue;
            mock_stream *both[2] = {&t->M, &t->S};
            for (int i = 0; i < 2 && !timed_out; i++) {
                mock_stream *s = both[i];
                if (s->head != s->tail && s->q[s->head].kind == K_WAIT) {
                    record_failure(t, TEC_ERR_TIMEOUT, &s->q[s->head], __atomic_load_n(s->q[s->head].flag,
                                                                                         __ATOMIC_ACQUIRE));
                    execute(s);
                    timed_out = 1;
                }
            }
        }
        if (!timed_out) {
            printf("FAIL an event wait can never complete (a record it waits for is never issued)\n");
            failures++;
            return 0;
        }
    }
}

/* ============================================================ the mock table */

static tec_status m_create(tec_transport **out, int device, int rank, int size, size_t bytes)
{
    tec_transport *t = calloc(1, sizeof *t);
    if (!t || !(t->base = calloc(1, bytes))) {
        free(t);
        return tec_set_error(TEC_ERR_NO_MEMORY, "mock: no memory");
    }
    t->rank = rank;
    t->size = size;
    t->bytes = bytes;
    t->M.owner = t->S.owner = t;
    g_rank[rank] = t;
    *out = t;
    return TEC_OK;
}

static void m_destroy(tec_transport *t)
{
    if (!t)
        return;
    if (g_rank[t->rank] == t)
        g_rank[t->rank] = NULL;
    free(t->base);
    free(t);
}

static tec_status m_local_handle(tec_transport *t, void *out, size_t *len)
{
    memcpy(out, &t->rank, sizeof t->rank);
    *len = sizeof t->rank;
    return TEC_OK;
}

static tec_status m_map_peers(tec_transport *t, const void *const *handles, const size_t *lens, void **bases)
{
    for (int i = 0; i < t->size; i++) {
        int r;
        memcpy(&r, handles[i], sizeof r);
        if (i != t->rank && (lens[i] != sizeof r || r != i || !g_rank[r]))
            return tec_set_error(TEC_ERR_INVALID_ARG, "mock: bad handle of rank %d", i);
        bases[i] = i == t->rank ? t->base : g_rank[r]->base;
    }
    return TEC_OK;
}

static void m_unmap_peers(tec_transport *t) { (void)t; }
static void *m_comm_stream(tec_transport *t) { return &t->M; }

static tec_status m_copy(tec_transport *t, void *dst, const void *src, size_t bytes, void *stream)
{
    op_t o = {.kind = K_COPY, .dst = dst, .src = src, .bytes = bytes};
    return push(stream, &o);
}

static tec_status m_signal(tec_transport *t, uint64_t *flag, uint64_t value, void *stream)
{
    op_t o = {.kind = K_SIGNAL, .flag = flag, .value = value};
    return push(stream, &o);
}

static tec_status m_check(tec_transport *t)
{
    if (!t->failed)
        return TEC_OK;
    char msg[768];
    tec_format_wait_error(msg, sizeof msg, (tec_status)t->failed, t->site, t->timeout, t->seen, t->want);
    return tec_set_error((tec_status)t->failed, "%s", msg);
}

static tec_status m_wait(tec_transport *t, const uint64_t *flag, uint64_t value, double timeout_s,
                         tec_wait_site site, void *stream)
{
    tec_status st = m_check(t);
    if (st)
        return st;
    op_t o = {.kind = K_WAIT, .flag = (uint64_t *)flag, .value = value, .timeout = timeout_s, .site = site};
    return push(stream, &o);
}

static tec_status m_event_record(tec_transport *t, int ev, void *stream)
{
    if (ev < 0 || ev >= TEC_COMM_NEVENTS)
        return tec_set_error(TEC_ERR_INVALID_ARG, "mock: event %d", ev);
    op_t o = {.kind = K_EVREC, .event = ev, .ticket = ++t->ev_issued[ev]};
    return push(stream, &o);
}

static tec_status m_event_wait(tec_transport *t, int ev, void *stream)
{
    if (ev < 0 || ev >= TEC_COMM_NEVENTS)
        return tec_set_error(TEC_ERR_INVALID_ARG, "mock: event %d", ev);
    op_t o = {.kind = K_EVWAIT, .event = ev, .ticket = t->ev_issued[ev]}; /* the latest record, as CUDA */
    return push(stream, &o);
}

static tec_status m_reduce(tec_transport *t, void *out, const void *const *srcs, int nsrc, int64_t rows,
                           int64_t cols, tec_dtype dtype, const void *bias, const tec_reduce_fp8 *fp8, void *stream)
{
    if (dtype != TEC_F32 || fp8 || nsrc < 1 || nsrc > NRANKS)
        return tec_set_error(TEC_ERR_INVALID_ARG, "mock: reduce of %d sources of dtype %d", nsrc, (int)dtype);
    op_t o = {.kind = K_REDUCE, .dst = out, .nsrc = nsrc, .rows = rows, .cols = cols, .bias = bias};
    memcpy(o.srcs, srcs, (size_t)nsrc * sizeof *srcs);
    return push(stream, &o);
}

static tec_status m_synchronize(tec_transport *t, void *stream)
{
    drain();
    return m_check(t);
}

static tec_transport_ops mock_transport;

/* With TEC_TRANSPORT_DEVICE_EPOCHS in the mock's caps, epochs are resolved
 * when each op runs (value_now) and ADVANCE steps are accepted. */
static tec_status m_flags(tec_transport *t, const tec_flag_step *steps, int n, double timeout_s, uint64_t *epochs,
                          void *stream)
{
    if (n < 0 || n > TEC_FLAG_STEPS_MAX)
        return tec_set_error(TEC_ERR_INVALID_ARG, "mock: flags: %d steps (0..%d)", n, TEC_FLAG_STEPS_MAX);
    const int dev = (mock_transport.caps & TEC_TRANSPORT_DEVICE_EPOCHS) != 0;
    for (int i = 0; i < n; i++) {
        const tec_flag_step *s = &steps[i];
        if (s->kind == TEC_STEP_ADVANCE && !dev)
            return tec_set_error(TEC_ERR_INVALID_ARG, "mock: ADVANCE step without device epochs");
        if (s->kind == TEC_STEP_WAIT && m_check(t))
            return m_check(t);
        op_t o = {.kind = s->kind == TEC_STEP_WAIT ? K_WAIT : s->kind == TEC_STEP_SIGNAL ? K_SIGNAL : K_ADVANCE,
                  .flag = s->flag, .value = s->value, .epochs = dev ? epochs : NULL, .epoch_ref = s->epoch,
                  .timeout = timeout_s, .site = s->site};
        tec_status st = push(stream, &o);
        if (st)
            return st;
    }
    return TEC_OK;
}

/* Run the recording again on the same streams (a graph launch): each
 * record gets a new ticket and each wait the latest record's, in capture
 * order, so the captured event edges hold again. */
static tec_status replay(void)
{
    for (int i = 0; i < g_ncap; i++) {
        op_t o = g_cap[i].o;
        tec_transport *t = g_cap[i].s->owner;
        if (o.kind == K_EVREC)
            o.ticket = ++t->ev_issued[o.event];
        else if (o.kind == K_EVWAIT)
            o.ticket = t->ev_issued[o.event];
        tec_status st = push(g_cap[i].s, &o);
        if (st)
            return st;
    }
    return TEC_OK;
}

static tec_transport_ops mock_transport = {
    .abi_version = TEC_TRANSPORT_ABI,
    .name = "mock",
    .caps = TEC_TRANSPORT_ASYNC,
    .create = m_create,
    .destroy = m_destroy,
    .local_handle = m_local_handle,
    .map_peers = m_map_peers,
    .unmap_peers = m_unmap_peers,
    .comm_stream = m_comm_stream,
    .copy = m_copy,
    .signal = m_signal,
    .wait = m_wait,
    .event_record = m_event_record,
    .event_wait = m_event_wait,
    .reduce = m_reduce,
    .synchronize = m_synchronize,
    .check = m_check,
    .flags = m_flags,
};

/* The backend tec.c dispatches to: its GEMM is enqueued on the caller's stream. */
static tec_status b_gemm(int device, const tec_gemm_args *a, void *stream)
{
    if (a->ab_dtype != TEC_F32 || a->c_dtype != TEC_F32 || a->transa)
        return tec_set_error(TEC_ERR_NOT_SUPPORTED, "mock gemm: float32, transa = 0 only");
    op_t o = {.kind = K_GEMM, .g = *a};
    return push(stream, &o);
}
static tec_status b_norm_fwd(int device, const tec_norm_fwd_args *a, void *stream)
{
    return tec_set_error(TEC_ERR_NOT_SUPPORTED, "mock: no norm");
}
static tec_status b_norm_bwd(int device, const tec_norm_bwd_args *a, void *stream)
{
    return tec_set_error(TEC_ERR_NOT_SUPPORTED, "mock: no norm");
}
static size_t b_norm_ws(int device, int64_t rows, int64_t cols) { return 0; }

const tec_backend tec_cpu_backend = {
    .abi_version = TEC_BACKEND_ABI,
    .name = "mock",
    .norm_fwd = b_norm_fwd,
    .norm_bwd = b_norm_bwd,
    .norm_bwd_workspace_bytes = b_norm_ws,
    .gemm = b_gemm,
    .gemm_workspace_bytes = 0,
    .transport = &mock_transport,
};

/* ============================================================== scenarios */

enum { ROWS = 3, K = 5, N = 4, BUF = 4096 };

static float frand(void) { return (float)((double)(rng() % 2001) / 1000.0 - 1.0); }
static void fill(float *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = frand();
}

static int close_to(float got, double want) { return fabs(got - want) <= 1e-4 * (1.0 + fabs(want)); }

/* tp communicators wired together (handles exchanged in rank order). */
static int open_group(tec_comm **c, int tp, const char *name)
{
    unsigned char h[NRANKS][512];
    const void *hp[NRANKS];
    size_t len[NRANKS];
    for (int r = 0; r < tp; r++) {
        if (tec_comm_create(&c[r], TEC_TRANSPORT_SHM, TEC_DEVICE_CPU, r, tp, BUF, name, 1.0) != TEC_OK ||
            tec_comm_local_handle(c[r], h[r], sizeof h[r], &len[r]) != TEC_OK) {
            printf("FAIL creating rank %d of %d: %s\n", r, tp, tec_last_error());
            failures++;
            return 0;
        }
        hp[r] = h[r];
    }
    for (int r = 0; r < tp; r++)
        if (tec_comm_open_peers(c[r], hp, len) != TEC_OK) {
            printf("FAIL opening rank %d: %s\n", r, tec_last_error());
            failures++;
            return 0;
        }
    return 1;
}

static void close_group(tec_comm **c, int tp)
{
    for (int r = 0; r < tp; r++) {
        tec_comm_destroy(c[r]);
        c[r] = NULL;
    }
}

#define S_OF(c) ((void *)&g_rank[tec_comm_rank(c)]->S)

/* Every rank calls `what`; then every rank synchronizes. */
static int sync_all(tec_comm **c, int tp, const char *what)
{
    int ok = 1;
    for (int r = 0; r < tp; r++)
        if (tec_comm_synchronize(c[r], S_OF(c[r])) != TEC_OK) {
            if (!g_quiet)
                printf("FAIL %s: rank %d: %s\n", what, r, tec_last_error());
            ok = 0;
        }
    return ok;
}

#define TRY_RANK(r, call)                                                                         \
    do {                                                                                          \
        if ((call) != TEC_OK) {                                                                   \
            if (!g_quiet) {                                                                       \
                printf("FAIL rank %d: %s: %s\n", (r), #call, tec_last_error());                 \
                failures++;                                                                       \
            }                                                                                     \
            return -1;                                                                            \
        }                                                                                         \
    } while (0)

/* Inputs and outputs of one AG+GEMM / GEMM+RS, per rank. */
typedef struct {
    float A[NRANKS][NRANKS * ROWS * K], B[K * N], bias[N], out[NRANKS][NRANKS * ROWS * N];
    float copy[NRANKS][ROWS * K], copy2[NRANKS][ROWS * K];
} gemm_io;

static void fresh(gemm_io *io, int tp, size_t a_elems, size_t out_elems)
{
    fill(io->B, K * N);
    fill(io->bias, N);
    for (int r = 0; r < tp; r++) {
        fill(io->A[r], a_elems);
        for (size_t i = 0; i < out_elems; i++)
            io->out[r][i] = NAN;
        memset(io->copy[r], 0, sizeof io->copy[r]);
        memset(io->copy2[r], 0, sizeof io->copy2[r]);
    }
}

static double bval(const gemm_io *io, int transb, int q, int j) { return transb ? io->B[j * K + q] : io->B[q * N + j]; }

/* AG+GEMM issued on every rank: from a_local (with the local copy, which a
 * later op on the compute stream reads), or written into the slot directly
 * after acquire (direct). */
static int issue_ag(tec_comm **c, int tp, gemm_io *io, int transb, int direct)
{
    for (int r = 0; r < tp; r++) {
        tec_ag_gemm_args a = {.a_local = direct ? NULL : io->A[r], .local_copy = direct ? NULL : io->copy[r],
                              .rows = ROWS, .k = K, .n = N, .dtype = TEC_F32, .out_dtype = TEC_F32, .b = io->B,
                              .ldb = transb ? K : N, .transb = transb, .out = io->out[r], .ldc = N, .bias = io->bias};
        if (direct) {
            TRY_RANK(r, tec_comm_acquire(c[r], S_OF(c[r])));
            TRY_RANK(r, mock_transport.copy(g_rank[r], (char *)tec_comm_base(c[r], r) + (size_t)r * ROWS * K * 4,
                                            io->A[r], ROWS * K * 4, S_OF(c[r])));
        }
        TRY_RANK(r, tec_comm_ag_gemm(c[r], &a, S_OF(c[r])));
        if (!direct) /* the caller's next work on its stream reads the local copy */
            TRY_RANK(r, mock_transport.copy(g_rank[r], io->copy2[r], io->copy[r], ROWS * K * 4, S_OF(c[r])));
    }
    return 0;
}

static int check_ag(tec_comm **c, int tp, const gemm_io *io, int transb, int direct, int slots_too)
{
    int wrong = 0;
    for (int r = 0; r < tp; r++) {
        const float *slots = tec_comm_base(c[r], r);
        for (int p = 0; p < tp; p++)
            for (int i = 0; i < ROWS; i++) {
                for (int j = 0; j < N; j++) {
                    double want = io->bias[j];
                    for (int q = 0; q < K; q++)
                        want += (double)io->A[p][i * K + q] * bval(io, transb, q, j);
                    wrong += !close_to(io->out[r][(p * ROWS + i) * N + j], want);
                }
                if (slots_too) /* the buffer holds the gathered input afterwards */
                    wrong += memcmp(slots + (size_t)(p * ROWS + i) * K, io->A[p] + i * K, K * 4) != 0;
            }
        if (!direct)
            wrong += memcmp(io->copy2[r], io->A[r], sizeof io->copy2[r]) != 0;
    }
    return wrong;
}

/* GEMM+RS issued on every rank. */
static int issue_rs(tec_comm **c, int tp, gemm_io *io, int transb)
{
    for (int r = 0; r < tp; r++) {
        tec_gemm_rs_args a = {.a = io->A[r], .lda = K, .rows = ROWS, .k = K, .n = N, .dtype = TEC_F32, .b = io->B,
                              .ldb = transb ? K : N, .transb = transb, .out = io->out[r], .bias = io->bias};
        TRY_RANK(r, tec_comm_gemm_rs(c[r], &a, S_OF(c[r])));
    }
    return 0;
}

static int check_rs(int tp, const gemm_io *io, int transb)
{
    int wrong = 0;
    for (int r = 0; r < tp; r++)
        for (int i = 0; i < ROWS; i++)
            for (int j = 0; j < N; j++) {
                double want = io->bias[j];
                for (int p = 0; p < tp; p++)
                    for (int q = 0; q < K; q++)
                        want += (double)io->A[p][(r * ROWS + i) * K + q] * bval(io, transb, q, j);
                wrong += !close_to(io->out[r][i * N + j], want);
            }
    return wrong;
}

/* Two batches of operations, each issued on every rank without a host
 * synchronization in between (as a layer's forward and backward issue
 * them), then synchronized and checked: returns the number of wrong
 * outputs, or -1 after a reported failure. */
static int steps(tec_comm **c, int tp, int transb)
{
    static gemm_io ag1, ag2, ag3, rs;
    static float bag[NRANKS][ROWS * K], bsrc[NRANKS][NRANKS * ROWS * N], bout[NRANKS][ROWS * N];
    int wrong = 0;

    /* Batch 1: GEMM+RS, bulk RS (pushes into the slots the reduce just
     * read), AG+GEMM, bulk AG (overwrites the slot peers just pulled). */
    fresh(&rs, tp, (size_t)tp * ROWS * K, ROWS * N);
    fresh(&ag1, tp, ROWS * K, (size_t)tp * ROWS * N);
    for (int r = 0; r < tp; r++) {
        fill(bag[r], ROWS * K);
        fill(bsrc[r], (size_t)tp * ROWS * N);
        for (int i = 0; i < ROWS * N; i++)
            bout[r][i] = NAN;
    }
    if (issue_rs(c, tp, &rs, transb))
        return -1;
    for (int r = 0; r < tp; r++)
        TRY_RANK(r, tec_comm_bulk_rs_start(c[r], bsrc[r], ROWS, N, TEC_F32, bout[r], S_OF(c[r])));
    for (int r = 0; r < tp; r++)
        TRY_RANK(r, tec_comm_bulk_rs_finish(c[r], S_OF(c[r])));
    if (issue_ag(c, tp, &ag1, transb, 0))
        return -1;
    for (int r = 0; r < tp; r++)
        TRY_RANK(r, tec_comm_bulk_ag_start(c[r], bag[r], ROWS * K * 4, S_OF(c[r])));
    for (int r = 0; r < tp; r++)
        TRY_RANK(r, tec_comm_bulk_ag_finish(c[r], S_OF(c[r])));
    if (!sync_all(c, tp, "batch 1"))
        return -1;
    wrong += check_rs(tp, &rs, transb);
    for (int r = 0; r < tp; r++)
        for (int i = 0; i < ROWS * N; i++) {
            double want = 0.0;
            for (int p = 0; p < tp; p++)
                want += bsrc[p][r * ROWS * N + i];
            wrong += !close_to(bout[r][i], want);
        }
    wrong += check_ag(c, tp, &ag1, transb, 0, 0);
    for (int r = 0; r < tp; r++) {
        const float *slots = tec_comm_base(c[r], r);
        for (int p = 0; p < tp; p++)
            wrong += memcmp(slots + (size_t)p * ROWS * K, bag[p], ROWS * K * 4) != 0;
    }

    /* Batch 2: AG+GEMM twice from a_local, then once written into the slot
     * directly (after acquire: the peers must have pulled the last one). */
    fresh(&ag2, tp, ROWS * K, (size_t)tp * ROWS * N);
    fresh(&ag3, tp, ROWS * K, (size_t)tp * ROWS * N);
    fresh(&ag1, tp, ROWS * K, (size_t)tp * ROWS * N);
    if (issue_ag(c, tp, &ag1, transb, 0) || issue_ag(c, tp, &ag2, transb, 0) || issue_ag(c, tp, &ag3, transb, 1))
        return -1;
    if (!sync_all(c, tp, "batch 2"))
        return -1;
    wrong += check_ag(c, tp, &ag1, transb, 0, 0) + check_ag(c, tp, &ag2, transb, 0, 0) +
             check_ag(c, tp, &ag3, transb, 1, 1);
    return wrong;
}

/* Every schedule, tp 1..4, both issue orders, both B layouts, many seeds. */
static void schedules_are_right(void)
{
    const unsigned caps[3] = {TEC_TRANSPORT_ASYNC, TEC_TRANSPORT_HOST_FLAGS,
                              TEC_TRANSPORT_ASYNC | TEC_TRANSPORT_DEVICE_EPOCHS};
    int runs = 0;
    for (int tp = 1; tp <= 4; tp++)
        for (int ci = 0; ci < 3; ci++)
            for (int transb = 0; transb < 2; transb++)
                for (int seed = 1; seed <= 12; seed++) {
                    tec_comm *c[NRANKS] = {0};
                    mock_transport.caps = caps[ci];
                    g_rng = 0x9e3779b97f4a7c15ull * (uint64_t)(seed + 100 * tp + 1000 * ci + 10000 * transb);
                    if (!open_group(c, tp, "sched"))
                        return;
                    for (int step = 0; step < 3; step++) {
                        const int wrong = steps(c, tp, transb);
                        CHECK(wrong == 0, "tp %d caps %#x transb %d seed %d step %d: %d wrong outputs", tp, caps[ci],
                              transb, seed, step, wrong);
                        if (wrong)
                            break;
                    }
                    tec_comm_stats st;
                    tec_comm_get_stats(c[0], &st);
                    if (tp > 1)
                        CHECK(st.ag_overlap == 12 && st.rs_overlap == 3 && st.bulk_ag == 3 && st.bulk_rs == 3,
                              "tp %d: overlapped paths %llu %llu %llu %llu", tp, (unsigned long long)st.ag_overlap,
                              (unsigned long long)st.rs_overlap, (unsigned long long)st.bulk_ag,
                              (unsigned long long)st.bulk_rs);
                    else
                        CHECK(st.non_overlap == 21 && st.ag_overlap == 0, "tp 1: %llu operations without overlap",
                              (unsigned long long)st.non_overlap);
                    close_group(c, tp);
                    runs++;
                }
    printf("schedules: %d runs checked\n", runs);
}

/* The checks above must catch a transport whose waits hold nothing back. */
static void ignoring_waits_is_caught(void)
{
    int caught = 0;
    g_ignore_waits = 1;
    for (int tp = 2; tp <= 4; tp++)
        for (int seed = 1; seed <= 6; seed++) {
            tec_comm *c[NRANKS] = {0};
            mock_transport.caps = TEC_TRANSPORT_ASYNC;
            g_rng = 0x2545f4914f6cdd1dull * (uint64_t)(seed + 10 * tp);
            if (!open_group(c, tp, "nowait"))
                break;
            caught += steps(c, tp, 1) != 0;
            close_group(c, tp);
        }
    g_ignore_waits = 0;
    CHECK(caught > 0, "a mock that ignores every wait passed the output checks");
    printf("negative check: ignored waits caught in %d of 18 runs\n", caught);
}

/* Bulk RS then bulk AG (start and finish) issued on every rank. */
static int issue_bulk(tec_comm **c, int tp, float (*src)[NRANKS * ROWS * N], float (*out)[ROWS * N],
                      float (*bag)[ROWS * K])
{
    for (int r = 0; r < tp; r++)
        TRY_RANK(r, tec_comm_bulk_rs_start(c[r], src[r], ROWS, N, TEC_F32, out[r], S_OF(c[r])));
    for (int r = 0; r < tp; r++)
        TRY_RANK(r, tec_comm_bulk_rs_finish(c[r], S_OF(c[r])));
    for (int r = 0; r < tp; r++)
        TRY_RANK(r, tec_comm_bulk_ag_start(c[r], bag[r], ROWS * K * 4, S_OF(c[r])));
    for (int r = 0; r < tp; r++)
        TRY_RANK(r, tec_comm_bulk_ag_finish(c[r], S_OF(c[r])));
    return 0;
}

/* CUDA graphs, as the mock models them: a GEMM+RS, an AG+GEMM from a_local,
 * one written into the slot directly, a bulk RS and a bulk AG, captured once
 * on every rank and replayed with new data, twice back to back and with
 * eager batches in between. Returns the number of wrong outputs, or -1
 * after a failure. */
static int replays(tec_comm **c, int tp, int transb)
{
    static gemm_io rs, ag, agd;
    static float bsrc[NRANKS][NRANKS * ROWS * N], bout[NRANKS][ROWS * N], bag[NRANKS][ROWS * K];
    int wrong = 0;
    g_ncap = 0;
    g_capturing = 1;
    const int issued = !issue_rs(c, tp, &rs, transb) && !issue_ag(c, tp, &ag, transb, 0) &&
                       !issue_ag(c, tp, &agd, transb, 1) && !issue_bulk(c, tp, bsrc, bout, bag);
    g_capturing = 0;
    if (!issued)
        return -1;
    for (int round = 0; round < 6; round++) {
        fresh(&rs, tp, (size_t)tp * ROWS * K, ROWS * N);
        fresh(&ag, tp, ROWS * K, (size_t)tp * ROWS * N);
        fresh(&agd, tp, ROWS * K, (size_t)tp * ROWS * N);
        for (int r = 0; r < tp; r++) {
            fill(bsrc[r], (size_t)tp * ROWS * N);
            fill(bag[r], ROWS * K);
        }
        if (replay() || (round % 2 && replay())) /* odd rounds: two launches, no host sync between */
            return -1;
        if (!sync_all(c, tp, "replay"))
            return -1;
        wrong += check_rs(tp, &rs, transb) + check_ag(c, tp, &ag, transb, 0, 0) + check_ag(c, tp, &agd, transb, 1, 0);
        for (int r = 0; r < tp; r++) {
            const float *slots = tec_comm_base(c[r], r);
            for (int i = 0; i < ROWS * N; i++) {
                double want = 0.0;
                for (int p = 0; p < tp; p++)
                    want += bsrc[p][r * ROWS * N + i];
                wrong += !close_to(bout[r][i], want);
            }
            for (int p = 0; p < tp; p++) /* the bulk AG, last: the buffers hold its gathered input */
                wrong += memcmp(slots + (size_t)p * ROWS * K, bag[p], ROWS * K * 4) != 0;
        }
        if (round % 3 == 1) { /* eager operations between launches continue the same epochs */
            const int w = steps(c, tp, transb);
            if (w < 0)
                return -1;
            wrong += w;
        }
    }
    return wrong;
}

static void graphs_replay(void)
{
    int runs = 0, caught = 0;
    for (int tp = 2; tp <= 4; tp++)
        for (int transb = 0; transb < 2; transb++)
            for (int seed = 1; seed <= 8; seed++) {
                tec_comm *c[NRANKS] = {0};
                mock_transport.caps = TEC_TRANSPORT_ASYNC | TEC_TRANSPORT_DEVICE_EPOCHS;
                g_rng = 0x51afd6ed4e1c2b3dull * (uint64_t)(seed + 100 * tp + 1000 * transb);
                if (!open_group(c, tp, "graph"))
                    return;
                const int w0 = steps(c, tp, transb); /* eager work before the capture */
                const int wrong = w0 < 0 ? w0 : replays(c, tp, transb);
                CHECK(w0 == 0 && wrong == 0, "graph replays: tp %d transb %d seed %d: %d / %d wrong outputs", tp,
                      transb, seed, w0, wrong);
                close_group(c, tp);
                runs++;
            }
    /* Negative check: epochs counted on the host are baked into what was
     * captured, so a replay after other work waits for stale epochs and
     * reads buffers before they are written. The same checks must see it. */
    const int before = failures;
    g_quiet = 1;
    for (int tp = 2; tp <= 4; tp++)
        for (int seed = 1; seed <= 4; seed++) {
            tec_comm *c[NRANKS] = {0};
            mock_transport.caps = TEC_TRANSPORT_ASYNC;
            g_rng = 0x2545f4914f6cdd1dull * (uint64_t)(seed + 10 * tp);
            if (!open_group(c, tp, "stale"))
                break;
            caught += steps(c, tp, 1) != 0 || replays(c, tp, 1) != 0;
            for (int r = 0; r < tp; r++) /* drain what a failed replay left queued */
                tec_comm_synchronize(c[r], S_OF(c[r]));
            close_group(c, tp);
        }
    g_quiet = 0;
    failures = before;
    CHECK(caught == 12, "host-counted epochs replayed correctly in %d of 12 runs", 12 - caught);
    printf("graphs: %d replay runs checked; negative check: stale epochs caught in %d of 12 runs\n", runs, caught);
}

/* A rank that never arrives: its peers time out naming the step and peer;
 * where flags are host memory the absent peer is named too. Afterwards the
 * communicator refuses work. */
static void absent_rank_times_out(unsigned caps)
{
    tec_comm *c[NRANKS] = {0};
    static float A[ROWS * K], B[K * N], out[3 * ROWS * N];
    mock_transport.caps = caps;
    g_rng = 77;
    if (!open_group(c, 3, "absent"))
        return;
    fill(A, ROWS * K);
    fill(B, K * N);
    for (int r = 0; r < 2; r++) { /* rank 2 never calls */
        tec_ag_gemm_args a = {.a_local = A, .rows = ROWS, .k = K, .n = N, .dtype = TEC_F32, .out_dtype = TEC_F32,
                              .b = B, .ldb = N, .out = out, .ldc = N};
        CHECK(tec_comm_ag_gemm(c[r], &a, S_OF(c[r])) == TEC_OK, "rank %d: %s", r, tec_last_error());
    }
    const tec_status st = tec_comm_synchronize(c[0], S_OF(c[0]));
    const char *msg = tec_last_error();
    CHECK(st == TEC_ERR_TIMEOUT, "absent rank: status %d (%s)", (int)st, msg);
    CHECK(strstr(msg, "communicator 'absent' rank 0: ag_gemm step 1 timed out") && strstr(msg, "peer 2"),
          "absent rank: message '%s'", msg);
    const int named = strstr(msg, "not yet at this operation: peer 2") != NULL;
    CHECK(named == ((caps & TEC_TRANSPORT_HOST_FLAGS) != 0), "caps %#x: absent peer named %d in '%s'", caps, named,
          msg);
    CHECK(tec_comm_acquire(c[0], S_OF(c[0])) == TEC_ERR_TIMEOUT && strstr(tec_last_error(), "unusable"),
          "a broken communicator took more work: %s", tec_last_error());
    close_group(c, 3);
}

/* Ranks disagreeing on the shape: the tag check reports it before data moves. */
static void mismatched_shapes_are_reported(void)
{
    tec_comm *c[NRANKS] = {0};
    static float A[2 * ROWS * K], B[K * N], out[ROWS * N];
    mock_transport.caps = TEC_TRANSPORT_ASYNC;
    g_rng = 99;
    if (!open_group(c, 2, "shapes"))
        return;
    fill(A, 2 * ROWS * K);
    fill(B, K * N);
    for (int r = 0; r < 2; r++) {
        tec_gemm_rs_args a = {.a = A, .lda = K, .rows = ROWS - r, .k = K, .n = N, .dtype = TEC_F32, .b = B,
                              .ldb = N, .out = out};
        CHECK(tec_comm_gemm_rs(c[r], &a, S_OF(c[r])) == TEC_OK, "rank %d: %s", r, tec_last_error());
    }
    const tec_status st = tec_comm_synchronize(c[0], S_OF(c[0]));
    CHECK(st == TEC_ERR_INVALID_ARG && strstr(tec_last_error(), "mismatched shapes"),
          "mismatched shapes: status %d (%s)", (int)st, tec_last_error());
    close_group(c, 2);
}

int main(void)
{
    schedules_are_right();
    ignoring_waits_is_caught();
    graphs_replay();
    absent_rank_times_out(TEC_TRANSPORT_ASYNC);
    absent_rank_times_out(TEC_TRANSPORT_ASYNC | TEC_TRANSPORT_DEVICE_EPOCHS);
    absent_rank_times_out(TEC_TRANSPORT_HOST_FLAGS);
    mismatched_shapes_are_reported();
    if (failures) {
        printf("FAIL comm_schedule_test: %d failures\n", failures);
        return 1;
    }
    printf("PASS comm_schedule_test\n");
    return 0;
}
