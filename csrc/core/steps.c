/* steps.c - the layers' composite steps of tec.h (linear backward, norm +
 * GEMM forward and backward): each chains tec_norm_* and tec_gemm, which
 * check and dispatch their parts. Exercised by tests/test_one_path.py (the
 * bindings) and by every layer test. */
#include "error.h"

/* dgrad: dx[m, k] = dy[m, n] @ w[n, k] */
static tec_gemm_args dgrad_args(tec_dtype dt, int64_t m, int64_t n, int64_t k, const void *dy, const void *w,
                                void *dx, void *ws, size_t ws_bytes)
{
    tec_gemm_args g = {.ab_dtype = dt, .c_dtype = dt, .m = m, .n = k, .k = n, .a = dy, .lda = n,
                       .b = w, .ldb = k, .c = dx, .ldc = k, .workspace = ws, .workspace_bytes = ws_bytes};
    return g;
}

/* wgrad: dw[n, k] = dy[m, n]^T @ x[m, k], db[n] = dy's column sums */
static tec_gemm_args wgrad_args(tec_dtype dt, int64_t m, int64_t n, int64_t k, const void *dy, const void *x,
                                void *dw, void *db, void *ws, size_t ws_bytes)
{
    tec_gemm_args g = {.ab_dtype = dt, .c_dtype = dt, .transa = 1, .m = n, .n = k, .k = m, .a = dy,
                       .lda = n, .b = x, .ldb = k, .c = dw, .ldc = k, .bias_grad = db, .workspace = ws,
                       .workspace_bytes = ws_bytes};
    return g;
}

tec_status tec_linear_bwd(int device, const tec_linear_bwd_args *a, void *stream)
{
    if (a->db && !a->dw)
        return tec_set_error(TEC_ERR_INVALID_ARG, "linear_bwd: db needs dw (the bias gradient comes with wgrad)");
    tec_status st = TEC_OK;
    if (a->dx) {
        tec_gemm_args d = dgrad_args(a->dtype, a->m, a->n, a->k, a->dy, a->w, a->dx, a->workspace,
                                     a->workspace_bytes);
        st = tec_gemm(device, &d, stream);
    }
    if (st == TEC_OK && a->dw) {
        tec_gemm_args g = wgrad_args(a->dtype, a->m, a->n, a->k, a->dy, a->x, a->dw, a->db, a->workspace,
                                     a->workspace_bytes);
        st = tec_gemm(device, &g, stream);
    }
    return st;
}

tec_status tec_norm_linear_fwd(int device, const tec_norm_linear_fwd_args *a, void *stream)
{
    tec_norm_fwd_args nf = {.rows = a->rows, .cols = a->k, .dtype = a->dtype, .x = a->x, .gamma = a->gamma,
                            .beta = a->beta, .y = a->ln_out, .mu = a->mu, .rsigma = a->rsigma, .eps = a->eps,
                            .zero_centered_gamma = a->zero_centered_gamma};
    tec_gemm_args g = {.ab_dtype = a->dtype, .c_dtype = a->dtype, .transb = 1, .m = a->rows, .n = a->n, .k = a->k,
                       .a = a->ln_out, .lda = a->k, .b = a->w, .ldb = a->k, .c = a->y, .ldc = a->n,
                       .bias = a->bias, .workspace = a->workspace, .workspace_bytes = a->workspace_bytes};
    tec_status st = tec_norm_fwd(device, &nf, stream);
    if (st == TEC_OK)
        st = tec_gemm(device, &g, stream);
    return st;
}

tec_status tec_norm_linear_bwd(int device, const tec_norm_linear_bwd_args *a, void *stream)
{
    if (a->db && !a->dw)
        return tec_set_error(TEC_ERR_INVALID_ARG,
                             "norm_linear_bwd: db needs dw (the bias gradient comes with wgrad)");
    tec_gemm_args d = dgrad_args(a->dtype, a->rows, a->n, a->k, a->dy, a->w, a->dln, a->workspace,
                                 a->workspace_bytes);
    tec_norm_bwd_args nb = {.rows = a->rows, .cols = a->k, .dtype = a->dtype, .dy = a->dln, .x = a->x,
                            .mu = a->mu, .rsigma = a->rsigma, .gamma = a->gamma, .dx = a->dx,
                            .dgamma = a->dgamma, .dbeta = a->dbeta, .zero_centered_gamma = a->zero_centered_gamma,
                            .workspace = a->norm_workspace, .workspace_bytes = a->norm_workspace_bytes};
    tec_status st = tec_gemm(device, &d, stream);
    if (st == TEC_OK && a->dw) {
        tec_gemm_args g = wgrad_args(a->dtype, a->rows, a->n, a->k, a->dy, a->ln_out, a->dw, a->db, a->workspace,
                                     a->workspace_bytes);
        st = tec_gemm(device, &g, stream);
    }
    if (st == TEC_OK)
        st = tec_norm_bwd(device, &nb, stream);
    return st;
}
