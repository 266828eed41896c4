/* gemm.cu - the row-major GEMM of tec.h on CUDA through cuBLASLt (fp32
 * compute), with a per-device cache of descriptors, layouts and algorithm,
 * fused bias / bias-gradient epilogues where cuBLASLt takes them and small
 * kernels where it does not. Exercised by tests/test_kernels.py (device="cuda"). */
#include <cublasLt.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_common.h"
#include "gemm_tune.h"

namespace {

/* ================================================================ kernels */

/* C[i, j] = (keep ? C[i, j] : 0) + bias[j] (bias may be NULL): the k == 0
 * product and the bias epilogue when cuBLASLt did not fuse it. */
template <typename CT, typename BT>
__global__ void __launch_bounds__(256)
gemm_fill_kernel(CT *c, int64_t ldc, int64_t m, int64_t n, int keep, const BT *bias)
{
    const int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
    if (j >= n)
        return;
    const float b = bias ? tec_to_f32(bias[j]) : 0.0f;
    for (int64_t i = (int64_t)blockIdx.y * 8 + threadIdx.y; i < m; i += (int64_t)gridDim.y * 8) {
        float v = b;
        if (keep)
            v += tec_to_f32(c[i * ldc + j]);
        c[i * ldc + j] = tec_from_f32<CT>(v);
    }
}

/* bias_grad[i] = sum_p A[i, p] for A stored [m, k] (transa = 0): one warp per
 * row, contiguous reads. */
template <typename T>
__global__ void __launch_bounds__(128)
bias_grad_rows_kernel(const T *a, int64_t lda, int64_t m, int64_t k, T *out)
{
    const int64_t i = (int64_t)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (i >= m)
        return;
    float s = 0.0f;
    for (int64_t p = lane; p < k; p += 32)
        s += tec_to_f32(a[i * lda + p]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0)
        out[i] = tec_from_f32<T>(s);
}

/* bias_grad[i] = sum_p A[p, i] for A stored [k, m] (transa = 1, the wgrad
 * layout): block (32, 16) owns 32 columns, fixed-order reduction. */
template <typename T>
__global__ void __launch_bounds__(512)
bias_grad_cols_kernel(const T *a, int64_t lda, int64_t m, int64_t k, T *out)
{
    __shared__ float part[16][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t i = (int64_t)blockIdx.x * 32 + tx;
    float s = 0.0f;
    if (i < m)
        for (int64_t p = ty; p < k; p += 16)
            s += tec_to_f32(a[p * lda + i]);
    part[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && i < m) {
        s = 0.0f;
#pragma unroll
        for (int r = 0; r < 16; r++)
            s += part[r][tx];
        out[i] = tec_from_f32<T>(s);
    }
}

/* Plain tiled GEMM for shapes cuBLASLt offers no algorithm for (unusual
 * alignment): row-major semantics of tec_gemm_args, bias and accumulate
 * included. */
template <typename AT, typename CT>
__global__ void __launch_bounds__(256)
gemm_simt_kernel(const AT *a, int64_t lda, int transa, const AT *b, int64_t ldb, int transb, CT *c,
                 int64_t ldc, int64_t m, int64_t n, int64_t k, int accumulate, const AT *bias)
{
    __shared__ float as[16][17], bs[16][17];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t i0 = (int64_t)blockIdx.y * 16, j0 = (int64_t)blockIdx.x * 16;
    float acc = 0.0f;
    for (int64_t p0 = 0; p0 < k; p0 += 16) {
        const int64_t ai = i0 + ty, ap = p0 + tx, bp = p0 + ty, bj = j0 + tx;
        as[ty][tx] = (ai < m && ap < k) ? tec_to_f32(transa ? a[ap * lda + ai] : a[ai * lda + ap]) : 0.0f;
        bs[ty][tx] = (bp < k && bj < n) ? tec_to_f32(transb ? b[bj * ldb + bp] : b[bp * ldb + bj]) : 0.0f;
        __syncthreads();
#pragma unroll
        for (int q = 0; q < 16; q++)
            acc += as[ty][q] * bs[q][tx];
        __syncthreads();
    }
    const int64_t i = i0 + ty, j = j0 + tx;
    if (i < m && j < n) {
        if (bias)
            acc += tec_to_f32(bias[j]);
        if (accumulate)
            acc += tec_to_f32(c[i * ldc + j]);
        c[i * ldc + j] = tec_from_f32<CT>(acc);
    }
}

/* ============================================================== launchers */

constexpr int64_t kMaxGridY = 65535;

template <typename AT, typename CT>
void launch_fill(const tec_gemm_args *g, int keep, const void *bias, cudaStream_t st)
{
    int64_t gy = (g->m + 7) / 8;
    if (gy > kMaxGridY)
        gy = kMaxGridY;
    dim3 grid((unsigned)((g->n + 31) / 32), (unsigned)gy);
    gemm_fill_kernel<CT, AT><<<grid, dim3(32, 8), 0, st>>>((CT *)g->c, g->ldc, g->m, g->n, keep, (const AT *)bias);
}

template <typename AT> void launch_bias_grad(const tec_gemm_args *g, cudaStream_t st)
{
    if (g->transa)
        bias_grad_cols_kernel<AT><<<(unsigned)((g->m + 31) / 32), dim3(32, 16), 0, st>>>(
            (const AT *)g->a, g->lda, g->m, g->k, (AT *)g->bias_grad);
    else
        bias_grad_rows_kernel<AT><<<(unsigned)((g->m + 3) / 4), 128, 0, st>>>((const AT *)g->a, g->lda, g->m, g->k,
                                                                              (AT *)g->bias_grad);
}

template <typename AT, typename CT> void launch_simt(const tec_gemm_args *g, cudaStream_t st)
{
    dim3 grid((unsigned)((g->n + 15) / 16), (unsigned)((g->m + 15) / 16));
    gemm_simt_kernel<AT, CT><<<grid, dim3(16, 16), 0, st>>>((const AT *)g->a, g->lda, g->transa, (const AT *)g->b,
                                                            g->ldb, g->transb, (CT *)g->c, g->ldc, g->m, g->n,
                                                            g->k, g->accumulate, (const AT *)g->bias);
}

/* Call F<AT, CT>::run(args...) for the (ab_dtype, c_dtype) pair. */
#define TEC_GEMM_DISPATCH(g, FN, ...)                                                             \
    do {                                                                                          \
        const bool c32_ = (g)->c_dtype == TEC_F32;                                                \
        switch ((g)->ab_dtype) {                                                                  \
        case TEC_F32: FN<float, float>(__VA_ARGS__); break;                                       \
        case TEC_BF16:                                                                            \
            if (c32_) FN<__nv_bfloat16, float>(__VA_ARGS__);                                      \
            else FN<__nv_bfloat16, __nv_bfloat16>(__VA_ARGS__);                                   \
            break;                                                                                \
        case TEC_F16:                                                                             \
            if (c32_) FN<__half, float>(__VA_ARGS__);                                             \
            else FN<__half, __half>(__VA_ARGS__);                                                 \
            break;                                                                                \
        }                                                                                         \
    } while (0)

void dispatch_bias_grad(const tec_gemm_args *g, cudaStream_t st)
{
    switch (g->ab_dtype) {
    case TEC_F32: launch_bias_grad<float>(g, st); break;
    case TEC_BF16: launch_bias_grad<__nv_bfloat16>(g, st); break;
    case TEC_F16: launch_bias_grad<__half>(g, st); break;
    }
}

/* ======================================================== cuBLASLt plans */

/* Row-major C[m,n] = op(A) op(B) is column-major C^T[n,m] = op(B)^T op(A)^T:
 * cuBLASLt's "A" is our B (layout la) and its "B" is our A (layout lb); the
 * row-major bias over n is a bias over the rows of D (EPILOGUE_BIAS), and the
 * row sums of op(A) are the column sums of cuBLASLt's B (EPILOGUE_BGRADB). */
struct gemm_key {
    int32_t ab, c, transa, transb, epi;
    int32_t sm_target; /* CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, 0: not set */
    uint32_t align_a, align_b, align_c, align_bias;
    int64_t m, n, k, lda, ldb, ldc;
};

/* Algorithm choice by measurement (opt-in: the TEC_GEMM_TUNE policy). The heuristic's
 * first answer is within 1% of cublasGemmEx's choice, but another of its
 * answers is 2-7% faster at most layer shapes on H200 when timed alone
 * (scripts/gemm_algos.cu). So a plan keeps the heuristic's candidates; with
 * tuning on, the first call that overwrites C (beta = 0, stream
 * not capturing) also runs each candidate once untimed and kTuneRounds times
 * between events on its stream, before its own product; a later call finds
 * the events complete (cudaEventQuery, never a wait) and keeps the fastest
 * (tec_tune_pick). Candidates
 * only write C (and the bias gradient), which the call itself then
 * overwrites. By default the heuristic's first answer is used. */
enum { kTuneAlgos = 8, kTuneRounds = 3, kTuneEvents = kTuneAlgos * kTuneRounds + 1 };
enum { kTuneOff, kTuneReady, kTunePending, kTuneDone };

struct gemm_plan {
    gemm_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo; /* the one in use */
    int epi;  /* epilogue fused in desc: CUBLASLT_EPILOGUE_DEFAULT, _BIAS or _BGRADB */
    int simt; /* cuBLASLt has no algorithm: use gemm_simt_kernel */
    int tune; /* kTune* */
    int nalgo; /* candidates; algos[0] is the heuristic's first */
    cublasLtMatmulAlgo_t algos[kTuneAlgos];
    size_t algo_ws[kTuneAlgos]; /* workspace each needs */
    int swept[kTuneAlgos];      /* ran in the sweep */
    cudaEvent_t ev[kTuneEvents]; /* sweep: before round r's launch at position j is ev[r * nalgo + j] */
};

enum { kPlans = 256, kMaxDevices = 64 };

struct gemm_dev {
    pthread_mutex_t lock; /* guards plans (and the per-call bias pointer in a plan's desc) */
    cublasLtHandle_t handle;
    int nplans;
    gemm_plan plans[kPlans]; /* entries are never removed, so never reused under a caller */
};

gemm_dev *g_devs[kMaxDevices];
pthread_mutex_t g_devs_lock = PTHREAD_MUTEX_INITIALIZER;

/* Counters readable through tec_cuda_gemm_stats (see the bottom). */
enum { kStatFused, kStatEpilogueKernel, kStatSimt, kStatPlans, kStatSweeps, kStatTuned, kStatTunedOther,
       kStatCount };
long long g_stats[kStatCount];
void stat_add(int i) { __atomic_fetch_add(&g_stats[i], 1, __ATOMIC_RELAXED); }

cudaDataType_t cuda_type(int dt)
{
    return dt == TEC_F32 ? CUDA_R_32F : dt == TEC_BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

/* The device's state, made (with its cuBLASLt handle) on first use. The
 * device must be current. */
tec_status get_dev(int device, gemm_dev **out)
{
    tec_status st = TEC_OK;
    *out = NULL;
    if (device < 0 || device >= kMaxDevices)
        return TEC_CUDA_FAIL(TEC_ERR_INVALID_ARG, "gemm: device %d out of range", device);
    gemm_dev *d = __atomic_load_n(&g_devs[device], __ATOMIC_ACQUIRE);
    if (d) {
        *out = d;
        return TEC_OK;
    }
    pthread_mutex_lock(&g_devs_lock);
    d = g_devs[device];
    if (!d) {
        d = (gemm_dev *)calloc(1, sizeof *d);
        if (!d) {
            st = TEC_CUDA_FAIL(TEC_ERR_NO_MEMORY, "gemm: no memory for the plan cache");
            goto fail;
        }
        TEC_CUBLAS_CHECK_GOTO(cublasLtCreate(&d->handle), st, fail);
        pthread_mutex_init(&d->lock, NULL);
        __atomic_store_n(&g_devs[device], d, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_devs_lock);
    *out = d;
    return TEC_OK;
fail:
    free(d);
    pthread_mutex_unlock(&g_devs_lock);
    return st;
}

void tune_drop_events(gemm_plan *p)
{
    for (int i = 0; i < kTuneEvents; i++)
        if (p->ev[i]) {
            cudaEventDestroy(p->ev[i]);
            p->ev[i] = NULL;
        }
}

void plan_release(gemm_plan *p)
{
    tune_drop_events(p);
    if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    p->desc = NULL;
    p->la = p->lb = p->lc = NULL;
    p->nalgo = 0;
}

/* Make the descriptor and layouts for epilogue `epi` and ask the heuristic
 * for one algorithm. *found = 0 (not an error) if it has none. */
tec_status plan_try(cublasLtHandle_t h, const gemm_key *k, int epi, const void *epi_ptr, gemm_plan *p, int *found)
{
    tec_status st = TEC_OK;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res[kTuneAlgos];
    int nres = 0;
    const cublasOperation_t opa = k->transb ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt A = our B */
    const cublasOperation_t opb = k->transa ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt B = our A */
    const cublasLtEpilogue_t e = (cublasLtEpilogue_t)epi;
    const uint64_t ws = TEC_CUDA_GEMM_WORKSPACE_BYTES;

    *found = 0;
    p->epi = epi;
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa),
                          st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb),
                          st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e), st,
                          fail);
    if (epi != CUBLASLT_EPILOGUE_DEFAULT)
        TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &epi_ptr,
                                                             sizeof epi_ptr),
                              st, fail);
    if (k->sm_target > 0)
        TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
                                                             &k->sm_target, sizeof k->sm_target),
                              st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatrixLayoutCreate(&p->la, cuda_type(k->ab), (uint64_t)(k->transb ? k->k : k->n),
                                                     (uint64_t)(k->transb ? k->n : k->k), k->ldb),
                          st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatrixLayoutCreate(&p->lb, cuda_type(k->ab), (uint64_t)(k->transa ? k->m : k->k),
                                                     (uint64_t)(k->transa ? k->k : k->m), k->lda),
                          st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatrixLayoutCreate(&p->lc, cuda_type(k->c), (uint64_t)k->n, (uint64_t)k->m, k->ldc),
                          st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceCreate(&pref), st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                               sizeof ws),
                          st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                               &k->align_b, sizeof k->align_b),
                          st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                               &k->align_a, sizeof k->align_a),
                          st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                               &k->align_c, sizeof k->align_c),
                          st, fail);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                               &k->align_c, sizeof k->align_c),
                          st, fail);
    /* No algorithm (CUBLAS_STATUS_NOT_SUPPORTED or nres == 0) is an answer,
     * not a failure: the caller falls back. */
    if (cublasLtMatmulAlgoGetHeuristic(h, p->desc, p->la, p->lb, p->lc, p->lc, pref, kTuneAlgos, res, &nres) ==
        CUBLAS_STATUS_SUCCESS) {
        for (int i = 0; i < nres; i++)
            if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= ws) {
                p->algos[p->nalgo] = res[i].algo;
                p->algo_ws[p->nalgo++] = res[i].workspaceSize;
            }
    }
    if (p->nalgo > 0) {
        p->algo = p->algos[0];
        *found = 1;
    } else {
        (void)cudaGetLastError();
    }
    cublasLtMatmulPreferenceDestroy(pref);
    return TEC_OK;
