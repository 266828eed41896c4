/* comm.c - the communicator's operations (tec_comm): its handshake helpers,
 * synchronize / unmap / acquire, and the comm-GEMM overlap schedules
 * (AG+GEMM, GEMM+RS, bulk AG / RS), written once against tec_transport_ops
 * (transport.h: region layout, handshakes, wire format, capabilities).
 * Creating, mapping and destroying one is comm_lifetime.c.
 * Exercised by tests/c/comm_schedule_test.c (a mock transport that checks
 * the handshakes) and tests/distributed/run_gemm_with_overlap.py. */
#include <stdio.h>

#include "backend.h"
#include "checked.h"
#include "comm.h"
#include "error.h"

enum { OP_AG = 1, OP_RS = 2, OP_BULK_AG = 3, OP_BULK_RS = 4 };
enum { EV_START = 0, EV_END = 1, EV_BULK = 2, EV_CHUNK = 3 };
enum { PENDING_NONE = 0, PENDING_AG = 1, PENDING_RS = 2 };

/* -------------------------------------------------------------- helpers */

/* A failure in the middle of a schedule leaves peers' flags and the comm
 * stream in an unknown state: remember it, report it again next time. */
static uint64_t *flag(tec_comm *c, int owner, int kind, int src);

/* After a timeout, where the flags are host memory: name the peers that
 * never started this operation (the peer a wait names may itself be
 * waiting on them). */
static void name_absent(tec_comm *c)
{
    if (!(c->ops->caps & TEC_TRANSPORT_HOST_FLAGS) || !c->mapped)
        return;
    char list[256] = "";
    size_t n = 0;
    for (int p = 0; p < c->size; p++) {
        uint64_t seen = __atomic_load_n(flag(c, p, TEC_FLAG_ARRIVED, p), __ATOMIC_ACQUIRE);
        if (p != c->rank && tec_flag_epoch(seen) < c->epoch && n < sizeof list - 16)
            n += (size_t)snprintf(list + n, sizeof list - n, "%speer %d", n ? ", " : "", p);
    }
    if (n) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s; not yet at this operation: %s", tec_last_error(), list);
        tec_set_error(TEC_ERR_TIMEOUT, "%s", msg);
    }
}

static tec_status fail(tec_comm *c, tec_status st)
{
    if (st == TEC_ERR_TIMEOUT && !c->broken)
        name_absent(c);
    if (st != TEC_OK && !c->broken) {
        c->broken = st;
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", tec_last_error());
    }
    return st;
}

#define TRY(expr) do { tec_status st_ = (expr); if (st_ != TEC_OK) return fail(c, st_); } while (0)

static uint64_t *flag(tec_comm *c, int owner, int kind, int src)
{
    return (uint64_t *)((char *)c->bases[owner] + c->flags_off) + (size_t)kind * TEC_COMM_MAX_RANKS + src;
}

static char *slot(tec_comm *c, int owner, int p, size_t chunk)
{
    return (char *)c->bases[owner] + (size_t)p * chunk;
}

static char *staging(tec_comm *c, int p, size_t chunk)
{
    return (char *)c->bases[c->rank] + c->data_bytes + (size_t)p * chunk;
}

static tec_wait_site site(tec_comm *c, const char *op, const char *what, int peer, int step)
{
    tec_wait_site s = {c->name, op, what, c->rank, peer, step};
    return s;
}

/* Flag steps collected in schedule order and handed to the transport
 * together (one kernel on CUDA) by seq_run, before the next copy, event or
 * GEMM that must come after them. */
typedef struct {
    tec_flag_step s[TEC_FLAG_STEPS_MAX];
    int n;
} flag_seq;
_Static_assert(3 * (TEC_COMM_MAX_RANKS - 1) <= TEC_FLAG_STEPS_MAX, "announce_free's sequence must fit a flag_seq");

static void seq_signal(flag_seq *q, uint64_t *f, uint64_t value)
{
    tec_flag_step st = {f, value, TEC_STEP_SIGNAL, TEC_EPOCH_OP, {0}};
    q->s[q->n++] = st;
}

/* Wait until our own flag `kind` from `src` reaches value's epoch. */
static void seq_wait(tec_comm *c, flag_seq *q, int kind, int src, uint64_t value, tec_wait_site site)
{
    tec_flag_step st = {flag(c, c->rank, kind, src), value, TEC_STEP_WAIT, TEC_EPOCH_OP, site};
    q->s[q->n++] = st;
    c->stats.waits++;
}

static tec_status seq_run(tec_comm *c, flag_seq *q, void *stream)
{
    const int n = q->n;
    q->n = 0;
    if (!n)
        return TEC_OK;
    TRY(c->ops->flags(c->t, q->s, n, c->timeout, flag(c, c->rank, TEC_FLAG_EPOCH, 0), stream));
    return TEC_OK;
}

