/* activation.cu - the activations of activation.h on CUDA: element-wise
 * forward/backward with 16-byte vector loads where cols and pointers allow,
 * and a tiled backward that also writes the bias gradient (per-slab column
 * sums in a float32 workspace, then a fixed-order sum: deterministic).
 * Formulas shared with the CPU kernels (act_math.h). Entries of the CUDA
 * backend table (cuda_backend.cu); tests/test_activations.py
 * (device="cuda") checks them against float64 references. */
#include "act_math.h"
#include "cuda_common.h"

namespace {

/* ================================================================ kernels */

template <typename T, int VEC> struct alignas(sizeof(T) * VEC) avec {
    T e[VEC];
};

template <typename T, int VEC> __device__ __forceinline__ void vload(float (&f)[VEC], const T *p)
{
    const avec<T, VEC> v = *reinterpret_cast<const avec<T, VEC> *>(p);
#pragma unroll
    for (int e = 0; e < VEC; e++)
        f[e] = tec_to_f32(v.e[e]);
}

template <typename T, int VEC> __device__ __forceinline__ void vstore(T *p, const float (&f)[VEC])
{
    avec<T, VEC> v;
#pragma unroll
    for (int e = 0; e < VEC; e++)
        v.e[e] = tec_from_f32<T>(f[e]);
    *reinterpret_cast<avec<T, VEC> *>(p) = v;
}

struct act_params {
    int64_t rows, cols; /* outputs per row; the input row has (GATED ? 2 : 1) * cols */
    float limit, alpha, offset;
};

/* y = act(x + bias): one VEC-group of outputs per step of a grid-stride loop. */
template <typename T, int F, bool GATED, int VEC>
__global__ void act_fwd_kernel(const T *__restrict__ x, const T *__restrict__ bias, T *__restrict__ y,
                               act_params p)
{
    const int64_t groups = p.cols / VEC, total = p.rows * groups, in = GATED ? 2 * p.cols : p.cols;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / groups, c = (i - r * groups) * VEC;
        float a[VEC], g[VEC], o[VEC];
        vload<T, VEC>(a, x + r * in + c);
        if (GATED)
            vload<T, VEC>(g, x + r * in + p.cols + c);
        if (bias) {
            float b[VEC];
            vload<T, VEC>(b, bias + c);
#pragma unroll
            for (int e = 0; e < VEC; e++) a[e] += b[e];
            if (GATED) {
                vload<T, VEC>(b, bias + p.cols + c);
#pragma unroll
                for (int e = 0; e < VEC; e++) g[e] += b[e];
            }
        }
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            o[e] = tec_act_f(F, a[e], p.limit, p.alpha);
            if (GATED)
                o[e] *= tec_act_gate(F, g[e], p.limit, p.offset);
        }
        vstore<T, VEC>(y + r * p.cols + c, o);
    }
}

/* dx for one VEC-group: da (activation half) and dg (gate half). */
template <int F, bool GATED, int VEC>
__device__ __forceinline__ void act_grad(const float (&dy)[VEC], const float (&a)[VEC], const float (&g)[VEC],
                                         float (&da)[VEC], float (&dg)[VEC], const act_params &p)
{
#pragma unroll
    for (int e = 0; e < VEC; e++) {
        if (GATED) {
            da[e] = tec_act_df(F, a[e], p.limit, p.alpha) * dy[e] * tec_act_gate(F, g[e], p.limit, p.offset);
            dg[e] = tec_act_f(F, a[e], p.limit, p.alpha) * dy[e] * tec_act_dgate(F, g[e], p.limit);
        } else {
            da[e] = tec_act_df(F, a[e], p.limit, p.alpha) * dy[e];
            dg[e] = 0.0f;
        }
    }
}

template <typename T, int F, bool GATED, int VEC>
__global__ void act_bwd_kernel(const T *__restrict__ dy, const T *__restrict__ x, T *__restrict__ dx, act_params p)
{
    const int64_t groups = p.cols / VEC, total = p.rows * groups, in = GATED ? 2 * p.cols : p.cols;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / groups, c = (i - r * groups) * VEC;
        float d[VEC], a[VEC], g[VEC], da[VEC], dg[VEC];
        vload<T, VEC>(d, dy + r * p.cols + c);
        vload<T, VEC>(a, x + r * in + c);
        if (GATED)
            vload<T, VEC>(g, x + r * in + p.cols + c);
        act_grad<F, GATED, VEC>(d, a, g, da, dg, p);
        vstore<T, VEC>(dx + r * in + c, da);
        if (GATED)
            vstore<T, VEC>(dx + r * in + p.cols + c, dg);
    }
}

/* Backward with the bias gradient. Block (kTx, kTy) covers kTx*VEC output
 * columns of one slab of rows; the float32 column sums of the slab go to
 * partial[slab][in_col] (threads of a column summed in ty order). */
constexpr int kTx = 32, kTy = 8;