fail:
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    plan_release(p);
    return st;
}

/* Build the plan for key: the requested epilogue, else none, else SIMT. */
tec_status plan_build(cublasLtHandle_t h, const gemm_key *k, const void *epi_ptr, gemm_plan *p)
{
    int found = 0;
    memset(p, 0, sizeof *p);
    p->key = *k;
    tec_status st = plan_try(h, k, k->epi, epi_ptr, p, &found);
    if (st != TEC_OK || found)
        return st;
    plan_release(p);
    if (k->epi != CUBLASLT_EPILOGUE_DEFAULT) {
        st = plan_try(h, k, CUBLASLT_EPILOGUE_DEFAULT, NULL, p, &found);
        if (st != TEC_OK || found)
            return st;
        plan_release(p);
    }
    p->epi = CUBLASLT_EPILOGUE_DEFAULT;
    p->simt = 1;
    return TEC_OK;
}

/* 1 if the sweep may be enqueued on (or read from) st now: not while st is
 * capturing (a graph would replay the sweep; an error asking counts as
 * capturing). */
int tune_stream_free(cudaStream_t st)
{
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(st, &cs) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return cs == cudaStreamCaptureStatusNone;
}

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

/* Enqueue the sweep on st (plan lock held; the caller's own product follows
 * on st, so C ends as the call defines it): one untimed round (first
 * launches, module loading), then kTuneRounds timed rounds, each starting
 * at a different candidate. Any failure only leaves the heuristic's choice
 * in place: the events are dropped and the call goes on. */