/* The end of an operation over more than one rank, where epochs live on
 * the device (transport.h "Where the epoch comes from"): an ADVANCE step
 * appended to q. It must come after every step of the operation in stream
 * order: in the comm stream's last sequence where all of the operation's
 * steps run there (all-gathers, bulk reduce-scatter), else on the caller's
 * stream after the comm stream joined it (finish_op). */
static void seq_advance(tec_comm *c, flag_seq *q, int published)
{
    if (!(c->ops->caps & TEC_TRANSPORT_DEVICE_EPOCHS))
        return;
    tec_flag_step st = {flag(c, c->rank, TEC_FLAG_EPOCH, 0), (uint64_t)(published != 0), TEC_STEP_ADVANCE,
                        TEC_EPOCH_OP, {0}};
    q->s[q->n++] = st;
}

static tec_status finish_op(tec_comm *c, int published, void *stream)
{
    flag_seq q = {.n = 0};
    seq_advance(c, &q, published);
    return seq_run(c, &q, stream);
}

/* Add waits until every peer finished pulling our own slot. */
static void seq_consumed(tec_comm *c, flag_seq *q, const char *op)
{
    if (!c->last_publish)
        return;
    for (int p = 0; p < c->size; p++)
        if (p != c->rank) {
            seq_wait(c, q, TEC_FLAG_CONSUMED, p, tec_flag_value(c->last_publish, 0), site(c, op, "chunk consumed", p, 0));
            q->s[q->n - 1].epoch = TEC_EPOCH_PUBLISHED;
        }
}

/* Make `stream` wait until every peer finished pulling our own slot. */
static tec_status wait_consumed(tec_comm *c, const char *op, void *stream)
{
    flag_seq q = {.n = 0};
    seq_consumed(c, &q, op);
    return seq_run(c, &q, stream);
}

/* Take the next epoch and, where the flags are host memory, say so in our
 * own region (read only by name_absent after a timeout; on CUDA it would
 * cost a kernel launch per operation for nothing). */
static uint64_t next_epoch(tec_comm *c, void *stream)
{
    uint64_t e = ++c->epoch;
    if (!(c->ops->caps & TEC_TRANSPORT_HOST_FLAGS))
        return e;
    tec_status st = c->ops->signal(c->t, flag(c, c->rank, TEC_FLAG_ARRIVED, c->rank), tec_flag_value(e, 0), stream);
    if (st)
        fail(c, st);
    return e;
}

static tec_status begin(tec_comm *c, const char *op)
{
    if (c->broken == TEC_ERR_CLOSED)
        return tec_set_error(TEC_ERR_CLOSED, "communicator '%s': %s after %s", c->name, op, c->broken_msg);
    if (c->broken)
        return tec_set_error(c->broken, "communicator '%s' is unusable after an earlier failure (close it): %s",
                             c->name, c->broken_msg);
    if (!c->mapped)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': %s before the peers were opened", c->name, op);
    tec_status st = c->ops->check(c->t);
    return st ? fail(c, st) : TEC_OK;
}

/* The bytes of one [rows, cols] chunk of dtype dt; SIZE_MAX when the
 * product overflows (check_chunk then refuses it). */
/* rows x cols elements of es bytes (SIZE_MAX when that overflows). */
static size_t chunk_bytes(int64_t rows, int64_t cols, size_t es)
{
    size_t b;
    return tec_mul3(rows, cols, (int64_t)es, &b) ? b : SIZE_MAX;
}

static tec_status check_chunk(tec_comm *c, const char *op, size_t chunk, int64_t rows, int64_t cols, tec_dtype dt)
{
    if (rows < 0 || cols <= 0 || !tec_dtype_size(dt))
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': %s: bad chunk [%lld, %lld] of dtype %d",
                             c->name, op, (long long)rows, (long long)cols, (int)dt);
    /* chunk * size is compared without forming the product (it may wrap). */
    if (chunk > c->data_bytes / (size_t)c->size)
        return tec_set_error(TEC_ERR_INVALID_ARG,
                             "communicator '%s': %s: buffer too small for the input: %d chunks of [%lld, %lld] "
                             "(%zu bytes each) need more than the buffer's %zu bytes",
                             c->name, op, c->size, (long long)rows, (long long)cols, chunk, c->data_bytes);
    if (chunk > TEC_FLAG_CHUNK_MAX)
        return tec_set_error(TEC_ERR_NOT_SUPPORTED, "communicator '%s': %s: chunks over 512 MiB are not supported",
                             c->name, op);
    return TEC_OK;
}

