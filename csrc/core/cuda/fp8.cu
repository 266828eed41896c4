/* fp8.cu - the CUDA backend's FP8 operations (tec.h): the fused amax + cast
 * (+ transpose) kernels, amax, the current-scaling scales and delayed
 * scaling's update; the FP8 GEMM is fp8_gemm.cu's. Scales are read on the device:
 * nothing here synchronises with the host, so every call can be captured
 * in a CUDA graph. Exercised by scripts/gpu_fp8.sh
 * (tests/test_fp8_engine.py with TEC_TEST_DEVICE=cuda). */
#include <cuda_fp8.h>
#include <float.h>
#include <string.h>

#include <type_traits>

#include "act_math.h"
#include "gemm_plan.h"

namespace {

/* ================================================================ kernels */

__device__ __forceinline__ uint8_t fp8_cvt(float v, int fmt)
{
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, fmt == TEC_FP8_E5M2 ? __NV_E5M2 : __NV_E4M3);
}

/* Non-negative floats order as their bit patterns: an integer atomicMax is
 * a float max for them. */
__device__ __forceinline__ void atomic_max_nonneg(float *addr, float v)
{
    atomicMax((int *)addr, __float_as_int(v));
}

/* Block-wide max of v (blockDim.x a multiple of 32, <= 1024), returned to
 * thread 0. */
__device__ __forceinline__ float block_max(float v)
{
    __shared__ float warp_max[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0)
        warp_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? warp_max[lane] : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

/* The noop flag of tec.h: set (nonzero), the kernel writes nothing. Every
 * thread of a block reads the same value, so a block returns as a whole
 * (before any barrier). */
__device__ __forceinline__ bool switched_off(const float *noop)
{
    return noop != NULL && *noop != 0.0f;
}

/* A fused activation ahead of a cast (tec.h's act_mode; MODE a template
 * argument, the function f at run time): the value cast for one element of
 * x (and of the activation's input `in`, read for the backward only),
 * computed in float32 and rounded to T as the activation kernels write it;
 * `exact` receives it before the rounding (what the bias gradient sums). */
struct act_in {
    const void *x; /* the activation's input (TEC_FP8_ACT_BWD), or NULL */
    int f;         /* its function (act_math.h) */
};

template <typename T, int MODE, int F = -1>
__device__ __forceinline__ float produce(float x, float in, int f, float &exact)
{
    if (MODE == TEC_FP8_ACT_NONE) {
        exact = x;
        return x;
    }
    const int fn = F >= 0 ? F : f; /* F: the function known when compiled (fast_act); -1: read at run time */
    exact = MODE == TEC_FP8_ACT_FWD ? tec_act_f(fn, x, 0.0f, 0.0f) : tec_act_df(fn, in, 0.0f, 0.0f) * x;
    return tec_to_f32(tec_from_f32<T>(exact));
}

/* produce() over a row of 8 elements of the vector kernel (w: the
 * activation's input, read for the backward only): the rounded values and,
 * before the rounding, `exact`. Not inlined: that kernel runs it for 16 rows
 * per lane, and 16 inlined copies of an activation (a backward's tanh and
 * exp) make a kernel too large to run from the instruction cache. */
template <typename T> struct produced8 {
    tec_vec<T, 8> v;
    float exact[8];
};

template <typename T, int MODE, int F>
__device__ __noinline__ produced8<T> produce8(tec_vec<T, 8> v, tec_vec<T, 8> w, int f)
{
    produced8<T> p;
    float r[8];
#pragma unroll
    for (int e = 0; e < 8; e++)
        r[e] = produce<T, MODE, F>(tec_vget(v, e), MODE == TEC_FP8_ACT_BWD ? tec_vget(w, e) : 0.0f, f, p.exact[e]);
    p.v = tec_vpack<T, 8>(r);
    return p;
}

/* Rowwise cast of n elements, VEC per thread per step (VEC == 1: any
 * alignment), with amax (NULL: none) and scale_inv (NULL: none). out may be
 * NULL (amax only). */
template <typename T, int VEC, int MODE, int F = -1>
__global__ void __launch_bounds__(256)
quantize_kernel(const T *__restrict__ x, int64_t n, const float *__restrict__ scale, int fmt, uint8_t *out,
                float *amax, float *scale_inv, const float *noop, act_in act)
{
    if (switched_off(noop))
        return;
    const float s = *scale;
    const T *__restrict__ ax = (const T *)act.x;
    float m = 0.0f, exact;
    const int64_t nv = n / VEC;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nv; i += (int64_t)gridDim.x * blockDim.x) {
        const tec_vec<T, VEC> v = reinterpret_cast<const tec_vec<T, VEC> *>(x)[i];
        tec_vec<T, VEC> w;
        if (MODE == TEC_FP8_ACT_BWD)
            w = reinterpret_cast<const tec_vec<T, VEC> *>(ax)[i];
        uint8_t q[VEC];
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            const float f = produce<T, MODE, F>(tec_vget(v, e), MODE == TEC_FP8_ACT_BWD ? tec_vget(w, e) : 0.0f,
                                             act.f, exact);
            m = fmaxf(m, fabsf(f));
            q[e] = fp8_cvt(f * s, fmt);
        }
        if (out) {
            if (VEC == 8) {
                uint2 w;
                memcpy(&w, q, 8);
                reinterpret_cast<uint2 *>(out)[i] = w;
            } else if (VEC == 4) {
                uint32_t w;
                memcpy(&w, q, 4);
                reinterpret_cast<uint32_t *>(out)[i] = w;
            } else {
#pragma unroll
                for (int e = 0; e < VEC; e++)
                    out[i * VEC + e] = q[e];
            }
        }
    }
    if (blockIdx.x == 0) /* the tail the vectors do not cover */
        for (int64_t i = nv * VEC + threadIdx.x; i < n; i += blockDim.x) {
            const float f = produce<T, MODE, F>(tec_to_f32(x[i]), MODE == TEC_FP8_ACT_BWD ? tec_to_f32(ax[i]) : 0.0f,
                                             act.f, exact);
            m = fmaxf(m, fabsf(f));
            if (out)
                out[i] = fp8_cvt(f * s, fmt);
        }
    if (amax) {
        m = block_max(m);
        if (threadIdx.x == 0)
            atomic_max_nonneg(amax, m);
    }
    if (scale_inv && blockIdx.x == 0 && threadIdx.x == 0)
        *scale_inv = 1.0f / s;
}

