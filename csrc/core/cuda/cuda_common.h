/* cuda_common.h - shared pieces of the CUDA backend: the backend's own
 * per-thread error message, check macros (RETURN and GOTO forms) for the CUDA
 * runtime and cuBLASLt, device enter/leave, and float <-> dtype conversions.
 * Included by every file under csrc/core/cuda; exercised by all CUDA tests. */
#ifndef TEC_CUDA_COMMON_H
#define TEC_CUDA_COMMON_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "tec.h"

/* Symbols the library exports on purpose (the build hides everything else). */
#define TEC_CUDA_EXPORT extern "C" __attribute__((visibility("default")))

/* ------------------------------------------------------------ errors */

/* Record "file:line: message" as the calling thread's backend error and
 * return `st` (read back through tec_backend.last_error). */
tec_status tec_cuda_fail(tec_status st, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
const char *tec_cuda_last_error(void);

/* CUDA runtime calls. cudaGetLastError() resets the runtime's last-error
 * state so that a failure does not leak into the next, unrelated check. */
#define TEC_CUDA_CHECK(call)                                                              \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess) {                                                          \
            (void)cudaGetLastError();                                                     \
            return tec_cuda_fail(TEC_ERR_CUDA, __FILE__, __LINE__, "%s: %s (%s)", #call,  \
                                 cudaGetErrorString(e_), cudaGetErrorName(e_));           \
        }                                                                                 \
    } while (0)

#define TEC_CUDA_CHECK_GOTO(call, st, label)                                              \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess) {                                                          \
            (void)cudaGetLastError();                                                     \
            (st) = tec_cuda_fail(TEC_ERR_CUDA, __FILE__, __LINE__, "%s: %s (%s)", #call,  \
                                 cudaGetErrorString(e_), cudaGetErrorName(e_));           \
            goto label;                                                                   \
        }                                                                                 \
    } while (0)

/* After a kernel launch: a bad configuration shows up here. */
#define TEC_CUDA_LAUNCH_CHECK_GOTO(what, st, label)                                       \
    do {                                                                                  \
        cudaError_t e_ = cudaGetLastError();                                              \
        if (e_ != cudaSuccess) {                                                          \
            (st) = tec_cuda_fail(TEC_ERR_CUDA, __FILE__, __LINE__, "launch of %s: %s (%s)", \
                                 (what), cudaGetErrorString(e_), cudaGetErrorName(e_));   \
            goto label;                                                                   \
        }                                                                                 \
    } while (0)

/* cuBLASLt calls (declared in cublasLt.h, which only gemm.cu includes). */
#define TEC_CUBLAS_CHECK(call)                                                            \
    do {                                                                                  \
        cublasStatus_t s_ = (call);                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                \
            (void)cudaGetLastError();                                                     \
            return tec_cuda_fail(TEC_ERR_CUBLAS, __FILE__, __LINE__, "%s: %s (%s)", #call, \
                                 cublasLtGetStatusString(s_), cublasLtGetStatusName(s_)); \
        }                                                                                 \
    } while (0)

#define TEC_CUBLAS_CHECK_GOTO(call, st, label)                                            \
    do {                                                                                  \
        cublasStatus_t s_ = (call);                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                \
            (void)cudaGetLastError();                                                     \
            (st) = tec_cuda_fail(TEC_ERR_CUBLAS, __FILE__, __LINE__, "%s: %s (%s)", #call, \
                                 cublasLtGetStatusString(s_), cublasLtGetStatusName(s_)); \
            goto label;                                                                   \
        }                                                                                 \
    } while (0)

/* ------------------------------------------------------------ devices */

/* Make `device` current, remembering the previous one in *prev. */
tec_status tec_cuda_enter(int device, int *prev);
/* Restore the device saved by tec_cuda_enter (errors ignored: the call's
 * own status is what the caller reports). */
void tec_cuda_leave(int device, int prev);
/* Number of SMs of `device` (cached; 132 if it cannot be queried). */
int tec_cuda_sm_count(int device);

static inline size_t tec_cuda_dtype_size(tec_dtype dt) { return dt == TEC_F32 ? 4 : 2; }

/* Largest power of two (up to 256) dividing the address; 256 for NULL. */
static inline unsigned tec_cuda_ptr_align(const void *p)
{
    uintptr_t u = (uintptr_t)p;
    if (u == 0 || (u & 255u) == 0)
        return 256u;
    return (unsigned)(u & (~u + 1u));
}

/* ------------------------------------------------- backend operations */

/* Implemented in norm.cu and gemm.cu; gathered into the table by
 * cuda_backend.cu. Same contract as the tec_backend members. */
tec_status tec_cuda_norm_fwd(int device, const tec_norm_fwd_args *a, void *stream);
tec_status tec_cuda_norm_bwd(int device, const tec_norm_bwd_args *a, void *stream);
size_t tec_cuda_norm_bwd_workspace_bytes(int device, int64_t rows, int64_t cols);
tec_status tec_cuda_gemm(int device, const tec_gemm_args *a, void *stream);
#define TEC_CUDA_GEMM_WORKSPACE_BYTES ((size_t)32 << 20)

/* ------------------------------------------------------- conversions */

#ifdef __CUDACC__
__device__ __forceinline__ float tec_to_f32(float v) { return v; }
__device__ __forceinline__ float tec_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float tec_to_f32(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T tec_from_f32(float v);
template <> __device__ __forceinline__ float tec_from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 tec_from_f32<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half tec_from_f32<__half>(float v) { return __float2half_rn(v); }
#endif

#endif /* TEC_CUDA_COMMON_H */
