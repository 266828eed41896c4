/* fp8_gemm.cu - the CUDA backend's FP8 GEMM (tec.h's tec_fp8_gemm, in the
 * backend's FP8 table of fp8.cu): cuBLASLt in the TN layout, with the plan
 * cache of gemm_plan.cu (FP8 keys) and per-call scale pointers; an FP8
 * output (cuBLASLt's FP8 D, its D scale and amax). Scales are read on the
 * device: every call can be captured in a CUDA graph. Exercised by
 * tests/test_fp8_engine.py and tests/test_fp8_block.py on cuda, and by the
 * FP8 partials of tests/distributed/run_gemm_with_overlap.py. */
#include <cuda_fp8.h>
#include <string.h>

#include "gemm_plan.h"

namespace {

/* C[i, j] += bias[j]: the bias when cuBLASLt did not fuse it. */
template <typename CT, typename BT>
__global__ void __launch_bounds__(256) bias_add_kernel(CT *c, int64_t ldc, int64_t m, int64_t n, const BT *bias)
{
    const int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
    if (j >= n)
        return;
    const float b = tec_to_f32(bias[j]);
    for (int64_t i = (int64_t)blockIdx.y * 8 + threadIdx.y; i < m; i += (int64_t)gridDim.y * 8)
        c[i * ldc + j] = tec_from_f32<CT>(tec_to_f32(c[i * ldc + j]) + b);
}

/* *amax = max(*amax, *part) (fmaxf: a NaN part is ignored). */
__global__ void amax_into_kernel(float *amax, const float *part)
{
    *amax = fmaxf(*amax, *part);
}

/* C = 0 (k == 0, no accumulate). */
__global__ void zero_rows_kernel(char *c, int64_t ldc_bytes, int64_t m, int64_t row_bytes)
{
    for (int64_t i = blockIdx.x; i < m; i += gridDim.x)
        for (int64_t j = threadIdx.x; j < row_bytes; j += blockDim.x)
            c[i * ldc_bytes + j] = 0;
}

} /* namespace */

/* The plan cache's key of an FP8 call: our row-major A [m, k] times B
 * [n, k]^T is the gemm.cu layout transa = 0, transb = 1 (cuBLASLt's TN). */
