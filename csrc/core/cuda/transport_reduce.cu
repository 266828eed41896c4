/* transport_reduce.cu - the CUDA transport's reduce (transport.h's reduce,
 * through ct_reduce in cuda_transport.cu, which checks its arguments):
 * out = the float32 sum of the sources in index order (+ bias), the sources
 * of out's dtype, or FP8 bytes each decoded with its own scale_inv
 * (tec_reduce_fp8: a gemm_rs's FP8 partials). Exercised by
 * tests/cuda/transport_test.cu and the communicator tests on CUDA
 * (tests/distributed/run_gemm_with_overlap.py --check fp8_partials). */
#include <cuda_fp8.h>
#include <stdint.h>
#include <string.h>

#include "cuda_common.h"
#include "cuda_transport.h"

namespace {

const int CT_REDUCE_THREADS = 256;

struct ct_reduce_args {
    const void *srcs[TEC_COMM_MAX_RANKS];
    void *out;
    const void *bias;
    int64_t n;    /* rows * cols elements */
    int64_t cols;
    int nsrc;
};

/* One element j, in fp32, sources in index order, bias last. */
template <typename T> __device__ __forceinline__ void ct_reduce_one(const ct_reduce_args &a, int64_t j)
{
    float acc = tec_to_f32(static_cast<const T *>(a.srcs[0])[j]);
    for (int s = 1; s < a.nsrc; s++)
        acc += tec_to_f32(static_cast<const T *>(a.srcs[s])[j]);
    if (a.bias)
        acc += tec_to_f32(static_cast<const T *>(a.bias)[j % a.cols]);
    static_cast<T *>(a.out)[j] = tec_from_f32<T>(acc);
}

/* V elements per thread and step (16-byte accesses when V > 1: every
 * pointer 16-aligned and, with a bias, cols % V == 0); the n % V tail is
 * summed element by element. */
template <typename T, int V> __global__ void __launch_bounds__(CT_REDUCE_THREADS) ct_reduce_kernel(ct_reduce_args a)
{
    typedef tec_vec<T, V> vec;
    const int64_t items = a.n / V;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t i = first; i < items; i += stride) {
        float acc[V];
        vec v = static_cast<const vec *>(a.srcs[0])[i];
#pragma unroll
        for (int k = 0; k < V; k++)
            acc[k] = tec_vget(v, k);
        for (int s = 1; s < a.nsrc; s++) {
            v = static_cast<const vec *>(a.srcs[s])[i];
#pragma unroll
            for (int k = 0; k < V; k++)
                acc[k] += tec_vget(v, k);
        }
        if (a.bias) {
            v = *reinterpret_cast<const vec *>(static_cast<const T *>(a.bias) + (i * V) % a.cols);
#pragma unroll
            for (int k = 0; k < V; k++)
                acc[k] += tec_vget(v, k);
        }
        static_cast<vec *>(a.out)[i] = tec_vpack<T, V>(acc);
    }
    if (V > 1 && first < a.n - items * V)
        ct_reduce_one<T>(a, items * V + first);
}

/* FP8 sources (tec_reduce_fp8): source s's value is its decoded byte times
 * *scale_inv[s], each product and sum rounded on its own (no fused
 * multiply-add), as the CPU transport computes them. */
struct ct_reduce_fp8_args {
    ct_reduce_args r;
    const float *scale_inv[TEC_COMM_MAX_RANKS];
};

template <int FMT> __device__ __forceinline__ float ct_fp8_value(uint8_t b)
{
    if (FMT == TEC_FP8_E4M3) {
        __nv_fp8_e4m3 x;
        x.__x = b;
        return float(x);
    }
    __nv_fp8_e5m2 x;
    x.__x = b;
    return float(x);
}

/* One element j. */
template <typename T, int FMT> __device__ __forceinline__ void ct_reduce_fp8_one(const ct_reduce_fp8_args &a, int64_t j)
{
    float acc = __fmul_rn(ct_fp8_value<FMT>(static_cast<const uint8_t *>(a.r.srcs[0])[j]), *a.scale_inv[0]);
    for (int s = 1; s < a.r.nsrc; s++)
        acc = __fadd_rn(acc, __fmul_rn(ct_fp8_value<FMT>(static_cast<const uint8_t *>(a.r.srcs[s])[j]),
                                       *a.scale_inv[s]));
    if (a.r.bias)
        acc = __fadd_rn(acc, tec_to_f32(static_cast<const T *>(a.r.bias)[j % a.r.cols]));
    static_cast<T *>(a.r.out)[j] = tec_from_f32<T>(acc);
}

/* 8 elements per thread and step with vec (8-byte source, 16-byte output
 * and bias accesses), the n % 8 tail element by element; one at a time
 * without. */