/* begin(), and no bulk operation pending. */
static tec_status begin_idle(tec_comm *c, const char *op)
{
    tec_status st = begin(c, op);
    if (st)
        return st;
    if (c->pending)
        return tec_set_error(TEC_ERR_INVALID_ARG,
                             "communicator '%s': %s while a bulk operation is pending (call its finish first)",
                             c->name, op);
    return TEC_OK;
}

/* The entry checks of an operation on chunks of `rows` x `cols` (`chunk`
 * bytes): begin_idle(), and chunks that fit the buffer. */
static tec_status begin_chunk(tec_comm *c, const char *op, size_t chunk, int64_t rows, int64_t cols, tec_dtype dt)
{
    tec_status st = begin_idle(c, op);
    return st ? st : check_chunk(c, op, chunk, rows, cols, dt);
}

/* One chunk GEMM of a schedule: out[m, n] = A[m, k] @ op(B) (+ bias), in
 * `dt` or, with f, in FP8 (A and B FP8 bytes, B [n, k]; dt the output's),
 * and with f and fp8_out an FP8 partial (f's partial_*; out bytes). */
static tec_status gemm(tec_comm *c, const tec_fp8_chunk_gemm *f, int fp8_out, const void *a, int64_t lda, int64_t m,
                       int64_t k, int64_t n, tec_dtype dt, const void *b, int64_t ldb, int transb, void *out,
                       int64_t ldc, tec_dtype cdt, const void *bias, void *stream)
{
    if (f) {
        tec_fp8_gemm_args g = {0};
        g.m = m; g.n = n; g.k = k;
        g.a_format = f->a_format; g.b_format = f->b_format;
        g.a = a; g.lda = lda; g.b = b; g.ldb = ldb;
        g.a_scale_inv = f->a_scale_inv; g.b_scale_inv = f->b_scale_inv;
        g.c = out; g.ldc = ldc; g.c_dtype = cdt; g.bias = bias;
        if (fp8_out) {
            g.c_format = f->partial_format; g.c_scale = f->partial_scale; g.c_amax = f->partial_amax;
        }
        g.fast_accum = f->fast_accum;
        g.workspace = c->gemm_ws; g.workspace_bytes = c->gemm_ws_bytes;
        g.sm_margin = c->gemm_sm_margin;
        return tec_fp8_gemm(c->device, &g, stream);
    }
    tec_gemm_args g = {0};
    g.transb = transb;
    g.m = m; g.n = n; g.k = k;
    g.a = a; g.lda = lda; g.b = b; g.ldb = ldb; g.c = out; g.ldc = ldc;
    g.ab_dtype = dt; g.c_dtype = cdt; g.bias = bias;
    g.workspace = c->gemm_ws; g.workspace_bytes = c->gemm_ws_bytes;
    g.sm_margin = c->gemm_sm_margin;
    return tec_gemm(c->device, &g, stream);
}

/* An FP8 schedule's operands, checked before the epoch is taken: formats
 * tec_fp8_gemm takes, both scales, B stored [n, k]. */
static tec_status fp8_check(tec_comm *c, const char *op, const tec_fp8_chunk_gemm *f, int transb)
{
    if (!f)
        return TEC_OK;
    if ((f->a_format != TEC_FP8_E4M3 && f->a_format != TEC_FP8_E5M2) ||
        (f->b_format != TEC_FP8_E4M3 && f->b_format != TEC_FP8_E5M2) ||
        (f->a_format == TEC_FP8_E5M2 && f->b_format == TEC_FP8_E5M2))
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': %s: FP8 formats a %d, b %d (E4M3 0, E5M2 1; "
                             "not both E5M2)", c->name, op, (int)f->a_format, (int)f->b_format);
    if (!f->a_scale_inv || !f->b_scale_inv)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': %s: FP8 without a_scale_inv or b_scale_inv",
                             c->name, op);
    if (transb != 1)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': %s: FP8 chunk GEMMs take B stored [n, k] "
                             "(transb 1)", c->name, op);
    if (f->partial_scale && (!f->partial_scale_inv || (f->partial_format != TEC_FP8_E4M3 &&
                                                       f->partial_format != TEC_FP8_E5M2)))
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': %s: FP8 partials need partial_scale_inv and "
                             "format E4M3 (0) or E5M2 (1), got format %d", c->name, op, (int)f->partial_format);
    if (!f->partial_scale && (f->partial_scale_inv || f->partial_amax))
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': %s: partial_scale_inv or partial_amax without "
                             "partial_scale", c->name, op);
    return TEC_OK;
}

