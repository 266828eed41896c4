/* cpu_fp8.h - the CPU backend's FP8 encoding and decoding (E4M3 / E5M2 in
 * plain C: round to nearest even, saturating, bit-identical to torch's
 * float8 casts of the clamped value), shared by cpu/fp8.c and
 * cpu/fp8_block.c; and the block dequantizer the FP8 GEMM emulation uses. */
#ifndef TEC_CPU_FP8_H
#define TEC_CPU_FP8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../tec.h"

/* Format constants: mantissa bits, exponent bias, largest finite code. */
typedef struct { int mbits, bias; uint8_t max_code, nan_code; float max; } fp8_fmt;
static const fp8_fmt k_fmt[2] = {
    {3, 7, 0x7e, 0x7f, 448.0f},     /* E4M3 (fn) */
    {2, 15, 0x7b, 0x7f, 57344.0f},  /* E5M2 */
};

static inline uint8_t fp8_encode(float v, const fp8_fmt *f)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u)
        return (uint8_t)(sign | f->nan_code);
    float a;
    memcpy(&a, &u, 4);
    if (a >= f->max) /* saturate (infinities too) */
        return (uint8_t)(sign | f->max_code);
    const int emin = 1 - f->bias; /* exponent of the smallest normal */
    if (a < ldexpf(1.0f, emin)) {
        /* Subnormal: a multiple of 2^(emin - mbits); exact scaling, then
         * nearbyintf rounds to nearest even. A carry to 2^mbits is the
         * smallest normal's code, as it should be. */
        return (uint8_t)(sign | (uint8_t)nearbyintf(ldexpf(a, f->mbits - emin)));
    }
    const int shift = 23 - f->mbits;
    u += (1u << (shift - 1)) - 1u + ((u >> shift) & 1u);
    const int e = (int)(u >> 23) - 127 + f->bias;
    const uint32_t m = (u >> shift) & ((1u << f->mbits) - 1u);
    uint32_t code = ((uint32_t)e << f->mbits) | m;
    if (code > f->max_code)
        code = f->max_code;
    return (uint8_t)(sign | code);
}

static inline float fp8_decode(uint8_t c, tec_fp8_format fmt)
{
    const fp8_fmt *f = &k_fmt[fmt];
    const int e = (c & 0x7f) >> f->mbits, m = c & ((1 << f->mbits) - 1);
    const int emax_field = (1 << (7 - f->mbits)) - 1;
    float v;
    if (fmt == TEC_FP8_E4M3 && e == emax_field && m == (1 << f->mbits) - 1)
        v = NAN;
    else if (fmt == TEC_FP8_E5M2 && e == emax_field)
        v = m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexpf((float)m, 1 - f->bias - f->mbits);
    else
        v = ldexpf(1.0f + (float)m / (float)(1 << f->mbits), e - f->bias);
    return (c & 0x80) ? -v : v;
}

/* rows x k FP8 values (leading dimension ld) decoded and multiplied by their
 * block scales (mode TEC_FP8_SCALE_1D or _2D, tec.h's layout of an
 * [rows, k] operand) into a dense float32 matrix (NULL: no memory). */
float *tec_cpu_fp8_block_dequantize(const uint8_t *q, int64_t rows, int64_t k, int64_t ld, tec_fp8_format fmt,
                                    int mode, const float *scale_inv);

#endif /* TEC_CPU_FP8_H */
