/* fp8.c - argument checks and device dispatch of the FP8 operations of
 * tec.h (quantize, amax, current-scaling scales, the FP8 GEMM with per-tensor
 * or block scales) through the backend tables (backend.h). Exercised by
 * tests/test_fp8_engine.py and tests/test_fp8_block.py. */
#include "backend.h"
#include "checked.h"
#include "error.h"

float tec_fp8_max(tec_fp8_format f) { return f == TEC_FP8_E5M2 ? 57344.0f : 448.0f; }

static int fmt_ok(tec_fp8_format f) { return f == TEC_FP8_E4M3 || f == TEC_FP8_E5M2; }
static int dtype_ok(tec_dtype dt) { return dt == TEC_F32 || dt == TEC_BF16 || dt == TEC_F16; }

static tec_status fp8_backend(const char *what, int device, const tec_fp8_ops **ops)
{
    tec_status st = tec_backend_check(device);
    if (st)
        return st;
    const tec_backend *b = tec_backend_for(device);
    if (!b->fp8)
        return tec_set_error(TEC_ERR_NOT_SUPPORTED, "%s: the %s backend has no FP8 operations", what, b->name);
    *ops = b->fp8;
    return TEC_OK;
}

tec_status tec_fp8_quantize(int device, const tec_fp8_quantize_args *a, void *stream)
{
    const tec_fp8_ops *ops = NULL;
    tec_status st = fp8_backend("fp8 quantize", device, &ops);
    if (st)
        return st;
    size_t bytes;
    if (a->rows < 0 || a->cols < 0 || !tec_mul3(a->rows, a->cols, 4, &bytes))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 quantize: bad shape rows=%lld cols=%lld",
                             (long long)a->rows, (long long)a->cols);
    if (!dtype_ok(a->dtype))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 quantize: unknown input dtype %d", (int)a->dtype);
    if (!fmt_ok(a->format))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 quantize: unknown FP8 format %d", (int)a->format);
    if (!a->scale)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 quantize: missing scale");
    if (!a->out && !a->out_t && !a->amax && !a->scale_inv && !a->dbias)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 quantize: no output (out, out_t, amax, scale_inv or dbias)");
    if (a->dbias) {
        const size_t need = tec_fp8_quantize_workspace_bytes(a->rows, a->cols);
        if (need && (!a->workspace || a->workspace_bytes < need))
            return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 quantize: dbias needs a workspace of %zu bytes, got %zu",
                                 need, a->workspace ? a->workspace_bytes : (size_t)0);
    }
    if (a->rows * a->cols > 0 && !a->x)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 quantize: missing input");
    if (a->act_mode != TEC_FP8_ACT_NONE) {
        if (a->act_mode != TEC_FP8_ACT_FWD && a->act_mode != TEC_FP8_ACT_BWD)
            return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 quantize: unknown act_mode %d (0 none, 1 forward, "
                                 "2 backward)", a->act_mode);
        if ((int)a->act < TEC_ACT_GELU || (int)a->act > TEC_ACT_SILU)
            return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 quantize: a fused activation must be one of the "
                                 "element-wise ones (gelu, relu, qgelu, srelu, silu: 0-4), got %d", (int)a->act);
        if (a->act_mode == TEC_FP8_ACT_BWD && a->rows * a->cols > 0 && !a->act_input)
            return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 quantize: the activation's backward needs act_input");
    }
    /* a noop flag is read by the device when the call runs: the arguments
     * above are the same call's whether it is set or not */
    return ops->quantize(device, a, stream);
}

size_t tec_fp8_quantize_workspace_bytes(int64_t rows, int64_t cols)
{
    size_t bytes;
    if (rows <= 0 || cols <= 0 || !tec_mul3((rows + 63) / 64, cols, 4, &bytes))
        return 0;
    return bytes;
}

tec_status tec_fp8_amax(int device, const void *x, int64_t n, tec_dtype dtype, float *amax, void *stream)
{
    const tec_fp8_ops *ops = NULL;
    tec_status st = fp8_backend("fp8 amax", device, &ops);
    if (st)
        return st;
    size_t bytes;
    if (n < 0 || !tec_mul3(n, 4, 1, &bytes))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 amax: bad element count %lld", (long long)n);
    if (!dtype_ok(dtype))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 amax: unknown input dtype %d", (int)dtype);
    if (!amax || (n > 0 && !x))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 amax: missing input or amax pointer");
    return ops->amax(device, x, n, dtype, amax, stream);
}

tec_status tec_fp8_scale_from_amax(int device, const float *amax, float *scale, float *scale_inv, int64_t n,
                                   float fp8_max, int pow2, float epsilon, void *stream)
{
    const tec_fp8_ops *ops = NULL;
    tec_status st = fp8_backend("fp8 scale_from_amax", device, &ops);
    if (st)
        return st;
    if (n < 0 || n > (int64_t)1 << 40)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 scale_from_amax: bad count %lld", (long long)n);
    if (!(fp8_max > 0.0f && fp8_max < 3.4e38f))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 scale_from_amax: fp8_max must be finite and > 0, got %g",
                             (double)fp8_max);
    if (!(epsilon >= 0.0f && epsilon < 3.4e38f))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 scale_from_amax: epsilon must be finite and >= 0, got %g",
                             (double)epsilon);
    if (n > 0 && (!amax || (!scale && !scale_inv)))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 scale_from_amax: missing amax, or both scale and scale_inv");
    if (n == 0)
        return TEC_OK;
    return ops->scale_from_amax(device, amax, scale, scale_inv, n, fp8_max, pow2 != 0, epsilon, stream);
}

