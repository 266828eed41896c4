/* norm.cu - LayerNorm / RMSNorm forward and backward for the CUDA backend:
 * fp32 math over fp32/bf16/fp16 rows, 16-byte vector loads held in registers
 * where pointers and cols allow, a scalar streaming path otherwise. Exercised
 * by tests/test_kernels.py (device="cuda") against float64 references. */
#include "cuda_common.h"

namespace {

/* ================================================================ kernels */

__device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over a row group of TPR threads: a warp (TPR == 32, no barrier) or the
 * whole block. Every thread of the group gets the same value; the order of
 * additions is fixed, so results are deterministic. red: 64 shared floats. */
template <int TPR> __device__ __forceinline__ float group_sum(float a, float *red)
{
    a = warp_sum(a);
    if constexpr (TPR > 32) {
        if ((threadIdx.x & 31) == 0)
            red[threadIdx.x >> 5] = a;
        __syncthreads();
        a = 0.0f;
#pragma unroll
        for (int i = 0; i < TPR / 32; i++)
            a += red[i];
        __syncthreads();
    }
    return a;
}

template <int TPR> __device__ __forceinline__ float2 group_sum2(float a, float b, float *red)
{
    a = warp_sum(a);
    b = warp_sum(b);
    if constexpr (TPR > 32) {
        if ((threadIdx.x & 31) == 0) {
            red[threadIdx.x >> 5] = a;
            red[32 + (threadIdx.x >> 5)] = b;
        }
        __syncthreads();
        a = 0.0f;
        b = 0.0f;
#pragma unroll
        for (int i = 0; i < TPR / 32; i++) {
            a += red[i];
            b += red[32 + i];
        }
        __syncthreads();
    }
    return make_float2(a, b);
}

/* A row group is one warp (TPR == 32, four groups per block) or one block. */
template <int TPR> struct rowgroup {
    static constexpr int groups = TPR == 32 ? 4 : 1;
    static constexpr int threads = TPR * groups;
    __device__ static int tid() { return TPR == 32 ? (int)(threadIdx.x & 31) : (int)threadIdx.x; }
    __device__ static int64_t first() { return (int64_t)blockIdx.x * groups + (TPR == 32 ? threadIdx.x >> 5 : 0); }
};

struct fwd_params {
    const void *x, *gamma, *beta;
    void *y;
    float *mu, *rsigma;
    int64_t rows, cols;
    float eps;
    float gshift; /* 1 with zero-centred gamma, else 0 */
};

/* Forward. NV > 0: each thread keeps its NV vectors of the row in registers
 * (x is read once). NV == 0: stream over the row three times (any cols). */
template <typename T, int VEC, int NV, int TPR>
__global__ void __launch_bounds__(rowgroup<TPR>::threads, 1) norm_fwd_kernel(fwd_params p)
{
    using V = tec_vec<T, VEC>;
    using G = rowgroup<TPR>;
    __shared__ float red[64];
    const int tid = G::tid();
    const int64_t nvec = p.cols / VEC;
    const bool rms = p.beta == nullptr;
    const float inv_n = 1.0f / (float)p.cols;
    const V *gv = (const V *)p.gamma, *bv = (const V *)p.beta;

    for (int64_t row = G::first(); row < p.rows; row += (int64_t)gridDim.x * G::groups) {
        const V *xr = (const V *)p.x + row * nvec;
        V *yr = (V *)p.y + row * nvec;
        float mean = 0.0f, ss = 0.0f, rs;
        if constexpr (NV > 0) {
            V xv[NV];
#pragma unroll
            for (int i = 0; i < NV; i++) {
                const int64_t idx = tid + (int64_t)i * TPR;
                if (idx < nvec)
                    xv[i] = xr[idx];
            }
            if (!rms) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < NV; i++)
                    if (tid + (int64_t)i * TPR < nvec)
#pragma unroll
                        for (int e = 0; e < VEC; e++)
                            s += tec_vget(xv[i], e);
                mean = group_sum<TPR>(s, red) * inv_n;
            }
#pragma unroll
            for (int i = 0; i < NV; i++)
                if (tid + (int64_t)i * TPR < nvec)
#pragma unroll
                    for (int e = 0; e < VEC; e++) {
                        const float d = tec_vget(xv[i], e) - mean;
                        ss += d * d;
                    }
            rs = 1.0f / sqrtf(group_sum<TPR>(ss, red) * inv_n + p.eps);
#pragma unroll
            for (int i = 0; i < NV; i++) {
                const int64_t idx = tid + (int64_t)i * TPR;
                if (idx < nvec) {
                    const V g = gv[idx];
                    V b;
                    float o[VEC];
                    if (!rms)
                        b = bv[idx];
#pragma unroll
                    for (int e = 0; e < VEC; e++) {
                        float v = (tec_vget(xv[i], e) - mean) * rs * (tec_vget(g, e) + p.gshift);
                        if (!rms)
                            v += tec_vget(b, e);
                        o[e] = v;
                    }
                    yr[idx] = tec_vpack<T, VEC>(o);
                }
            }
        } else {
            if (!rms) {
                float s = 0.0f;
                for (int64_t idx = tid; idx < nvec; idx += TPR) {
                    const V xv = xr[idx];
#pragma unroll
                    for (int e = 0; e < VEC; e++)
                        s += tec_vget(xv, e);
                }
                mean = group_sum<TPR>(s, red) * inv_n;
            }
            for (int64_t idx = tid; idx < nvec; idx += TPR) {
                const V xv = xr[idx];
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    const float d = tec_vget(xv, e) - mean;
                    ss += d * d;
                }
            }
            rs = 1.0f / sqrtf(group_sum<TPR>(ss, red) * inv_n + p.eps);
            for (int64_t idx = tid; idx < nvec; idx += TPR) {
                const V xv = xr[idx], g = gv[idx];
                V b;
                float o[VEC];
                if (!rms)
                    b = bv[idx];
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    float v = (tec_vget(xv, e) - mean) * rs * (tec_vget(g, e) + p.gshift);
                    if (!rms)
                        v += tec_vget(b, e);
                    o[e] = v;
                }
                yr[idx] = tec_vpack<T, VEC>(o);
            }
        }
        if (tid == 0) {
            if (!rms)
                p.mu[row] = mean;
            p.rsigma[row] = rs;
        }
    }
}

