/* tec.h - the public C interface of the transformer_engine_c engine.
 *
 * Pure C (never includes Python.h). Status codes, non-owning argument
 * structs, the backend interface every device implements, and the
 * communicator / overlap schedules. Exercised through the CPython module
 * (csrc/python) by the tests under tests/.
 */
#ifndef TEC_H
#define TEC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- status */

typedef enum {
    TEC_OK = 0,
    TEC_ERR_INVALID_ARG,    /* bad shape, dtype, pointer, size: a caller bug */
    TEC_ERR_NOT_SUPPORTED,  /* valid request this build/backend cannot do */
    TEC_ERR_NO_MEMORY,
    TEC_ERR_SYSTEM,         /* errno-carrying OS call failed */
    TEC_ERR_CUDA,           /* CUDA runtime error */
    TEC_ERR_CUBLAS,         /* cuBLAS(Lt) error */
    TEC_ERR_NCCL,
    TEC_ERR_TIMEOUT,        /* a wait on a peer ran past its deadline */
    TEC_ERR_CLOSED,         /* object used after close() */
    TEC_ERR_INTERNAL
} tec_status;

const char *tec_status_string(tec_status s);

/* The message of the last failure on the calling thread ("" if none). Every
 * function that returns a status other than TEC_OK sets it. */
const char *tec_last_error(void);

/* Record a failure message for the calling thread and return `s`. */
tec_status tec_set_error(tec_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ------------------------------------------------------------------ types */

typedef enum { TEC_F32 = 0, TEC_BF16 = 1, TEC_F16 = 2 } tec_dtype;

size_t tec_dtype_size(tec_dtype dt);

/* Device: -1 is the CPU, >= 0 a CUDA device ordinal. */
#define TEC_DEVICE_CPU (-1)

/* -------------------------------------------------------- normalisation */

/* LayerNorm (beta != NULL, mu != NULL) or RMSNorm (beta == NULL, mu == NULL)
 * over the last dimension of a row-major [rows, cols] matrix.
 * x, gamma, beta, y share `dtype`; mu and rsigma are float32 [rows].
 * y may point anywhere (e.g. into a communication buffer). With
 * zero_centered_gamma the scale applied is (1 + gamma). */
typedef struct {
    int64_t rows, cols;
    tec_dtype dtype;
    const void *x;
    const void *gamma;
    const void *beta;
    void *y;
    float *mu;
    float *rsigma;
    float eps;
    int zero_centered_gamma;
} tec_norm_fwd_args;

/* Backward of the above: dx [rows, cols] (dtype), dgamma and dbeta [cols]
 * (dtype, overwritten, not accumulated). dbeta/mu NULL for RMSNorm.
 * workspace: at least tec_norm_bwd_workspace_bytes() bytes on the device. */
typedef struct {
    int64_t rows, cols;
    tec_dtype dtype;
    const void *dy;
    const void *x;
    const float *mu;
    const float *rsigma;
    const void *gamma;
    void *dx;
    void *dgamma;
    void *dbeta;
    int zero_centered_gamma;
    void *workspace;
    size_t workspace_bytes;
} tec_norm_bwd_args;

/* ------------------------------------------------------------------ GEMM */

/* Row-major C[m, n] (+)= op(A)[m, k] @ op(B)[k, n] (+ bias).
 *   A is stored [m, k] (lda >= k), or [k, m] when transa (lda >= m).
 *   B is stored [k, n] (ldb >= n), or [n, k] when transb (ldb >= k).
 *   C is stored [m, n] (ldc >= n), dtype c_dtype (ab_dtype or float32).
 *   bias: [n] of ab_dtype added to every row (not with accumulate).
 *   bias_grad: [m] of ab_dtype, written with the row sums of op(A) over k
 *     (the wgrad layout gives the bias gradient this way).
 *   accumulate: C += result instead of C = result.
 * Arithmetic and accumulation in float32.
 * The three linear-layer layouts:
 *   fprop  Y[t,o]  = X[t,i]  @ W[o,i]^T   transa=0 transb=1
 *   dgrad  dX[t,i] = dY[t,o] @ W[o,i]     transa=0 transb=0
 *   wgrad  dW[o,i] = dY[t,o]^T @ X[t,i]   transa=1 transb=0 (bias_grad) */
typedef struct {
    int transa, transb;
    int64_t m, n, k;
    const void *a; int64_t lda;
    const void *b; int64_t ldb;
    void *c; int64_t ldc;
    tec_dtype ab_dtype, c_dtype;
    const void *bias;
    void *bias_grad;
    int accumulate;
    void *workspace;
    size_t workspace_bytes;
} tec_gemm_args;

/* --------------------------------------------------------------- backend */

/* What one device kind implements. The CPU backend is linked in; the CUDA
 * backend lives in a separate shared library loaded on first use, so the
 * CPU build never depends on CUDA. `stream` is a cudaStream_t for CUDA
 * (work is enqueued on it, nothing waits), ignored on the CPU (work is done
 * when the call returns). */
typedef struct tec_backend {
    int abi_version;
    const char *name;
    tec_status (*norm_fwd)(int device, const tec_norm_fwd_args *a, void *stream);
    tec_status (*norm_bwd)(int device, const tec_norm_bwd_args *a, void *stream);
    size_t (*norm_bwd_workspace_bytes)(int device, int64_t rows, int64_t cols);
    tec_status (*gemm)(int device, const tec_gemm_args *a, void *stream);
    size_t gemm_workspace_bytes;
    /* The calling thread's last error inside the backend library. */
    const char *(*last_error)(void);
} tec_backend;

#define TEC_BACKEND_ABI 1

extern const tec_backend tec_cpu_backend;

/* Load the CUDA backend from a shared library (once; later calls return
 * TEC_OK). Symbol: `tec_cuda_backend_get`, returning const tec_backend *. */
tec_status tec_load_cuda_backend(const char *path);
const tec_backend *tec_backend_for(int device); /* NULL if not loaded */
/* Another symbol of the loaded CUDA backend library (NULL if not loaded or
 * absent): lets other parts (the CUDA transport) add tables of their own. */
void *tec_cuda_symbol(const char *name);

/* Device-dispatching entry points (validate, then call the backend). */
tec_status tec_norm_fwd(int device, const tec_norm_fwd_args *a, void *stream);
tec_status tec_norm_bwd(int device, const tec_norm_bwd_args *a, void *stream);
size_t tec_norm_bwd_workspace_bytes(int device, int64_t rows, int64_t cols);
tec_status tec_gemm(int device, const tec_gemm_args *a, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* TEC_H */