/* Cast + transpose: a 64x64 tile per block of (64, 4) threads; out (may be
 * NULL) [rows, cols], out_t [cols, rows]. */
constexpr int kTile = 64;
template <typename T, int MODE>
__global__ void __launch_bounds__(256)
cast_transpose_kernel(const T *__restrict__ x, int64_t rows, int64_t cols, const float *__restrict__ scale, int fmt,
                      uint8_t *out, uint8_t *__restrict__ out_t, float *amax, float *scale_inv,
                      const float *noop, act_in act)
{
    if (switched_off(noop))
        return;
    __shared__ uint8_t tile[kTile][kTile + 4];
    const float s = *scale;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t r0 = (int64_t)blockIdx.y * kTile, c0 = (int64_t)blockIdx.x * kTile;
    float m = 0.0f;
    for (int r = ty; r < kTile; r += 4) {
        const int64_t gr = r0 + r, gc = c0 + tx;
        uint8_t q = 0;
        if (gr < rows && gc < cols) {
            float exact;
            const float f = produce<T, MODE>(
                tec_to_f32(x[gr * cols + gc]),
                MODE == TEC_FP8_ACT_BWD ? tec_to_f32(((const T *)act.x)[gr * cols + gc]) : 0.0f, act.f, exact);
            m = fmaxf(m, fabsf(f));
            q = fp8_cvt(f * s, fmt);
            if (out)
                out[gr * cols + gc] = q;
        }
        tile[r][tx] = q;
    }
    __syncthreads();
    for (int c = ty; c < kTile; c += 4) {
        const int64_t gc = c0 + c, gr = r0 + tx;
        if (gc < cols && gr < rows)
            out_t[gc * rows + gr] = tile[tx][c];
    }
    if (amax) {
        /* block_max wants a flat block: threads are numbered x-fastest. */
        __shared__ float part[256];
        const int t = ty * kTile + tx;
        part[t] = m;
        __syncthreads();
        for (int o = 128; o > 0; o >>= 1) {
            if (t < o)
                part[t] = fmaxf(part[t], part[t + o]);
            __syncthreads();
        }
        if (t == 0)
            atomic_max_nonneg(amax, part[0]);
    }
    if (scale_inv && blockIdx.x == 0 && blockIdx.y == 0 && tx == 0 && ty == 0)
        *scale_inv = 1.0f / s;
}

