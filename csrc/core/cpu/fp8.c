/* cpu/fp8.c - the CPU backend's FP8 operations (tec.h), with the encoding
 * of cpu_fp8.h: the fused amax + cast + transpose, the current-scaling
 * scales, and the FP8 GEMM emulated exactly (operands decoded and scaled in
 * float32, per tensor or per block, then the CPU GEMM). Exercised by
 * tests/test_fp8_engine.py and tests/test_fp8_block.py. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backend.h"
#include "../act_math.h"
#include "../error.h"
#include "cpu_dtype.h"
#include "cpu_fp8.h"

static tec_status cpu_quantize(int device, const tec_fp8_quantize_args *a, void *stream)
{
    (void)device; (void)stream;
    if (a->noop && *a->noop != 0.0f) /* switched off: nothing is written */
        return TEC_OK;
    const fp8_fmt *f = &k_fmt[a->format];
    const float s = *a->scale;
    float amax = 0.0f;
    const size_t ncols = (size_t)(a->cols > 0 ? a->cols : 1);
    const int act = a->act_mode != TEC_FP8_ACT_NONE;
    const int64_t row_bytes = a->cols * (int64_t)tec_dtype_size(a->dtype);
    float *row = malloc(ncols * sizeof(float));
    float *sum = a->dbias ? calloc(ncols, sizeof(float)) : NULL; /* column sums, rows in order */
    /* a fused activation: its input row (float32), its float32 values and the row in dtype */
    float *in = act ? malloc(2 * ncols * sizeof(float)) : NULL;
    char *rounded = act ? malloc((size_t)(row_bytes > 0 ? row_bytes : 1)) : NULL;
    if (!row || (a->dbias && !sum) || (act && (!in || !rounded))) {
        free(row);
        free(sum);
        free(in);
        free(rounded);
        return tec_set_error(TEC_ERR_NO_MEMORY, "fp8 quantize: no memory for a row of %lld", (long long)a->cols);
    }
    for (int64_t r = 0; r < a->rows; r++) {
        tec_load_row(row, (const char *)a->x + r * row_bytes, a->cols, a->dtype);
        if (act) { /* row <- the activation's values rounded to dtype; in + cols: the unrounded ones */
            float *exact = in + ncols;
            if (a->act_mode == TEC_FP8_ACT_BWD)
                tec_load_row(in, (const char *)a->act_input + r * row_bytes, a->cols, a->dtype);
            for (int64_t c = 0; c < a->cols; c++)
                exact[c] = a->act_mode == TEC_FP8_ACT_FWD ? tec_act_f((int)a->act, row[c], 0.0f, 0.0f)
                                                          : tec_act_df((int)a->act, in[c], 0.0f, 0.0f) * row[c];
            tec_store_row(rounded, exact, a->cols, a->dtype);
            tec_load_row(row, rounded, a->cols, a->dtype);
        }
        for (int64_t c = 0; c < a->cols; c++) {
            const float v = row[c];
            amax = fmaxf(amax, fabsf(v));
            if (sum)
                sum[c] += act ? in[ncols + c] : v;
            if (a->out || a->out_t) {
                const uint8_t q = fp8_encode(v * s, f);
                if (a->out)
                    a->out[r * a->cols + c] = q;
                if (a->out_t)
                    a->out_t[c * a->rows + r] = q;
            }
        }
    }
    free(row);
    free(in);
    free(rounded);
    if (sum) {
        tec_store_row(a->dbias, sum, a->cols, a->dtype);
        free(sum);
    }
    if (a->amax)
        *a->amax = fmaxf(*a->amax, amax);
    if (a->scale_inv)
        *a->scale_inv = 1.0f / s;
    return TEC_OK;
}

static tec_status cpu_amax(int device, const void *x, int64_t n, tec_dtype dtype, float *amax, void *stream)
{
    (void)device; (void)stream;
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++)
        m = fmaxf(m, fabsf(tec_load(x, i, dtype)));
    *amax = m;
    return TEC_OK;
}

/* The current-scaling rule of tec.h, shared with the CUDA kernel's logic. */
static float scale_from_amax(float amax, float fp8_max, int pow2, float epsilon)
{
    if (amax < epsilon)
        amax = epsilon;
    if (isinf(amax) || amax == 0.0f || isnan(amax))
        return 1.0f;
    float s = fp8_max / amax;
    if (isinf(s))
        s = 3.40282347e38f;
    if (pow2) {
        uint32_t u;
        memcpy(&u, &s, 4);
        u &= 0xff800000u;
        memcpy(&s, &u, 4);
    }
    return s;
}

static tec_status cpu_scale_from_amax(int device, const float *amax, float *scale, float *scale_inv, int64_t n,
                                      float fp8_max, int pow2, float epsilon, void *stream)
{
    (void)device; (void)stream;
    for (int64_t i = 0; i < n; i++) {
        const float s = scale_from_amax(amax[i], fp8_max, pow2, epsilon);
        if (scale)
            scale[i] = s;
        if (scale_inv)
            scale_inv[i] = 1.0f / s;
    }
    return TEC_OK;
}

/* rows x k FP8 values (leading dimension ld) decoded and scaled into a
 * dense float32 matrix (NULL: no memory). */
