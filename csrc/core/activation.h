/* activation.h - the engine's MLP activations (forward and backward, with an
 * optional fused bias / bias gradient), the same functions as
 * TransformerEngine's. Pure C. CPU kernels in cpu/activation.c, CUDA kernels
 * in cuda/activation.cu, dispatch in activation.c; tests/test_activations.py.
 */
#ifndef TEC_ACTIVATION_H
#define TEC_ACTIVATION_H

#include "tec.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element-wise functions (low 4 bits) and their gated forms (+16).
 *   gelu   x * (0.5 + 0.5 tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (tanh form)
 *   relu   max(x, 0)          qgelu  x * sigmoid(1.702 x)
 *   srelu  max(x, 0)^2        silu   x * sigmoid(x)
 *   clamped silu (gpt-oss): m = min(x, limit); m * sigmoid(alpha m)
 *   sigmoid (glu only)
 * Gated: the input row is [a | g] of 2*cols values (TE's layout of fc1's
 * doubled output: the activation half first, the linear "gate" half
 * second); y = f(a) * g. clamped_swiglu uses
 * (clamp(g, -limit, limit) + glu_offset) as the gate. */
typedef enum {
    TEC_ACT_GELU = 0,
    TEC_ACT_RELU = 1,
    TEC_ACT_QGELU = 2,
    TEC_ACT_SRELU = 3,
    TEC_ACT_SILU = 4,
    TEC_ACT_GEGLU = 16,
    TEC_ACT_REGLU = 17,
    TEC_ACT_QGEGLU = 18,
    TEC_ACT_SREGLU = 19,
    TEC_ACT_SWIGLU = 20,
    TEC_ACT_CLAMPED_SWIGLU = 21,
    TEC_ACT_GLU = 22
} tec_activation;

#define TEC_ACT_GATED 16
static inline int tec_act_is_gated(tec_activation act) { return ((int)act & TEC_ACT_GATED) != 0; }
/* Width of the input row for `cols` outputs. */
static inline int64_t tec_act_in_cols(tec_activation act, int64_t cols)
{
    return tec_act_is_gated(act) ? 2 * cols : cols;
}

/* y[rows, cols] = act(x + bias). x is [rows, in_cols] (in_cols =
 * tec_act_in_cols(act, cols)), bias [in_cols] or NULL; x, bias and y share
 * `dtype`, all contiguous; arithmetic in float32. limit, alpha, glu_offset:
 * clamped_swiglu only (TE's defaults 7.0, 1.702, 1.0). */
typedef struct {
    tec_activation act;
    int64_t rows, cols;
    tec_dtype dtype;
    const void *x;
    const void *bias;
    void *y;
    float limit, alpha, glu_offset;
} tec_act_fwd_args;

/* dx[rows, in_cols] = d act(x) / dx * dy, with x the activation's input
 * (bias already added) and dy [rows, cols]. dbias, if not NULL, receives the
 * column sums of dx ([in_cols], dtype; float32 sums in a fixed order, so the
 * result is deterministic); it needs the workspace of
 * tec_act_bwd_workspace_bytes. */
typedef struct {
    tec_activation act;
    int64_t rows, cols;
    tec_dtype dtype;
    const void *dy;
    const void *x;
    void *dx;
    void *dbias;
    void *workspace;
    size_t workspace_bytes;
    float limit, alpha, glu_offset;
} tec_act_bwd_args;

/* Validate, then run on the device's backend (the CPU, or the loaded CUDA
 * library). `stream` as for every backend call. */
tec_status tec_act_fwd(int device, const tec_act_fwd_args *a, void *stream);
tec_status tec_act_bwd(int device, const tec_act_bwd_args *a, void *stream);
/* Workspace of a backward with dbias (0 if the backend is not loaded). */
size_t tec_act_bwd_workspace_bytes(int device, tec_activation act, int64_t rows, int64_t cols);

/* The backends' kernels, gathered into their tables (backend.h): CPU in
 * cpu/activation.c, CUDA in cuda/activation.cu. Same contracts, called after
 * the checks of activation.c. */
tec_status tec_cpu_act_fwd(int device, const tec_act_fwd_args *a, void *stream);
tec_status tec_cpu_act_bwd(int device, const tec_act_bwd_args *a, void *stream);
size_t tec_cpu_act_bwd_workspace_bytes(int device, tec_activation act, int64_t rows, int64_t cols);
tec_status tec_cuda_act_fwd(int device, const tec_act_fwd_args *a, void *stream);
tec_status tec_cuda_act_bwd(int device, const tec_act_bwd_args *a, void *stream);
size_t tec_cuda_act_bwd_workspace_bytes(int device, tec_activation act, int64_t rows, int64_t cols);

#ifdef __cplusplus
}
#endif
#endif /* TEC_ACTIVATION_H */