/* FP8 partials (tec_fp8_chunk_gemm.partial_scale) in a chunk: rows * n
 * bytes, then, 16-byte aligned, the float scale_inv that decodes them. */
enum { PARTIAL_TAIL = 16 };
static size_t partial_scale_inv_offset(int64_t rows, int64_t n)
{
    const size_t b = chunk_bytes(rows, n, 1); /* SIZE_MAX on overflow: check_chunk refuses the chunk */
    if (b > SIZE_MAX - 2 * PARTIAL_TAIL)
        return SIZE_MAX - PARTIAL_TAIL;
    return (b + PARTIAL_TAIL - 1) / PARTIAL_TAIL * PARTIAL_TAIL;
}

/* B's extent and the backend's workspace, checked before an operation takes
 * its epoch (tec_gemm checks them again, too late to leave the peers in
 * step). */
static tec_status gemm_check(tec_comm *c, const char *op, const void *b, int64_t b_rows, int64_t ldb, tec_dtype dt)
{
    size_t bytes;
    const tec_backend *be = tec_backend_for(c->device);
    if (!tec_matrix_bytes(b_rows, ldb, 4, &bytes))
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': %s: weight of %lld rows with ldb=%lld is too large",
                             c->name, op, (long long)b_rows, (long long)ldb);
    if (be && (c->gemm_ws_bytes < be->gemm_workspace_bytes || (be->gemm_workspace_bytes && !c->gemm_ws)))
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': %s: GEMM workspace of %zu bytes, %zu needed",
                             c->name, op, c->gemm_ws_bytes, be->gemm_workspace_bytes);
    (void)b; (void)dt;
    return TEC_OK;
}

/* ------------------------------------------------------ synchronisation */

tec_status tec_comm_synchronize(tec_comm *c, void *stream)
{
    TRY(c->ops->synchronize(c->t, c->ops->comm_stream(c->t)));
    TRY(c->ops->synchronize(c->t, stream));
    return TEC_OK;
}

tec_status tec_comm_unmap_peers(tec_comm *c, void *stream)
{
    if (!c->mapped)
        return TEC_OK;
    /* Drain both streams before unmapping, also after a failure: the comm
     * side may still be copying into a peer's region. */
    tec_status st = tec_comm_synchronize(c, stream);
    if (c->broken) {
        c->ops->synchronize(c->t, c->ops->comm_stream(c->t));
        c->ops->synchronize(c->t, stream);
        st = TEC_OK;
    }
    char why[256];
    snprintf(why, sizeof why, "%s", st ? tec_last_error() : "");
    c->ops->unmap_peers(c->t);
    for (int r = 0; r < c->size; r++)
        if (r != c->rank)
            c->bases[r] = NULL;
    c->mapped = 0;
    if (!c->broken) {
        c->broken = TEC_ERR_CLOSED;
        snprintf(c->broken_msg, sizeof c->broken_msg, "its peers were unmapped for closing");
    }
    return st ? tec_set_error(st, "%s", why) : TEC_OK;
}

tec_status tec_comm_acquire(tec_comm *c, void *stream)
{
    tec_status st = begin_idle(c, "acquire");
    return st ? st : wait_consumed(c, "acquire", stream);
}

/* ------------------------------------------------------------ AG + GEMM */

/* Make the comm stream wait for `stream`'s work so far, or for the EV_START
 * the caller recorded on it (recorded: it issued work after that). */
static tec_status follow(tec_comm *c, int recorded, void *stream)
{
    if (!recorded)
        TRY(c->ops->event_record(c->t, EV_START, stream));
    TRY(c->ops->event_wait(c->t, EV_START, c->ops->comm_stream(c->t)));
    return TEC_OK;
}

/* Publish our own slot for epoch e (after `stream`'s work so far), then
 * pull every peer's chunk into its slot, own chunk order (rank - i).
 * Records EV_CHUNK + i after chunk i arrived (when ev_chunks). On M: the
 * READY signals and the first wait are one flag sequence, each CONSUMED
 * signal goes with the next chunk's wait, the last with the operation's end
 * (nothing of the operation reads the epoch on `stream` after the fork). */