/* Two floats to two FP8 codes (x in the low byte), one instruction. */
template <bool E5M2> __device__ __forceinline__ uint32_t fp8x2(float a, float b)
{
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, E5M2 ? __NV_E5M2 : __NV_E4M3);
}

/* Cast + transpose, the vector path (rows and cols multiples of 8, x 16-byte
 * and out / out_t 8-byte aligned). A block of 8 warps covers a tile of
 * kVRows x kVCols; a lane holds 8 x 8 sub-tiles: it loads 8 rows of 8
 * elements (16 bytes for 16-bit types), writes their rowwise codes from
 * registers (8 bytes per row), transposes the 8 x 8 codes in registers and
 * stages each column's 8 codes in shared memory. The block then writes
 * out_t's rows from the stage, 8 bytes per lane, kVRows bytes per row. The
 * stage's 8-byte slots are XOR-swizzled by the writing lane, so that neither
 * the writes nor the reads conflict on banks. With partial (dbias; 64-row
 * tiles), the block's column sums of x (fp32, a fixed order) go to
 * partial[blockIdx.y, c]. */
constexpr int kVCols = 256;
constexpr int kDbiasRows = 64;          /* rows per partial sum (tec.h's workspace) */
/* 8-row blocks per warp: 2 (tiles of 128 rows) for a cast alone, 1 (64
 * rows) with a bias gradient: those kernels hold more registers and run
 * 2-3 blocks per SM, and smaller tiles fill their last wave better (the
 * fused activation backward's most); a tile is one partial row. */
template <bool DBIAS> __host__ __device__ constexpr int vgroups() { return DBIAS ? 1 : 2; }
static_assert(64 * vgroups<true>() == kDbiasRows, "one partial row per tile with dbias");

template <typename T, bool E5M2, bool DBIAS, int MODE, int F = -1>
/* blocks per SM: the plain cast 4 (3 with dbias), with a fused activation 3 (forward) or 2 (backward) */
__global__ void __launch_bounds__(256, MODE == TEC_FP8_ACT_NONE ? (DBIAS ? 3 : 4) : MODE == TEC_FP8_ACT_FWD ? 3 : 2)
cast_transpose_vec_kernel(const T *__restrict__ x, int64_t rows, int64_t cols, const float *__restrict__ scale,
                          uint8_t *out, uint8_t *__restrict__ out_t, float *amax, float *scale_inv,
                          float *__restrict__ partial, const float *noop, act_in act)
{
    constexpr int kVGroups = vgroups<DBIAS>();
    constexpr int kVRows = 64 * kVGroups;
    constexpr int kVSlots = kVRows / 8; /* 8-byte slots per staged row */
    if (switched_off(noop))
        return;
    __shared__ uint2 stage[kVCols][kVSlots];
    __shared__ float red[DBIAS ? 8 : 1][DBIAS ? kVCols : 8];
    const float s = *scale;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t r0 = (int64_t)blockIdx.y * kVRows, c0 = (int64_t)blockIdx.x * kVCols;
    const int64_t c = c0 + 8 * lane;
    const bool col_in = c < cols;
    float m = 0.0f;
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int g = 0; g < kVGroups; g++) {
        const int b = g * 8 + warp; /* the tile's 8-row block */
        const int64_t rb = r0 + 8 * b;
        uint32_t lo[8], hi[8]; /* row i's codes of columns c..c+3 and c+4..c+7 */
        tec_vec<T, 8> v[8], w[MODE == TEC_FP8_ACT_BWD ? 8 : 1];
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (col_in && rb + i < rows) {
                v[i] = *reinterpret_cast<const tec_vec<T, 8> *>(x + (rb + i) * cols + c);
                if (MODE == TEC_FP8_ACT_BWD)
                    w[MODE == TEC_FP8_ACT_BWD ? i : 0] =
                        *reinterpret_cast<const tec_vec<T, 8> *>((const T *)act.x + (rb + i) * cols + c);
            }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            lo[i] = hi[i] = 0u;
            if (!(col_in && rb + i < rows))
                continue;
            float f[8], exact[8];
            if constexpr (MODE != TEC_FP8_ACT_NONE) { /* the activation's row: v[i] becomes its rounded values */
                const produced8<T> p =
                    produce8<T, MODE, F>(v[i], MODE == TEC_FP8_ACT_BWD ? w[MODE == TEC_FP8_ACT_BWD ? i : 0] : v[i],
                                         act.f);
                v[i] = p.v;
#pragma unroll
                for (int e = 0; e < 8; e++)
                    exact[e] = p.exact[e];
            }
#pragma unroll
            for (int e = 0; e < 8; e++) {
                f[e] = tec_vget(v[i], e);
                m = fmaxf(m, fabsf(f[e]));
                if (DBIAS)
                    acc[e] += MODE != TEC_FP8_ACT_NONE ? exact[e] : f[e];
            }
            lo[i] = fp8x2<E5M2>(f[0] * s, f[1] * s) | (fp8x2<E5M2>(f[2] * s, f[3] * s) << 16);
            hi[i] = fp8x2<E5M2>(f[4] * s, f[5] * s) | (fp8x2<E5M2>(f[6] * s, f[7] * s) << 16);
            if (out)
                *reinterpret_cast<uint2 *>(out + (rb + i) * cols + c) = make_uint2(lo[i], hi[i]);
        }
