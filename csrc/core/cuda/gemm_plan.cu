/* gemm_plan.cu - cuBLASLt plans of the CUDA GEMM and their per-device cache:
 * a plan (descriptor, layouts, the heuristic's candidate algorithms) is
 * built once per shape key, found by hash, and the least recently used plan
 * that no caller holds is evicted once the cache is full. The cache lock
 * covers only lookup, insertion and the tuning state; builds and every
 * enqueue run outside it. Exercised by tests/test_kernels.py (device="cuda"). */
#include <stdlib.h>
#include <string.h>

#include "gemm_plan.h"

namespace {

enum { kPlans = 256, kBuckets = 512, kMaxDevices = 64 };

cudaDataType_t cuda_type(int dt)
{
    return dt == TEC_F32 ? CUDA_R_32F : dt == TEC_BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

/* The cuBLASLt type of our A (a = 1) or B (a = 0): FP8 keys carry the
 * operands' formats, others their common dtype. */
cudaDataType_t operand_type(const gemm_key *k, int a)
{
    if (!k->fp8)
        return cuda_type(k->ab);
    const int code = k->fp8 - 1, fmt = a ? (code & 1) : (code >> 1);
    return fmt == TEC_FP8_E5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
}

/* FNV-1a over the key's bytes (the key has no padding; callers zero it). */
uint64_t key_hash(const gemm_key *k)
{
    const unsigned char *p = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof *k; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return h;
}
static_assert(sizeof(gemm_key) == 16 * 4 + 6 * 8, "gemm_key must have no padding (it is hashed as bytes)");

void plan_free(gemm_plan *p)
{
    if (!p)
        return;
    gemm_tune_drop_events(p);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    if (p->ld) cublasLtMatrixLayoutDestroy(p->ld);
    free(p);
}

/* Layouts and descriptor for epilogue `epi`, and the heuristic's
 * candidates. *found = 0 (not an error) if it has none. */
tec_status plan_try(cublasLtHandle_t h, const gemm_key *k, int epi, const void *epi_ptr, gemm_plan *p, int *found)
{
    tec_status st = TEC_OK;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res[kTuneAlgos];
    int nres = 0;
    const uint64_t ws = TEC_CUDA_GEMM_WORKSPACE_BYTES;

    *found = 0;
    p->epi = epi;
    p->nalgo = 0;
    if ((st = gemm_desc_init(&p->desc, k, epi, epi_ptr)) != TEC_OK)
        return st;
    if (!p->la)
        TEC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, operand_type(k, 0), (uint64_t)(k->transb ? k->k : k->n),
                                                    (uint64_t)(k->transb ? k->n : k->k), k->ldb));
    if (!p->lb)
        TEC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, operand_type(k, 1), (uint64_t)(k->transa ? k->m : k->k),
                                                    (uint64_t)(k->transa ? k->k : k->m), k->lda));
    if (!p->lc)
        TEC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lc, cuda_type(k->c), (uint64_t)k->n, (uint64_t)k->m, k->ldc));
    if (k->d_fp8 && !p->ld)
        TEC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->ld, k->d_fp8 - 1 == TEC_FP8_E5M2 ? CUDA_R_8F_E5M2
                                                                                        : CUDA_R_8F_E4M3,
                                                    (uint64_t)k->n, (uint64_t)k->m, k->ldc));
    TEC_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                               sizeof ws),
                          st, out);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                               &k->align_b, sizeof k->align_b),
                          st, out);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                               &k->align_a, sizeof k->align_a),
                          st, out);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                               &k->align_c, sizeof k->align_c),
                          st, out);
    TEC_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                               &k->align_c, sizeof k->align_c),
                          st, out);
    /* No algorithm (CUBLAS_STATUS_NOT_SUPPORTED or nres == 0) is an answer,
     * not a failure: the caller falls back. */
    if (cublasLtMatmulAlgoGetHeuristic(h, &p->desc, p->la, p->lb, p->lc, k->d_fp8 ? p->ld : p->lc, pref, kTuneAlgos,
                                       res, &nres) ==
        CUBLAS_STATUS_SUCCESS) {
        for (int i = 0; i < nres; i++)
            if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= ws) {
                p->algos[p->nalgo] = res[i].algo;
                p->algo_ws[p->nalgo++] = res[i].workspaceSize;
            }
    }
    if (p->nalgo > 0) {
        p->algo = p->algos[0];
        *found = 1;
    } else {
        (void)cudaGetLastError();
    }
