/* cuda_backend.cu - the CUDA library's one exported entry: it keeps the
 * core's hooks (errors, GEMM policy) and returns the backend table (norm,
 * GEMM, the CUDA IPC transport, the engine collectives, FP8 and block-scaled FP8, RoPE). Loaded by tec_load_cuda_backend; every
 * CUDA test uses it. */
#include "cuda_common.h"
#include "rope.h"

static const tec_backend tec_cuda_backend = {
    TEC_BACKEND_ABI,                    /* abi_version */
    "cuda",                             /* name */
    tec_cuda_norm_fwd,                  /* norm_fwd */
    tec_cuda_norm_bwd,                  /* norm_bwd */
    tec_cuda_norm_bwd_workspace_bytes,  /* norm_bwd_workspace_bytes */
    tec_cuda_gemm,                      /* gemm */
    TEC_CUDA_GEMM_WORKSPACE_BYTES + TEC_CUDA_GEMM_SCRATCH_BYTES, /* gemm_workspace_bytes */
    &tec_cuda_transport,                /* transport */
    tec_cuda_act_fwd,                   /* act_fwd (activation.cu) */
    tec_cuda_act_bwd,                   /* act_bwd */
    tec_cuda_act_bwd_workspace_bytes,   /* act_bwd_workspace_bytes */
    &tec_cuda_nccl,                     /* nccl (nccl.cu) */
    &tec_cuda_fp8,                      /* fp8 (fp8.cu) */
    &tec_cuda_fp8_block,                /* fp8_block (fp8_block.cu) */
    tec_cuda_rope,                      /* rope (rope.cu) */
};

TEC_CUDA_EXPORT const tec_backend *tec_cuda_backend_init(const tec_core_hooks *hooks)
{
    if (!hooks || hooks->abi_version != TEC_BACKEND_ABI || !hooks->set_error)
        return NULL;
    tec_cuda_set_hooks(hooks);
    return &tec_cuda_backend;
}
