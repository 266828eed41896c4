/* cpu_backend.c - the CPU backend: LayerNorm/RMSNorm forward and backward
 * and the row-major GEMM of tec.h, float32 arithmetic for every dtype.
 * Checked against float64 references by tests/test_kernels.py. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backend.h"
#include "../error.h"
#include "cpu_dtype.h"

/* ------------------------------------------------------------ norm */

static tec_status cpu_norm_fwd(int device, const tec_norm_fwd_args *a, void *stream)
{
    (void)device; (void)stream;
    const int64_t n = a->cols;
    const int rms = a->beta == NULL;
    float *buf = malloc((size_t)n * 3 * sizeof(float));
    if (!buf)
        return tec_set_error(TEC_ERR_NO_MEMORY, "norm: no memory for %lld floats", (long long)n * 3);
    float *xr = buf, *g = buf + n, *b = buf + 2 * n;
    tec_load_row(g, a->gamma, n, a->dtype);
    if (a->zero_centered_gamma)
        for (int64_t j = 0; j < n; j++) g[j] += 1.0f;
    if (!rms)
        tec_load_row(b, a->beta, n, a->dtype);
    for (int64_t r = 0; r < a->rows; r++) {
        tec_load_row(xr, (const char *)a->x + r * n * tec_dtype_size(a->dtype), n, a->dtype);
        float mu = 0.0f;
        if (!rms) {
            double s = 0.0;
            for (int64_t j = 0; j < n; j++) s += xr[j];
            mu = (float)(s / (double)n);
        }
        double ss = 0.0;
        for (int64_t j = 0; j < n; j++) {
            float d = xr[j] - mu;
            ss += (double)d * d;
        }
        float rs = (float)(1.0 / sqrt(ss / (double)n + a->eps));
        if (rms)
            for (int64_t j = 0; j < n; j++) xr[j] = xr[j] * rs * g[j];
        else
            for (int64_t j = 0; j < n; j++) xr[j] = (xr[j] - mu) * rs * g[j] + b[j];
        tec_store_row((char *)a->y + r * n * tec_dtype_size(a->dtype), xr, n, a->dtype);
        if (!rms) a->mu[r] = mu;
        a->rsigma[r] = rs;
    }
    free(buf);
    return TEC_OK;
}

static size_t cpu_norm_bwd_ws(int device, int64_t rows, int64_t cols)
{
    (void)device; (void)rows;
    return (size_t)cols * 2 * sizeof(float); /* dgamma, dbeta accumulators */
}

static tec_status cpu_norm_bwd(int device, const tec_norm_bwd_args *a, void *stream)
{
    (void)device; (void)stream;
    const int64_t n = a->cols;
    const int rms = a->dbeta == NULL;
    const size_t es = tec_dtype_size(a->dtype);
    float *buf = malloc((size_t)n * 3 * sizeof(float));
    if (!buf)
        return tec_set_error(TEC_ERR_NO_MEMORY, "norm backward: no memory for %lld floats", (long long)n * 3);
    float *xr = buf, *dyr = buf + n, *g = buf + 2 * n;
    float *dg = a->workspace, *db = dg + n;
    memset(dg, 0, (size_t)n * 2 * sizeof(float));
    tec_load_row(g, a->gamma, n, a->dtype);
    if (a->zero_centered_gamma)
        for (int64_t j = 0; j < n; j++) g[j] += 1.0f;
    for (int64_t r = 0; r < a->rows; r++) {
        tec_load_row(xr, (const char *)a->x + r * n * es, n, a->dtype);
        tec_load_row(dyr, (const char *)a->dy + r * n * es, n, a->dtype);
        const float mu = rms ? 0.0f : a->mu[r], rs = a->rsigma[r];
        float s_dyg = 0.0f, s_dyg_xh = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            float xh = (xr[j] - mu) * rs, dyg = dyr[j] * g[j];
            s_dyg += dyg;
            s_dyg_xh += dyg * xh;
            dg[j] += dyr[j] * xh;
            db[j] += dyr[j];
            xr[j] = xh;
        }
        const float m1 = rms ? 0.0f : s_dyg / (float)n, m2 = s_dyg_xh / (float)n;
        for (int64_t j = 0; j < n; j++)
            xr[j] = rs * (dyr[j] * g[j] - m1 - xr[j] * m2);
        tec_store_row((char *)a->dx + r * n * es, xr, n, a->dtype);
    }
    tec_store_row(a->dgamma, dg, n, a->dtype);
    if (!rms)
        tec_store_row(a->dbeta, db, n, a->dtype);
    free(buf);
    return TEC_OK;
}

/* ------------------------------------------------------------ GEMM */

