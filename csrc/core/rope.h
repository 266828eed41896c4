/* rope.h - internal: the backends' RoPE kernels (the contract, tec_rope_args
 * and tec_rope, is public in tec.h) and the two formulas both compilers build
 * (a token's position and one channel's rotation), so that the CPU
 * (cpu/rope.c) and CUDA (cuda/rope.cu) compute the same thing. Checks and
 * dispatch in rope.c; tests/test_rope.py. Never included by csrc/python. */
#ifndef TEC_ROPE_H
#define TEC_ROPE_H

#include <math.h>

#include "tec.h"

#ifdef __CUDACC__
#define TEC_ROPE_FN static __host__ __device__ __forceinline__
#else
#define TEC_ROPE_FN static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

tec_status tec_cpu_rope(int device, const tec_rope_args *a, void *stream);
tec_status tec_cuda_rope(int device, const tec_rope_args *a, void *stream);

#ifdef __cplusplus
}
#endif

/* Position of the token at index j of a sequence of local length n
 * (tec.h: context parallelism's two chunks, plus the start offset). */
TEC_ROPE_FN int64_t tec_rope_position(int64_t j, int64_t n, int cp_size, int cp_rank, int64_t start)
{
    if (cp_size > 1) {
        int64_t half = n / 2;
        j = j < half ? cp_rank * half + j : cp_size * n - (cp_rank + 1) * half + (j - half);
    }
    return j + start;
}

/* Output channel c (< d2) of one head: x(k) loads channel k as float32,
 * f the angles row of the token's position. Forward: x[c] cos f[c] +
 * partner's rotation; backward: the transpose (tec.h). */
#define TEC_ROPE_CHANNEL(out, c, d2, interleaved, backward, f, X)                                   \
    do {                                                                                           \
        int64_t c_ = (c), half_ = (d2) / 2, p_;                                                    \
        int first_;                                                                                \
        if (interleaved) {                                                                         \
            first_ = (c_ & 1) == 0;                                                                \
            p_ = first_ ? c_ + 1 : c_ - 1;                                                         \
        } else {                                                                                   \
            first_ = c_ < half_;                                                                   \
            p_ = first_ ? c_ + half_ : c_ - half_;                                                 \
        }                                                                                          \
        float v_ = X(c_) * cosf((f)[c_]);                                                          \
        if (backward)                                                                              \
            v_ += (first_ ? 1.0f : -1.0f) * X(p_) * sinf((f)[p_]);                                 \
        else                                                                                       \
            v_ += (first_ ? -1.0f : 1.0f) * X(p_) * sinf((f)[c_]);                                 \
        (out) = v_;                                                                                \
    } while (0)

#endif /* TEC_ROPE_H */