static float *dequantize(const uint8_t *q, int64_t rows, int64_t k, int64_t ld, tec_fp8_format fmt, float s)
{
    float lut[256];
    for (int c = 0; c < 256; c++)
        lut[c] = fp8_decode((uint8_t)c, fmt) * s;
    float *out = malloc((size_t)(rows * k > 0 ? rows * k : 1) * sizeof(float));
    if (!out)
        return NULL;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t p = 0; p < k; p++)
            out[r * k + p] = lut[q[r * ld + p]];
    return out;
}

static tec_status cpu_fp8_gemm(int device, const tec_fp8_gemm_args *g, void *stream)
{
    (void)stream;
    tec_status st = TEC_OK;
    float *a, *b;
    if (g->a_scale_mode == TEC_FP8_SCALE_TENSOR) {
        a = dequantize(g->a, g->m, g->k, g->lda, g->a_format, *g->a_scale_inv);
        b = dequantize(g->b, g->n, g->k, g->ldb, g->b_format, *g->b_scale_inv);
    } else { /* cpu/fp8_block.c */
        a = tec_cpu_fp8_block_dequantize(g->a, g->m, g->k, g->lda, g->a_format, g->a_scale_mode, g->a_scale_inv);
        b = tec_cpu_fp8_block_dequantize(g->b, g->n, g->k, g->ldb, g->b_format, g->b_scale_mode, g->b_scale_inv);
    }
    float *bias = NULL, *tmp = NULL;
    if (!a || !b)
        goto nomem;
    if (g->bias) {
        const tec_dtype bdt = g->c_dtype == TEC_F16 ? TEC_F16 : TEC_BF16;
        if (!(bias = malloc((size_t)g->n * sizeof(float))))
            goto nomem;
        tec_load_row(bias, g->bias, g->n, bdt);
    }
    /* A float32 C takes the product directly; a 16-bit C is rounded once
     * from the float32 result (plus its old value with accumulate), and an
     * FP8 C encoded from it. */
    tec_gemm_args f = {.transb = 1, .m = g->m, .n = g->n, .k = g->k, .a = a, .lda = g->k, .b = b, .ldb = g->k,
                       .ab_dtype = TEC_F32, .c_dtype = TEC_F32, .bias = bias};
    if (g->c_dtype == TEC_F32) {
        f.c = g->c;
        f.ldc = g->ldc;
        f.accumulate = g->accumulate;
        st = tec_cpu_backend.gemm(device, &f, NULL);
        goto done;
    }
    if (!(tmp = malloc((size_t)(g->m * g->n) * sizeof(float))))
        goto nomem;
    f.c = tmp;
    f.ldc = g->n;
    if ((st = tec_cpu_backend.gemm(device, &f, NULL)) != TEC_OK)
        goto done;
    if (g->c_scale) { /* FP8 bytes: the float32 result scaled and encoded, its amax recorded */
        const fp8_fmt *cf = &k_fmt[g->c_format];
        const float cs = *g->c_scale;
        float amax = 0.0f;
        for (int64_t i = 0; i < g->m; i++)
            for (int64_t j = 0; j < g->n; j++) {
                const float v = tmp[i * g->n + j];
                amax = fmaxf(amax, fabsf(v));
                ((uint8_t *)g->c)[i * g->ldc + j] = fp8_encode(v * cs, cf);
            }
        if (g->c_amax)
            *g->c_amax = fmaxf(*g->c_amax, amax);
        goto done;
    }
    for (int64_t i = 0; i < g->m; i++) {
        char *crow = (char *)g->c + i * g->ldc * 2;
        for (int64_t j = 0; j < g->n; j++) {
            float v = tmp[i * g->n + j];
            if (g->accumulate)
                v += tec_load(crow, j, g->c_dtype);
            tec_store(crow, j, g->c_dtype, v);
        }
    }
    goto done;
nomem:
    st = tec_set_error(TEC_ERR_NO_MEMORY, "fp8 gemm: no memory for the dequantized %lldx%lldx%lld operands",
                       (long long)g->m, (long long)g->n, (long long)g->k);
done:
    free(a); free(b); free(bias); free(tmp);
    return st;
}

static tec_status cpu_delayed_update(int device, float *history, float *scale, float *scale_inv, int64_t len,
                                     int64_t n, float fp8_max, float divisor, int most_recent, void *stream)
{
    (void)device; (void)stream;
    for (int64_t c = 0; c < n; c++) {
        float amax = -INFINITY;
        for (int64_t i = 0; i < len; i++) { /* NaN entries count as 0 */
            const float v = history[i * n + c];
            amax = fmaxf(amax, isnan(v) ? 0.0f : v);
        }
        if (most_recent)
            amax = history[c];
        float s = (fp8_max / amax) / divisor;
        if (isinf(s))
            s = 3.40282347e38f;
        if (isfinite(amax) && amax > 0.0f)
            scale[c] = s;
        scale_inv[c] = 1.0f / scale[c];
        const float first = history[c];
        for (int64_t i = 0; i + 1 < len; i++)
            history[i * n + c] = history[(i + 1) * n + c];
        history[(len - 1) * n + c] = first;
        history[c] = 0.0f;
    }
    return TEC_OK;
}

const tec_fp8_ops tec_cpu_fp8 = {
    .quantize = cpu_quantize,
    .amax = cpu_amax,
    .scale_from_amax = cpu_scale_from_amax,
    .gemm = cpu_fp8_gemm,
    .delayed_update = cpu_delayed_update,
};