/* op(X) as a dense float32 [rows, cols] matrix; X stored [rows, cols] with
 * leading dimension ld, or [cols, rows] when trans. */
static float *to_f32(const void *x, int64_t rows, int64_t cols, int64_t ld, int trans, tec_dtype dt)
{
    float *out = malloc((size_t)(rows * cols > 0 ? rows * cols : 1) * sizeof(float));
    if (!out)
        return NULL;
    const size_t es = tec_dtype_size(dt);
    if (!trans) {
        for (int64_t r = 0; r < rows; r++)
            tec_load_row(out + r * cols, (const char *)x + r * ld * es, cols, dt);
    } else {
        float *row = malloc((size_t)(rows > 0 ? rows : 1) * sizeof(float));
        if (!row) {
            free(out);
            return NULL;
        }
        for (int64_t c = 0; c < cols; c++) {
            tec_load_row(row, (const char *)x + c * ld * es, rows, dt);
            for (int64_t r = 0; r < rows; r++) out[r * cols + c] = row[r];
        }
        free(row);
    }
    return out;
}

enum { MR = 4, NB = 256 };

static tec_status cpu_gemm(int device, const tec_gemm_args *g, void *stream)
{
    (void)device; (void)stream;
    const int64_t M = g->m, N = g->n, K = g->k;
    float *A = to_f32(g->a, M, K, g->lda, g->transa, g->ab_dtype);
    float *B = to_f32(g->b, K, N, g->ldb, g->transb, g->ab_dtype);
    /* Accumulated in double: products and partial sums of float inputs
     * never overflow there, so a result is inf only when the exact one
     * rounds to inf in float (a float accumulator could reach inf, then
     * inf - inf = NaN, where the true sum is finite or an infinity). */
    double *acc = malloc((size_t)MR * NB * sizeof(double));
    float *crow = malloc((size_t)N * sizeof(float));
    float *bias = g->bias ? malloc((size_t)N * sizeof(float)) : NULL;
    tec_status st = TEC_OK;
    if (!A || !B || !acc || !crow || (g->bias && !bias)) {
        st = tec_set_error(TEC_ERR_NO_MEMORY, "gemm: no memory for a %lldx%lldx%lld product",
                           (long long)M, (long long)N, (long long)K);
        goto done;
    }
    if (bias)
        tec_load_row(bias, g->bias, N, g->ab_dtype);
    const size_t ces = tec_dtype_size(g->c_dtype);
    for (int64_t i0 = 0; i0 < M; i0 += MR) {
        const int mr = (int)(M - i0 < MR ? M - i0 : MR);
        for (int64_t j0 = 0; j0 < N; j0 += NB) {
            const int nb = (int)(N - j0 < NB ? N - j0 : NB);
            memset(acc, 0, (size_t)MR * NB * sizeof(double));
            for (int64_t p = 0; p < K; p++) {
                const float *b = B + p * N + j0;
                for (int r = 0; r < mr; r++) {
                    const double av = A[(i0 + r) * K + p];
                    double *c = acc + r * NB;
                    for (int j = 0; j < nb; j++) c[j] += av * (double)b[j];
                }
            }
            for (int r = 0; r < mr; r++) {
                char *cdst = (char *)g->c + ((i0 + r) * g->ldc + j0) * ces;
                double *c = acc + r * NB;
                if (bias)
                    for (int j = 0; j < nb; j++) c[j] += bias[j0 + j];
                if (g->accumulate) {
                    tec_load_row(crow, cdst, nb, g->c_dtype);
                    for (int j = 0; j < nb; j++) c[j] += crow[j];
                }
                for (int j = 0; j < nb; j++) crow[j] = (float)c[j];
                tec_store_row(cdst, crow, nb, g->c_dtype);
            }
        }
    }
    if (g->bias_grad)
        for (int64_t i = 0; i < M; i++) {
            float s = 0.0f;
            for (int64_t p = 0; p < K; p++) s += A[i * K + p];
            tec_store(g->bias_grad, i, g->ab_dtype, s);
        }
done:
    free(A); free(B); free(acc); free(crow); free(bias);
    return st;
}

const tec_backend tec_cpu_backend = {
    .abi_version = TEC_BACKEND_ABI,
    .name = "cpu",
    .norm_fwd = cpu_norm_fwd,
    .norm_bwd = cpu_norm_bwd,
    .norm_bwd_workspace_bytes = cpu_norm_bwd_ws,
    .gemm = cpu_gemm,
    .gemm_workspace_bytes = 0,
    .transport = &tec_shm_transport,
    .act_fwd = tec_cpu_act_fwd,
    .act_bwd = tec_cpu_act_bwd,
    .act_bwd_workspace_bytes = tec_cpu_act_bwd_workspace_bytes,
};
