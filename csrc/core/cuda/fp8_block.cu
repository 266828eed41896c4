/* fp8_block.cu - the CUDA backend's block-scaled FP8 quantization (tec.h,
 * tec_fp8_block_quantize): one thread block per 128x128 tile of the input,
 * staged in shared memory, writes the rowwise bytes and/or the transpose's
 * with their block scales in cuBLASLt's GEMM-ready layout (1x128 and 128x1
 * blocks with their own amaxes, or one 128x128 block shared by both). No host
 * synchronisation (graph-capturable). Exercised by scripts/gpu_fp8_block.sh
 * (tests/test_fp8_block.py with the cuda device). */
#include <cuda_fp8.h>
#include <float.h>

#include "cuda_common.h"

namespace {

constexpr int kB = TEC_FP8_BLOCK; /* 128 */
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

/* ================================================================ kernels */

/* Shared-memory row stride: a column read by a warp hits 32 banks. */
template <typename T> constexpr int tile_ld() { return kB + (int)(4 / sizeof(T)); }

template <typename T> __device__ __forceinline__ float dtype_max();
template <> __device__ __forceinline__ float dtype_max<float>() { return FLT_MAX; }
template <> __device__ __forceinline__ float dtype_max<__nv_bfloat16>() { return 3.38953139e38f; }
template <> __device__ __forceinline__ float dtype_max<__half>() { return 65504.0f; }

__device__ __forceinline__ uint8_t cvt(float v, int fmt)
{
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, fmt == TEC_FP8_E5M2 ? __NV_E5M2 : __NV_E4M3);
}

__device__ __forceinline__ float warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* tec.h's block scale rule (the CPU's in cpu/fp8_block.c). */
__device__ __forceinline__ float block_scale(float amax, float fp8_max, int pow2, float eps, float inf_value)
{
    if (amax < eps)
        amax = eps;
    if (isinf(amax) || amax == 0.0f || isnan(amax))
        return 1.0f;
    float s = __fdiv_rn(fp8_max, amax);
    if (isinf(s))
        s = inf_value;
    if (pow2)
        s = __uint_as_float(__float_as_uint(s) & 0xff800000u);
    return s;
}

__device__ __forceinline__ int64_t round4(int64_t a) { return (a + 3) / 4 * 4; }

/* One 128x128 tile of x [rows, cols] per block: out / out_t (either may be
 * NULL) and their scales (tec.h's layout). block_dim 1: rows of the tile
 * are 1x128 blocks of out, its columns 1x128 blocks of out_t; 2: the tile
 * is one block. */
