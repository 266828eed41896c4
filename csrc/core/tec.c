/* tec.c - argument checks and device dispatch for the engine's operations,
 * and loading the CUDA backend library (handing it the core's error hooks).
 * Exercised by every test that calls into the engine (tests/test_kernels.py
 * covers the checks). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "backend.h"
#include "checked.h"
#include "error.h"

size_t tec_dtype_size(tec_dtype dt)
{
    switch (dt) {
    case TEC_F32: return 4;
    case TEC_BF16: return 2;
    case TEC_F16: return 2;
    }
    return 0;
}

/* ------------------------------------------------------- backend loading */

static const tec_backend *cuda_backend;
static void *cuda_handle;
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

/* Given to the CUDA library: it reports through these (one error channel). */
static tec_core_hooks core_hooks = {TEC_BACKEND_ABI, tec_set_error, 0};

tec_status tec_load_cuda_backend(const char *path, unsigned gemm_policy)
{
    tec_status st = TEC_OK;
    pthread_mutex_lock(&load_lock);
    if (cuda_backend)
        goto out;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        st = tec_set_error(TEC_ERR_NOT_SUPPORTED, "cannot load CUDA backend %s: %s", path, dlerror());
        goto out;
    }
    tec_cuda_backend_init_fn init = (tec_cuda_backend_init_fn)dlsym(h, TEC_CUDA_BACKEND_ENTRY);
    core_hooks.gemm_policy = gemm_policy;
    const tec_backend *b = init ? init(&core_hooks) : NULL;
    if (!b || b->abi_version != TEC_BACKEND_ABI) {
        dlclose(h);
        st = tec_set_error(TEC_ERR_NOT_SUPPORTED, "%s is not a CUDA backend of ABI %d", path, TEC_BACKEND_ABI);
        goto out;
    }
    cuda_handle = h; /* stays open for the life of the process */
    cuda_backend = b;
out:
    pthread_mutex_unlock(&load_lock);
    return st;
}

const tec_backend *tec_backend_for(int device)
{
    return device == TEC_DEVICE_CPU ? &tec_cpu_backend : cuda_backend;
}

static tec_status get_backend(int device, const tec_backend **out)
{
    *out = tec_backend_for(device);
    if (!*out)
        return tec_set_error(TEC_ERR_NOT_SUPPORTED,
                             "device cuda:%d requested but the CUDA backend is not loaded", device);
    return TEC_OK;
}

tec_status tec_backend_check(int device)
{
    const tec_backend *b;
    return get_backend(device, &b);
}

size_t tec_gemm_workspace_bytes(int device)
{
    const tec_backend *b = tec_backend_for(device);
    return b ? b->gemm_workspace_bytes : 0;
}

static int dtype_ok(tec_dtype dt) { return dt == TEC_F32 || dt == TEC_BF16 || dt == TEC_F16; }

/* A [rows, cols] float32 matrix (the widest the backends compute in) must
 * have a byte count that fits: the backends index it with int64 products. */
static tec_status check_norm_size(const char *op, int64_t rows, int64_t cols)
{
    size_t bytes;
    if (!tec_mul3(rows, cols, 8, &bytes))
        return tec_set_error(TEC_ERR_INVALID_ARG, "%s: rows=%lld x cols=%lld is too large (byte count overflows)",
                             op, (long long)rows, (long long)cols);
    return TEC_OK;
}

/* ------------------------------------------------------------ operations */

tec_status tec_norm_fwd(int device, const tec_norm_fwd_args *a, void *stream)
{
    const tec_backend *b;
    tec_status st = get_backend(device, &b);
    if (st) return st;
    if (a->rows < 0 || a->cols <= 0)
        return tec_set_error(TEC_ERR_INVALID_ARG, "norm: rows=%lld cols=%lld", (long long)a->rows, (long long)a->cols);
    if (!dtype_ok(a->dtype))
        return tec_set_error(TEC_ERR_INVALID_ARG, "norm: unknown dtype %d", (int)a->dtype);
    if ((st = check_norm_size("norm", a->rows, a->cols)))
        return st;
    if (!a->gamma || !a->rsigma || (a->rows && (!a->x || !a->y)) || (!a->beta) != (!a->mu))
        return tec_set_error(TEC_ERR_INVALID_ARG, "norm: missing pointer (x, y, gamma, rsigma; beta and mu together)");
    if (!(a->eps >= 0.0f))
        return tec_set_error(TEC_ERR_INVALID_ARG, "norm: eps must be >= 0");
    if (a->rows == 0)
        return TEC_OK;
    return b->norm_fwd(device, a, stream);
}