tec_status tec_fp8_delayed_update(int device, float *history, float *scale, float *scale_inv, int64_t len, int64_t n,
                                  float fp8_max, float divisor, int most_recent, void *stream)
{
    const tec_fp8_ops *ops = NULL;
    tec_status st = fp8_backend("fp8 delayed_update", device, &ops);
    if (st)
        return st;
    if (len < 1 || len > TEC_FP8_HISTORY_MAX || n < 0 || n > (int64_t)1 << 20)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 delayed_update: history length %lld (1..%d) or %lld roles "
                             "out of range", (long long)len, TEC_FP8_HISTORY_MAX, (long long)n);
    if (!(fp8_max > 0.0f && fp8_max < 3.4e38f) || !(divisor > 0.0f && divisor < 3.4e38f))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 delayed_update: fp8_max %g and divisor %g must be finite and > 0",
                             (double)fp8_max, (double)divisor);
    if (n > 0 && (!history || !scale || !scale_inv))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 delayed_update: missing history, scale or scale_inv");
    if (n == 0)
        return TEC_OK;
    return ops->delayed_update(device, history, scale, scale_inv, len, n, fp8_max, divisor, most_recent != 0, stream);
}

tec_status tec_fp8_gemm(int device, const tec_fp8_gemm_args *a, void *stream)
{
    const tec_fp8_ops *ops = NULL;
    tec_status st = fp8_backend("fp8 gemm", device, &ops);
    if (st)
        return st;
    if (a->m < 0 || a->n < 0 || a->k < 0)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: negative size m=%lld n=%lld k=%lld", (long long)a->m,
                             (long long)a->n, (long long)a->k);
    if (!fmt_ok(a->a_format) || !fmt_ok(a->b_format))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: unknown FP8 format (a %d, b %d)", (int)a->a_format,
                             (int)a->b_format);
    if (a->a_format == TEC_FP8_E5M2 && a->b_format == TEC_FP8_E5M2)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: A and B cannot both be E5M2 (cuBLASLt has no E5M2 x E5M2)");
    if (!dtype_ok(a->c_dtype))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: unknown output dtype %d", (int)a->c_dtype);
    const int ma = a->a_scale_mode, mb = a->b_scale_mode;
    if (ma < TEC_FP8_SCALE_TENSOR || ma > TEC_FP8_SCALE_2D || mb < TEC_FP8_SCALE_TENSOR || mb > TEC_FP8_SCALE_2D)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: unknown scale mode (a %d, b %d)", ma, mb);
    if ((ma == TEC_FP8_SCALE_TENSOR) != (mb == TEC_FP8_SCALE_TENSOR))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: per-tensor and block scales cannot be mixed (a %d, b %d)",
                             ma, mb);
    if (ma == TEC_FP8_SCALE_2D && mb == TEC_FP8_SCALE_2D)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: A and B cannot both have 128x128 block scales "
                             "(cuBLASLt has 1x128 by 1x128, 1x128 by 128x128 and 128x128 by 1x128)");
    if (a->lda < (a->k > 1 ? a->k : 1) || a->ldb < (a->k > 1 ? a->k : 1) || a->ldc < (a->n > 1 ? a->n : 1))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: leading dimension too small (lda=%lld ldb=%lld ldc=%lld)",
                             (long long)a->lda, (long long)a->ldb, (long long)a->ldc);
    size_t bytes;
    if (!tec_matrix_bytes(a->m, a->lda, 4, &bytes) || !tec_matrix_bytes(a->n, a->ldb, 4, &bytes) ||
        !tec_matrix_bytes(a->m, a->ldc, 4, &bytes) || !tec_mul3(a->m, a->n, 4, &bytes))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: sizes too large (byte count overflows)");
    if (a->bias && a->accumulate)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: bias with accumulate is not supported");
    if (a->c_scale && (!fmt_ok(a->c_format) || a->c_dtype == TEC_F32 || a->accumulate || ma != TEC_FP8_SCALE_TENSOR ||
                       a->k == 0))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: an FP8 output needs a known c_format (got %d), a bf16 or "
                             "f16 c_dtype for its bias (got %d), no accumulate, per-tensor scales and k > 0",
                             (int)a->c_format, (int)a->c_dtype);
    if (a->c_amax && !a->c_scale)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: c_amax without c_scale (the amax is an FP8 output's)");
    if (!a->a_scale_inv || !a->b_scale_inv)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: missing a_scale_inv or b_scale_inv");
    if (a->m == 0 || a->n == 0)
        return TEC_OK;
    if (!a->c || (a->k > 0 && (!a->a || !a->b)))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 gemm: missing A, B or C pointer");
    return ops->gemm(device, a, stream);
}