static tec_status fp8_key(int device, const tec_fp8_gemm_args *g, int fuse_bias, gemm_key *key,
                          const void **epi_ptr)
{
    memset(key, 0, sizeof *key);
    if (g->sm_margin > 0) { /* leave SMs free for the comm stream's kernels (an overlap schedule) */
        int sms;
        tec_status s = tec_cuda_sm_count(device, &sms);
        if (s != TEC_OK)
            return s;
        key->sm_target = sms - g->sm_margin > 1 ? sms - g->sm_margin : 1;
    }
    key->ab = g->c_dtype;
    key->c = g->c_dtype; /* with an FP8 output, the bias's and C's type */
    key->d_fp8 = g->c_scale ? 1 + (int)g->c_format : 0;
    key->amax_d = g->c_amax ? 1 : 0;
    key->transa = 0;
    key->transb = 1;
    key->fp8 = 1 + (int)g->a_format + 2 * (int)g->b_format;
    key->fast_accum = g->fast_accum ? 1 : 0;
    key->scale_a = g->a_scale_mode; /* block scales: gemm_plan.cu sets cuBLASLt's scale modes */
    key->scale_b = g->b_scale_mode;
    key->epi = CUBLASLT_EPILOGUE_DEFAULT;
    *epi_ptr = NULL;
    if (g->bias && fuse_bias) {
        key->epi = CUBLASLT_EPILOGUE_BIAS;
        *epi_ptr = g->bias;
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

template <typename CT, typename BT>
static void launch_bias_add(const tec_fp8_gemm_args *g, cudaStream_t st)
{
    int64_t gy = (g->m + 7) / 8;
    if (gy > 65535)
        gy = 65535;
    bias_add_kernel<CT, BT><<<dim3((unsigned)((g->n + 31) / 32), (unsigned)gy), dim3(32, 8), 0, st>>>(
        (CT *)g->c, g->ldc, g->m, g->n, (const BT *)g->bias);
}

tec_status tec_cuda_fp8_gemm(int device, const tec_fp8_gemm_args *g, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    TEC_CUDA_ENTER(device);
    const size_t ces = tec_cuda_dtype_size(g->c_dtype);
    /* An FP8 output's amax: cuBLASLt writes it into the scratch after its
     * workspace, folded into the caller's afterwards. */
    float *amax_part = NULL;
    if (g->c_amax) {
        if (!g->workspace || g->workspace_bytes < TEC_CUDA_GEMM_WORKSPACE_BYTES + TEC_CUDA_GEMM_SCRATCH_BYTES)
            return TEC_CUDA_FAIL(TEC_ERR_INVALID_ARG, "fp8 gemm: an FP8 output's amax needs a workspace of %zu bytes "
                                 "(tec_gemm_workspace_bytes), got %zu",
                                 TEC_CUDA_GEMM_WORKSPACE_BYTES + TEC_CUDA_GEMM_SCRATCH_BYTES, g->workspace_bytes);
        amax_part = (float *)((char *)g->workspace + TEC_CUDA_GEMM_WORKSPACE_BYTES);
    }
    if (g->k == 0) { /* C = 0 (+ bias), or unchanged with accumulate */
        if (!g->accumulate) {
            zero_rows_kernel<<<(unsigned)(g->m < 65535 ? g->m : 65535), 256, 0, st>>>(
                (char *)g->c, g->ldc * (int64_t)ces, g->m, g->n * (int64_t)ces);
            TEC_CUDA_LAUNCH_CHECK("fp8 gemm zero kernel (k == 0)");
        }
        if (g->bias) {
            if (g->c_dtype == TEC_F32) launch_bias_add<float, __nv_bfloat16>(g, st);
            else if (g->c_dtype == TEC_BF16) launch_bias_add<__nv_bfloat16, __nv_bfloat16>(g, st);
            else launch_bias_add<__half, __half>(g, st);
            TEC_CUDA_LAUNCH_CHECK("fp8 gemm bias kernel (k == 0)");
        }
        return TEC_OK;
    }
    gemm_cache *cache = NULL;
    gemm_key key;
    const void *epi_ptr;
    gemm_use use;
    const int fuse = !(tec_cuda_gemm_policy() & TEC_GEMM_UNFUSED_EPILOGUE);
    tec_status s = gemm_cache_get(device, &cache);
    if (s != TEC_OK)
        return s;
    if ((s = fp8_key(device, g, fuse, &key, &epi_ptr)) != TEC_OK)
        return s;
    if ((s = gemm_plan_acquire(cache, &key, epi_ptr, 0, st, &use)) != TEC_OK)
        return s;
    gemm_plan *plan = use.plan;
    if (plan->simt) {
        s = TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED,
                          "fp8 gemm: cuBLASLt has no FP8 algorithm for m=%lld n=%lld k=%lld (lda=%lld ldb=%lld "
                          "ldc=%lld; FP8 needs 16-byte aligned operands and k, lda, ldb multiples of 16)",
                          (long long)g->m, (long long)g->n, (long long)g->k, (long long)g->lda, (long long)g->ldb,
                          (long long)g->ldc);
        goto out;
    }
    {
        const float alpha = 1.0f, beta = g->accumulate ? 1.0f : 0.0f;
        cublasLtMatmulDescOpaque_t call_desc;
        /* cuBLASLt's A is our B and its B our A (gemm_plan.h). */
        const void *lt_a_scale = g->b_scale_inv, *lt_b_scale = g->a_scale_inv;
        if ((s = gemm_desc_init(&call_desc, &key, plan->epi, epi_ptr)) != TEC_OK)
            goto out;
        TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(&call_desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                             &lt_a_scale, sizeof lt_a_scale),
                              s, out);
        TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(&call_desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                             &lt_b_scale, sizeof lt_b_scale),
                              s, out);
        if (plan->epi == CUBLASLT_EPILOGUE_BIAS)
            gemm_stat_add(kStatFused);
        if (g->c_scale) {
            if (g->bias && plan->epi != CUBLASLT_EPILOGUE_BIAS) { /* no kernel adds a bias to FP8 bytes */
                s = TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED, "fp8 gemm: cuBLASLt did not fuse the bias of an FP8 output "
                                  "(m=%lld n=%lld k=%lld)", (long long)g->m, (long long)g->n, (long long)g->k);
                goto out;
            }
            TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(&call_desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER,
                                                                 &g->c_scale, sizeof g->c_scale),
                                  s, out);
            if (amax_part) {
                TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(&call_desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER,
                                                                     &amax_part, sizeof amax_part),
                                      s, out);
                TEC_CUDA_CHECK_GOTO(cudaMemsetAsync(amax_part, 0, sizeof(float), st), s, out);
            }
        }
        const size_t wsb = g->workspace_bytes < TEC_CUDA_GEMM_WORKSPACE_BYTES ? g->workspace_bytes
                                                                            : TEC_CUDA_GEMM_WORKSPACE_BYTES;
        /* An FP8 output has no C (beta is 0; C's layout is the bias's type, as cuBLASLt requires). */
        TEC_CUBLAS_CHECK_GOTO(cublasLtMatmul(gemm_cache_handle(cache), &call_desc, &alpha, g->b, plan->la, g->a,
                                             plan->lb, &beta, g->c_scale ? NULL : g->c, plan->lc, g->c,
                                             g->c_scale ? plan->ld : plan->lc, &use.algo, g->workspace, wsb, st),
                              s, out);
        if (amax_part) {
            amax_into_kernel<<<1, 1, 0, st>>>(g->c_amax, amax_part);
            TEC_CUDA_LAUNCH_CHECK_GOTO("fp8 gemm amax kernel", s, out);
        }
    }
    if (g->bias && plan->epi != CUBLASLT_EPILOGUE_BIAS) {
        if (g->c_dtype == TEC_F32) launch_bias_add<float, __nv_bfloat16>(g, st);
        else if (g->c_dtype == TEC_BF16) launch_bias_add<__nv_bfloat16, __nv_bfloat16>(g, st);
        else launch_bias_add<__half, __half>(g, st);
        TEC_CUDA_LAUNCH_CHECK_GOTO("fp8 gemm bias kernel", s, out);
        gemm_stat_add(kStatEpilogueKernel);
    }
out:
    gemm_plan_release(cache, &use);
    return s;
}

