/* The mock transport and backend that tests/c/comm_schedule_test.c runs the
 * overlap schedules of csrc/core/comm.c against (comm_mock.h): every rank's comm
 * and compute streams as queues that a seeded random scheduler drains in any order
 * the ops' dependencies allow, a "CUDA graph" recording and replay, and the backend
 * tec.c dispatches to (float32 GEMMs enqueued on the caller's stream). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_mock.h"

int failures;

/* ================================================================ streams */

enum { K_COPY, K_SIGNAL, K_WAIT, K_EVREC, K_EVWAIT, K_REDUCE, K_GEMM, K_ADVANCE };
enum { QMAX = 1024 };

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

tec_transport *g_rank[NRANKS]; /* the mock's "IPC": rank -> transport */
int g_ignore_waits;                    /* the negative check: waits never hold anything back */
int g_quiet;                           /* negative checks: failures expected, not reported */
uint64_t g_rng = 1;

/* "CUDA graph capture": while g_capturing, enqueued ops are recorded
 * instead of queued; replay() enqueues the recording again, as a graph
 * launch runs the captured nodes again (event edges kept, by re-issuing
 * records and waits in capture order; flag values exactly as captured). */
enum { CAPMAX = 4096 };
static struct {
    mock_stream *s;
    op_t o;
} g_cap[CAPMAX];
int g_ncap, g_capturing;

uint64_t rng(void)
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
int drain(void)
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

tec_transport_ops mock_transport;

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
tec_status replay(void)
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

tec_transport_ops mock_transport = {
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

void *mock_compute_stream(int rank) { return &g_rank[rank]->S; }