#pragma unroll
        for (int j = 0; j < 8; j++) { /* column c + j: rows rb..rb+3 in t0, rb+4..rb+7 in t1 */
            const int sh = 8 * (j & 3);
            uint32_t t0 = 0u, t1 = 0u;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                t0 |= (((j < 4 ? lo[i] : hi[i]) >> sh) & 0xffu) << (8 * i);
                t1 |= (((j < 4 ? lo[i + 4] : hi[i + 4]) >> sh) & 0xffu) << (8 * i);
            }
            stage[8 * lane + j][b ^ (lane & (kVSlots - 1))] = make_uint2(t0, t1);
        }
    }
    if (DBIAS) {
#pragma unroll
        for (int e = 0; e < 8; e++)
            red[warp][8 * lane + e] = acc[e];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __shared__ float warp_max[8];
    if (lane == 0)
        warp_max[warp] = m;
    __syncthreads();
    for (int idx = threadIdx.x; idx < kVCols * kVSlots; idx += 256) {
        const int cr = idx / kVSlots, slot = idx % kVSlots;
        const int b = slot ^ ((cr >> 3) & (kVSlots - 1)); /* the writer's swizzle undone */
        const int64_t gc = c0 + cr, gr = r0 + 8 * b;
        if (gc < cols && gr < rows)
            *reinterpret_cast<uint2 *>(out_t + gc * rows + gr) = stage[cr][slot];
    }
    if (DBIAS && c0 + threadIdx.x < cols) {
        float t = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++)
            t += red[w][threadIdx.x];
        partial[(int64_t)blockIdx.y * cols + c0 + threadIdx.x] = t;
    }
    if (threadIdx.x == 0) {
        float bm = warp_max[0];
#pragma unroll
        for (int w = 1; w < 8; w++)
            bm = fmaxf(bm, warp_max[w]);
        if (amax)
            atomic_max_nonneg(amax, bm);
        if (scale_inv && blockIdx.x == 0 && blockIdx.y == 0)
            *scale_inv = 1.0f / s;
    }
}

/* partial[b, c] = the sum of x[r, c] over the rows r of block b (kDbiasRows
 * each): the column sums of a path without the vector kernel, one column per
 * thread. */
template <typename T, int MODE>
__global__ void __launch_bounds__(256)
column_partial_kernel(const T *__restrict__ x, int64_t rows, int64_t cols, float *__restrict__ partial,
                      const float *noop, act_in act)
{
    if (switched_off(noop))
        return;
    const int64_t c = (int64_t)blockIdx.x * 256 + threadIdx.x;
    if (c >= cols)
        return;
    const int64_t r0 = (int64_t)blockIdx.y * kDbiasRows;
    const int64_t r1 = r0 + kDbiasRows < rows ? r0 + kDbiasRows : rows;
    float t = 0.0f, exact;
    for (int64_t r = r0; r < r1; r++) {
        produce<T, MODE>(tec_to_f32(x[r * cols + c]),
                         MODE == TEC_FP8_ACT_BWD ? tec_to_f32(((const T *)act.x)[r * cols + c]) : 0.0f, act.f, exact);
        t += exact;
    }
    partial[(int64_t)blockIdx.y * cols + c] = t;
}

