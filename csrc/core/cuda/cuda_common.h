/* cuda_common.h - what every .cu file of the CUDA library shares: error
 * reporting through the core's one tec_set_error (handed over on load,
 * backend.h), the check macros (RETURN and GOTO forms, CUDA runtime and
 * cuBLASLt), the device scope, the SM count, float <-> dtype conversions,
 * the 16-byte vector type and the backend entry points. Included by every
 * file under csrc/core/cuda (and tests/cuda/transport_test.cu); exercised by
 * all CUDA tests. Launch style: kernel<<<grid, block, 0, stream>>>(...)
 * followed by TEC_CUDA_LAUNCH_CHECK[_GOTO]. */
#ifndef TEC_CUDA_COMMON_H
#define TEC_CUDA_COMMON_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "backend.h"
#include "transport.h"

/* Symbols the library exports on purpose (the build hides everything else). */
#define TEC_CUDA_EXPORT extern "C" __attribute__((visibility("default")))

/* ------------------------------------------------------------ errors */

/* Keep the core's hooks (tec_cuda_backend_init does, on load; the transport
 * test does it itself). Until then failures return their status without a
 * message. */
void tec_cuda_set_hooks(const tec_core_hooks *hooks);
/* The hooks' gemm_policy (0 before tec_cuda_set_hooks). */
unsigned tec_cuda_gemm_policy(void);

/* Record "file:line: message" through the core's tec_set_error and return
 * `st`. */
tec_status tec_cuda_fail(tec_status st, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
#define TEC_CUDA_FAIL(st, ...) tec_cuda_fail((st), __FILE__, __LINE__, __VA_ARGS__)
/* Record `msg` as it is (a message written for the user by the same
 * formatter on every device, e.g. tec_format_wait_error) and return `st`. */
tec_status tec_cuda_report(tec_status st, const char *msg);

/* The status of a CUDA runtime error: out of memory is TEC_ERR_NO_MEMORY
 * (as everywhere in the engine), anything else TEC_ERR_CUDA. */
static inline tec_status tec_cuda_status(cudaError_t e)
{
    return e == cudaErrorMemoryAllocation ? TEC_ERR_NO_MEMORY : TEC_ERR_CUDA;
}

/* CUDA runtime calls. cudaGetLastError() resets the runtime's last-error
 * state so that a failure does not leak into the next, unrelated check. */
#define TEC_CUDA_CHECK(call)                                                                  \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            (void)cudaGetLastError();                                                         \
            return TEC_CUDA_FAIL(tec_cuda_status(e_), "%s: %s (%s)", #call,                   \
                                 cudaGetErrorString(e_), cudaGetErrorName(e_));               \
        }                                                                                     \
    } while (0)

#define TEC_CUDA_CHECK_GOTO(call, st, label)                                                  \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            (void)cudaGetLastError();                                                         \
            (st) = TEC_CUDA_FAIL(tec_cuda_status(e_), "%s: %s (%s)", #call,                   \
                                 cudaGetErrorString(e_), cudaGetErrorName(e_));               \
            goto label;                                                                       \
        }                                                                                     \
    } while (0)

/* After a kernel launch: a bad configuration shows up here. */
#define TEC_CUDA_LAUNCH_CHECK(what)                                                           \
    do {                                                                                      \
        cudaError_t e_ = cudaGetLastError();                                                  \
        if (e_ != cudaSuccess)                                                                \
            return TEC_CUDA_FAIL(tec_cuda_status(e_), "launch of %s: %s (%s)", (what),        \
                                 cudaGetErrorString(e_), cudaGetErrorName(e_));               \
    } while (0)

#define TEC_CUDA_LAUNCH_CHECK_GOTO(what, st, label)                                           \
    do {                                                                                      \
        cudaError_t e_ = cudaGetLastError();                                                  \
        if (e_ != cudaSuccess) {                                                              \
            (st) = TEC_CUDA_FAIL(tec_cuda_status(e_), "launch of %s: %s (%s)", (what),        \
                                 cudaGetErrorString(e_), cudaGetErrorName(e_));               \
            goto label;                                                                       \
        }                                                                                     \
    } while (0)

