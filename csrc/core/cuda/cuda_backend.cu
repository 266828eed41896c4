/* cuda_backend.cu - the CUDA backend's table (tec_cuda_backend_get, the only
 * entry point tec.c looks up), its per-thread error message and the device
 * enter/leave helpers. Loaded by tec_load_cuda_backend; every CUDA test uses it. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "cuda_common.h"

/* ------------------------------------------------------------ errors */

static thread_local char tec_cuda_errbuf[1024];

tec_status tec_cuda_fail(tec_status st, const char *file, int line, const char *fmt, ...)
{
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    int n = snprintf(tec_cuda_errbuf, sizeof tec_cuda_errbuf, "%s:%d: ", base, line);
    if (n < 0 || (size_t)n >= sizeof tec_cuda_errbuf)
        n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tec_cuda_errbuf + n, sizeof tec_cuda_errbuf - (size_t)n, fmt, ap);
    va_end(ap);
    return st;
}

const char *tec_cuda_last_error(void) { return tec_cuda_errbuf; }

/* ------------------------------------------------------------ devices */

tec_status tec_cuda_enter(int device, int *prev)
{
    *prev = device;
    TEC_CUDA_CHECK(cudaGetDevice(prev));
    if (*prev != device)
        TEC_CUDA_CHECK(cudaSetDevice(device));
    return TEC_OK;
}

void tec_cuda_leave(int device, int prev)
{
    if (prev != device && cudaSetDevice(prev) != cudaSuccess)
        (void)cudaGetLastError();
}

#define TEC_CUDA_MAX_DEVICES 64
static int tec_cuda_sms[TEC_CUDA_MAX_DEVICES]; /* 0: not asked yet */

int tec_cuda_sm_count(int device)
{
    if (device < 0 || device >= TEC_CUDA_MAX_DEVICES)
        return 132;
    int n = __atomic_load_n(&tec_cuda_sms[device], __ATOMIC_RELAXED);
    if (n > 0)
        return n;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) {
        (void)cudaGetLastError();
        n = 132; /* deterministic default: an H100/H200 */
    }
    __atomic_store_n(&tec_cuda_sms[device], n, __ATOMIC_RELAXED);
    return n;
}

/* ------------------------------------------------------------- table */

static const tec_backend tec_cuda_backend = {
    TEC_BACKEND_ABI,                    /* abi_version */
    "cuda",                             /* name */
    tec_cuda_norm_fwd,                  /* norm_fwd */
    tec_cuda_norm_bwd,                  /* norm_bwd */
    tec_cuda_norm_bwd_workspace_bytes,  /* norm_bwd_workspace_bytes */
    tec_cuda_gemm,                      /* gemm */
    TEC_CUDA_GEMM_WORKSPACE_BYTES,      /* gemm_workspace_bytes */
    tec_cuda_last_error,                /* last_error */
};

TEC_CUDA_EXPORT const tec_backend *tec_cuda_backend_get(void) { return &tec_cuda_backend; }