struct bwd_params {
    const void *dy, *x, *gamma;
    const float *mu, *rsigma;
    void *dx;
    float *ws; /* [2][groups][cols] fp32 partial dgamma, dbeta */
    int64_t rows, cols;
    int64_t groups;
    float gshift;
    int has_dbeta;
};

/* Backward, first kernel: dx for every row, and per row group the partial
 * sums of dgamma and dbeta over the rows it handled (rows g, g + groups, ...),
 * written to the group's slice of the workspace. NV > 0: the thread's columns
 * of x and dy stay in registers and the partials accumulate in registers.
 * NV == 0: streaming; the partials accumulate in the workspace (each thread
 * owns its columns, so no synchronisation is needed). */
template <typename T, int VEC, int NV, int TPR>
__global__ void __launch_bounds__(rowgroup<TPR>::threads, 1) norm_bwd_kernel(bwd_params p)
{
    using V = tec_vec<T, VEC>;
    using G = rowgroup<TPR>;
    __shared__ float red[64];
    const int tid = G::tid();
    const int64_t g = G::first();
    if (g >= p.groups) /* only whole warps of a 4-group block leave here */
        return;
    const int64_t nvec = p.cols / VEC;
    const bool rms = !p.has_dbeta;
    const float inv_n = 1.0f / (float)p.cols;
    const V *gv = (const V *)p.gamma;
    float *wdg = p.ws + g * p.cols;
    float *wdb = p.ws + (p.groups + g) * p.cols;

    if constexpr (NV > 0) {
        float dg[NV][VEC], db[NV][VEC];
#pragma unroll
        for (int i = 0; i < NV; i++)
#pragma unroll
            for (int e = 0; e < VEC; e++)
                dg[i][e] = db[i][e] = 0.0f;
        for (int64_t row = g; row < p.rows; row += p.groups) {
            const V *xr = (const V *)p.x + row * nvec, *dyr = (const V *)p.dy + row * nvec;
            V xv[NV], dyv[NV];
#pragma unroll
            for (int i = 0; i < NV; i++) {
                const int64_t idx = tid + (int64_t)i * TPR;
                if (idx < nvec) {
                    xv[i] = xr[idx];
                    dyv[i] = dyr[idx];
                }
            }
            const float mu = rms ? 0.0f : p.mu[row], rs = p.rsigma[row];
            float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
            for (int i = 0; i < NV; i++) {
                const int64_t idx = tid + (int64_t)i * TPR;
                if (idx < nvec) {
                    const V gg = gv[idx];
#pragma unroll
                    for (int e = 0; e < VEC; e++) {
                        const float xh = (tec_vget(xv[i], e) - mu) * rs, dy = tec_vget(dyv[i], e);
                        const float dyg = dy * (tec_vget(gg, e) + p.gshift);
                        s1 += dyg;
                        s2 += dyg * xh;
                        dg[i][e] += dy * xh;
                        db[i][e] += dy;
                    }
                }
            }
            const float2 s = group_sum2<TPR>(s1, s2, red);
            const float m1 = rms ? 0.0f : s.x * inv_n, m2 = s.y * inv_n;
            V *dxr = (V *)p.dx + row * nvec;
#pragma unroll
            for (int i = 0; i < NV; i++) {
                const int64_t idx = tid + (int64_t)i * TPR;
                if (idx < nvec) {
                    const V gg = gv[idx];
                    float o[VEC];
#pragma unroll
                    for (int e = 0; e < VEC; e++) {
                        const float xh = (tec_vget(xv[i], e) - mu) * rs, dy = tec_vget(dyv[i], e);
                        const float dyg = dy * (tec_vget(gg, e) + p.gshift);
                        o[e] = rs * (dyg - m1 - xh * m2);
                    }
                    dxr[idx] = tec_vpack<T, VEC>(o);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int64_t idx = tid + (int64_t)i * TPR;
            if (idx < nvec) {
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    wdg[idx * VEC + e] = dg[i][e];
                    if (!rms)
                        wdb[idx * VEC + e] = db[i][e];
                }
            }
        }
    } else {
        for (int64_t idx = tid; idx < nvec; idx += TPR)
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                wdg[idx * VEC + e] = 0.0f;
                if (!rms)
                    wdb[idx * VEC + e] = 0.0f;
            }
        for (int64_t row = g; row < p.rows; row += p.groups) {
            const V *xr = (const V *)p.x + row * nvec, *dyr = (const V *)p.dy + row * nvec;
            const float mu = rms ? 0.0f : p.mu[row], rs = p.rsigma[row];
            float s1 = 0.0f, s2 = 0.0f;
            for (int64_t idx = tid; idx < nvec; idx += TPR) {
                const V xv = xr[idx], dyv = dyr[idx], gg = gv[idx];
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    const float xh = (tec_vget(xv, e) - mu) * rs, dy = tec_vget(dyv, e);
                    const float dyg = dy * (tec_vget(gg, e) + p.gshift);
                    s1 += dyg;
                    s2 += dyg * xh;
                    wdg[idx * VEC + e] += dy * xh;
                    if (!rms)
                        wdb[idx * VEC + e] += dy;
                }
            }
            const float2 s = group_sum2<TPR>(s1, s2, red);
            const float m1 = rms ? 0.0f : s.x * inv_n, m2 = s.y * inv_n;
            V *dxr = (V *)p.dx + row * nvec;
            for (int64_t idx = tid; idx < nvec; idx += TPR) {
                const V xv = xr[idx], dyv = dyr[idx], gg = gv[idx];
                float o[VEC];
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    const float xh = (tec_vget(xv, e) - mu) * rs, dy = tec_vget(dyv, e);
                    const float dyg = dy * (tec_vget(gg, e) + p.gshift);
                    o[e] = rs * (dyg - m1 - xh * m2);
                }
                dxr[idx] = tec_vpack<T, VEC>(o);
            }
        }
    }
}

