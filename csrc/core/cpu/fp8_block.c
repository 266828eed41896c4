/* cpu/fp8_block.c - the CPU backend's block-scaled FP8 (tec.h,
 * tec_fp8_block_quantize): 1x128 and 128x128 block amaxes, TE's block scale
 * rule and the cast, in the GEMM-ready scale layout; and the block
 * dequantizer of the FP8 GEMM emulation (cpu/fp8.c). Exercised by
 * tests/test_fp8_block.py. */
#include <float.h>
#include <stdlib.h>

#include "../backend.h"
#include "../error.h"
#include "cpu_dtype.h"
#include "cpu_fp8.h"

enum { B = TEC_FP8_BLOCK };

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round4(int64_t a) { return (a + 3) / 4 * 4; }

/* The largest finite value of the input dtype: the scale when fp8_max / a
 * overflows (TE's rule for block scales). */
static float dtype_max(tec_dtype dt)
{
    return dt == TEC_F16 ? 65504.0f : dt == TEC_BF16 ? 3.38953139e38f : FLT_MAX;
}

/* tec.h's block scale rule. */
static float block_scale(float amax, float fp8_max, int pow2, float epsilon, float inf_value)
{
    if (amax < epsilon)
        amax = epsilon;
    if (isinf(amax) || amax == 0.0f || isnan(amax))
        return 1.0f;
    float s = fp8_max / amax;
    if (isinf(s))
        s = inf_value;
    if (pow2) {
        uint32_t u;
        memcpy(&u, &s, 4);
        u &= 0xff800000u;
        memcpy(&s, &u, 4);
    }
    return s;
}

/* Blocks of x (float32, [rows, cols]) of br x bc elements: each one's
 * scale, its bytes into out (row-major [rows, cols], or NULL) and/or out_t
 * ([cols, rows], or NULL), its scale_inv at sidx(block row, block col). */
typedef struct {
    const float *x;
    int64_t rows, cols, br, bc;
    const fp8_fmt *f;
    int pow2;
    float epsilon, inf_value;
} blocks;

static void quantize_blocks(const blocks *b, uint8_t *out, uint8_t *out_t, float *sinv, int64_t ld, int transposed)
{
    for (int64_t r0 = 0; r0 < b->rows; r0 += b->br)
        for (int64_t c0 = 0; c0 < b->cols; c0 += b->bc) {
            const int64_t r1 = r0 + b->br < b->rows ? r0 + b->br : b->rows;
            const int64_t c1 = c0 + b->bc < b->cols ? c0 + b->bc : b->cols;
            float amax = 0.0f;
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = c0; c < c1; c++)
                    amax = fmaxf(amax, fabsf(b->x[r * b->cols + c]));
            const float s = block_scale(amax, b->f->max, b->pow2, b->epsilon, b->inf_value);
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = c0; c < c1; c++) {
                    const uint8_t q = fp8_encode(b->x[r * b->cols + c] * s, b->f);
                    if (out)
                        out[r * b->cols + c] = q;
                    if (out_t)
                        out_t[c * b->rows + r] = q;
                }
            /* the scale's place: block (r0, c0) of x, or of x^T when transposed */
            const int64_t br = r0 / b->br, bc = c0 / b->bc;
            int64_t i;
            if (b->br == 1) /* 1x128 of x: [cb][r] */
                i = bc * ld + r0;
            else if (b->bc == 1) /* 128x1 of x = 1x128 of x^T: [rb][c] */
                i = br * ld + c0;
            else /* 128x128 */
                i = transposed ? bc * ld + br : br * ld + bc;
            sinv[i] = 1.0f / s;
        }
}

static tec_status cpu_block_quantize(int device, const tec_fp8_block_quantize_args *a, void *stream)
{
    (void)device; (void)stream;
    const int64_t rows = a->rows, cols = a->cols;
    float *x = malloc((size_t)(rows * cols) * sizeof(float));
    if (!x)
        return tec_set_error(TEC_ERR_NO_MEMORY, "fp8 block quantize: no memory for %lldx%lld floats",
                             (long long)rows, (long long)cols);
    tec_load_row(x, a->x, rows * cols, a->dtype);
    blocks b = {x, rows, cols, 1, B, &k_fmt[a->format], a->pow2 != 0, a->epsilon, dtype_max(a->dtype)};
    if (a->block_dim == 2) {
        b.br = B;
        if (a->out)
            quantize_blocks(&b, a->out, a->out_t, a->scale_inv, round4(cdiv(cols, B)), 0);
        else
            quantize_blocks(&b, NULL, a->out_t, a->scale_inv_t, round4(cdiv(rows, B)), 1);
        if (a->out && a->out_t) /* the transpose's scales: the same grid, transposed */
            for (int64_t rb = 0; rb < cdiv(rows, B); rb++)
                for (int64_t cb = 0; cb < cdiv(cols, B); cb++)
                    a->scale_inv_t[cb * round4(cdiv(rows, B)) + rb] = a->scale_inv[rb * round4(cdiv(cols, B)) + cb];
    } else {
        if (a->out)
            quantize_blocks(&b, a->out, NULL, a->scale_inv, round4(rows), 0);
        if (a->out_t) {
            b.br = B;
            b.bc = 1;
            quantize_blocks(&b, NULL, a->out_t, a->scale_inv_t, round4(cols), 1);
        }
    }
    free(x);
    return TEC_OK;
}

float *tec_cpu_fp8_block_dequantize(const uint8_t *q, int64_t rows, int64_t k, int64_t ld, tec_fp8_format fmt,
                                    int mode, const float *scale_inv)
{
    float lut[256];
    for (int c = 0; c < 256; c++)
        lut[c] = fp8_decode((uint8_t)c, fmt);
    float *out = malloc((size_t)(rows * k > 0 ? rows * k : 1) * sizeof(float));
    if (!out)
        return NULL;
    const int64_t sld = mode == TEC_FP8_SCALE_1D ? round4(rows) : round4(cdiv(k, B));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t p = 0; p < k; p++) {
            const float s = mode == TEC_FP8_SCALE_1D ? scale_inv[(p / B) * sld + r] : scale_inv[(r / B) * sld + p / B];
            out[r * k + p] = lut[q[r * ld + p]] * s;
        }
    return out;
}

const tec_fp8_block_ops tec_cpu_fp8_block = {
    .quantize = cpu_block_quantize,
};
