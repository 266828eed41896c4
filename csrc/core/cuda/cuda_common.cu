/* cuda_common.cu - the CUDA library's link to the core's error channel (the
 * hooks handed over on load) and the per-device SM count; the declarations
 * and check macros are in cuda_common.h. Linked into libtec_cuda.so and into
 * tests/cuda/transport_test.cu; every CUDA test exercises it. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "cuda_common.h"

/* ------------------------------------------------------------ errors */

static const tec_core_hooks *g_hooks; /* set once, before any other call */

void tec_cuda_set_hooks(const tec_core_hooks *hooks) { __atomic_store_n(&g_hooks, hooks, __ATOMIC_RELEASE); }

unsigned tec_cuda_gemm_policy(void)
{
    const tec_core_hooks *h = __atomic_load_n(&g_hooks, __ATOMIC_ACQUIRE);
    return h ? h->gemm_policy : 0u;
}

tec_status tec_cuda_fail(tec_status st, const char *file, int line, const char *fmt, ...)
{
    const tec_core_hooks *h = __atomic_load_n(&g_hooks, __ATOMIC_ACQUIRE);
    if (!h)
        return st;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *base = strrchr(file, '/');
    return h->set_error(st, "%s:%d: %s", base ? base + 1 : file, line, msg);
}

tec_status tec_cuda_report(tec_status st, const char *msg)
{
    const tec_core_hooks *h = __atomic_load_n(&g_hooks, __ATOMIC_ACQUIRE);
    return h ? h->set_error(st, "%s", msg) : st;
}

/* ------------------------------------------------------------ devices */

#define TEC_CUDA_MAX_DEVICES 64
static int g_sms[TEC_CUDA_MAX_DEVICES]; /* 0: not asked yet */

tec_status tec_cuda_sm_count(int device, int *out)
{
    *out = 0;
    int n = device >= 0 && device < TEC_CUDA_MAX_DEVICES ? __atomic_load_n(&g_sms[device], __ATOMIC_RELAXED) : 0;
    if (n <= 0) {
        TEC_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
        if (n <= 0)
            return TEC_CUDA_FAIL(TEC_ERR_CUDA, "cuda:%d reports %d multiprocessors", device, n);
        if (device >= 0 && device < TEC_CUDA_MAX_DEVICES)
            __atomic_store_n(&g_sms[device], n, __ATOMIC_RELAXED);
    }
    *out = n;
    return TEC_OK;
}
