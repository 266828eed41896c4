/* cpu_backend.c - the CPU backend: LayerNorm/RMSNorm forward and backward
 * and the row-major GEMM of tec.h, float32 arithmetic for every dtype.
 * Checked against float64 references by tests/test_kernels.py. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backend.h"
#include "../error.h"
#include "../rope.h"
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

/* The parameter gradients are column sums over the rows. Each block of
 * NORM_BLOCK rows is summed in order into a block partial; the block
 * partials are then added pairwise (a binary counter of partials: level k
 * holds the sum of 2^k blocks), so the error grows with NORM_BLOCK + log2 of
 * the block count instead of with the row count, and the order, hence the
 * result, is fixed. Workspace: the block partial and one partial per level,
 * each dgamma and dbeta (2 * cols floats). */
enum { NORM_BLOCK = 16 };

static int norm_levels(int64_t rows)
{
    int64_t blocks = (rows + NORM_BLOCK - 1) / NORM_BLOCK;
    int levels = 1;
    while (blocks > 1) {
        blocks = (blocks + 1) / 2;
        levels++;
    }
    return levels;
}

static size_t cpu_norm_bwd_ws(int device, int64_t rows, int64_t cols)
{
    (void)device;
    return (size_t)cols * 2 * (size_t)(1 + norm_levels(rows)) * sizeof(float);
}

/* Carry the finished block partial blk (2n floats, zeroed after) into the
 * levels: `done` blocks were carried before it. */
static void norm_carry(float *blk, float *levels, int64_t n2, int64_t done)
{
    int k = 0;
    for (; done & ((int64_t)1 << k); k++) {
        const float *lv = levels + (int64_t)k * n2;
        for (int64_t j = 0; j < n2; j++) blk[j] += lv[j];
    }
    memcpy(levels + (int64_t)k * n2, blk, (size_t)n2 * sizeof(float));
    memset(blk, 0, (size_t)n2 * sizeof(float));
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
    float *dg = a->workspace, *db = dg + n, *levels = dg + 2 * n;
    int64_t done = 0; /* blocks carried into the levels */
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
        if ((r + 1) % NORM_BLOCK == 0 || r + 1 == a->rows)
            norm_carry(dg, levels, 2 * n, done++);
    }
    /* the levels still holding a partial, smallest first */
    for (int k = 0; done >> k; k++)
        if (done & ((int64_t)1 << k)) {
            const float *lv = levels + (int64_t)k * 2 * n;
            for (int64_t j = 0; j < 2 * n; j++) dg[j] += lv[j];
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

/* Whether the bytes [p, p + pn) and [q, q + qn) overlap. */
static int overlap(const void *p, size_t pn, const void *q, size_t qn)
{
    const char *a = p, *b = q;
    return a < b + qn && b < a + pn;
}

/* op(X) as float32 rows of length `cols`, `*ld` apart: X itself when it is
 * float32, not transposed and not overlapping the output (no copy: on small
 * products the copies and their allocations are most of the time), else a
 * dense copy (*owned set to it, for the caller to free). NULL: no memory. */
static const float *operand(const void *x, int64_t rows, int64_t cols, int64_t ld, int trans, tec_dtype dt,
                            const void *c, size_t c_bytes, int64_t *ld_out, float **owned)
{
    *owned = NULL;
    if (dt == TEC_F32 && !trans && !overlap(x, (size_t)((rows - 1) * ld + cols) * 4, c, c_bytes)) {
        *ld_out = ld;
        return x;
    }
    *ld_out = cols;
    return *owned = to_f32(x, rows, cols, ld, trans, dt);
}

static tec_status cpu_gemm(int device, const tec_gemm_args *g, void *stream)
{
    (void)device; (void)stream;
    const int64_t M = g->m, N = g->n, K = g->k;
    const size_t ces = tec_dtype_size(g->c_dtype);
    const size_t c_bytes = (size_t)((M - 1) * g->ldc + N) * ces;
    int64_t lda, ldb;
    float *a_copy, *b_copy;
    const float *A = operand(g->a, M, K, g->lda, g->transa, g->ab_dtype, g->c, c_bytes, &lda, &a_copy);
    const float *B = operand(g->b, K, N, g->ldb, g->transb, g->ab_dtype, g->c, c_bytes, &ldb, &b_copy);
    /* Accumulated in double: products and partial sums of float inputs
     * never overflow there, so a result is inf only when the exact one
     * rounds to inf in float (a float accumulator could reach inf, then
     * inf - inf = NaN, where the true sum is finite or an infinity). */
    double acc[MR * NB];
    float crow[NB], bias[NB];
    tec_status st = TEC_OK;
    if (!A || !B) {
        st = tec_set_error(TEC_ERR_NO_MEMORY, "gemm: no memory for a %lldx%lldx%lld product",
                           (long long)M, (long long)N, (long long)K);
        goto done;
    }
    for (int64_t i0 = 0; i0 < M; i0 += MR) {
        const int mr = (int)(M - i0 < MR ? M - i0 : MR);
        for (int64_t j0 = 0; j0 < N; j0 += NB) {
            const int nb = (int)(N - j0 < NB ? N - j0 : NB);
            for (int r = 0; r < mr; r++)
                memset(acc + r * NB, 0, (size_t)nb * sizeof(double));
            for (int64_t p = 0; p < K; p++) {
                const float *b = B + p * ldb + j0;
                for (int r = 0; r < mr; r++) {
                    const double av = A[(i0 + r) * lda + p];
                    double *c = acc + r * NB;
                    for (int j = 0; j < nb; j++) c[j] += av * (double)b[j];
                }
            }
            if (g->bias)
                tec_load_row(bias, (const char *)g->bias + j0 * tec_dtype_size(g->ab_dtype), nb, g->ab_dtype);
            for (int r = 0; r < mr; r++) {
                char *cdst = (char *)g->c + ((i0 + r) * g->ldc + j0) * ces;
                double *c = acc + r * NB;
                if (g->bias)
                    for (int j = 0; j < nb; j++) c[j] += bias[j];
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
            for (int64_t p = 0; p < K; p++) s += A[i * lda + p];
            tec_store(g->bias_grad, i, g->ab_dtype, s);
        }
done:
    free(a_copy); free(b_copy);
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
    .fp8 = &tec_cpu_fp8,
    .fp8_block = &tec_cpu_fp8_block,
    .rope = tec_cpu_rope,
};