static tec_status gather(tec_comm *c, const char *op, const void *src, size_t chunk, uint64_t v, int ev_chunks,
                         int recorded, void *stream)
{
    void *M = c->ops->comm_stream(c->t);
    const int r = c->rank, n = c->size;
    flag_seq q = {.n = 0};
    TRY(follow(c, recorded, stream));
    if (src && src != slot(c, r, r, chunk)) {
        seq_consumed(c, &q, op);
        TRY(seq_run(c, &q, M));
        TRY(c->ops->copy(c->t, slot(c, r, r, chunk), src, chunk, M));
    }
    c->last_publish = tec_flag_epoch(v);
    for (int p = 0; p < n; p++)
        if (p != r)
            seq_signal(&q, flag(c, p, TEC_FLAG_READY, r), v);
    for (int i = 1; i < n; i++) {
        const int p = (r - i + n) % n;
        seq_wait(c, &q, TEC_FLAG_READY, p, v, site(c, op, "chunk ready", p, i));
        TRY(seq_run(c, &q, M));
        TRY(c->ops->copy(c->t, slot(c, r, p, chunk), slot(c, p, p, chunk), chunk, M));
        c->stats.chunks_sent++;
        c->stats.bytes_sent += chunk;
        if (ev_chunks)
            TRY(c->ops->event_record(c->t, EV_CHUNK + i, M));
        seq_signal(&q, flag(c, p, TEC_FLAG_CONSUMED, r), tec_flag_value(tec_flag_epoch(v), 0));
    }
    seq_advance(c, &q, 1);
    return seq_run(c, &q, M);
}

tec_status tec_comm_ag_gemm(tec_comm *c, const tec_ag_gemm_args *a, void *stream)
{
    const size_t ces = tec_dtype_size(a->out_dtype);
    /* A's chunks: FP8 bytes, or elements of dtype */
    const size_t chunk = chunk_bytes(a->rows, a->k, a->fp8 ? 1 : tec_dtype_size(a->dtype));
    tec_status st = begin_chunk(c, "ag_gemm", chunk, a->rows, a->k, a->dtype);
    if (st)
        return st;
    size_t out_bytes;
    if (!a->out || !a->b || a->n <= 0 || !ces || a->ldc < a->n)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': ag_gemm: missing B or out, or bad n/ldc", c->name);
    if (!tec_mul3(a->rows * c->size, a->ldc, (int64_t)ces, &out_bytes))
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': ag_gemm: output of %d x %lld rows with ldc=%lld "
                             "is too large", c->name, c->size, (long long)a->rows, (long long)a->ldc);
    /* Everything the GEMMs check, checked before the epoch is taken: a
     * refused call must leave the communicator usable on every rank. */
    if ((a->out_dtype != a->dtype && a->out_dtype != TEC_F32) || (a->transb != 0 && a->transb != 1) ||
        a->ldb < (a->transb ? a->k : a->n) || a->ldb < 1 || a->k <= 0)
        return tec_set_error(TEC_ERR_INVALID_ARG,
                             "communicator '%s': ag_gemm: out_dtype must be the input's dtype or float32, transb 0 "
                             "or 1, and ldb at least %lld (got out_dtype %d for dtype %d, transb %d, ldb %lld)",
                             c->name, (long long)(a->transb ? a->k : a->n), (int)a->out_dtype, (int)a->dtype,
                             a->transb, (long long)a->ldb);
    if ((st = gemm_check(c, "ag_gemm", a->b, a->transb ? a->n : a->k, a->ldb, a->dtype)) ||
        (st = fp8_check(c, "ag_gemm", a->fp8, a->transb)))
        return st;
    const int r = c->rank, n = c->size;
    const uint64_t e = next_epoch(c, stream), v = tec_flag_value(e, tec_flag_tag(OP_AG, chunk));
    const void *local = a->a_local ? a->a_local : slot(c, r, r, chunk);
    char *out = a->out;
    const int64_t orow = a->rows * a->ldc * (int64_t)ces;
    if (n == 1) {
        /* The contract holds with one rank too: the buffer holds the gathered
         * input afterwards (a row layer's wgrad reads it). */
        if (a->a_local && a->a_local != slot(c, r, r, chunk))
            TRY(c->ops->copy(c->t, slot(c, r, r, chunk), a->a_local, chunk, stream));
        if (a->local_copy)
            TRY(c->ops->copy(c->t, a->local_copy, local, chunk, stream));
        TRY(gemm(c, a->fp8, 0, local, a->k, a->rows, a->k, a->n, a->dtype, a->b, a->ldb, a->transb, out, a->ldc,
                 a->out_dtype, a->bias, stream));
        c->stats.non_overlap++;
        return TEC_OK;
    }
    /* Local chunk first, straight from where it is. It needs nothing from
     * the comm side, so where streams run asynchronously (CUDA) it is issued
     * before the handshakes and copies: the host's time to issue those would
     * otherwise delay it whenever the GPU has caught up with the host. On
     * the CPU a compute-stream call runs at once, so the comm thread's work
     * is queued first. */
    const int gemm_first = (c->ops->caps & TEC_TRANSPORT_ASYNC) != 0;
    const void *src = a->a_local;
    if (gemm_first) {
        if (src && src != slot(c, r, r, chunk)) {
            /* The peers pull our chunk from the buffer, so it goes there
             * first, on this stream: a device-to-device copy runs on SMs,
             * and on the comm stream it would wait for the GEMM's, delaying
             * every peer's pull by a chunk GEMM. */
            TRY(wait_consumed(c, "ag_gemm", stream));
            TRY(c->ops->copy(c->t, slot(c, r, r, chunk), src, chunk, stream));
            src = NULL;
        }
        TRY(c->ops->event_record(c->t, EV_START, stream));
        TRY(gemm(c, a->fp8, 0, local, a->k, a->rows, a->k, a->n, a->dtype, a->b, a->ldb, a->transb, out + r * orow,
                 a->ldc, a->out_dtype, a->bias, stream));
    }
    TRY(gather(c, "ag_gemm", src, chunk, v, 1, gemm_first, stream));
    if (a->local_copy) /* on the comm stream after the pulls: the GEMMs do not wait for it */
        TRY(c->ops->copy(c->t, a->local_copy, local, chunk, c->ops->comm_stream(c->t)));
    if (!gemm_first)
        TRY(gemm(c, a->fp8, 0, local, a->k, a->rows, a->k, a->n, a->dtype, a->b, a->ldb, a->transb, out + r * orow,
                 a->ldc, a->out_dtype, a->bias, stream));
    for (int i = 1; i < n; i++) {
        const int p = (r - i + n) % n;
        TRY(c->ops->event_wait(c->t, EV_CHUNK + i, stream));
        TRY(gemm(c, a->fp8, 0, slot(c, r, p, chunk), a->k, a->rows, a->k, a->n, a->dtype, a->b, a->ldb, a->transb,
                 out + p * orow, a->ldc, a->out_dtype, a->bias, stream));
    }
    void *M = c->ops->comm_stream(c->t);
    TRY(c->ops->event_record(c->t, EV_END, M));
    TRY(c->ops->event_wait(c->t, EV_END, stream));
    c->stats.ag_overlap++;
    return TEC_OK;
}