template <typename T, int F, bool GATED, int VEC>
__global__ void __launch_bounds__(kTx *kTy)
    act_bwd_dbias_kernel(const T *__restrict__ dy, const T *__restrict__ x, T *__restrict__ dx,
                         float *__restrict__ partial, int64_t slab_rows, act_params p)
{
    constexpr int W = kTx * VEC * (GATED ? 2 : 1);
    __shared__ float sh[kTy][W];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t in = GATED ? 2 * p.cols : p.cols;
    const int64_t c = ((int64_t)blockIdx.x * kTx + tx) * VEC;
    const int64_t r0 = (int64_t)blockIdx.y * slab_rows;
    const int64_t r1 = r0 + slab_rows < p.rows ? r0 + slab_rows : p.rows;
    float sa[VEC], sg[VEC];
#pragma unroll
    for (int e = 0; e < VEC; e++) sa[e] = sg[e] = 0.0f;
    if (c < p.cols) {
        for (int64_t r = r0 + ty; r < r1; r += kTy) {
            float d[VEC], a[VEC], g[VEC], da[VEC], dg[VEC];
            vload<T, VEC>(d, dy + r * p.cols + c);
            vload<T, VEC>(a, x + r * in + c);
            if (GATED)
                vload<T, VEC>(g, x + r * in + p.cols + c);
            act_grad<F, GATED, VEC>(d, a, g, da, dg, p);
            vstore<T, VEC>(dx + r * in + c, da);
            if (GATED)
                vstore<T, VEC>(dx + r * in + p.cols + c, dg);
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                sa[e] += da[e];
                sg[e] += dg[e];
            }
        }
    }
#pragma unroll
    for (int e = 0; e < VEC; e++) {
        sh[ty][tx * VEC + e] = sa[e];
        if (GATED)
            sh[ty][kTx * VEC + tx * VEC + e] = sg[e];
    }
    __syncthreads();
    if (ty == 0 && c < p.cols) {
        float *out = partial + (int64_t)blockIdx.y * in;
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            float s = 0.0f, t = 0.0f;
            for (int k = 0; k < kTy; k++) {
                s += sh[k][tx * VEC + e];
                if (GATED)
                    t += sh[k][kTx * VEC + tx * VEC + e];
            }
            out[c + e] = s;
            if (GATED)
                out[p.cols + c + e] = t;
        }
    }
}

/* dbias[j] = sum over slabs of partial[s][j], in slab order. */
template <typename T>
__global__ void dbias_reduce_kernel(const float *__restrict__ partial, T *__restrict__ dbias, int64_t nslabs,
                                    int64_t in)
{
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < in; j += (int64_t)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int64_t k = 0; k < nslabs; k++) s += partial[k * in + j];
        dbias[j] = tec_from_f32<T>(s);
    }
}

/* ============================================================== launchers */

constexpr int kThreads = 256;

/* Slabs of rows of the dbias backward: a function of rows only, so the sum
 * order (and the result) does not depend on the device. */
int64_t dbias_slabs(int64_t rows)
{
    int64_t n = (rows + 63) / 64;
    return n > 128 ? 128 : n;
}

/* Blocks of a grid-stride kernel over `work` items: at most 16 per SM. */
unsigned grid_for(int sms, int64_t work)
{
    int64_t blocks = (work + kThreads - 1) / kThreads, cap = (int64_t)sms * 16;
    if (blocks > cap) blocks = cap;
    return (unsigned)(blocks > 0 ? blocks : 1);
}

template <typename T, int F, bool GATED, int VEC>
void launch_fwd(int sms, const tec_act_fwd_args *a, const act_params &p, cudaStream_t st)
{
    act_fwd_kernel<T, F, GATED, VEC><<<grid_for(sms, p.rows * (p.cols / VEC)), kThreads, 0, st>>>(
        (const T *)a->x, (const T *)a->bias, (T *)a->y, p);
}

template <typename T, int F, bool GATED, int VEC>
void launch_bwd(int sms, const tec_act_bwd_args *a, const act_params &p, cudaStream_t st)
{
    if (!a->dbias) {
        act_bwd_kernel<T, F, GATED, VEC><<<grid_for(sms, p.rows * (p.cols / VEC)), kThreads, 0, st>>>(
            (const T *)a->dy, (const T *)a->x, (T *)a->dx, p);
        return;
    }
    const int64_t nslabs = dbias_slabs(p.rows), in = GATED ? 2 * p.cols : p.cols;
    if (nslabs > 0) {
        const int64_t slab_rows = (p.rows + nslabs - 1) / nslabs;
        dim3 grid((unsigned)((p.cols + (int64_t)kTx * VEC - 1) / ((int64_t)kTx * VEC)), (unsigned)nslabs);
        act_bwd_dbias_kernel<T, F, GATED, VEC><<<grid, dim3(kTx, kTy), 0, st>>>(
            (const T *)a->dy, (const T *)a->x, (T *)a->dx, (float *)a->workspace, slab_rows, p);
    }
    dbias_reduce_kernel<T><<<grid_for(sms, in), kThreads, 0, st>>>((const float *)a->workspace, (T *)a->dbias,
                                                                      nslabs, in);
}