/* cuBLASLt calls (declared in cublasLt.h, which only the GEMM files
 * include). An allocation failure is TEC_ERR_NO_MEMORY. */
#define TEC_CUBLAS_STATUS(s) ((s) == CUBLAS_STATUS_ALLOC_FAILED ? TEC_ERR_NO_MEMORY : TEC_ERR_CUBLAS)

#define TEC_CUBLAS_CHECK(call)                                                                \
    do {                                                                                      \
        cublasStatus_t s_ = (call);                                                           \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                    \
            (void)cudaGetLastError();                                                         \
            return TEC_CUDA_FAIL(TEC_CUBLAS_STATUS(s_), "%s: %s (%s)", #call,                 \
                                 cublasLtGetStatusString(s_), cublasLtGetStatusName(s_));     \
        }                                                                                     \
    } while (0)

#define TEC_CUBLAS_CHECK_GOTO(call, st, label)                                                \
    do {                                                                                      \
        cublasStatus_t s_ = (call);                                                           \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                    \
            (void)cudaGetLastError();                                                         \
            (st) = TEC_CUDA_FAIL(TEC_CUBLAS_STATUS(s_), "%s: %s (%s)", #call,                 \
                                 cublasLtGetStatusString(s_), cublasLtGetStatusName(s_));     \
            goto label;                                                                       \
        }                                                                                     \
    } while (0)

/* A caller's bad argument: TEC_ERR_INVALID_ARG with the message. */
#define TEC_CUDA_REQUIRE(cond, ...)                                                           \
    do {                                                                                      \
        if (!(cond))                                                                          \
            return TEC_CUDA_FAIL(TEC_ERR_INVALID_ARG, __VA_ARGS__);                           \
    } while (0)

/* A call whose failure changes nothing (cleanup): clear the sticky error. */
static inline void tec_cuda_ignore(cudaError_t e)
{
    if (e != cudaSuccess)
        (void)cudaGetLastError();
}

/* ------------------------------------------------------------ devices */

/* Make `device` current for the scope, restore the caller's on exit:
 *   TEC_CUDA_ENTER(device);   (returns the failure from the function) */
class tec_cuda_device_scope {
  public:
    explicit tec_cuda_device_scope(int device) : device_(device)
    {
        err_ = cudaGetDevice(&prev_);
        if (err_ == cudaSuccess && prev_ != device)
            err_ = cudaSetDevice(device);
        if (err_ != cudaSuccess) {
            (void)cudaGetLastError();
            prev_ = device;
        }
    }
    ~tec_cuda_device_scope()
    {
        if (prev_ != device_)
            tec_cuda_ignore(cudaSetDevice(prev_));
    }
    cudaError_t error() const { return err_; }
    tec_cuda_device_scope(const tec_cuda_device_scope &) = delete;
    tec_cuda_device_scope &operator=(const tec_cuda_device_scope &) = delete;

  private:
    int device_, prev_ = -1;
    cudaError_t err_;
};

#define TEC_CUDA_ENTER(device)                                                                \
    tec_cuda_device_scope tec_scope_(device);                                                 \
    if (tec_scope_.error() != cudaSuccess)                                                    \
    return TEC_CUDA_FAIL(tec_cuda_status(tec_scope_.error()), "cannot make cuda:%d current: %s (%s)", \
                         (device), cudaGetErrorString(tec_scope_.error()),                    \
                         cudaGetErrorName(tec_scope_.error()))

/* Number of SMs of `device` (cudaDevAttrMultiProcessorCount, cached). */
tec_status tec_cuda_sm_count(int device, int *out);

static inline size_t tec_cuda_dtype_size(tec_dtype dt) { return dt == TEC_F32 ? 4 : 2; }

/* Largest power of two (up to 256) dividing the address; 256 for NULL. */
static inline unsigned tec_cuda_ptr_align(const void *p)
{
    uintptr_t u = (uintptr_t)p;
    if (u == 0 || (u & 255u) == 0)
        return 256u;
    return (unsigned)(u & (~u + 1u));
}