/* ------------------------------------------------------------ GEMM + RS */

/* Tell every peer its slot in our buffer may be written for epoch v, and
 * make M wait until every peer freed ours (one flag sequence on M: the
 * pushes that follow need no wait of their own; all ranks announce as they
 * start the operation, long before the first push is ready). */
static tec_status announce_free(tec_comm *c, const char *op, uint64_t v, int recorded, void *stream)
{
    void *M = c->ops->comm_stream(c->t);
    const int r = c->rank, n = c->size;
    flag_seq q = {.n = 0};
    TRY(follow(c, recorded, stream));
    /* Peers push into slots laid out by this operation's chunk size, which
     * may overlap this rank's slot of the last all-gather: they must have
     * finished pulling it first. */
    seq_consumed(c, &q, op);
    for (int p = 0; p < n; p++)
        if (p != r)
            seq_signal(&q, flag(c, p, TEC_FLAG_FREE, r), v);
    for (int i = 1; i < n; i++) {
        const int p = (r + i) % n;
        seq_wait(c, &q, TEC_FLAG_FREE, p, v, site(c, op, "slot free", p, i));
    }
    return seq_run(c, &q, M);
}

/* On M (after announce_free): push `src` (our partial for p) into p's slot. */
static tec_status push(tec_comm *c, int p, const void *src, size_t chunk, uint64_t v)
{
    void *M = c->ops->comm_stream(c->t);
    flag_seq q = {.n = 0};
    TRY(c->ops->copy(c->t, slot(c, p, c->rank, chunk), src, chunk, M));
    seq_signal(&q, flag(c, p, TEC_FLAG_READY, c->rank), v);
    TRY(seq_run(c, &q, M));
    c->stats.chunks_sent++;
    c->stats.bytes_sent += chunk;
    return TEC_OK;
}

/* On `stream`: wait for every peer's partial, sum all in rank order; with
 * `last`, the operation ends with the waits (every step of it ran before on
 * `stream`). */
static tec_status reduce_slots(tec_comm *c, const char *op, const void *own, size_t chunk, int64_t rows, int64_t cols,
                               tec_dtype dt, void *out, const void *bias, const tec_reduce_fp8 *fp8, uint64_t v,
                               int last, void *stream)
{
    const void *srcs[TEC_COMM_MAX_RANKS];
    flag_seq q = {.n = 0};
    for (int p = 0; p < c->size; p++) {
        srcs[p] = p == c->rank ? own : slot(c, c->rank, p, chunk);
        if (p != c->rank)
            seq_wait(c, &q, TEC_FLAG_READY, p, v, site(c, op, "partial ready", p, c->size));
    }
    if (last)
        seq_advance(c, &q, 0);
    TRY(seq_run(c, &q, stream));
    TRY(c->ops->reduce(c->t, out, srcs, c->size, rows, cols, dt, bias, fp8, stream));
    return TEC_OK;
}