/* dbias[c] = the sum of partial[b, c] over the nb blocks, in order. */
template <typename T>
__global__ void __launch_bounds__(256) dbias_sum_kernel(const float *__restrict__ partial, int64_t nb, int64_t cols,
                                                        T *__restrict__ dbias, const float *noop)
{
    if (switched_off(noop))
        return;
    const int64_t c = (int64_t)blockIdx.x * 256 + threadIdx.x;
    if (c >= cols)
        return;
    float t = 0.0f;
    for (int64_t b = 0; b < nb; b++)
        t += partial[b * cols + c];
    dbias[c] = tec_from_f32<T>(t);
}

/* The current-scaling rule of tec.h (the CPU's in cpu/fp8.c). */
__global__ void scale_from_amax_kernel(const float *amax, float *scale, float *scale_inv, int64_t n, float fp8_max,
                                       int pow2, float epsilon)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    float a = amax[i];
    if (a < epsilon)
        a = epsilon;
    float s = 1.0f;
    if (!(isinf(a) || a == 0.0f || isnan(a))) {
        s = __fdiv_rn(fp8_max, a);
        if (isinf(s))
            s = FLT_MAX;
        if (pow2)
            s = __uint_as_float(__float_as_uint(s) & 0xff800000u);
    }
    if (scale)
        scale[i] = s;
    if (scale_inv)
        scale_inv[i] = __frcp_rn(s);
}

/* ============================================================== launchers */

unsigned grid_for(int64_t work, int threads, int sms)
{
    int64_t g = (work + threads - 1) / threads;
    const int64_t cap = (int64_t)sms * 8;
    if (g > cap) g = cap;
    return (unsigned)(g > 0 ? g : 1);
}

/* Calls fn(std::integral_constant<int, F>) with a fused activation's
 * function as a compile-time F where the kernels have it so (bf16, the
 * dtype of FP8 training: the activation's forward without a bias gradient,
 * and its backward), else with F = -1 (the function read at run time, much
 * slower: per element, a switch the compiler cannot hoist). */
template <typename T, int MODE, bool FAST, typename Fn> void with_act_fn(int f, Fn fn)
{
    if constexpr (FAST && MODE != TEC_FP8_ACT_NONE && std::is_same<T, __nv_bfloat16>::value) {
        switch (f) {
        case TEC_F_GELU: fn(std::integral_constant<int, TEC_F_GELU>()); return;
        case TEC_F_RELU: fn(std::integral_constant<int, TEC_F_RELU>()); return;
        case TEC_F_QGELU: fn(std::integral_constant<int, TEC_F_QGELU>()); return;
        case TEC_F_SRELU: fn(std::integral_constant<int, TEC_F_SRELU>()); return;
        case TEC_F_SILU: fn(std::integral_constant<int, TEC_F_SILU>()); return;
        default: break;
        }
    }
    fn(std::integral_constant<int, -1>());
}

template <typename T, bool E5M2, int MODE>
void launch_vec(const tec_fp8_quantize_args *a, dim3 grid, act_in act, cudaStream_t st)
{
    /* the forward's fast kernels: E4M3 (the forward format of every recipe but E5M2), no bias gradient */
    constexpr bool fast_fwd = MODE != TEC_FP8_ACT_FWD || !E5M2;
    if (a->dbias)
        with_act_fn<T, MODE, MODE != TEC_FP8_ACT_FWD>(act.f, [&](auto fc) {
            cast_transpose_vec_kernel<T, E5M2, true, MODE, decltype(fc)::value><<<grid, 256, 0, st>>>(
                (const T *)a->x, a->rows, a->cols, a->scale, a->out, a->out_t, a->amax, a->scale_inv,
                (float *)a->workspace, a->noop, act);
        });
    else
        with_act_fn<T, MODE, fast_fwd>(act.f, [&](auto fc) {
            cast_transpose_vec_kernel<T, E5M2, false, MODE, decltype(fc)::value><<<grid, 256, 0, st>>>(
                (const T *)a->x, a->rows, a->cols, a->scale, a->out, a->out_t, a->amax, a->scale_inv, NULL,
                a->noop, act);
        });
}

