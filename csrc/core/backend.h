/* backend.h - internal: the table a device backend implements (the CPU's is
 * linked in, csrc/core/cpu/cpu_backend.c; the CUDA library's is returned by
 * its one exported entry, csrc/core/cuda/cuda_backend.cu), and the hooks the
 * core hands that library when it loads it, so that both shared libraries
 * report errors through the one tec_set_error of csrc/core/error.c.
 * Used by csrc/core (tec.c dispatches through it) and csrc/core/cuda; never
 * by csrc/python. */
#ifndef TEC_BACKEND_H
#define TEC_BACKEND_H

#include "activation.h"
#include "tec.h"
#include "transport.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What one device kind implements. Entry points are called by tec.c after
 * its argument checks, with the same contracts as the tec.h functions;
 * failures return a status with the message set through tec_set_error (the
 * CUDA library: tec_core_hooks.set_error). */
/* The engine collectives (tec.h) of the CUDA library (nccl.cu). */
typedef struct tec_nccl_ops {
    tec_status (*unique_id)(unsigned char *id);
    tec_status (*create)(int device, const unsigned char *id, int nranks, int rank, double timeout_s,
                         const char *label, tec_nccl **out);
    tec_status (*run)(tec_nccl *c, int op, const void *send, void *recv, size_t count, tec_dtype dtype,
                      void *stream, int async, uint64_t *ticket);
    tec_status (*join)(tec_nccl *c, uint64_t ticket, void *stream);
    void (*close)(tec_nccl *c, int abort);
    void (*free)(tec_nccl *c);
    int (*version)(void);
} tec_nccl_ops;

/* FP8 operations (tec.h), called by fp8.c after its checks. */
typedef struct tec_fp8_ops {
    tec_status (*quantize)(int device, const tec_fp8_quantize_args *a, void *stream);
    tec_status (*amax)(int device, const void *x, int64_t n, tec_dtype dtype, float *amax, void *stream);
    tec_status (*scale_from_amax)(int device, const float *amax, float *scale, float *scale_inv, int64_t n,
                                  float fp8_max, int pow2, float epsilon, void *stream);
    tec_status (*gemm)(int device, const tec_fp8_gemm_args *a, void *stream);
    tec_status (*delayed_update)(int device, float *history, float *scale, float *scale_inv, int64_t len, int64_t n,
                                 float fp8_max, float divisor, int most_recent, void *stream);
} tec_fp8_ops;

/* Block-scaled FP8 (tec.h), called by fp8_block.c after its checks. */
typedef struct tec_fp8_block_ops {
    tec_status (*quantize)(int device, const tec_fp8_block_quantize_args *a, void *stream);
} tec_fp8_block_ops;

typedef struct tec_backend {
    int abi_version; /* TEC_BACKEND_ABI */
    const char *name;
    tec_status (*norm_fwd)(int device, const tec_norm_fwd_args *a, void *stream);
    tec_status (*norm_bwd)(int device, const tec_norm_bwd_args *a, void *stream);
    size_t (*norm_bwd_workspace_bytes)(int device, int64_t rows, int64_t cols);
    tec_status (*gemm)(int device, const tec_gemm_args *a, void *stream);
    size_t gemm_workspace_bytes;
    /* The communicator transport of this device kind (NULL: none). */
    const tec_transport_ops *transport;
    /* Activations (activation.h), called after activation.c's checks. */
    tec_status (*act_fwd)(int device, const tec_act_fwd_args *a, void *stream);
    tec_status (*act_bwd)(int device, const tec_act_bwd_args *a, void *stream);
    size_t (*act_bwd_workspace_bytes)(int device, tec_activation act, int64_t rows, int64_t cols);
    /* Engine collectives (NULL: none). */
    const tec_nccl_ops *nccl;
    /* FP8 quantization and GEMM (NULL: none). */
    const tec_fp8_ops *fp8;
    /* Block-scaled FP8 quantization (NULL: none); the FP8 GEMM takes the
     * block scale modes of tec_fp8_gemm_args. */
    const tec_fp8_block_ops *fp8_block;
    /* RoPE's apply (tec.h), called by rope.c after its checks. */
    tec_status (*rope)(int device, const tec_rope_args *a, void *stream);
} tec_backend;

#define TEC_BACKEND_ABI 14 /* 3: transport; hooks at load; no last_error. 4: activations. 5: nccl. 6: fp8.
                             * 7: fp8 delayed_update. 8: fp8_block; the FP8 GEMM's scale modes. 9: fp8
                             * quantize's dbias. 10: fp8 quantize's noop flag. 11: the FP8 GEMM's
                             * sm_margin. 12: fp8 quantize's fused activation. 13: the FP8 GEMM's FP8
                             * output; the transport's reduce of FP8 partials. 14: rope */

/* What the core hands the CUDA library on load (it keeps the pointer). */
typedef struct tec_core_hooks {
    int abi_version; /* TEC_BACKEND_ABI */
    /* The core's tec_set_error: record the calling thread's message, return s. */
    tec_status (*set_error)(tec_status s, const char *fmt, ...);
    unsigned gemm_policy; /* TEC_GEMM_* of tec.h */
} tec_core_hooks;

/* The CUDA library's one exported symbol (looked up by tec.c):
 *   const tec_backend *tec_cuda_backend_init(const tec_core_hooks *hooks);
 * NULL if the hooks' ABI is not the library's. */
#define TEC_CUDA_BACKEND_ENTRY "tec_cuda_backend_init"
typedef const tec_backend *(*tec_cuda_backend_init_fn)(const tec_core_hooks *hooks);

extern const tec_backend tec_cpu_backend;
extern const tec_fp8_ops tec_cpu_fp8; /* cpu/fp8.c */
extern const tec_fp8_block_ops tec_cpu_fp8_block; /* cpu/fp8_block.c */

/* The backend of `device` (TEC_DEVICE_CPU or a CUDA ordinal); NULL if its
 * library is not loaded. */
const tec_backend *tec_backend_for(int device);

#ifdef __cplusplus
}
#endif
#endif /* TEC_BACKEND_H */