static inline bool tec_cuda_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* ------------------------------------------------- backend operations */

/* Implemented in norm.cu and gemm.cu, gathered into the table with the
 * transport (cuda_transport.cu) by cuda_backend.cu. Same contract as the
 * tec_backend members. */
tec_status tec_cuda_norm_fwd(int device, const tec_norm_fwd_args *a, void *stream);
tec_status tec_cuda_norm_bwd(int device, const tec_norm_bwd_args *a, void *stream);
size_t tec_cuda_norm_bwd_workspace_bytes(int device, int64_t rows, int64_t cols);
tec_status tec_cuda_gemm(int device, const tec_gemm_args *a, void *stream);
#define TEC_CUDA_GEMM_WORKSPACE_BYTES ((size_t)32 << 20)
/* After cuBLASLt's part of a GEMM workspace: the FP8 GEMM's amax of an FP8
 * output, before it is folded into the caller's (fp8.cu). */
#define TEC_CUDA_GEMM_SCRATCH_BYTES ((size_t)256)
extern const tec_transport_ops tec_cuda_transport;
extern const tec_nccl_ops tec_cuda_nccl; /* nccl.cu */
extern const tec_fp8_ops tec_cuda_fp8;   /* fp8.cu */
tec_status tec_cuda_fp8_gemm(int device, const tec_fp8_gemm_args *g, void *stream); /* fp8_gemm.cu */
extern const tec_fp8_block_ops tec_cuda_fp8_block; /* fp8_block.cu */

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

/* ------------------------------------------------------------ vectors */

/* VEC elements moved by one load/store (16 bytes on the vector paths).
 * tec_vget reads element e as float; tec_vpack builds a vector from VEC
 * floats. */
template <typename T, int VEC> struct alignas(sizeof(T) * VEC) tec_vec {
    T e[VEC];
};
template <typename T, int VEC> __device__ __forceinline__ float tec_vget(const tec_vec<T, VEC> &v, int e)
{
    return tec_to_f32(v.e[e]);
}
template <typename T, int VEC> __device__ __forceinline__ tec_vec<T, VEC> tec_vpack(const float (&f)[VEC])
{
    tec_vec<T, VEC> v;
#pragma unroll
    for (int e = 0; e < VEC; e++)
        v.e[e] = tec_from_f32<T>(f[e]);
    return v;
}

/* 16-bit types, 16 bytes: kept as four packed 32-bit words, so that a lane
 * holding several vectors spends 4 registers on each (not 8). */
template <> struct alignas(16) tec_vec<__nv_bfloat16, 8> {
    uint32_t w[4];
};
template <> struct alignas(16) tec_vec<__half, 8> {
    uint32_t w[4];
};
__device__ __forceinline__ float tec_vget(const tec_vec<__nv_bfloat16, 8> &v, int e)
{
    const uint32_t w = v.w[e >> 1];
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
}
__device__ __forceinline__ float tec_vget(const tec_vec<__half, 8> &v, int e)
{
    const uint32_t w = v.w[e >> 1];
    return __half2float(__ushort_as_half((unsigned short)((e & 1) ? (w >> 16) : (w & 0xffffu))));
}
template <> __device__ __forceinline__ tec_vec<__nv_bfloat16, 8> tec_vpack<__nv_bfloat16, 8>(const float (&f)[8])
{
    tec_vec<__nv_bfloat16, 8> v;
#pragma unroll
    for (int i = 0; i < 4; i++)
        v.w[i] = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i])) |
                 ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i + 1])) << 16);
    return v;
}
template <> __device__ __forceinline__ tec_vec<__half, 8> tec_vpack<__half, 8>(const float (&f)[8])
{
    tec_vec<__half, 8> v;
#pragma unroll
    for (int i = 0; i < 4; i++)
        v.w[i] = (uint32_t)__half_as_ushort(__float2half_rn(f[2 * i])) |
                 ((uint32_t)__half_as_ushort(__float2half_rn(f[2 * i + 1])) << 16);
    return v;
}
#endif /* __CUDACC__ */

#endif /* TEC_CUDA_COMMON_H */