template <typename T, int MODE>
tec_status launch_quantize(int device, const tec_fp8_quantize_args *a, cudaStream_t st)
{
    const act_in act = {MODE == TEC_FP8_ACT_BWD ? a->act_input : NULL, (int)a->act};
    const bool act_aligned = MODE != TEC_FP8_ACT_BWD || tec_cuda_aligned16(a->act_input);
    const int64_t n = a->rows * a->cols;
    int sms;
    tec_status s = tec_cuda_sm_count(device, &sms);
    if (s != TEC_OK)
        return s;
    const int64_t nb = (a->rows + kDbiasRows - 1) / kDbiasRows; /* the dbias partial rows */
    const int64_t vrows = 64 * (a->dbias ? vgroups<true>() : vgroups<false>());
    const dim3 vgrid((unsigned)((a->cols + kVCols - 1) / kVCols), (unsigned)((a->rows + vrows - 1) / vrows));
    bool partial_done = false;
    if (a->out_t && n > 0) {
        const bool vec = a->rows % 8 == 0 && a->cols % 8 == 0 && tec_cuda_aligned16(a->x) && act_aligned &&
                         ((uintptr_t)a->out & 7u) == 0 && ((uintptr_t)a->out_t & 7u) == 0 && vgrid.y <= 65535u;
        if (vec) {
            if (a->format == TEC_FP8_E5M2)
                launch_vec<T, true, MODE>(a, vgrid, act, st);
            else
                launch_vec<T, false, MODE>(a, vgrid, act, st);
            TEC_CUDA_LAUNCH_CHECK("fp8 cast+transpose kernel");
            partial_done = true;
        } else {
            dim3 grid((unsigned)((a->cols + kTile - 1) / kTile), (unsigned)((a->rows + kTile - 1) / kTile));
            if (grid.y > 65535)
                return TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED, "fp8 cast+transpose: %lld rows is too many",
                                     (long long)a->rows);
            cast_transpose_kernel<T, MODE><<<grid, dim3(kTile, 4), 0, st>>>((const T *)a->x, a->rows, a->cols,
                                                                           a->scale, a->format, a->out, a->out_t,
                                                                           a->amax, a->scale_inv, a->noop, act);
            TEC_CUDA_LAUNCH_CHECK("fp8 cast+transpose kernel");
        }
    } else if (a->out || a->amax || a->scale_inv) {
        constexpr int kVec = 16 / sizeof(T) > 8 ? 8 : 16 / sizeof(T);
        const bool vec = tec_cuda_aligned16(a->x) && act_aligned && ((uintptr_t)a->out & (kVec - 1)) == 0;
        if (vec)
            with_act_fn<T, MODE, true>(act.f, [&](auto fc) {
                quantize_kernel<T, kVec, MODE, decltype(fc)::value><<<grid_for(n / kVec, 256, sms), 256, 0, st>>>(
                    (const T *)a->x, n, a->scale, a->format, a->out, a->amax, a->scale_inv, a->noop, act);
            });
        else
            quantize_kernel<T, 1, MODE><<<grid_for(n, 256, sms), 256, 0, st>>>(
                (const T *)a->x, n, a->scale, a->format, a->out, a->amax, a->scale_inv, a->noop, act);
        TEC_CUDA_LAUNCH_CHECK("fp8 quantize kernel");
    }
    if (a->dbias && a->cols > 0) {
        if (nb > 65535)
            return TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED, "fp8 quantize: the bias gradient of %lld rows is too many",
                                 (long long)a->rows);
        if (!partial_done && nb > 0) {
            column_partial_kernel<T, MODE><<<vgrid, 256, 0, st>>>((const T *)a->x, a->rows, a->cols,
                                                                  (float *)a->workspace, a->noop, act);
            TEC_CUDA_LAUNCH_CHECK("fp8 quantize column-sum kernel");
        }
        dbias_sum_kernel<T><<<(unsigned)((a->cols + 255) / 256), 256, 0, st>>>((const float *)a->workspace, nb,
                                                                              a->cols, (T *)a->dbias, a->noop);
        TEC_CUDA_LAUNCH_CHECK("fp8 quantize bias-gradient kernel");
    }
    return TEC_OK;
}

