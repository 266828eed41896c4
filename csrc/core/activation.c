/* activation.c - argument checks and device dispatch of the activations
 * (activation.h) through the backend tables (backend.h). Exercised by
 * tests/test_activations.py. */
#include "activation.h"

#include "backend.h"
#include "error.h"

static int act_known(tec_activation act)
{
    switch (act) {
    case TEC_ACT_GELU: case TEC_ACT_RELU: case TEC_ACT_QGELU: case TEC_ACT_SRELU: case TEC_ACT_SILU:
    case TEC_ACT_GEGLU: case TEC_ACT_REGLU: case TEC_ACT_QGEGLU: case TEC_ACT_SREGLU:
    case TEC_ACT_SWIGLU: case TEC_ACT_CLAMPED_SWIGLU: case TEC_ACT_GLU:
        return 1;
    }
    return 0;
}

static tec_status check_common(const char *what, int device, tec_activation act, int64_t rows, int64_t cols,
                               tec_dtype dt, float limit, float alpha, const tec_backend **b)
{
    tec_status st = tec_backend_check(device);
    if (st)
        return st;
    *b = tec_backend_for(device);
    if (!act_known(act))
        return tec_set_error(TEC_ERR_INVALID_ARG, "%s: unknown activation %d", what, (int)act);
    if (rows < 0 || cols <= 0)
        return tec_set_error(TEC_ERR_INVALID_ARG, "%s: rows=%lld cols=%lld", what, (long long)rows, (long long)cols);
    if (dt != TEC_F32 && dt != TEC_BF16 && dt != TEC_F16)
        return tec_set_error(TEC_ERR_INVALID_ARG, "%s: unknown dtype %d", what, (int)dt);
    if (act == TEC_ACT_CLAMPED_SWIGLU && !(limit > 0.0f && alpha > 0.0f))
        return tec_set_error(TEC_ERR_INVALID_ARG, "%s: clamped_swiglu needs limit > 0 and alpha > 0 (got %g, %g)",
                             what, (double)limit, (double)alpha);
    return TEC_OK;
}

tec_status tec_act_fwd(int device, const tec_act_fwd_args *a, void *stream)
{
    const tec_backend *b;
    tec_status st = check_common("activation", device, a->act, a->rows, a->cols, a->dtype, a->limit, a->alpha, &b);
    if (st) return st;
    if (a->rows && (!a->x || !a->y))
        return tec_set_error(TEC_ERR_INVALID_ARG, "activation: missing x or y pointer");
    if (a->rows == 0)
        return TEC_OK;
    return b->act_fwd(device, a, stream);
}

size_t tec_act_bwd_workspace_bytes(int device, tec_activation act, int64_t rows, int64_t cols)
{
    const tec_backend *b = tec_backend_for(device);
    if (!b || !act_known(act) || rows < 0 || cols <= 0)
        return 0;
    return b->act_bwd_workspace_bytes(device, act, rows, cols);
}

tec_status tec_act_bwd(int device, const tec_act_bwd_args *a, void *stream)
{
    const tec_backend *b;
    tec_status st = check_common("activation backward", device, a->act, a->rows, a->cols, a->dtype, a->limit,
                                 a->alpha, &b);
    if (st) return st;
    if (a->rows && (!a->x || !a->dy || !a->dx))
        return tec_set_error(TEC_ERR_INVALID_ARG, "activation backward: missing dy, x or dx pointer");
    if (a->dbias) {
        size_t need = b->act_bwd_workspace_bytes(device, a->act, a->rows, a->cols);
        if (a->workspace_bytes < need || (need && !a->workspace))
            return tec_set_error(TEC_ERR_INVALID_ARG, "activation backward: workspace of %zu bytes, %zu needed",
                                 a->workspace_bytes, need);
    }
    return b->act_bwd(device, a, stream);
}