template <typename T, int FMT, bool VEC>
__global__ void __launch_bounds__(CT_REDUCE_THREADS) ct_reduce_fp8_kernel(ct_reduce_fp8_args a)
{
    constexpr int V = 8;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (!VEC) {
        for (int64_t j = first; j < a.r.n; j += stride)
            ct_reduce_fp8_one<T, FMT>(a, j);
        return;
    }
    typedef tec_vec<T, V> vec;
    const int64_t items = a.r.n / V;
    for (int64_t i = first; i < items; i += stride) {
        float acc[V];
        for (int s = 0; s < a.r.nsrc; s++) {
            uint8_t b[V];
            *reinterpret_cast<uint2 *>(b) = static_cast<const uint2 *>(a.r.srcs[s])[i];
            const float sinv = *a.scale_inv[s];
#pragma unroll
            for (int k = 0; k < V; k++) {
                const float v = __fmul_rn(ct_fp8_value<FMT>(b[k]), sinv);
                acc[k] = s == 0 ? v : __fadd_rn(acc[k], v);
            }
        }
        if (a.r.bias) {
            const vec bv = *reinterpret_cast<const vec *>(static_cast<const T *>(a.r.bias) + (i * V) % a.r.cols);
#pragma unroll
            for (int k = 0; k < V; k++)
                acc[k] = __fadd_rn(acc[k], tec_vget(bv, k));
        }
        static_cast<vec *>(a.r.out)[i] = tec_vpack<T, V>(acc);
    }
    if (first < a.r.n - items * V)
        ct_reduce_fp8_one<T, FMT>(a, items * V + first);
}

template <typename T> tec_status ct_reduce_launch(const ct_reduce_args &a, int sm_count, cudaStream_t stream)
{
    constexpr int V = 16 / (int)sizeof(T);
    bool vec = tec_cuda_aligned16(a.out) && (!a.bias || (tec_cuda_aligned16(a.bias) && a.cols % V == 0));
    for (int i = 0; i < a.nsrc; i++)
        vec = vec && tec_cuda_aligned16(a.srcs[i]);
    const int64_t items = vec ? (a.n + V - 1) / V : a.n;
    int64_t blocks = (items + CT_REDUCE_THREADS - 1) / CT_REDUCE_THREADS;
    const int64_t cap = (int64_t)sm_count * 8;
    if (blocks > cap)
        blocks = cap;
    if (vec)
        ct_reduce_kernel<T, V><<<(unsigned)blocks, CT_REDUCE_THREADS, 0, stream>>>(a);
    else
        ct_reduce_kernel<T, 1><<<(unsigned)blocks, CT_REDUCE_THREADS, 0, stream>>>(a);
    TEC_CUDA_LAUNCH_CHECK("the reduce kernel");
    return TEC_OK;
}

template <typename T, int FMT> tec_status ct_reduce_fp8_launch(const ct_reduce_fp8_args &a, int sm_count,
                                                                 cudaStream_t stream)
{
    constexpr int V = 8;
    bool vec = sizeof(T) * V == 16 && tec_cuda_aligned16(a.r.out) &&
               (!a.r.bias || (tec_cuda_aligned16(a.r.bias) && a.r.cols % V == 0));
    for (int i = 0; i < a.r.nsrc; i++)
        vec = vec && ((uintptr_t)a.r.srcs[i] & 7u) == 0;
    const int64_t items = vec ? (a.r.n + V - 1) / V : a.r.n;
    int64_t blocks = (items + CT_REDUCE_THREADS - 1) / CT_REDUCE_THREADS;
    const int64_t cap = (int64_t)sm_count * 8;
    if (blocks > cap)
        blocks = cap;
    if (vec)
        ct_reduce_fp8_kernel<T, FMT, true><<<(unsigned)blocks, CT_REDUCE_THREADS, 0, stream>>>(a);
    else
        ct_reduce_fp8_kernel<T, FMT, false><<<(unsigned)blocks, CT_REDUCE_THREADS, 0, stream>>>(a);
    TEC_CUDA_LAUNCH_CHECK("the FP8 reduce kernel");
    return TEC_OK;
}

template <typename T> tec_status ct_reduce_fp8_dispatch(const ct_reduce_fp8_args &a, tec_fp8_format f, int sm_count,
                                                        cudaStream_t stream)
{
    return f == TEC_FP8_E5M2 ? ct_reduce_fp8_launch<T, TEC_FP8_E5M2>(a, sm_count, stream)
                             : ct_reduce_fp8_launch<T, TEC_FP8_E4M3>(a, sm_count, stream);
}

}  // namespace

tec_status ct_reduce_run(void *out, const void *const *srcs, int nsrc, int64_t rows, int64_t cols, tec_dtype dtype,
                         const void *bias, const tec_reduce_fp8 *fp8, int sm_count, cudaStream_t s)
{
    ct_reduce_args a;
    memset(&a, 0, sizeof a);
    a.n = rows * cols;
    for (int i = 0; i < nsrc; i++)
        a.srcs[i] = srcs[i];
    a.out = out;
    a.bias = bias;
    a.cols = cols;
    a.nsrc = nsrc;
    if (fp8) {
        ct_reduce_fp8_args f;
        f.r = a;
        for (int i = 0; i < nsrc; i++)
            f.scale_inv[i] = (const float *)((const char *)srcs[i] + fp8->scale_inv_offset);
        switch (dtype) {
        case TEC_F32: return ct_reduce_fp8_dispatch<float>(f, fp8->format, sm_count, s);
        case TEC_BF16: return ct_reduce_fp8_dispatch<__nv_bfloat16>(f, fp8->format, sm_count, s);
        case TEC_F16: return ct_reduce_fp8_dispatch<__half>(f, fp8->format, sm_count, s);
        }
    }
    switch (dtype) {
    case TEC_F32: return ct_reduce_launch<float>(a, sm_count, s);
    case TEC_BF16: return ct_reduce_launch<__nv_bfloat16>(a, sm_count, s);
    case TEC_F16: return ct_reduce_launch<__half>(a, sm_count, s);
    }
    return TEC_CUDA_FAIL(TEC_ERR_INTERNAL, "reduce: dtype %d", (int)dtype);
}