template <int MODE> tec_status quantize_dtype(int device, const tec_fp8_quantize_args *a, cudaStream_t st)
{
    switch (a->dtype) {
    case TEC_F32: return launch_quantize<float, MODE>(device, a, st);
    case TEC_BF16: return launch_quantize<__nv_bfloat16, MODE>(device, a, st);
    default: return launch_quantize<__half, MODE>(device, a, st);
    }
}

} /* namespace */

/* ============================================================ operations */

/* Stream contract (all four): enqueued on `stream`, nothing waits. */
static tec_status cuda_quantize(int device, const tec_fp8_quantize_args *a, void *stream)
{
    TEC_CUDA_ENTER(device);
    cudaStream_t st = (cudaStream_t)stream;
    switch (a->act_mode) {
    case TEC_FP8_ACT_FWD: return quantize_dtype<TEC_FP8_ACT_FWD>(device, a, st);
    case TEC_FP8_ACT_BWD: return quantize_dtype<TEC_FP8_ACT_BWD>(device, a, st);
    default: return quantize_dtype<TEC_FP8_ACT_NONE>(device, a, st);
    }
}

static tec_status cuda_amax(int device, const void *x, int64_t n, tec_dtype dtype, float *amax, void *stream)
{
    TEC_CUDA_ENTER(device);
    cudaStream_t st = (cudaStream_t)stream;
    TEC_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), st));
    if (n == 0)
        return TEC_OK;
    /* The quantize kernel without an output: the scale it reads is amax
     * itself (any readable float; the products are discarded). */
    tec_fp8_quantize_args q = {0};
    q.rows = 1;
    q.cols = n;
    q.dtype = dtype;
    q.x = x;
    q.scale = amax;
    q.amax = amax;
    return quantize_dtype<TEC_FP8_ACT_NONE>(device, &q, st);
}

static tec_status cuda_scale_from_amax(int device, const float *amax, float *scale, float *scale_inv, int64_t n,
                                       float fp8_max, int pow2, float epsilon, void *stream)
{
    TEC_CUDA_ENTER(device);
    scale_from_amax_kernel<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)stream>>>(amax, scale, scale_inv, n,
                                                                                        fp8_max, pow2, epsilon);
    TEC_CUDA_LAUNCH_CHECK("fp8 scale_from_amax kernel");
    return TEC_OK;
}

/* Delayed scaling's update (tec.h): one block per role, its history
 * column staged in shared memory so that the roll reads before it writes. */
__global__ void __launch_bounds__(256) delayed_update_kernel(float *hist, float *scale, float *scale_inv, int64_t len,
                                                             int64_t n, float fp8_max, float divisor, int most_recent)
{
    extern __shared__ float col[];
    __shared__ float amax_s;
    const int64_t c = blockIdx.x;
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
        const float v = hist[i * n + c];
        col[i] = v;
        m = fmaxf(m, isnan(v) ? 0.0f : v);
    }
    m = block_max(m); /* (its own __syncthreads: col is complete after it) */
    if (threadIdx.x == 0) {
        const float amax = most_recent ? col[0] : m;
        float s = (fp8_max / amax) / divisor;
        if (isinf(s))
            s = 3.40282347e38f;
        float cur = scale[c];
        if (isfinite(amax) && amax > 0.0f)
            cur = s;
        scale[c] = cur;
        scale_inv[c] = 1.0f / cur;
        amax_s = amax;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x)
        hist[i * n + c] = i == 0 ? 0.0f : (i == len - 1 ? col[0] : col[i + 1]);
}

static tec_status cuda_delayed_update(int device, float *history, float *scale, float *scale_inv, int64_t len,
                                      int64_t n, float fp8_max, float divisor, int most_recent, void *stream)
{
    TEC_CUDA_ENTER(device);
    delayed_update_kernel<<<(unsigned)n, 256, (size_t)len * sizeof(float), (cudaStream_t)stream>>>(
        history, scale, scale_inv, len, n, fp8_max, divisor, most_recent);
    TEC_CUDA_LAUNCH_CHECK("fp8 delayed_update kernel");
    return TEC_OK;
}

const tec_fp8_ops tec_cuda_fp8 = {
    cuda_quantize,        /* quantize */
    cuda_amax,            /* amax */
    cuda_scale_from_amax, /* scale_from_amax */
    tec_cuda_fp8_gemm,    /* gemm (fp8_gemm.cu) */
    cuda_delayed_update,  /* delayed_update */
};
