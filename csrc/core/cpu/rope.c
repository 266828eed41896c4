/* cpu/rope.c - RoPE's apply on the CPU (tec.h, tec_rope): one pass over the
 * tokens, each head's row loaded through x's strides into float32, its
 * rotated channels written to the contiguous y. The formulas are rope.h's,
 * shared with cuda/rope.cu. Exercised by tests/test_rope.py. */
#include <stdlib.h>

#include "../error.h"
#include "../rope.h"
#include "cpu_dtype.h"

/* Rotate (or copy past d2) one head: row[d] -> y[d]. */
static void rotate_row(const tec_rope_args *a, const float *row, const float *f, void *y, int64_t base)
{
#define ROW(k) row[k]
    for (int64_t c = 0; c < a->d2; c++) {
        float v;
        TEC_ROPE_CHANNEL(v, c, a->d2, a->interleaved, a->backward, f, ROW);
        tec_store(y, base + c, a->dtype, v);
    }
#undef ROW
    for (int64_t c = a->d2; c < a->d; c++)
        tec_store(y, base + c, a->dtype, row[c]);
}

/* One token: sequence i, index j in it, of local length n; y_token the
 * offset of its first element in y, x_token its offset in x. */
static tec_status token(const tec_rope_args *a, float *row, int64_t i, int64_t j, int64_t n, int64_t x_token,
                        int64_t y_token)
{
    int64_t start = a->start_positions ? a->start_positions[i] : 0;
    int64_t pos = tec_rope_position(j, n, a->cp_size, a->cp_rank, start);
    if (pos < 0 || pos >= a->freqs_rows)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: position %lld (sequence %lld, token %lld) is outside the "
                             "%lld rows of freqs", (long long)pos, (long long)i, (long long)j,
                             (long long)a->freqs_rows);
    const float *f = a->freqs + pos * a->d2;
    for (int64_t hh = 0; hh < a->h; hh++) {
        int64_t xo = x_token + hh * a->stride_h;
        for (int64_t c = 0; c < a->d; c++)
            row[c] = tec_load(a->x, xo + c * a->stride_d, a->dtype);
        rotate_row(a, row, f, a->y, y_token + hh * a->d);
    }
    return TEC_OK;
}

tec_status tec_cpu_rope(int device, const tec_rope_args *a, void *stream)
{
    (void)device;
    (void)stream;
    float *row = malloc((size_t)a->d * sizeof(float));
    if (!row)
        return tec_set_error(TEC_ERR_NO_MEMORY, "rope: no memory for a %lld-channel row", (long long)a->d);
    tec_status st = TEC_OK;
    const int64_t hd = a->h * a->d;
    if (a->format == TEC_ROPE_THD) {
        for (int64_t i = 0; i < a->b && st == TEC_OK; i++) {
            int64_t lo = a->cu_seqlens[i] / a->cp_size, hi = a->cu_seqlens[i + 1] / a->cp_size;
            if (lo < 0 || hi < lo || hi > a->s) {
                st = tec_set_error(TEC_ERR_INVALID_ARG, "rope: cu_seqlens[%lld..%lld] = %d..%d (/%d) is outside the "
                                   "%lld tokens", (long long)i, (long long)i + 1, a->cu_seqlens[i],
                                   a->cu_seqlens[i + 1], a->cp_size, (long long)a->s);
                break;
            }
            for (int64_t t = lo; t < hi && st == TEC_OK; t++)
                st = token(a, row, i, t - lo, hi - lo, t * a->stride_s, t * hd);
        }
    } else {
        for (int64_t si = 0; si < a->s && st == TEC_OK; si++)
            for (int64_t bi = 0; bi < a->b && st == TEC_OK; bi++) {
                int64_t yo = a->format == TEC_ROPE_SBHD ? (si * a->b + bi) * hd : (bi * a->s + si) * hd;
                st = token(a, row, bi, si, a->s, si * a->stride_s + bi * a->stride_b, yo);
            }
    }
    free(row);
    return st;
}