void tune_sweep(gemm_dev *d, gemm_plan *p, const tec_gemm_args *g, size_t wsb, cudaStream_t st)
{
    relaxed_capture relaxed;
    const float alpha = 1.0f, beta = 0.0f;
    const int n = p->nalgo, nev = kTuneRounds * n + 1;
    p->tune = kTuneOff;
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
            if (p->swept[i] && cublasLtMatmul(d->handle, p->desc, &alpha, g->b, p->la, g->a, p->lb, &beta, g->c,
                                              p->lc, g->c, p->lc, &p->algos[i], g->workspace, wsb,
                                              st) != CUBLAS_STATUS_SUCCESS) {
                (void)cudaGetLastError();
                p->swept[i] = 0; /* launch refused: not a candidate */
            }
        }
    if (cudaEventRecord(p->ev[nev - 1], st) != cudaSuccess)
        goto fail;
    p->tune = kTunePending;
    stat_add(kStatSweeps);
    return;
fail:
    (void)cudaGetLastError();
    tune_drop_events(p);
}

/* If the sweep has run, keep its choice: each candidate's best timed round,
 * the heuristic's answer unless another beats it by over 2%. */
void tune_finish(gemm_plan *p)
{
    relaxed_capture relaxed;
    const int n = p->nalgo, nev = kTuneRounds * n + 1;
    const cudaError_t e = cudaEventQuery(p->ev[nev - 1]);
    if (e == cudaErrorNotReady)
        return;
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
    const int best = tec_tune_pick(t, ok, n, 0.02f); /* 0 when none was timed */
    p->algo = p->algos[best];
    p->tune = kTuneDone;
    tune_drop_events(p);
    stat_add(kStatTuned);
    if (best != 0)
        stat_add(kStatTunedOther);
}

} /* namespace */

