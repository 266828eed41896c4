/* act_math.h - the scalar formulas of the activations (activation.h), one
 * copy compiled both by the C compiler (CPU kernels) and by nvcc (CUDA
 * kernels, __host__ __device__), so the two backends compute the same thing.
 * The formulas follow TransformerEngine's (float32 tanhf/expf). */
#ifndef TEC_ACT_MATH_H
#define TEC_ACT_MATH_H

#include <math.h>

#ifdef __CUDACC__
#define TEC_ACT_FN static __host__ __device__ __forceinline__
#else
#define TEC_ACT_FN static inline
#endif

/* Element-wise function ids: the low 4 bits of tec_activation. */
enum { TEC_F_GELU = 0, TEC_F_RELU = 1, TEC_F_QGELU = 2, TEC_F_SRELU = 3, TEC_F_SILU = 4, TEC_F_CLAMPED_SILU = 5, TEC_F_SIGMOID = 6 };

TEC_ACT_FN float tec_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* f(x); `limit`, `alpha` only for the clamped silu. */
TEC_ACT_FN float tec_act_f(int f, float x, float limit, float alpha)
{
    switch (f) {
    case TEC_F_GELU: return x * (0.5f + 0.5f * tanhf(x * (0.79788456f + 0.03567741f * x * x)));
    case TEC_F_RELU: return x > 0.0f ? x : 0.0f;
    case TEC_F_QGELU: return x * tec_sigmoid(1.702f * x);
    case TEC_F_SRELU: return x > 0.0f ? x * x : 0.0f;
    case TEC_F_SILU: return x * tec_sigmoid(x);
    case TEC_F_SIGMOID: return tec_sigmoid(x);
    default: {
        const float m = x < limit ? x : limit;
        return m * tec_sigmoid(alpha * m);
    }
    }
}

/* f'(x). */
TEC_ACT_FN float tec_act_df(int f, float x, float limit, float alpha)
{
    switch (f) {
    case TEC_F_GELU: {
        const float t = tanhf(0.79788456f * x * (1.0f + 0.044715f * x * x));
        return 0.5f * x * ((1.0f - t * t) * (0.79788456f + 0.1070322243f * x * x)) + 0.5f * (1.0f + t);
    }
    case TEC_F_RELU: return x > 0.0f ? 1.0f : 0.0f;
    case TEC_F_QGELU: {
        const float s = tec_sigmoid(1.702f * x);
        return 1.702f * x * s * (1.0f - s) + s;
    }
    case TEC_F_SRELU: return x > 0.0f ? 2.0f * x : 0.0f;
    case TEC_F_SILU: {
        const float s = tec_sigmoid(x);
        return x * s * (1.0f - s) + s;
    }
    case TEC_F_SIGMOID: {
        const float s = tec_sigmoid(x);
        return s * (1.0f - s);
    }
    default: {
        if (x > limit)
            return 0.0f;
        const float s = tec_sigmoid(alpha * x);
        return alpha * x * s * (1.0f - s) + s;
    }
    }
}

/* The gate value a gated activation multiplies by, and its derivative
 * (identity, except clamp(g, -limit, limit) + offset for the clamped swiglu). */
TEC_ACT_FN float tec_act_gate(int f, float g, float limit, float offset)
{
    if (f != TEC_F_CLAMPED_SILU)
        return g;
    return (g < -limit ? -limit : (g > limit ? limit : g)) + offset;
}

TEC_ACT_FN float tec_act_dgate(int f, float g, float limit)
{
    if (f != TEC_F_CLAMPED_SILU)
        return 1.0f;
    return (g >= -limit && g <= limit) ? 1.0f : 0.0f;
}

#endif /* TEC_ACT_MATH_H */
