/* fp8_steps.c - the FP8 steps of a linear layer of tec.h (the casts and
 * GEMMs of one forward or one backward in one call): each chains
 * tec_fp8_amax, tec_fp8_scale_from_amax, tec_fp8_quantize and
 * tec_fp8_gemm, which check and dispatch their parts, so a step computes
 * exactly what the separate calls compute. Exercised by
 * tests/test_fp8_steps.py (against the separate calls) and by the FP8
 * layer tests. */
#include "error.h"

/* One cast of tec_fp8_cast over [rows, cols] of dtype; dbias as in
 * tec_fp8_quantize_args. */
static tec_status cast(int device, const tec_fp8_cast *c, int64_t rows, int64_t cols, tec_dtype dtype, void *dbias,
                       void *ws, size_t ws_bytes, void *stream)
{
    tec_fp8_quantize_args q = {.rows = rows, .cols = cols, .dtype = dtype, .format = c->format, .x = c->x,
                               .scale = c->scale, .out = c->data, .out_t = c->data_t, .amax = c->amax,
                               .scale_inv = c->scale_inv, .dbias = dbias, .workspace = ws, .workspace_bytes = ws_bytes,
                               .act_mode = c->act_mode, .act = c->act, .act_input = c->act_input};
    tec_status st = TEC_OK;
    if (c->current) {  /* the tensor's own amax, then its scale, on the device */
        if (c->act_mode != TEC_FP8_ACT_NONE)
            return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 cast: current scaling with a fused activation is not "
                                 "supported (the activation's amax would need a pass of its own)");
        st = tec_fp8_amax(device, c->x, rows * cols, dtype, c->current, stream);
        if (st == TEC_OK)
            st = tec_fp8_scale_from_amax(device, c->current, c->current + 1, NULL, 1, tec_fp8_max(c->format),
                                         c->pow2, c->epsilon, stream);
        q.scale = c->current + 1;
        q.amax = NULL;
    }
    if (st == TEC_OK)
        st = tec_fp8_quantize(device, &q, stream);
    return st;
}

tec_status tec_fp8_linear_fwd(int device, const tec_fp8_linear_fwd_args *a, void *stream)
{
    if (!a->x.data || !a->w.data)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 linear_fwd: x.data and w.data are required (the GEMM reads "
                             "them)");
    if (a->rows < 0 || a->n < 0 || a->k < 0)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 linear_fwd: negative size rows=%lld n=%lld k=%lld",
                             (long long)a->rows, (long long)a->n, (long long)a->k);
    tec_status st = TEC_OK;
    tec_fp8_cast x = a->x;
    if (a->norm) {  /* the norm first: its output is what the cast reads */
        tec_norm_fwd_args nf = *a->norm;
        nf.rows = a->rows;
        nf.cols = a->k;
        nf.dtype = a->dtype;
        if (!nf.y)
            return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 linear_fwd: the norm needs its output (norm.y)");
        st = tec_norm_fwd(device, &nf, stream);
        x.x = nf.y;
    }
    if (st == TEC_OK && x.x)
        st = cast(device, &x, a->rows, a->k, a->dtype, NULL, NULL, 0, stream);
    if (st == TEC_OK && a->w.x)
        st = cast(device, &a->w, a->n, a->k, a->dtype, NULL, NULL, 0, stream);
    if (st != TEC_OK)
        return st;
    tec_fp8_gemm_args g = {.m = a->rows, .n = a->n, .k = a->k, .a_format = a->x.format, .b_format = a->w.format,
                           .a = a->x.data, .lda = a->k > 1 ? a->k : 1, .b = a->w.data, .ldb = a->k > 1 ? a->k : 1,
                           .a_scale_inv = a->x.scale_inv, .b_scale_inv = a->w.scale_inv, .c = a->y,
                           .ldc = a->n > 1 ? a->n : 1, .c_dtype = a->dtype, .bias = a->bias,
                           .fast_accum = a->fast_accum, .workspace = a->workspace,
                           .workspace_bytes = a->workspace_bytes};
    return tec_fp8_gemm(device, &g, stream);
}

tec_status tec_fp8_linear_bwd(int device, const tec_fp8_linear_bwd_args *a, void *stream)
{
    if (a->rows < 0 || a->n < 0 || a->k < 0)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 linear_bwd: negative size rows=%lld n=%lld k=%lld",
                             (long long)a->rows, (long long)a->n, (long long)a->k);
    if (a->norm && !a->dx)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 linear_bwd: the norm's backward needs dx (its dy)");
    if ((a->dx && (!a->dy.data || !a->w_t)) || (a->dw && (!a->dy.data_t || !a->x_t)))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 linear_bwd: dgrad needs dy.data and w_t, wgrad dy.data_t "
                             "and x_t");
    if (a->dw && a->rows % 16)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 linear_bwd: wgrad's inner dimension (rows=%lld) must be a "
                             "multiple of 16", (long long)a->rows);
    tec_status st = TEC_OK;
    if (a->dy.x)
        st = cast(device, &a->dy, a->rows, a->n, a->dtype, a->dbias, a->dbias_workspace, a->dbias_workspace_bytes,
                  stream);
    if (st == TEC_OK && a->dx) {
        const int64_t ld = a->n > 1 ? a->n : 1;
        tec_fp8_gemm_args d = {.m = a->rows, .n = a->k, .k = a->n, .a_format = a->dy.format, .b_format = a->w_format,
                               .a = a->dy.data, .lda = ld, .b = a->w_t, .ldb = ld, .a_scale_inv = a->dy.scale_inv,
                               .b_scale_inv = a->w_scale_inv, .c = a->dx, .ldc = a->k > 1 ? a->k : 1,
                               .c_dtype = a->dtype, .fast_accum = a->dgrad_fast_accum, .workspace = a->workspace,
                               .workspace_bytes = a->workspace_bytes};
        st = tec_fp8_gemm(device, &d, stream);
    }
    if (st == TEC_OK && a->dw) {
        const int64_t ld = a->rows > 1 ? a->rows : 1;
        tec_fp8_gemm_args g = {.m = a->n, .n = a->k, .k = a->rows, .a_format = a->dy.format, .b_format = a->x_format,
                               .a = a->dy.data_t, .lda = ld, .b = a->x_t, .ldb = ld, .a_scale_inv = a->dy.scale_inv,
                               .b_scale_inv = a->x_scale_inv, .c = a->dw, .ldc = a->k > 1 ? a->k : 1,
                               .c_dtype = a->dw_dtype, .accumulate = a->accumulate,
                               .fast_accum = a->wgrad_fast_accum, .workspace = a->workspace,
                               .workspace_bytes = a->workspace_bytes};
        st = tec_fp8_gemm(device, &g, stream);
    }
    if (st == TEC_OK && a->norm) {  /* the norm's backward of dgrad's output */
        tec_norm_bwd_args nb = *a->norm;
        nb.rows = a->rows;
        nb.cols = a->k;
        nb.dtype = a->dtype;
        nb.dy = a->dx;
        st = tec_norm_bwd(device, &nb, stream);
    }
    return st;
}
