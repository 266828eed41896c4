/* cpu_dtype.h - float32 <-> bfloat16 / float16 conversion for the CPU
 * backend (round to nearest even), and strided load/store of a row. */
#ifndef TEC_CPU_DTYPE_H
#define TEC_CPU_DTYPE_H

#include <stdint.h>
#include <string.h>

#include "../tec.h"

static inline float tec_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t tec_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet */
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float tec_load(const void *p, int64_t i, tec_dtype dt)
{
    switch (dt) {
    case TEC_BF16: return tec_bf16_to_f32(((const uint16_t *)p)[i]);
    case TEC_F16: return (float)((const _Float16 *)p)[i];
    default: return ((const float *)p)[i];
    }
}

static inline void tec_store(void *p, int64_t i, tec_dtype dt, float v)
{
    switch (dt) {
    case TEC_BF16: ((uint16_t *)p)[i] = tec_f32_to_bf16(v); break;
    case TEC_F16: ((_Float16 *)p)[i] = (_Float16)v; break;
    default: ((float *)p)[i] = v; break;
    }
}

/* dst[0..n) = src[0..n) as float32. */
static inline void tec_load_row(float *dst, const void *src, int64_t n, tec_dtype dt)
{
    if (dt == TEC_F32) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        dst[i] = tec_load(src, i, dt);
}

static inline void tec_store_row(void *dst, const float *src, int64_t n, tec_dtype dt)
{
    if (dt == TEC_F32) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        tec_store(dst, i, dt, src[i]);
}

#endif
