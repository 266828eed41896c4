/* activation.h - internal: the backends' activation kernels. The
 * activations' contract (tec_activation, tec_act_fwd_args, tec_act_bwd_args,
 * tec_act_fwd/bwd) is public, in tec.h. CPU kernels in cpu/activation.c,
 * CUDA kernels in cuda/activation.cu, checks and dispatch in activation.c;
 * tests/test_activations.py. Never included by csrc/python.
 */
#ifndef TEC_ACTIVATION_H
#define TEC_ACTIVATION_H

#include "tec.h"

#ifdef __cplusplus
extern "C" {
#endif

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
