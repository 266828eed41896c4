/* rope.cu - RoPE's apply on CUDA (tec.h, tec_rope): one block per token,
 * its threads over the token's heads x channels, x read through its
 * strides, y written contiguously; THD tokens find their sequence by a
 * binary search of cu_seqlens. The formulas are rope.h's, shared with the
 * CPU (cpu/rope.c). Entry of the CUDA backend table (cuda_backend.cu);
 * tests/test_rope.py (device="cuda") checks it against the unfused path. */
#include "cuda_common.h"
#include "rope.h"

namespace {

/* ================================================================ kernels */

struct rope_params {
    int format, interleaved, backward, cp_size, cp_rank;
    int64_t s, b, h, d, d2;
    int64_t stride_s, stride_b, stride_h, stride_d;
    const float *freqs;
    const int32_t *cu_seqlens, *start_positions;
};

/* The sequence of THD token t: the last i with cu_seqlens[i] / cp <= t, or
 * -1 when t lies past every sequence. */
__device__ int64_t thd_sequence(const rope_params &p, int64_t t)
{
    int64_t lo = 0, hi = p.b; /* answer in [0, b) */
    if (p.b == 0 || t >= p.cu_seqlens[p.b] / p.cp_size || t < p.cu_seqlens[0] / p.cp_size)
        return -1;
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (p.cu_seqlens[mid] / p.cp_size <= t)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

template <typename T> __global__ void rope_kernel(rope_params p, const T *__restrict__ x, T *__restrict__ y)
{
    const int64_t token = blockIdx.x;
    int64_t seq, j, n, x_token;
    if (p.format == TEC_ROPE_THD) {
        seq = thd_sequence(p, token);
        if (seq < 0)
            return; /* y was zeroed by the caller */
        int64_t lo = p.cu_seqlens[seq] / p.cp_size;
        j = token - lo;
        n = p.cu_seqlens[seq + 1] / p.cp_size - lo;
        x_token = token * p.stride_s;
    } else {
        int64_t si = token / p.b, bi = token % p.b; /* token = si * b + bi */
        seq = bi;
        j = si;
        n = p.s;
        x_token = si * p.stride_s + bi * p.stride_b;
    }
    const int64_t start = p.start_positions ? p.start_positions[seq] : 0;
    const int64_t pos = tec_rope_position(j, n, p.cp_size, p.cp_rank, start);
    const float *f = p.freqs + pos * p.d2;
    int64_t y_token;
    if (p.format == TEC_ROPE_BSHD)
        y_token = ((token % p.b) * p.s + token / p.b) * p.h * p.d;
    else
        y_token = token * p.h * p.d;
    for (int64_t e = threadIdx.x; e < p.h * p.d; e += blockDim.x) {
        const int64_t hh = e / p.d, c = e % p.d;
        const T *row = x + x_token + hh * p.stride_h;
        float v;
        if (c < p.d2) {
#define ROW(k) tec_to_f32(row[(k) * p.stride_d])
            TEC_ROPE_CHANNEL(v, c, p.d2, p.interleaved, p.backward, f, ROW);
#undef ROW
        } else {
            v = tec_to_f32(row[c * p.stride_d]);
        }
        y[y_token + e] = tec_from_f32<T>(v);
    }
}

/* ============================================================== launchers */

template <typename T> void launch(const rope_params &p, int64_t tokens, const void *x, void *y, cudaStream_t st)
{
    int64_t work = p.h * p.d;
    int threads = work >= 256 ? 256 : (int)((work + 31) / 32 * 32);
    rope_kernel<T><<<(unsigned)tokens, threads, 0, st>>>(p, (const T *)x, (T *)y);
}

} /* namespace */

tec_status tec_cuda_rope(int device, const tec_rope_args *a, void *stream)
{
    const int64_t tokens = a->format == TEC_ROPE_THD ? a->s : a->s * a->b;
    if (tokens == 0 || a->h == 0)
        return TEC_OK;
    if (tokens > 0x7fffffffLL)
        return TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED, "rope: %lld tokens exceed one grid dimension",
                             (long long)tokens);
    rope_params p;
    p.format = (int)a->format;
    p.interleaved = a->interleaved;
    p.backward = a->backward;
    p.cp_size = a->cp_size;
    p.cp_rank = a->cp_rank;
    p.s = a->s; p.b = a->b; p.h = a->h; p.d = a->d; p.d2 = a->d2;
    p.stride_s = a->stride_s; p.stride_b = a->stride_b; p.stride_h = a->stride_h; p.stride_d = a->stride_d;
    p.freqs = a->freqs;
    p.cu_seqlens = a->cu_seqlens;
    p.start_positions = a->start_positions;
    cudaStream_t st = (cudaStream_t)stream;
    TEC_CUDA_ENTER(device);
    switch (a->dtype) {
    case TEC_F32: launch<float>(p, tokens, a->x, a->y, st); break;
    case TEC_BF16: launch<__nv_bfloat16>(p, tokens, a->x, a->y, st); break;
    case TEC_F16: launch<__half>(p, tokens, a->x, a->y, st); break;
    }
    TEC_CUDA_LAUNCH_CHECK("rope kernel");
    return TEC_OK;
}
