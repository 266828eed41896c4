/* gemm_plan.h - private header of the CUDA GEMM (gemm.cu, gemm_plan.cu,
 * gemm_tune.cu): what a cuBLASLt plan holds, the per-device plan cache (a
 * hash of the call's shape, pointer alignments and epilogue, least recently
 * used plan evicted), and the algorithm sweep run on a plan. Exercised by
 * tests/test_kernels.py (device="cuda", test_gemm_algorithm_sweep) and
 * tests/test_gemm_cache.py (eviction, concurrent fused-bias GEMMs). */
#ifndef TEC_GEMM_PLAN_H
#define TEC_GEMM_PLAN_H

#include <cublasLt.h>
#include <pthread.h>

#include "cuda_common.h"

/* Row-major C[m,n] = op(A) op(B) is column-major C^T[n,m] = op(B)^T op(A)^T:
 * cuBLASLt's "A" is our B (layout la) and its "B" is our A (layout lb); the
 * row-major bias over n is a bias over the rows of D (EPILOGUE_BIAS), and the
 * row sums of op(A) are the column sums of cuBLASLt's B (EPILOGUE_BGRADB). */
struct gemm_key {
    int32_t ab, c, transa, transb, epi;
    int32_t sm_target; /* CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, 0: not set */
    int32_t fp8;        /* 0: ab is the operands' dtype; else 1 + A's + 2 * B's tec_fp8_format (fp8.cu) */
    int32_t fast_accum; /* FP8: CUBLASLT_MATMUL_DESC_FAST_ACCUM */
    int32_t scale_a, scale_b; /* FP8: our A's and B's TEC_FP8_SCALE_* (block plans never meet per-tensor ones) */
    int32_t d_fp8;  /* FP8 output: 0, C's and D's type is `c`; else 1 + D's tec_fp8_format, `c` the bias's (and C's) */
    int32_t amax_d; /* FP8 output: CUBLASLT_MATMUL_DESC_AMAX_D_POINTER is set */
    uint32_t align_a, align_b, align_c, align_bias;
    int64_t m, n, k, lda, ldb, ldc;
};

/* Algorithm choice by measurement (opt-in: the TEC_GEMM_TUNE policy). The
 * heuristic's first answer is within 1% of cublasGemmEx's choice, but
 * another of its answers is 2-7% faster at most layer shapes on H200 when
 * timed alone (scripts/gemm_algos.cu). So a plan keeps the heuristic's
 * candidates; with tuning on, the first call that overwrites C (beta = 0,
 * stream not capturing) also runs each candidate once untimed and
 * kTuneRounds times between events on its stream, before its own product; a
 * later call finds the events complete (cudaEventQuery, never a wait) and
 * keeps the fastest (tec_tune_pick). Candidates only write C (and the bias
 * gradient), which the call itself then overwrites. By default the
 * heuristic's first answer is used. */
enum { kTuneAlgos = 8, kTuneRounds = 3, kTuneEvents = kTuneAlgos * kTuneRounds + 1 };
/* A plan's tuning state; Sweeping and Finishing: one caller owns the sweep's
 * events until it hands the plan back. */
enum { kTuneOff, kTuneReady, kTuneSweeping, kTunePending, kTuneFinishing, kTuneDone };

struct gemm_plan {
    gemm_key key;
    uint64_t hash;
    gemm_plan *next;                 /* bucket chain */
    gemm_plan *older, *newer;        /* use order (the cache's list) */
    int refs;                        /* callers between acquire and release (atomic) */
    cublasLtMatmulDescOpaque_t desc; /* read-only after the build */
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatrixLayout_t ld;       /* D's, for an FP8 output (key.d_fp8); else D uses lc */
    cublasLtMatmulAlgo_t algo;       /* the one in use (under the cache lock) */
    int epi;  /* epilogue fused in desc: CUBLASLT_EPILOGUE_DEFAULT, _BIAS or _BGRADB */
    int simt; /* cuBLASLt has no algorithm: use the fallback kernel */
    int tune; /* kTune* (under the cache lock) */
    int nalgo; /* candidates; algos[0] is the heuristic's first */
    cublasLtMatmulAlgo_t algos[kTuneAlgos];
    size_t algo_ws[kTuneAlgos]; /* workspace each needs */
    int swept[kTuneAlgos];      /* ran in the sweep */
    cudaEvent_t ev[kTuneEvents]; /* sweep: before round r's launch at position j is ev[r * nalgo + j] */
};

/* What a caller gets from gemm_plan_acquire; handed back to gemm_plan_release. */
enum { kActNone, kActSweep, kActFinish };
struct gemm_use {
    gemm_plan *plan;
    cublasLtMatmulAlgo_t algo; /* a copy: the plan's may change meanwhile */
    int action;                /* kAct*: this caller runs the sweep or reads it back */
    int result, best;          /* the action's outcome (new kTune* state, chosen candidate) */
};

struct gemm_cache; /* per device: cuBLASLt handle, plans */

/* The device's cache (made with its cuBLASLt handle on first use). */
tec_status gemm_cache_get(int device, gemm_cache **out);
cublasLtHandle_t gemm_cache_handle(const gemm_cache *c);

/* The plan for `key` (built outside the lock on a miss; the least recently
 * used plan no caller holds is evicted when the cache is full), held until
 * gemm_plan_release. tune: the policy allows a sweep for this call (it
 * overwrites C); the caller runs use->action. */
tec_status gemm_plan_acquire(gemm_cache *c, const gemm_key *key, const void *epi_ptr, int tune, cudaStream_t st,
                             gemm_use *use);
void gemm_plan_release(gemm_cache *c, gemm_use *use);

/* A call's own descriptor for the plan's key and epilogue (the epilogue
 * pointer differs per call), in caller storage: no allocation. */
tec_status gemm_desc_init(cublasLtMatmulDesc_t d, const gemm_key *k, int epi, const void *epi_ptr);

/* The sweep (gemm_tune.cu), run by the caller that acquired kActSweep:
 * enqueue it on st with the call's descriptor; returns the new state
 * (kTunePending, or kTuneOff when it could not be enqueued). */
int gemm_tune_sweep(cublasLtHandle_t h, gemm_plan *p, cublasLtMatmulDesc_t desc, const tec_gemm_args *g,
                    size_t wsb, cudaStream_t st);
/* The read-back, run by the caller that acquired kActFinish: kTunePending
 * while the sweep has not completed, else kTuneDone with *best set. */
int gemm_tune_finish(gemm_plan *p, int *best);
/* Drop a plan's sweep events. */
void gemm_tune_drop_events(gemm_plan *p);

/* Counters readable through tec_cuda_gemm_stats (gemm.cu). */
enum { kStatFused, kStatEpilogueKernel, kStatSimt, kStatPlans, kStatSweeps, kStatTuned, kStatTunedOther,
       kStatEvicted, kStatCount };
void gemm_stat_add(int i);

#endif /* TEC_GEMM_PLAN_H */