template <typename T>
__global__ void __launch_bounds__(kThreads)
block_quantize_kernel(const T *__restrict__ x, int64_t rows, int64_t cols, int fmt, float fp8_max, int block_dim,
                      int pow2, float eps, uint8_t *out, float *sinv, uint8_t *out_t, float *sinv_t)
{
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int LD = tile_ld<T>();
    T *tile = reinterpret_cast<T *>(smem);
    const int64_t r0 = (int64_t)blockIdx.y * kB, c0 = (int64_t)blockIdx.x * kB;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const float inf_value = dtype_max<T>();
    float m = 0.0f;
    for (int i = t; i < kB * kB; i += kThreads) { /* outside x: zeros, which leave every amax as it is */
        const int r = i / kB, c = i % kB;
        const int64_t gr = r0 + r, gc = c0 + c;
        const T v = gr < rows && gc < cols ? x[gr * cols + gc] : tec_from_f32<T>(0.0f);
        tile[r * LD + c] = v;
        m = fmaxf(m, fabsf(tec_to_f32(v)));
    }
    __syncthreads();

    if (block_dim == 2) {
        __shared__ float part[kWarps];
        __shared__ float scale_s;
        m = warp_max(m);
        if (lane == 0)
            part[warp] = m;
        __syncthreads();
        if (t == 0) {
            float a = part[0];
            for (int w = 1; w < kWarps; w++)
                a = fmaxf(a, part[w]);
            const float s = block_scale(a, fp8_max, pow2, eps, inf_value);
            scale_s = s;
            const int64_t nrb = (rows + kB - 1) / kB, ncb = (cols + kB - 1) / kB;
            if (out)
                sinv[blockIdx.y * round4(ncb) + blockIdx.x] = __frcp_rn(s);
            if (out_t)
                sinv_t[blockIdx.x * round4(nrb) + blockIdx.y] = __frcp_rn(s);
        }
        __syncthreads();
        const float s = scale_s;
        if (out)
            for (int i = t; i < kB * kB; i += kThreads) {
                const int r = i / kB, c = i % kB;
                const int64_t gr = r0 + r, gc = c0 + c;
                if (gr < rows && gc < cols)
                    out[gr * cols + gc] = cvt(tec_to_f32(tile[r * LD + c]) * s, fmt);
            }
        if (out_t)
            for (int i = t; i < kB * kB; i += kThreads) {
                const int c = i / kB, r = i % kB;
                const int64_t gr = r0 + r, gc = c0 + c;
                if (gr < rows && gc < cols)
                    out_t[gc * rows + gr] = cvt(tec_to_f32(tile[r * LD + c]) * s, fmt);
            }
        return;
    }

    if (out) /* 1x128 blocks: a warp per tile row */
        for (int r = warp; r < kB; r += kWarps) {
            const int64_t gr = r0 + r;
            if (gr >= rows)
                break;
            float v[4], a = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                v[j] = tec_to_f32(tile[r * LD + lane + 32 * j]);
                a = fmaxf(a, fabsf(v[j]));
            }
            const float s = block_scale(warp_max(a), fp8_max, pow2, eps, inf_value);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int64_t gc = c0 + lane + 32 * j;
                if (gc < cols)
                    out[gr * cols + gc] = cvt(v[j] * s, fmt);
            }
            if (lane == 0)
                sinv[blockIdx.x * round4(rows) + gr] = __frcp_rn(s);
        }
    if (out_t) /* 128x1 blocks of x (1x128 of its transpose): a warp per tile column */
        for (int c = warp; c < kB; c += kWarps) {
            const int64_t gc = c0 + c;
            if (gc >= cols)
                break;
            float v[4], a = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                v[j] = tec_to_f32(tile[(lane + 32 * j) * LD + c]);
                a = fmaxf(a, fabsf(v[j]));
            }
            const float s = block_scale(warp_max(a), fp8_max, pow2, eps, inf_value);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int64_t gr = r0 + lane + 32 * j;
                if (gr < rows)
                    out_t[gc * rows + gr] = cvt(v[j] * s, fmt);
            }
            if (lane == 0)
                sinv_t[blockIdx.y * round4(cols) + gc] = __frcp_rn(s);
        }
}

/* ============================================================== launchers */

template <typename T>
tec_status launch_block_quantize(const tec_fp8_block_quantize_args *a, cudaStream_t st)
{
    const int64_t gx = (a->cols + kB - 1) / kB, gy = (a->rows + kB - 1) / kB;
    if (gy > 65535 || gx > INT32_MAX)
        return TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED, "fp8 block quantize: %lldx%lld is too large",
                             (long long)a->rows, (long long)a->cols);
    const size_t smem = (size_t)kB * tile_ld<T>() * sizeof(T);
    if (smem > 48 * 1024) /* float tiles: opt in to more than the default */
        TEC_CUDA_CHECK(cudaFuncSetAttribute(block_quantize_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)smem));
    const float fp8_max = a->format == TEC_FP8_E5M2 ? 57344.0f : 448.0f;
    block_quantize_kernel<T><<<dim3((unsigned)gx, (unsigned)gy), kThreads, smem, st>>>(
        (const T *)a->x, a->rows, a->cols, (int)a->format, fp8_max, a->block_dim, a->pow2, a->epsilon, a->out,
        a->scale_inv, a->out_t, a->scale_inv_t);
    TEC_CUDA_LAUNCH_CHECK("fp8 block quantize kernel");
    return TEC_OK;
}

} /* namespace */

/* ============================================================ operations */

/* Stream contract: enqueued on `stream`, nothing waits. */
static tec_status cuda_block_quantize(int device, const tec_fp8_block_quantize_args *a, void *stream)
{
    TEC_CUDA_ENTER(device);
    cudaStream_t st = (cudaStream_t)stream;
    switch (a->dtype) {
    case TEC_F32: return launch_block_quantize<float>(a, st);
    case TEC_BF16: return launch_block_quantize<__nv_bfloat16>(a, st);
    default: return launch_block_quantize<__half>(a, st);
    }
}

const tec_fp8_block_ops tec_cuda_fp8_block = {
    cuda_block_quantize, /* quantize */
};