size_t tec_norm_bwd_workspace_bytes(int device, int64_t rows, int64_t cols)
{
    const tec_backend *b = tec_backend_for(device);
    size_t bytes;
    if (rows < 0 || cols <= 0 || !tec_mul3(rows, cols, 8, &bytes))
        return SIZE_MAX; /* no workspace can be this large: tec_norm_bwd refuses the sizes */
    return b ? b->norm_bwd_workspace_bytes(device, rows, cols) : 0;
}

tec_status tec_norm_bwd(int device, const tec_norm_bwd_args *a, void *stream)
{
    const tec_backend *b;
    tec_status st = get_backend(device, &b);
    if (st) return st;
    if (a->rows < 0 || a->cols <= 0)
        return tec_set_error(TEC_ERR_INVALID_ARG, "norm backward: rows=%lld cols=%lld", (long long)a->rows, (long long)a->cols);
    if (!dtype_ok(a->dtype))
        return tec_set_error(TEC_ERR_INVALID_ARG, "norm backward: unknown dtype %d", (int)a->dtype);
    if ((st = check_norm_size("norm backward", a->rows, a->cols)))
        return st;
    if (!a->gamma || !a->rsigma || !a->dgamma || (a->rows && (!a->x || !a->dy || !a->dx)) || (!a->dbeta) != (!a->mu))
        return tec_set_error(TEC_ERR_INVALID_ARG, "norm backward: missing pointer");
    size_t need = b->norm_bwd_workspace_bytes(device, a->rows, a->cols);
    if (a->workspace_bytes < need || (need && !a->workspace))
        return tec_set_error(TEC_ERR_INVALID_ARG, "norm backward: workspace of %zu bytes, %zu needed",
                             a->workspace_bytes, need);
    return b->norm_bwd(device, a, stream);
}

tec_status tec_gemm(int device, const tec_gemm_args *a, void *stream)
{
    const tec_backend *b;
    tec_status st = get_backend(device, &b);
    if (st) return st;
    if (a->m < 0 || a->n < 0 || a->k < 0)
        return tec_set_error(TEC_ERR_INVALID_ARG, "gemm: negative size m=%lld n=%lld k=%lld",
                             (long long)a->m, (long long)a->n, (long long)a->k);
    if (!dtype_ok(a->ab_dtype) || (a->c_dtype != a->ab_dtype && a->c_dtype != TEC_F32))
        return tec_set_error(TEC_ERR_INVALID_ARG, "gemm: C must have the dtype of A and B, or float32");
    int64_t a_cols = a->transa ? a->m : a->k, b_cols = a->transb ? a->k : a->n;
    if (a->lda < (a_cols > 1 ? a_cols : 1) || a->ldb < (b_cols > 1 ? b_cols : 1) || a->ldc < (a->n > 1 ? a->n : 1))
        return tec_set_error(TEC_ERR_INVALID_ARG, "gemm: leading dimension too small (lda=%lld ldb=%lld ldc=%lld)",
                             (long long)a->lda, (long long)a->ldb, (long long)a->ldc);
    /* Every operand's extent (and the float32 copies the CPU backend makes)
     * must have a byte count that fits, or its addressing would wrap. */
    size_t bytes;
    if (!tec_matrix_bytes(a->transa ? a->k : a->m, a->lda, 4, &bytes) ||
        !tec_matrix_bytes(a->transb ? a->n : a->k, a->ldb, 4, &bytes) || !tec_matrix_bytes(a->m, a->ldc, 4, &bytes) ||
        !tec_mul3(a->m, a->k, 4, &bytes) || !tec_mul3(a->k, a->n, 4, &bytes) || !tec_mul3(a->m, a->n, 4, &bytes))
        return tec_set_error(TEC_ERR_INVALID_ARG,
                             "gemm: sizes too large (byte count overflows): m=%lld n=%lld k=%lld lda=%lld ldb=%lld ldc=%lld",
                             (long long)a->m, (long long)a->n, (long long)a->k, (long long)a->lda, (long long)a->ldb,
                             (long long)a->ldc);
    if (a->transa != 0 && a->transa != 1)
        return tec_set_error(TEC_ERR_INVALID_ARG, "gemm: transa must be 0 or 1, got %d", a->transa);
    if (a->transb != 0 && a->transb != 1)
        return tec_set_error(TEC_ERR_INVALID_ARG, "gemm: transb must be 0 or 1, got %d", a->transb);
    if (a->bias && a->accumulate)
        return tec_set_error(TEC_ERR_INVALID_ARG, "gemm: bias with accumulate is not supported");
    if (a->m == 0 || a->n == 0)
        return TEC_OK;
    if ((a->k && (!a->a || !a->b)) || !a->c)
        return tec_set_error(TEC_ERR_INVALID_ARG, "gemm: missing A, B or C pointer");
    if (a->workspace_bytes < b->gemm_workspace_bytes || (b->gemm_workspace_bytes && !a->workspace))
        return tec_set_error(TEC_ERR_INVALID_ARG, "gemm: workspace of %zu bytes, %zu needed",
                             a->workspace_bytes, b->gemm_workspace_bytes);
    return b->gemm(device, a, stream);
}