out:
    cublasLtMatmulPreferenceDestroy(pref);
    return st;
}

/* A new plan for key: the requested epilogue, else none, else SIMT. */
tec_status plan_build(cublasLtHandle_t h, const gemm_key *k, const void *epi_ptr, gemm_plan **out)
{
    int found = 0;
    *out = NULL;
    gemm_plan *p = (gemm_plan *)calloc(1, sizeof *p);
    if (!p)
        return TEC_CUDA_FAIL(TEC_ERR_NO_MEMORY, "gemm: no host memory for a plan");
    p->key = *k;
    p->hash = key_hash(k);
    tec_status st = plan_try(h, k, k->epi, epi_ptr, p, &found);
    if (st == TEC_OK && !found && k->epi != CUBLASLT_EPILOGUE_DEFAULT)
        st = plan_try(h, k, CUBLASLT_EPILOGUE_DEFAULT, NULL, p, &found);
    if (st != TEC_OK) {
        plan_free(p);
        return st;
    }
    if (!found) {
        p->epi = CUBLASLT_EPILOGUE_DEFAULT;
        p->simt = 1;
    }
    gemm_stat_add(kStatPlans);
    *out = p;
    return TEC_OK;
}

/* 1 if the sweep may be enqueued on (or read from) st now: not while st is
 * capturing (a graph would replay the sweep; an error asking counts as
 * capturing). */
int tune_stream_free(cudaStream_t st)
{
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(st, &cs) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return cs == cudaStreamCaptureStatusNone;
}

} /* namespace */

/* ================================================================= cache */

struct gemm_cache {
    pthread_mutex_t lock; /* buckets, the use list, nplans, plans' tune and algo */
    cublasLtHandle_t handle;
    int nplans;
    gemm_plan *bucket[kBuckets];
    gemm_plan *newest, *oldest;
};

static gemm_cache *g_caches[kMaxDevices];
static pthread_mutex_t g_caches_lock = PTHREAD_MUTEX_INITIALIZER;

cublasLtHandle_t gemm_cache_handle(const gemm_cache *c) { return c->handle; }

