/* gemm.cu - the row-major GEMM of tec.h on CUDA through cuBLASLt (fp32
 * compute): the entry point, fused bias / bias-gradient epilogues where
 * cuBLASLt takes them and small kernels where it does not, and a plain
 * fallback kernel for shapes cuBLASLt has no algorithm for. Plans and their
 * cache are in gemm_plan.cu, the algorithm sweep in gemm_tune.cu.
 * Exercised by tests/test_kernels.py (device="cuda"). */
#include <string.h>

#include "gemm_plan.h"

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

} /* namespace */

/* ================================================================ counters */

static long long g_stats[kStatCount];

void gemm_stat_add(int i) { __atomic_fetch_add(&g_stats[i], 1, __ATOMIC_RELAXED); }

/* Counters since load, for tests that need to know which path ran:
 * out[0] matmuls with a fused cuBLASLt epilogue (bias or bias gradient),
 * out[1] epilogues done by our own kernels (not fused),
 * out[2] products done by the SIMT fallback kernel (no cuBLASLt algorithm),
 * out[3] plans built (cache misses),
 * out[4] algorithm sweeps enqueued, out[5] sweeps read back (a choice made),
 * out[6] of those, choices other than the heuristic's first answer,
 * out[7] plans evicted from a full cache. */
TEC_CUDA_EXPORT void tec_cuda_gemm_stats(long long out[8])
{
    for (int i = 0; i < kStatCount; i++)
        out[i] = __atomic_load_n(&g_stats[i], __ATOMIC_RELAXED);
}

/* ============================================================ entry point */

/* The plan cache's key for this call (zeroed: it is hashed as bytes). */
static tec_status make_key(int device, const tec_gemm_args *g, unsigned policy, gemm_key *key, const void **epi_ptr)
{
    memset(key, 0, sizeof *key);
    *epi_ptr = NULL;
    key->epi = CUBLASLT_EPILOGUE_DEFAULT;
    if (!(policy & TEC_GEMM_UNFUSED_EPILOGUE) && g->c_dtype == g->ab_dtype) {
        if (g->bias) {
            key->epi = CUBLASLT_EPILOGUE_BIAS;
            *epi_ptr = g->bias;
        } else if (g->bias_grad) {
            key->epi = CUBLASLT_EPILOGUE_BGRADB;
            *epi_ptr = g->bias_grad;
        }
    }
    key->ab = g->ab_dtype;
    key->c = g->c_dtype;
    key->transa = g->transa;
    key->transb = g->transb;
    if (g->sm_margin > 0) { /* leave SMs free for the comm stream's kernels */
        int sms;
        tec_status s = tec_cuda_sm_count(device, &sms);
        if (s != TEC_OK)
            return s;
        key->sm_target = sms - g->sm_margin > 1 ? sms - g->sm_margin : 1;
    }
    key->align_a = tec_cuda_ptr_align(g->a);
    key->align_b = tec_cuda_ptr_align(g->b);
    key->align_c = tec_cuda_ptr_align(g->c);
    key->align_bias = tec_cuda_ptr_align(*epi_ptr);
    key->m = g->m;
    key->n = g->n;
    key->k = g->k;
    key->lda = g->lda;
    key->ldb = g->ldb;
    key->ldc = g->ldc;
    return TEC_OK;
}

/* Stream contract: the product and every epilogue kernel are enqueued on
 * `stream`, in order; nothing waits. No lock is held while anything is
 * enqueued: the plan cache's lock covers its lookup only, and a call whose
 * epilogue takes a pointer builds its own descriptor (on the stack). */
tec_status tec_cuda_gemm(int device, const tec_gemm_args *g, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    const unsigned policy = tec_cuda_gemm_policy();
    if (g->m == 0 || g->n == 0)
        return TEC_OK;
    TEC_CUDA_ENTER(device);

    if (g->k == 0) { /* C = 0 (or unchanged) + bias; bias_grad = 0 */
        if (!g->accumulate || g->bias) {
            TEC_GEMM_DISPATCH(g, launch_fill, g, g->accumulate, g->bias, st);
            TEC_CUDA_LAUNCH_CHECK("gemm fill kernel (k == 0)");
        }
        if (g->bias_grad) {
            dispatch_bias_grad(g, st);
            TEC_CUDA_LAUNCH_CHECK("bias gradient kernel (k == 0)");
        }
        return TEC_OK;
    }

    gemm_cache *cache = NULL;
    gemm_key key;
    const void *epi_ptr;
    gemm_use use;
    tec_status s = gemm_cache_get(device, &cache);
    if (s == TEC_OK)
        s = make_key(device, g, policy, &key, &epi_ptr);
    if (s == TEC_OK)
        s = gemm_plan_acquire(cache, &key, epi_ptr, (policy & TEC_GEMM_TUNE) && !g->accumulate, st, &use);
    if (s != TEC_OK)
        return s;
    gemm_plan *plan = use.plan;
    if (plan->simt) {
        if ((g->m + 15) / 16 > kMaxGridY) {
            s = TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED,
                              "gemm: cuBLASLt has no algorithm and m=%lld is too large for the fallback kernel",
                              (long long)g->m);
            goto out;
        }
        TEC_GEMM_DISPATCH(g, launch_simt, g, st);
        TEC_CUDA_LAUNCH_CHECK_GOTO("fallback GEMM kernel", s, out);
        gemm_stat_add(kStatSimt);
    } else {
        const float alpha = 1.0f, beta = g->accumulate ? 1.0f : 0.0f;
        cublasLtMatmulDescOpaque_t call_desc;
        cublasLtMatmulDesc_t desc = &plan->desc; /* read-only: shared by every caller */
        if (plan->epi != CUBLASLT_EPILOGUE_DEFAULT) {
            if ((s = gemm_desc_init(&call_desc, &key, plan->epi, epi_ptr)) != TEC_OK)
                goto out;
            desc = &call_desc;
            gemm_stat_add(kStatFused);
        }
        const size_t wsb = g->workspace_bytes < TEC_CUDA_GEMM_WORKSPACE_BYTES ? g->workspace_bytes
                                                                            : TEC_CUDA_GEMM_WORKSPACE_BYTES;
        const cublasLtHandle_t h = gemm_cache_handle(cache);
        if (use.action == kActSweep)
            use.result = gemm_tune_sweep(h, plan, desc, g, wsb, st);
        else if (use.action == kActFinish && (use.result = gemm_tune_finish(plan, &use.best)) == kTuneDone)
            use.algo = plan->algos[use.best];
        TEC_CUBLAS_CHECK_GOTO(cublasLtMatmul(h, desc, &alpha, g->b, plan->la, g->a, plan->lb, &beta, g->c, plan->lc,
                                             g->c, plan->lc, &use.algo, g->workspace, wsb, st),
                              s, out);
    }
    /* Epilogues cuBLASLt did not fuse (the SIMT kernel adds bias itself). */
    if (g->bias && !plan->simt && plan->epi != CUBLASLT_EPILOGUE_BIAS) {
        TEC_GEMM_DISPATCH(g, launch_fill, g, 1, g->bias, st);
        TEC_CUDA_LAUNCH_CHECK_GOTO("bias epilogue kernel", s, out);
        gemm_stat_add(kStatEpilogueKernel);
    }
    if (g->bias_grad && plan->epi != CUBLASLT_EPILOGUE_BGRADB) {
        dispatch_bias_grad(g, st);
        TEC_CUDA_LAUNCH_CHECK_GOTO("bias gradient kernel", s, out);
        gemm_stat_add(kStatEpilogueKernel);
    }
out:
    gemm_plan_release(cache, &use);
    return s;
}