/* ------------------------------------------------------ engine collectives */

static tec_status nccl_ops(const tec_nccl_ops **out)
{
    *out = cuda_backend ? cuda_backend->nccl : NULL;
    if (!*out)
        return tec_set_error(TEC_ERR_NOT_SUPPORTED,
                             "engine collectives need the CUDA backend, which is not loaded (CPU-only build "
                             "or no CUDA device)");
    return TEC_OK;
}

tec_status tec_nccl_unique_id(unsigned char id[TEC_NCCL_ID_BYTES])
{
    const tec_nccl_ops *o;
    tec_status st = nccl_ops(&o);
    return st ? st : o->unique_id(id);
}

tec_status tec_nccl_create(int device, const unsigned char id[TEC_NCCL_ID_BYTES], int nranks, int rank,
                           double timeout_s, const char *label, tec_nccl **out)
{
    const tec_nccl_ops *o;
    tec_status st = nccl_ops(&o);
    if (st)
        return st;
    if (device < 0)
        return tec_set_error(TEC_ERR_INVALID_ARG, "engine collectives: device must be a CUDA ordinal, got %d", device);
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return tec_set_error(TEC_ERR_INVALID_ARG, "engine collectives: rank %d of %d ranks", rank, nranks);
    if (!(timeout_s > 0 && timeout_s <= TEC_COMM_TIMEOUT_MAX))
        return tec_set_error(TEC_ERR_INVALID_ARG, "engine collectives: timeout must be in (0, %g] s, got %g",
                             TEC_COMM_TIMEOUT_MAX, timeout_s);
    return o->create(device, id, nranks, rank, timeout_s, label, out);
}

tec_status tec_nccl_run(tec_nccl *c, int op, const void *send, void *recv, size_t count, tec_dtype dtype,
                        void *stream, int async, uint64_t *ticket)
{
    const tec_nccl_ops *o;
    tec_status st = nccl_ops(&o);
    if (st)
        return st;
    if (op < TEC_NCCL_ALL_GATHER || op > TEC_NCCL_ALL_REDUCE)
        return tec_set_error(TEC_ERR_INVALID_ARG, "engine collectives: unknown collective %d", op);
    if (!dtype_ok(dtype))
        return tec_set_error(TEC_ERR_INVALID_ARG, "engine collectives: unknown dtype %d", (int)dtype);
    if (count && (!send || !recv))
        return tec_set_error(TEC_ERR_INVALID_ARG, "engine collectives: missing send or receive pointer");
    return o->run(c, op, send, recv, count, dtype, stream, async, ticket);
}

tec_status tec_nccl_join(tec_nccl *c, uint64_t ticket, void *stream)
{
    const tec_nccl_ops *o;
    tec_status st = nccl_ops(&o);
    return st ? st : o->join(c, ticket, stream);
}

void tec_nccl_close(tec_nccl *c, int abort)
{
    const tec_nccl_ops *o;
    if (c && nccl_ops(&o) == TEC_OK)
        o->close(c, abort);
}

void tec_nccl_free(tec_nccl *c)
{
    const tec_nccl_ops *o;
    if (c && nccl_ops(&o) == TEC_OK)
        o->free(c);
}

int tec_nccl_version(void)
{
    const tec_nccl_ops *o;
    return nccl_ops(&o) == TEC_OK ? o->version() : 0;
}