/* Backward, second kernel: dgamma[j] (and dbeta[j]) = sum over the groups'
 * partials, in a fixed order. Block (32, 16): 32 columns, 16 partial rows at
 * a time. groups == 0 (no rows) writes zeros. */
template <typename T>
__global__ void __launch_bounds__(512)
norm_bwd_reduce_kernel(const float *ws, int64_t groups, int64_t cols, T *dgamma, T *dbeta)
{
    __shared__ float sg[16][33], sb[16][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t j = (int64_t)blockIdx.x * 32 + tx;
    float a = 0.0f, b = 0.0f;
    if (j < cols)
        for (int64_t r = ty; r < groups; r += 16) {
            a += ws[r * cols + j];
            if (dbeta)
                b += ws[(groups + r) * cols + j];
        }
    sg[ty][tx] = a;
    sb[ty][tx] = b;
    __syncthreads();
    if (ty == 0 && j < cols) {
        a = 0.0f;
        b = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            a += sg[i][tx];
            b += sb[i][tx];
        }
        dgamma[j] = tec_from_f32<T>(a);
        if (dbeta)
            dbeta[j] = tec_from_f32<T>(b);
    }
}

/* ============================================================== launchers */

constexpr int64_t kMaxGrid = 0x7fffffff;

template <typename T, int VEC, int NV, int TPR> void launch_fwd(const fwd_params &p, cudaStream_t st)
{
    using G = rowgroup<TPR>;
    int64_t blocks = (p.rows + G::groups - 1) / G::groups;
    if (blocks > kMaxGrid)
        blocks = kMaxGrid;
    norm_fwd_kernel<T, VEC, NV, TPR><<<(unsigned)blocks, G::threads, 0, st>>>(p);
}

