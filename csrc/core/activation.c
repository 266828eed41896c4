/* activation.c - argument checks and device dispatch of the activations
 * (activation.h): the CPU kernels directly, the CUDA ones through symbols of
 * the loaded CUDA backend library (so the backend table stays as it is).
 * Exercised by tests/test_activations.py. */
#include "activation.h"

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

static tec_status check_common(const char *what, tec_activation act, int64_t rows, int64_t cols, tec_dtype dt,
                               float limit, float alpha)
{
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

/* The CUDA backend's function `name`, or an error naming it. */
static tec_status cuda_fn(int device, const char *name, void **out)
{
    const tec_backend *b = tec_backend_for(device);
    *out = b ? tec_cuda_symbol(name) : NULL;
    if (!b)
        return tec_set_error(TEC_ERR_NOT_SUPPORTED, "device cuda:%d requested but the CUDA backend is not loaded", device);
    if (!*out)
        return tec_set_error(TEC_ERR_NOT_SUPPORTED, "the loaded CUDA backend has no %s (rebuild it)", name);
    return TEC_OK;
}

static tec_status from_cuda(int device, tec_status st)
{
    const tec_backend *b = tec_backend_for(device);
    if (st != TEC_OK && b && b->last_error)
        tec_set_error(st, "%s", b->last_error());
    return st;
}

tec_status tec_act_fwd(int device, const tec_act_fwd_args *a, void *stream)
{
    tec_status st = check_common("activation", a->act, a->rows, a->cols, a->dtype, a->limit, a->alpha);
    if (st) return st;
    if (a->rows && (!a->x || !a->y))
        return tec_set_error(TEC_ERR_INVALID_ARG, "activation: missing x or y pointer");
    if (a->rows == 0)
        return TEC_OK;
    if (device == TEC_DEVICE_CPU)
        return tec_cpu_act_fwd(a);
    void *fn;
    if ((st = cuda_fn(device, "tec_cuda_act_fwd", &fn)))
        return st;
    return from_cuda(device, ((tec_cuda_act_fwd_fn)fn)(device, a, stream));
}

size_t tec_act_bwd_workspace_bytes(int device, tec_activation act, int64_t rows, int64_t cols)
{
    if (!act_known(act) || rows < 0 || cols <= 0)
        return 0;
    if (device == TEC_DEVICE_CPU)
        return tec_cpu_act_bwd_workspace_bytes(act, rows, cols);
    void *fn;
    if (cuda_fn(device, "tec_cuda_act_bwd_workspace_bytes", &fn))
        return 0;
    return ((tec_cuda_act_ws_fn)fn)(act, rows, cols);
}

tec_status tec_act_bwd(int device, const tec_act_bwd_args *a, void *stream)
{
    tec_status st = check_common("activation backward", a->act, a->rows, a->cols, a->dtype, a->limit, a->alpha);
    if (st) return st;
    if (a->rows && (!a->x || !a->dy || !a->dx))
        return tec_set_error(TEC_ERR_INVALID_ARG, "activation backward: missing dy, x or dx pointer");
    void *fn = NULL;
    if (device != TEC_DEVICE_CPU && (st = cuda_fn(device, "tec_cuda_act_bwd", &fn)))
        return st;
    if (a->dbias) {
        size_t need = tec_act_bwd_workspace_bytes(device, a->act, a->rows, a->cols);
        if (a->workspace_bytes < need || (need && !a->workspace))
            return tec_set_error(TEC_ERR_INVALID_ARG, "activation backward: workspace of %zu bytes, %zu needed",
                                 a->workspace_bytes, need);
    }
    if (device == TEC_DEVICE_CPU)
        return tec_cpu_act_bwd(a);
    return from_cuda(device, ((tec_cuda_act_bwd_fn)fn)(device, a, stream));
}