tec_status tec_comm_gemm_rs(tec_comm *c, const tec_gemm_rs_args *a, void *stream)
{
    const size_t es = tec_dtype_size(a->dtype), aes = a->fp8 ? 1 : es; /* partials' and A's element sizes */
    /* FP8 partials: bytes and their scale_inv per chunk (one rank has none) */
    const int fp8p = a->fp8 && a->fp8->partial_scale && c->size > 1;
    const size_t sinv_off = fp8p ? partial_scale_inv_offset(a->rows, a->n) : 0;
    const size_t chunk = fp8p ? sinv_off + PARTIAL_TAIL : chunk_bytes(a->rows, a->n, es);
    tec_status st = begin_chunk(c, "gemm_rs", chunk, a->rows, a->n, a->dtype);
    if (st)
        return st;
    size_t a_bytes;
    if (!a->out || !a->b || !a->a || a->k <= 0 || a->lda < a->k)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': gemm_rs: missing A, B or out, or bad k/lda", c->name);
    if (!tec_mul3(a->rows * c->size, a->lda, (int64_t)aes, &a_bytes))
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': gemm_rs: input of %d x %lld rows with lda=%lld "
                             "is too large", c->name, c->size, (long long)a->rows, (long long)a->lda);
    if ((a->transb != 0 && a->transb != 1) || a->ldb < (a->transb ? a->k : a->n) || a->ldb < 1)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': gemm_rs: transb must be 0 or 1 and ldb at least "
                             "%lld (got transb %d, ldb %lld)", c->name, (long long)(a->transb ? a->k : a->n),
                             a->transb, (long long)a->ldb);
    if ((st = gemm_check(c, "gemm_rs", a->b, a->transb ? a->n : a->k, a->ldb, a->dtype)) ||
        (st = fp8_check(c, "gemm_rs", a->fp8, a->transb)))
        return st;
    if (a->fp8 && a->fp8->partial_scale && a->dtype != TEC_BF16 && a->dtype != TEC_F16)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': gemm_rs: FP8 partials sum into a bf16 or f16 "
                             "output (got dtype %d)", c->name, (int)a->dtype);
    const int r = c->rank, n = c->size;
    const uint64_t e = next_epoch(c, stream), v = tec_flag_value(e, tec_flag_tag(OP_RS, chunk));
    const char *A = a->a;
    const int64_t arow = a->rows * a->lda * (int64_t)aes;
    if (n == 1) {
        TRY(gemm(c, a->fp8, 0, A, a->lda, a->rows, a->k, a->n, a->dtype, a->b, a->ldb, a->transb, a->out, a->n,
                 a->dtype, a->bias, stream));
        c->stats.non_overlap++;
        return TEC_OK;
    }
    void *M = c->ops->comm_stream(c->t);
    const tec_reduce_fp8 rfp8 = {fp8p ? a->fp8->partial_format : TEC_FP8_E4M3, sinv_off};
    /* Each staged partial carries this rank's scale_inv (the GEMMs write only the bytes before it). */
    for (int p = 0; fp8p && p < n; p++)
        TRY(c->ops->copy(c->t, staging(c, p, chunk) + sinv_off, a->fp8->partial_scale_inv, sizeof(float), stream));
    /* As in ag_gemm: with an asynchronous transport (CUDA) the first GEMM is
     * issued before the handshake (it writes only our staging area), with a
     * synchronous one (CPU) after it. */
    const int gemm_first = (c->ops->caps & TEC_TRANSPORT_ASYNC) != 0;
    if (gemm_first)
        TRY(c->ops->event_record(c->t, EV_START, stream));
    else
        TRY(announce_free(c, "gemm_rs", v, 0, stream));
    /* Peers' partials first (each pushed while the next is computed), ours last. */
    for (int i = 1; i < n; i++) {
        const int p = (r + i) % n;
        TRY(gemm(c, a->fp8, fp8p, A + p * arow, a->lda, a->rows, a->k, a->n, a->dtype, a->b, a->ldb, a->transb,
                 staging(c, p, chunk), a->n, a->dtype, NULL, stream));
        TRY(c->ops->event_record(c->t, EV_CHUNK + i, stream));
        if (gemm_first && i == 1)
            TRY(announce_free(c, "gemm_rs", v, 1, stream));
        TRY(c->ops->event_wait(c->t, EV_CHUNK + i, M));
        TRY(push(c, p, staging(c, p, chunk), chunk, v));
    }
    TRY(gemm(c, a->fp8, fp8p, A + r * arow, a->lda, a->rows, a->k, a->n, a->dtype, a->b, a->ldb, a->transb,
             staging(c, r, chunk), a->n, a->dtype, NULL, stream));
    TRY(reduce_slots(c, "gemm_rs", staging(c, r, chunk), chunk, a->rows, a->n, a->dtype, a->out, a->bias,
                     fp8p ? &rfp8 : NULL, v, 0, stream));
    TRY(c->ops->event_record(c->t, EV_END, M));
    TRY(c->ops->event_wait(c->t, EV_END, stream));
    TRY(finish_op(c, 0, stream)); /* the reduce's waits on `stream` and the pushes on M read the epoch */
    c->stats.rs_overlap++;
    return TEC_OK;
}