tec_status gemm_cache_get(int device, gemm_cache **out)
{
    tec_status st = TEC_OK;
    *out = NULL;
    if (device < 0 || device >= kMaxDevices)
        return TEC_CUDA_FAIL(TEC_ERR_INVALID_ARG, "gemm: device %d out of range 0..%d", device, kMaxDevices - 1);
    gemm_cache *c = __atomic_load_n(&g_caches[device], __ATOMIC_ACQUIRE);
    if (c) {
        *out = c;
        return TEC_OK;
    }
    pthread_mutex_lock(&g_caches_lock);
    c = g_caches[device];
    if (!c) {
        c = (gemm_cache *)calloc(1, sizeof *c);
        if (!c) {
            st = TEC_CUDA_FAIL(TEC_ERR_NO_MEMORY, "gemm: no host memory for the plan cache");
            goto fail;
        }
        TEC_CUBLAS_CHECK_GOTO(cublasLtCreate(&c->handle), st, fail);
        pthread_mutex_init(&c->lock, NULL);
        __atomic_store_n(&g_caches[device], c, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_caches_lock);
    *out = c;
    return TEC_OK;
fail:
    free(c);
    pthread_mutex_unlock(&g_caches_lock);
    return st;
}

/* The list and bucket operations below run under c->lock. */

static gemm_plan *cache_find(gemm_cache *c, const gemm_key *k, uint64_t h)
{
    for (gemm_plan *p = c->bucket[h % kBuckets]; p; p = p->next)
        if (p->hash == h && memcmp(&p->key, k, sizeof *k) == 0)
            return p;
    return NULL;
}

static void list_unlink(gemm_cache *c, gemm_plan *p)
{
    if (p->newer) p->newer->older = p->older;
    else c->newest = p->older;
    if (p->older) p->older->newer = p->newer;
    else c->oldest = p->newer;
    p->older = p->newer = NULL;
}

static void list_push_newest(gemm_cache *c, gemm_plan *p)
{
    p->older = c->newest;
    p->newer = NULL;
    if (c->newest) c->newest->newer = p;
    else c->oldest = p;
    c->newest = p;
}

/* Take the least recently used plan no caller holds out of the cache
 * (NULL if every plan is held); the caller frees it after unlocking. */
static gemm_plan *cache_evict(gemm_cache *c)
{
    for (gemm_plan *p = c->oldest; p; p = p->newer) {
        if (__atomic_load_n(&p->refs, __ATOMIC_ACQUIRE) != 0)
            continue;
        gemm_plan **pp = &c->bucket[p->hash % kBuckets];
        while (*pp != p)
            pp = &(*pp)->next;
        *pp = p->next;
        list_unlink(c, p);
        c->nplans--;
        return p;
    }
    return NULL;
}

/* Hold p for this caller and claim the tuning step this call may run. */
static void take(gemm_plan *p, int tune, cudaStream_t st, gemm_use *use)
{
    __atomic_add_fetch(&p->refs, 1, __ATOMIC_ACQ_REL);
    use->plan = p;
    use->algo = p->algo;
    use->action = kActNone;
    if ((p->tune == kTuneReady && tune) || p->tune == kTunePending) {
        if (tune_stream_free(st)) {
            use->action = p->tune == kTuneReady ? kActSweep : kActFinish;
            use->result = p->tune; /* what release restores if the call fails before the step */
            p->tune = p->tune == kTuneReady ? kTuneSweeping : kTuneFinishing;
        }
    }
}

tec_status gemm_plan_acquire(gemm_cache *c, const gemm_key *key, const void *epi_ptr, int tune, cudaStream_t st,
                             gemm_use *use)
{
    const uint64_t h = key_hash(key);
    memset(use, 0, sizeof *use);
    pthread_mutex_lock(&c->lock);
    gemm_plan *p = cache_find(c, key, h);
    if (p) {
        list_unlink(c, p);
        list_push_newest(c, p);
        take(p, tune, st, use);
        pthread_mutex_unlock(&c->lock);
        return TEC_OK;
    }
    pthread_mutex_unlock(&c->lock);

    gemm_plan *fresh = NULL, *evicted = NULL;
    tec_status s = plan_build(c->handle, key, epi_ptr, &fresh);
    if (s != TEC_OK)
        return s;
    /* Tuning is worth it only with a choice to make. */
    fresh->tune = !fresh->simt && (tec_cuda_gemm_policy() & TEC_GEMM_TUNE) && fresh->nalgo > 1 ? kTuneReady
                                                                                                 : kTuneOff;
    pthread_mutex_lock(&c->lock);
    p = cache_find(c, key, h); /* another thread may have built it meanwhile */
    if (!p) {
        if (c->nplans >= kPlans)
            evicted = cache_evict(c); /* if every plan is held, the cache grows past kPlans for now */
        p = fresh;
        fresh = NULL;
        p->next = c->bucket[h % kBuckets];
        c->bucket[h % kBuckets] = p;
        c->nplans++;
    } else {
        list_unlink(c, p);
    }
    list_push_newest(c, p);
    take(p, tune, st, use);
    pthread_mutex_unlock(&c->lock);
    plan_free(fresh);
    if (evicted) {
        plan_free(evicted);
        gemm_stat_add(kStatEvicted);
    }
    return TEC_OK;
}

void gemm_plan_release(gemm_cache *c, gemm_use *use)
{
    gemm_plan *p = use->plan;
    if (!p)
        return;
    if (use->action != kActNone) {
        pthread_mutex_lock(&c->lock);
        p->tune = use->result;
        if (use->result == kTuneDone)
            p->algo = p->algos[use->best];
        pthread_mutex_unlock(&c->lock);
    }
    __atomic_sub_fetch(&p->refs, 1, __ATOMIC_ACQ_REL);
    use->plan = NULL;
}

/* ============================================================ descriptor */

/* Block scales (TEC_FP8_SCALE_1D / _2D, tec.h's layout): cuBLASLt's
 * VEC128_32F / BLK128x128_32F modes (cuBLASLt 12.9+, sm_90). cuBLASLt's A
 * is our B. */
static tec_status block_scale_modes(cublasLtMatmulDesc_t d, const gemm_key *k)
{
#if CUBLAS_VERSION >= 120900
    static size_t lt_version; /* cublasLtGetVersion, read once (a constant) */
    if (!__atomic_load_n(&lt_version, __ATOMIC_RELAXED))
        __atomic_store_n(&lt_version, cublasLtGetVersion(), __ATOMIC_RELAXED);
    if (lt_version < 120900)
        return TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED, "fp8 gemm: block scales need cuBLASLt 12.9 or newer, the loaded "
                             "one is %zu", lt_version);
    const int32_t lt_a = k->scale_b == TEC_FP8_SCALE_2D ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                                        : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const int32_t lt_b = k->scale_a == TEC_FP8_SCALE_2D ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                                        : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &lt_a, sizeof lt_a));
    TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &lt_b, sizeof lt_b));
    /* Block-scaled kernels are only offered to a descriptor that has scale
     * pointers (the scalar mode's may be unset). The plan's heuristic query
     * sees a stand-in address, 256-byte aligned as the caller's tensors are,
     * never dereferenced; every call sets its own (fp8.cu). */
    const void *stand_in = (const void *)(uintptr_t)4096;
    TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &stand_in,
                                                    sizeof stand_in));
    TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &stand_in,
                                                    sizeof stand_in));
    return TEC_OK;