/* ============================================================ entry point */

/* Stream contract: the product and every epilogue kernel are enqueued on
 * `stream`, in order; nothing waits. The plan cache lock is held only while
 * the matmul is enqueued (the bias pointer lives in the shared descriptor). */
tec_status tec_cuda_gemm(int device, const tec_gemm_args *g, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    gemm_dev *d = NULL;
    gemm_plan tmp, *plan = NULL;
    int locked = 0, temp = 0;
    const unsigned policy = tec_cuda_gemm_policy();
    if (g->m == 0 || g->n == 0)
        return TEC_OK;
    TEC_CUDA_ENTER(device);
    tec_status s = TEC_OK;

    if (g->k == 0) { /* C = 0 (or unchanged) + bias; bias_grad = 0 */
        if (!g->accumulate || g->bias) {
            TEC_GEMM_DISPATCH(g, launch_fill, g, g->accumulate, g->bias, st);
            TEC_CUDA_LAUNCH_CHECK_GOTO("gemm fill kernel (k == 0)", s, out);
        }
        if (g->bias_grad) {
            dispatch_bias_grad(g, st);
            TEC_CUDA_LAUNCH_CHECK_GOTO("bias gradient kernel (k == 0)", s, out);
        }
        goto out;
    }

    s = get_dev(device, &d);
    if (s != TEC_OK)
        goto out;
    {
        gemm_key key;
        memset(&key, 0, sizeof key);
        const void *epi_ptr = NULL;
        key.epi = CUBLASLT_EPILOGUE_DEFAULT;
        if (!(policy & TEC_GEMM_UNFUSED_EPILOGUE) && g->c_dtype == g->ab_dtype) {
            if (g->bias) {
                key.epi = CUBLASLT_EPILOGUE_BIAS;
                epi_ptr = g->bias;
            } else if (g->bias_grad) {
                key.epi = CUBLASLT_EPILOGUE_BGRADB;
                epi_ptr = g->bias_grad;
            }
        }
        key.ab = g->ab_dtype;
        key.c = g->c_dtype;
        key.transa = g->transa;
        key.transb = g->transb;
        if (g->sm_margin > 0) { /* leave SMs free for the comm stream's kernels */
            int sms;
            if ((s = tec_cuda_sm_count(device, &sms)) != TEC_OK)
                goto out;
            key.sm_target = sms - g->sm_margin > 1 ? sms - g->sm_margin : 1;
        }
        key.align_a = tec_cuda_ptr_align(g->a);
        key.align_b = tec_cuda_ptr_align(g->b);
        key.align_c = tec_cuda_ptr_align(g->c);
        key.align_bias = tec_cuda_ptr_align(epi_ptr);
        key.m = g->m;
        key.n = g->n;
        key.k = g->k;
        key.lda = g->lda;
        key.ldb = g->ldb;
        key.ldc = g->ldc;

        pthread_mutex_lock(&d->lock);
        locked = 1;
        for (int i = 0; i < d->nplans; i++)
            if (memcmp(&d->plans[i].key, &key, sizeof key) == 0) {
                plan = &d->plans[i];
                break;
            }
        if (!plan) {
            temp = d->nplans == kPlans; /* full: a plan for this call only */
            plan = temp ? &tmp : &d->plans[d->nplans];
            s = plan_build(d->handle, &key, epi_ptr, plan);
            if (s != TEC_OK)
                goto out;
            if (!temp)
                d->nplans++;
            if (!temp && !plan->simt && (policy & TEC_GEMM_TUNE) && plan->nalgo > 1)
                plan->tune = kTuneReady;
            stat_add(kStatPlans);
        }

        if (plan->simt) {
            pthread_mutex_unlock(&d->lock);
            locked = 0;
            if ((g->m + 15) / 16 > kMaxGridY) {
                s = TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED,
                                  "gemm: cuBLASLt has no algorithm and m=%lld is too large for the fallback kernel",
                                  (long long)g->m);
                goto out;
            }
            TEC_GEMM_DISPATCH(g, launch_simt, g, st);
            TEC_CUDA_LAUNCH_CHECK_GOTO("fallback GEMM kernel", s, out);
            stat_add(kStatSimt);
        } else {
            const float alpha = 1.0f, beta = g->accumulate ? 1.0f : 0.0f;
            if (plan->epi != CUBLASLT_EPILOGUE_DEFAULT) {
                TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                                     &epi_ptr, sizeof epi_ptr),
                                      s, out);
                stat_add(kStatFused);
            }
            size_t wsb = g->workspace_bytes < TEC_CUDA_GEMM_WORKSPACE_BYTES ? g->workspace_bytes
                                                                           : TEC_CUDA_GEMM_WORKSPACE_BYTES;
            if ((plan->tune == kTunePending || (plan->tune == kTuneReady && !g->accumulate)) &&
                tune_stream_free(st)) {
                if (plan->tune == kTunePending)
                    tune_finish(plan);
                else
                    tune_sweep(d, plan, g, wsb, st);
            }
            TEC_CUBLAS_CHECK_GOTO(cublasLtMatmul(d->handle, plan->desc, &alpha, g->b, plan->la, g->a, plan->lb,
                                                 &beta, g->c, plan->lc, g->c, plan->lc, &plan->algo, g->workspace,
                                                 wsb, st),
                                  s, out);
            pthread_mutex_unlock(&d->lock);
            locked = 0;
        }
    }
    /* Epilogues cuBLASLt did not fuse (the SIMT kernel adds bias itself). */
    if (g->bias && !plan->simt && plan->epi != CUBLASLT_EPILOGUE_BIAS) {
        TEC_GEMM_DISPATCH(g, launch_fill, g, 1, g->bias, st);
        TEC_CUDA_LAUNCH_CHECK_GOTO("bias epilogue kernel", s, out);
        stat_add(kStatEpilogueKernel);
    }
    if (g->bias_grad && plan->epi != CUBLASLT_EPILOGUE_BGRADB) {
        dispatch_bias_grad(g, st);
        TEC_CUDA_LAUNCH_CHECK_GOTO("bias gradient kernel", s, out);
        stat_add(kStatEpilogueKernel);
    }
out:
    if (locked)
        pthread_mutex_unlock(&d->lock);
    if (temp)
        plan_release(&tmp);
    return s;
}

/* Counters since load, for tests that need to know which path ran:
 * out[0] matmuls with a fused cuBLASLt epilogue (bias or bias gradient),
 * out[1] epilogues done by our own kernels (not fused),
 * out[2] products done by the SIMT fallback kernel (no cuBLASLt algorithm),
 * out[3] plans built (cache misses),
 * out[4] algorithm sweeps enqueued, out[5] sweeps read back (a choice made),
 * out[6] of those, choices other than the heuristic's first answer. */
TEC_CUDA_EXPORT void tec_cuda_gemm_stats(long long out[7])
{
    for (int i = 0; i < kStatCount; i++)
        out[i] = __atomic_load_n(&g_stats[i], __ATOMIC_RELAXED);
}
