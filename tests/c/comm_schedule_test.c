/* The overlap schedules of csrc/core/comm.c against a mock transport and backend
 * (tests/c/comm_mock.c), on the CPU, in one process: built with comm_mock.c, comm.c,
 * comm_lifetime.c, fp8.c, tec.c and error.c and run by
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

#include "comm_mock.h"

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

#define S_OF(c) mock_compute_stream(tec_comm_rank(c))

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