/* Pick the kernel for a row of p.cols elements. vec: every pointer is 16-byte
 * aligned and cols is a multiple of 16 / sizeof(T). */
template <typename T> void fwd_dispatch(const fwd_params &p, bool vec, cudaStream_t st)
{
    constexpr int V = 16 / sizeof(T);
    const int64_t cols = p.cols;
    if (vec) {
        const int64_t nvec = cols / V;
        if (nvec <= 32) launch_fwd<T, V, 1, 32>(p, st);          /* one warp per row */
        else if (nvec <= 64) launch_fwd<T, V, 2, 32>(p, st);
        else if (nvec <= 128) launch_fwd<T, V, 4, 32>(p, st);
        /* Above 128 vectors a row is split over more threads (4 vectors
         * each): 2048 and 4096 bf16 columns ran at 62-88% of a device copy's
         * bandwidth with one warp per row, 74-95% this way (H200,
         * scripts/norm_variants.cu). */
        else if (nvec <= 256) launch_fwd<T, V, 4, 64>(p, st);    /* one block per row */
        else if (nvec <= 512) launch_fwd<T, V, 4, 128>(p, st);
        else if (nvec <= 1024) launch_fwd<T, V, 8, 128>(p, st);
        else if (nvec <= 2048) launch_fwd<T, V, 8, 256>(p, st);
        else if (nvec <= 4096) launch_fwd<T, V, 8, 512>(p, st);
        else launch_fwd<T, V, 0, 1024>(p, st);                   /* streaming */
    } else {
        if (cols <= 1024) launch_fwd<T, 1, 0, 32>(p, st);       /* scalar, streaming */
        else if (cols <= 4096) launch_fwd<T, 1, 0, 128>(p, st);
        else if (cols <= 8192) launch_fwd<T, 1, 0, 256>(p, st);
        else if (cols <= 16384) launch_fwd<T, 1, 0, 512>(p, st);
        else launch_fwd<T, 1, 0, 1024>(p, st);
    }
}

/* Most row groups the backward uses on a device of `sms` SMs: bounds the
 * workspace. */
int64_t bwd_max_groups(int sms) { return (int64_t)sms * 8; }