/* act (runtime) -> L(F, GATED) with the element-wise function and gating
 * as template arguments (act was checked by the caller). */
#define TEC_ACT_SWITCH(act, L)                                  \
    switch (act) {                                              \
    case TEC_ACT_GELU: L(TEC_F_GELU, false); break;             \
    case TEC_ACT_RELU: L(TEC_F_RELU, false); break;             \
    case TEC_ACT_QGELU: L(TEC_F_QGELU, false); break;           \
    case TEC_ACT_SRELU: L(TEC_F_SRELU, false); break;           \
    case TEC_ACT_SILU: L(TEC_F_SILU, false); break;             \
    case TEC_ACT_GEGLU: L(TEC_F_GELU, true); break;             \
    case TEC_ACT_REGLU: L(TEC_F_RELU, true); break;             \
    case TEC_ACT_QGEGLU: L(TEC_F_QGELU, true); break;           \
    case TEC_ACT_SREGLU: L(TEC_F_SRELU, true); break;           \
    case TEC_ACT_SWIGLU: L(TEC_F_SILU, true); break;            \
    case TEC_ACT_CLAMPED_SWIGLU: L(TEC_F_CLAMPED_SILU, true); break; \
    case TEC_ACT_GLU: L(TEC_F_SIGMOID, true); break;            \
    }

template <typename T>
void fwd_for(int sms, const tec_act_fwd_args *a, const act_params &p, bool vec, cudaStream_t st)
{
#define TEC_L(F, G) \
    (vec ? launch_fwd<T, F, G, 16 / sizeof(T)>(sms, a, p, st) : launch_fwd<T, F, G, 1>(sms, a, p, st))
    TEC_ACT_SWITCH(a->act, TEC_L)
#undef TEC_L
}

template <typename T>
void bwd_for(int sms, const tec_act_bwd_args *a, const act_params &p, bool vec, cudaStream_t st)
{
#define TEC_L(F, G) \
    (vec ? launch_bwd<T, F, G, 16 / sizeof(T)>(sms, a, p, st) : launch_bwd<T, F, G, 1>(sms, a, p, st))
    TEC_ACT_SWITCH(a->act, TEC_L)
#undef TEC_L
}

} // namespace

size_t tec_cuda_act_bwd_workspace_bytes(int device, tec_activation act, int64_t rows, int64_t cols)
{
    (void)device;
    return (size_t)dbias_slabs(rows) * (size_t)tec_act_in_cols(act, cols) * sizeof(float);
}

tec_status tec_cuda_act_fwd(int device, const tec_act_fwd_args *a, void *stream)
{
    if (a->rows == 0)
        return TEC_OK;
    int sms;
    tec_status s = tec_cuda_sm_count(device, &sms);
    if (s != TEC_OK)
        return s;
    const int64_t V = 16 / (int64_t)tec_cuda_dtype_size(a->dtype);
    const bool vec = a->cols % V == 0 && tec_cuda_aligned16(a->x) && tec_cuda_aligned16(a->y) &&
                     (!a->bias || tec_cuda_aligned16(a->bias));
    const act_params p = {a->rows, a->cols, a->limit, a->alpha, a->glu_offset};
    cudaStream_t st = (cudaStream_t)stream;
    TEC_CUDA_ENTER(device);
    switch (a->dtype) {
    case TEC_F32: fwd_for<float>(sms, a, p, vec, st); break;
    case TEC_BF16: fwd_for<__nv_bfloat16>(sms, a, p, vec, st); break;
    case TEC_F16: fwd_for<__half>(sms, a, p, vec, st); break;
    }
    TEC_CUDA_LAUNCH_CHECK("activation forward kernel");
    return TEC_OK;
}

tec_status tec_cuda_act_bwd(int device, const tec_act_bwd_args *a, void *stream)
{
    if (a->rows == 0 && !a->dbias)
        return TEC_OK;
    int sms;
    tec_status s = tec_cuda_sm_count(device, &sms);
    if (s != TEC_OK)
        return s;
    const int64_t V = 16 / (int64_t)tec_cuda_dtype_size(a->dtype);
    const bool vec = a->cols % V == 0 && tec_cuda_aligned16(a->x) && tec_cuda_aligned16(a->dy) &&
                     tec_cuda_aligned16(a->dx);
    const act_params p = {a->rows, a->cols, a->limit, a->alpha, a->glu_offset};
    cudaStream_t st = (cudaStream_t)stream;
    TEC_CUDA_ENTER(device);
    switch (a->dtype) {
    case TEC_F32: bwd_for<float>(sms, a, p, vec, st); break;
    case TEC_BF16: bwd_for<__nv_bfloat16>(sms, a, p, vec, st); break;
    case TEC_F16: bwd_for<__half>(sms, a, p, vec, st); break;
    }
    TEC_CUDA_LAUNCH_CHECK("activation backward kernel");
    return TEC_OK;
}
