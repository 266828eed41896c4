/* cpu/activation.c - the CPU kernels of the activations (activation.h):
 * row by row in float32 with the formulas of act_math.h shared with CUDA.
 * Checked against a float64 reference by tests/test_activations.py. */
#include <stdlib.h>
#include <string.h>

#include "../act_math.h"
#include "../activation.h"
#include "../error.h"
#include "cpu_dtype.h"

size_t tec_cpu_act_bwd_workspace_bytes(int device, tec_activation act, int64_t rows, int64_t cols)
{
    (void)device; (void)rows;
    return (size_t)tec_act_in_cols(act, cols) * sizeof(float); /* dbias accumulators */
}

tec_status tec_cpu_act_fwd(int device, const tec_act_fwd_args *a, void *stream)
{
    (void)device; (void)stream;
    const int gated = tec_act_is_gated(a->act), f = (int)a->act & 15;
    const int64_t n = a->cols, in = tec_act_in_cols(a->act, n);
    const size_t es = tec_dtype_size(a->dtype);
    float *buf = malloc((size_t)(2 * in + n) * sizeof(float));
    if (!buf)
        return tec_set_error(TEC_ERR_NO_MEMORY, "activation: no memory for %lld floats", (long long)(2 * in + n));
    float *xr = buf, *b = buf + in, *yr = buf + 2 * in;
    if (a->bias)
        tec_load_row(b, a->bias, in, a->dtype);
    for (int64_t r = 0; r < a->rows; r++) {
        tec_load_row(xr, (const char *)a->x + r * in * es, in, a->dtype);
        if (a->bias)
            for (int64_t j = 0; j < in; j++) xr[j] += b[j];
        for (int64_t j = 0; j < n; j++) {
            float v = tec_act_f(f, xr[j], a->limit, a->alpha);
            yr[j] = gated ? v * tec_act_gate(f, xr[n + j], a->limit, a->glu_offset) : v;
        }
        tec_store_row((char *)a->y + r * n * es, yr, n, a->dtype);
    }
    free(buf);
    return TEC_OK;
}

tec_status tec_cpu_act_bwd(int device, const tec_act_bwd_args *a, void *stream)
{
    (void)device; (void)stream;
    const int gated = tec_act_is_gated(a->act), f = (int)a->act & 15;
    const int64_t n = a->cols, in = tec_act_in_cols(a->act, n);
    const size_t es = tec_dtype_size(a->dtype);
    float *buf = malloc((size_t)(2 * in + n) * sizeof(float));
    if (!buf)
        return tec_set_error(TEC_ERR_NO_MEMORY, "activation backward: no memory for %lld floats",
                             (long long)(2 * in + n));
    float *xr = buf, *dxr = buf + in, *dyr = buf + 2 * in;
    float *db = a->dbias ? (float *)a->workspace : NULL;
    if (db)
        memset(db, 0, (size_t)in * sizeof(float));
    for (int64_t r = 0; r < a->rows; r++) {
        tec_load_row(xr, (const char *)a->x + r * in * es, in, a->dtype);
        tec_load_row(dyr, (const char *)a->dy + r * n * es, n, a->dtype);
        for (int64_t j = 0; j < n; j++) {
            const float x = xr[j], dy = dyr[j];
            if (!gated) {
                dxr[j] = tec_act_df(f, x, a->limit, a->alpha) * dy;
                continue;
            }
            const float g = xr[n + j];
            dxr[j] = tec_act_df(f, x, a->limit, a->alpha) * dy * tec_act_gate(f, g, a->limit, a->glu_offset);
            dxr[n + j] = tec_act_f(f, x, a->limit, a->alpha) * dy * tec_act_dgate(f, g, a->limit);
        }
        if (db) /* float32 values before rounding to dtype, as TE's dbias */
            for (int64_t j = 0; j < in; j++) db[j] += dxr[j];
        tec_store_row((char *)a->dx + r * in * es, dxr, in, a->dtype);
    }
    if (db)
        tec_store_row(a->dbias, db, in, a->dtype);
    free(buf);
    return TEC_OK;
}