/* The backward's first kernel with `groups` row groups (at most p.rows). */
template <typename T, int VEC, int NV, int TPR>
void launch_bwd_groups(bwd_params &p, int64_t groups, cudaStream_t st)
{
    using G = rowgroup<TPR>;
    if (groups > p.rows)
        groups = p.rows;
    p.groups = groups;
    if (groups == 0)
        return;
    norm_bwd_kernel<T, VEC, NV, TPR><<<(unsigned)((groups + G::groups - 1) / G::groups), G::threads, 0, st>>>(p);
}

/* How many row groups share the rows. A group writes one fp32 partial row of
 * dgamma (and dbeta), which the second kernel sums: more groups, more rows in
 * flight but more partial traffic and a longer sum. A block-wide group (TPR
 * >= 64) does best with about 16 rows, and between one and two groups per SM
 * (bf16, 1024-4096 columns, 1024-8192 rows on an H200: 1.3-2.7x faster than
 * sms * 1024 / TPR groups at up to 4096 rows; scripts/experiments/
 * norm_bwd_variants.cu). A warp-wide group (four to a block) keeps sms * 8. */
template <int TPR> int64_t bwd_groups(int64_t rows, int sms)
{
    if (TPR == 32)
        return bwd_max_groups(sms);
    int64_t g = rows / 16;
    if (g < sms)
        g = sms;
    if (g > 2 * (int64_t)sms)
        g = 2 * (int64_t)sms;
    return g;
}

template <typename T, int VEC, int NV, int TPR>
void launch_bwd(bwd_params &p, int sms, cudaStream_t st)
{
    launch_bwd_groups<T, VEC, NV, TPR>(p, bwd_groups<TPR>(p.rows, sms), st);
}

template <typename T> void bwd_dispatch(bwd_params &p, bool vec, int sms, cudaStream_t st)
{
    constexpr int V = 16 / sizeof(T);
    const int64_t cols = p.cols;
    if (vec) {
        const int64_t nvec = cols / V;
        if (nvec <= 32) launch_bwd<T, V, 1, 32>(p, sms, st);
        else if (nvec <= 64) launch_bwd<T, V, 2, 32>(p, sms, st);
        else if (nvec <= 128) launch_bwd<T, V, 1, 128>(p, sms, st);
        else if (nvec <= 256) launch_bwd<T, V, 1, 256>(p, sms, st);
        else if (nvec <= 512) launch_bwd<T, V, 2, 256>(p, sms, st);
        else if (nvec <= 1024) launch_bwd<T, V, 2, 512>(p, sms, st);
        else if (nvec <= 2048) launch_bwd<T, V, 4, 512>(p, sms, st);
        else launch_bwd<T, V, 0, 512>(p, sms, st);
    } else {
        if (cols <= 1024) launch_bwd<T, 1, 0, 32>(p, sms, st);
        else if (cols <= 4096) launch_bwd<T, 1, 0, 128>(p, sms, st);
        else if (cols <= 8192) launch_bwd<T, 1, 0, 256>(p, sms, st);
        else launch_bwd<T, 1, 0, 512>(p, sms, st);
    }
}

template <typename T> void launch_bwd_reduce(const bwd_params &p, void *dgamma, void *dbeta, cudaStream_t st)
{
    const int64_t blocks = (p.cols + 31) / 32;
    norm_bwd_reduce_kernel<T><<<(unsigned)blocks, dim3(32, 16), 0, st>>>(p.ws, p.groups, p.cols, (T *)dgamma,
                                                                         (T *)dbeta);
}

} /* namespace */

/* ============================================================ entry points */