/* ----------------------------------------------------------------- bulk */

tec_status tec_comm_bulk_ag_start(tec_comm *c, const void *src, size_t chunk, void *stream)
{
    tec_status st = begin_chunk(c, "bulk_ag", chunk, 1, 1, TEC_F32);
    if (st)
        return st;
    const uint64_t e = next_epoch(c, stream), v = tec_flag_value(e, tec_flag_tag(OP_BULK_AG, chunk));
    if (c->size == 1) {
        void *M = c->ops->comm_stream(c->t);
        TRY(c->ops->event_record(c->t, EV_START, stream));
        TRY(c->ops->event_wait(c->t, EV_START, M));
        if (src && src != slot(c, 0, 0, chunk))
            TRY(c->ops->copy(c->t, slot(c, 0, 0, chunk), src, chunk, M));
        c->last_publish = e;
        c->stats.non_overlap++;
    } else {
        TRY(gather(c, "bulk_ag", src, chunk, v, 0, 0, stream));
    }
    TRY(c->ops->event_record(c->t, EV_BULK, c->ops->comm_stream(c->t)));
    c->pending = PENDING_AG;
    return TEC_OK;
}

static tec_status bulk_finish(tec_comm *c, int kind, const char *op, void *stream)
{
    if (!c->mapped)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': %s before the peers were opened", c->name, op);
    if (c->pending != kind)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': %s without a matching start", c->name, op);
    c->pending = PENDING_NONE;
    TRY(c->ops->event_wait(c->t, EV_BULK, stream));
    if (c->size > 1) {
        if (kind == PENDING_AG) c->stats.bulk_ag++;
        else c->stats.bulk_rs++;
    }
    return TEC_OK;
}

tec_status tec_comm_bulk_ag_finish(tec_comm *c, void *stream)
{
    return bulk_finish(c, PENDING_AG, "bulk_ag_finish", stream);
}

tec_status tec_comm_bulk_rs_start(tec_comm *c, const void *src, int64_t rows, int64_t cols, tec_dtype dtype,
                                  void *out, void *stream)
{
    const size_t chunk = chunk_bytes(rows, cols, tec_dtype_size(dtype));
    tec_status st = begin_chunk(c, "bulk_rs", chunk, rows, cols, dtype);
    if (st)
        return st;
    if (!src || !out)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': bulk_rs: missing src or out", c->name);
    const char *s = src, *base = c->bases[c->rank];
    if (s < base + c->region_bytes && s + chunk * (size_t)c->size > base)
        return tec_set_error(TEC_ERR_INVALID_ARG,
                             "communicator '%s': bulk_rs: the input lies in the communicator's own buffer; "
                             "reduce-scatter needs it elsewhere", c->name);
    const uint64_t e = next_epoch(c, stream), v = tec_flag_value(e, tec_flag_tag(OP_BULK_RS, chunk));
    void *M = c->ops->comm_stream(c->t);
    const int r = c->rank, n = c->size;
    if (n == 1) {
        TRY(c->ops->event_record(c->t, EV_START, stream));
        TRY(c->ops->event_wait(c->t, EV_START, M));
        TRY(c->ops->copy(c->t, out, src, chunk, M));
        c->stats.non_overlap++;
    } else {
        TRY(announce_free(c, "bulk_rs", v, 0, stream));
        for (int i = 1; i < n; i++) {
            const int p = (r + i) % n;
            TRY(push(c, p, s + p * chunk, chunk, v));
        }
        TRY(reduce_slots(c, "bulk_rs", s + r * chunk, chunk, rows, cols, dtype, out, NULL, NULL, v, 1, M));
    }
    TRY(c->ops->event_record(c->t, EV_BULK, M));
    c->pending = PENDING_RS;
    return TEC_OK;
}

tec_status tec_comm_bulk_rs_finish(tec_comm *c, void *stream)
{
    return bulk_finish(c, PENDING_RS, "bulk_rs_finish", stream);
}
