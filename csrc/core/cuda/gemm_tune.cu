/* gemm_tune.cu - the CUDA GEMM's algorithm sweep (see gemm_plan.h): enqueue
 * every cuBLASLt candidate between events on the caller's stream, and later
 * read the events back and keep the fastest (the choice itself is plain C in
 * gemm_tune.h, checked on the CPU by tests/c/gemm_tune_test.c). Only the
 * caller that claimed the step (gemm_plan_acquire) touches a plan's events.
 * Exercised by tests/test_kernels.py::test_gemm_algorithm_sweep. */
#include "gemm_plan.h"
#include "gemm_tune.h"

namespace {

/* The sweep's event and query calls are legal even while another thread
 * captures in global mode: this thread runs them in relaxed mode. */
struct relaxed_capture {
    cudaStreamCaptureMode prev = cudaStreamCaptureModeRelaxed;
    bool set = false;
    relaxed_capture()
    {
        set = cudaThreadExchangeStreamCaptureMode(&prev) == cudaSuccess;
        if (!set)
            (void)cudaGetLastError();
    }
    ~relaxed_capture()
    {
        if (set)
            (void)cudaThreadExchangeStreamCaptureMode(&prev);
    }
};

} /* namespace */

void gemm_tune_drop_events(gemm_plan *p)
{
    for (int i = 0; i < kTuneEvents; i++)
        if (p->ev[i]) {
            tec_cuda_ignore(cudaEventDestroy(p->ev[i]));
            p->ev[i] = NULL;
        }
}

/* One untimed round (first launches, module loading), then kTuneRounds
 * timed rounds, each starting at a different candidate; the caller's own
 * product follows on st, so C ends as the call defines it. Any failure only
 * leaves the heuristic's choice in place: the events are dropped and the
 * call goes on. */
int gemm_tune_sweep(cublasLtHandle_t h, gemm_plan *p, cublasLtMatmulDesc_t desc, const tec_gemm_args *g,
                    size_t wsb, cudaStream_t st)
{
    relaxed_capture relaxed;
    const float alpha = 1.0f, beta = 0.0f;
    const int n = p->nalgo, nev = kTuneRounds * n + 1;
    for (int i = 0; i < n; i++)
        p->swept[i] = p->algo_ws[i] <= wsb;
    for (int i = 0; i < nev; i++)
        if (cudaEventCreate(&p->ev[i]) != cudaSuccess)
            goto fail;
    for (int r = -1; r < kTuneRounds; r++)
        for (int j = 0; j < n; j++) {
            const int i = tec_tune_candidate(r, j, n);
            if (r >= 0 && cudaEventRecord(p->ev[r * n + j], st) != cudaSuccess)
                goto fail;
            if (p->swept[i] && cublasLtMatmul(h, desc, &alpha, g->b, p->la, g->a, p->lb, &beta, g->c, p->lc, g->c,
                                              p->lc, &p->algos[i], g->workspace, wsb, st) != CUBLAS_STATUS_SUCCESS) {
                (void)cudaGetLastError();
                p->swept[i] = 0; /* launch refused: not a candidate */
            }
        }
    if (cudaEventRecord(p->ev[nev - 1], st) != cudaSuccess)
        goto fail;
    gemm_stat_add(kStatSweeps);
    return kTunePending;
fail:
    (void)cudaGetLastError();
    gemm_tune_drop_events(p);
    return kTuneOff;
}

/* If the sweep has run: each candidate's best timed round, the heuristic's
 * answer unless another beats it by over 2%. */
int gemm_tune_finish(gemm_plan *p, int *best)
{
    relaxed_capture relaxed;
    const int n = p->nalgo, nev = kTuneRounds * n + 1;
    *best = 0;
    const cudaError_t e = cudaEventQuery(p->ev[nev - 1]);
    if (e == cudaErrorNotReady)
        return kTunePending;
    float ms[kTuneEvents] = {0}, t[kTuneAlgos];
    int got[kTuneEvents] = {0}, ok[kTuneAlgos];
    for (int i = 0; i < n; i++)
        ok[i] = e == cudaSuccess && p->swept[i];
    for (int k = 0; k < nev - 1 && e == cudaSuccess; k++) {
        got[k] = cudaEventElapsedTime(&ms[k], p->ev[k], p->ev[k + 1]) == cudaSuccess;
        if (!got[k])
            (void)cudaGetLastError();
    }
    if (e != cudaSuccess)
        (void)cudaGetLastError();
    tec_tune_reduce(ms, got, n, kTuneRounds, t, ok);
    *best = tec_tune_pick(t, ok, n, 0.02f); /* 0 when none was timed */
    gemm_tune_drop_events(p);
    gemm_stat_add(kStatTuned);
    if (*best != 0)
        gemm_stat_add(kStatTunedOther);
    return kTuneDone;
}