/* Stream contract: everything is enqueued on `stream`; nothing waits. */
tec_status tec_cuda_norm_fwd(int device, const tec_norm_fwd_args *a, void *stream)
{
    if (a->rows == 0)
        return TEC_OK;
    if (a->cols > kMaxGrid)
        return TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED, "norm: cols=%lld is too large", (long long)a->cols);
    const int64_t V = 16 / (int64_t)tec_cuda_dtype_size(a->dtype);
    const bool vec = a->cols % V == 0 && tec_cuda_aligned16(a->x) && tec_cuda_aligned16(a->y) && tec_cuda_aligned16(a->gamma) &&
                     (!a->beta || tec_cuda_aligned16(a->beta));
    fwd_params p;
    p.x = a->x;
    p.gamma = a->gamma;
    p.beta = a->beta;
    p.y = a->y;
    p.mu = a->mu;
    p.rsigma = a->rsigma;
    p.rows = a->rows;
    p.cols = a->cols;
    p.eps = a->eps;
    p.gshift = a->zero_centered_gamma ? 1.0f : 0.0f;
    cudaStream_t st = (cudaStream_t)stream;

    TEC_CUDA_ENTER(device);
    switch (a->dtype) {
    case TEC_F32: fwd_dispatch<float>(p, vec, st); break;
    case TEC_BF16: fwd_dispatch<__nv_bfloat16>(p, vec, st); break;
    case TEC_F16: fwd_dispatch<__half>(p, vec, st); break;
    }
    TEC_CUDA_LAUNCH_CHECK("norm forward kernel");
    return TEC_OK;
}

/* 0 when the SM count cannot be had (tec_cuda_norm_bwd then reports why). */
size_t tec_cuda_norm_bwd_workspace_bytes(int device, int64_t rows, int64_t cols)
{
    int sms = 0;
    if (tec_cuda_sm_count(device, &sms) != TEC_OK)
        return 0;
    int64_t groups = bwd_max_groups(sms);
    if (groups > rows)
        groups = rows;
    if (groups <= 0 || cols <= 0)
        return 0;
    return (size_t)groups * (size_t)cols * 2 * sizeof(float);
}

tec_status tec_cuda_norm_bwd(int device, const tec_norm_bwd_args *a, void *stream)
{
    if (a->cols > kMaxGrid)
        return TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED, "norm backward: cols=%lld is too large", (long long)a->cols);
    int sms;
    tec_status s = tec_cuda_sm_count(device, &sms);
    if (s != TEC_OK)
        return s;
    const size_t need = tec_cuda_norm_bwd_workspace_bytes(device, a->rows, a->cols);
    if (a->workspace_bytes < need || (need && !a->workspace))
        return TEC_CUDA_FAIL(TEC_ERR_INVALID_ARG, "norm backward: workspace of %zu bytes, %zu needed",
                             a->workspace_bytes, need);
    const int64_t V = 16 / (int64_t)tec_cuda_dtype_size(a->dtype);
    const bool vec = a->cols % V == 0 && tec_cuda_aligned16(a->x) && tec_cuda_aligned16(a->dy) && tec_cuda_aligned16(a->dx) &&
                     tec_cuda_aligned16(a->gamma);
    bwd_params p;
    p.dy = a->dy;
    p.x = a->x;
    p.gamma = a->gamma;
    p.mu = a->mu;
    p.rsigma = a->rsigma;
    p.dx = a->dx;
    p.ws = (float *)a->workspace;
    p.rows = a->rows;
    p.cols = a->cols;
    p.groups = 0;
    p.gshift = a->zero_centered_gamma ? 1.0f : 0.0f;
    p.has_dbeta = a->dbeta != NULL;
    cudaStream_t st = (cudaStream_t)stream;

    TEC_CUDA_ENTER(device);
    switch (a->dtype) {
    case TEC_F32: bwd_dispatch<float>(p, vec, sms, st); break;
    case TEC_BF16: bwd_dispatch<__nv_bfloat16>(p, vec, sms, st); break;
    case TEC_F16: bwd_dispatch<__half>(p, vec, sms, st); break;
    }
    TEC_CUDA_LAUNCH_CHECK("norm backward kernel");
    switch (a->dtype) {
    case TEC_F32: launch_bwd_reduce<float>(p, a->dgamma, a->dbeta, st); break;
    case TEC_BF16: launch_bwd_reduce<__nv_bfloat16>(p, a->dgamma, a->dbeta, st); break;
    case TEC_F16: launch_bwd_reduce<__half>(p, a->dgamma, a->dbeta, st); break;
    }
    TEC_CUDA_LAUNCH_CHECK("norm backward reduction kernel");
    return TEC_OK;
}