#else
    (void)d; (void)k;
    return TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED, "fp8 gemm: block scales need cuBLASLt 12.9 or newer; this library "
                         "was built with cuBLASLt %d", (int)CUBLAS_VERSION);
#endif
}

tec_status gemm_desc_init(cublasLtMatmulDesc_t d, const gemm_key *k, int epi, const void *epi_ptr)
{
    const cublasOperation_t opa = k->transb ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt A = our B */
    const cublasOperation_t opb = k->transa ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt B = our A */
    const cublasLtEpilogue_t e = (cublasLtEpilogue_t)epi;
    TEC_CUBLAS_CHECK(cublasLtMatmulDescInit(d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
    TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
    TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e));
    if (epi != CUBLASLT_EPILOGUE_DEFAULT)
        TEC_CUBLAS_CHECK(
            cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &epi_ptr, sizeof epi_ptr));
    if (k->sm_target > 0)
        TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &k->sm_target,
                                                        sizeof k->sm_target));
    if (k->fp8) { /* the scale pointers are the call's own (fp8.cu sets them) */
        const int8_t fast = k->fast_accum ? 1 : 0;
        TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
        if (epi == CUBLASLT_EPILOGUE_BIAS) {
            const cudaDataType_t bt = k->c == TEC_F16 ? CUDA_R_16F : CUDA_R_16BF;
            TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
        }
        if (k->scale_a || k->scale_b) {
            tec_status st = block_scale_modes(d, k);
            if (st != TEC_OK)
                return st;
        }
        if (k->d_fp8) { /* stand-ins for the plan's heuristic query, as block_scale_modes' */
            const void *stand_in = (const void *)(uintptr_t)4096;
            TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &stand_in,
                                                            sizeof stand_in));
            if (k->amax_d)
                TEC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &stand_in,
                                                                sizeof stand_in));
        }
    }
    return TEC_OK;
}
