/* tec.h - the public C interface of the transformer_engine_c engine.
 *
 * Pure C (never includes Python.h). Status codes, dtypes, non-owning
 * operation arguments, the device-dispatching operations and the
 * communicator (handle, overlap schedules). What the device backends and
 * the communication transports implement is internal (backend.h,
 * transport.h). Exercised through the CPython module (csrc/python) by the
 * tests under tests/.
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

/* ------------------------------------------------------------------ types */

typedef enum { TEC_F32 = 0, TEC_BF16 = 1, TEC_F16 = 2 } tec_dtype;

/* The FP8 formats (the FP8 operations below). */
typedef enum { TEC_FP8_E4M3 = 0, TEC_FP8_E5M2 = 1 } tec_fp8_format;

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
    /* SMs the product leaves free for work on other streams (CUDA: the
     * flag kernels and copies of an overlap schedule); 0: it may use all.
     * The CPU backend ignores it. */
    int sm_margin;
} tec_gemm_args;

/* --------------------------------------------------------------- devices */

/* The CPU backend is linked in; the CUDA backend lives in a separate shared
 * library loaded on first use, so the CPU build never depends on CUDA.
 * `stream` is a cudaStream_t for CUDA (work is enqueued on it, nothing
 * waits), ignored on the CPU (work is done when the call returns). */

/* GEMM policy, chosen by the caller when it loads the CUDA backend (the
 * Python package reads it from the environment): */
#define TEC_GEMM_TUNE 1u             /* time cuBLASLt's candidates, keep the fastest */
#define TEC_GEMM_UNFUSED_EPILOGUE 2u /* bias / bias gradient by our own kernels */

/* Load the CUDA backend from a shared library (once; later calls return
 * TEC_OK and keep the first call's gemm_policy, a set of TEC_GEMM_*). */
tec_status tec_load_cuda_backend(const char *path, unsigned gemm_policy);
/* TEC_OK if `device`'s backend is loaded (the CPU's always is), else
 * TEC_ERR_NOT_SUPPORTED with a message saying so. */
tec_status tec_backend_check(int device);

/* Device-dispatching entry points (validate, then call the backend). */
tec_status tec_norm_fwd(int device, const tec_norm_fwd_args *a, void *stream);
tec_status tec_norm_bwd(int device, const tec_norm_bwd_args *a, void *stream);
size_t tec_norm_bwd_workspace_bytes(int device, int64_t rows, int64_t cols); /* 0 if not loaded */
tec_status tec_gemm(int device, const tec_gemm_args *a, void *stream);
/* Workspace tec_gemm_args needs on `device` (0 if the backend is not loaded). */
size_t tec_gemm_workspace_bytes(int device);

/* ------------------------------------------------------------ activations
 *
 * The MLP activations, forward and backward with an optional fused bias /
 * bias gradient: TransformerEngine's functions (checks and dispatch in
 * csrc/core/activation.c; tests/test_activations.py). */

/* Element-wise functions (low 4 bits) and their gated forms (+16).
 *   gelu   x * (0.5 + 0.5 tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (tanh form)
 *   relu   max(x, 0)          qgelu  x * sigmoid(1.702 x)
 *   srelu  max(x, 0)^2        silu   x * sigmoid(x)
 *   clamped silu (gpt-oss): m = min(x, limit); m * sigmoid(alpha m)
 *   sigmoid (glu only)
 * Gated: the input row is [a | g] of 2*cols values (TE's layout of fc1's
 * doubled output: the activation half first, the linear "gate" half
 * second); y = f(a) * g. clamped_swiglu uses
 * (clamp(g, -limit, limit) + glu_offset) as the gate. */
typedef enum {
    TEC_ACT_GELU = 0,
    TEC_ACT_RELU = 1,
    TEC_ACT_QGELU = 2,
    TEC_ACT_SRELU = 3,
    TEC_ACT_SILU = 4,
    TEC_ACT_GEGLU = 16,
    TEC_ACT_REGLU = 17,
    TEC_ACT_QGEGLU = 18,
    TEC_ACT_SREGLU = 19,
    TEC_ACT_SWIGLU = 20,
    TEC_ACT_CLAMPED_SWIGLU = 21,
    TEC_ACT_GLU = 22
} tec_activation;

#define TEC_ACT_GATED 16
static inline int tec_act_is_gated(tec_activation act) { return ((int)act & TEC_ACT_GATED) != 0; }
/* Width of the input row for `cols` outputs. */
static inline int64_t tec_act_in_cols(tec_activation act, int64_t cols)
{
    return tec_act_is_gated(act) ? 2 * cols : cols;
}

/* y[rows, cols] = act(x + bias). x is [rows, in_cols] (in_cols =
 * tec_act_in_cols(act, cols)), bias [in_cols] or NULL; x, bias and y share
 * `dtype`, all contiguous; arithmetic in float32. limit, alpha, glu_offset:
 * clamped_swiglu only (TE's defaults 7.0, 1.702, 1.0). */
typedef struct {
    tec_activation act;
    int64_t rows, cols;
    tec_dtype dtype;
    const void *x;
    const void *bias;
    void *y;
    float limit, alpha, glu_offset;
} tec_act_fwd_args;

/* dx[rows, in_cols] = d act(x) / dx * dy, with x the activation's input
 * (bias already added) and dy [rows, cols]. dbias, if not NULL, receives the
 * column sums of dx ([in_cols], dtype; float32 sums in a fixed order, so the
 * result is deterministic); it needs the workspace of
 * tec_act_bwd_workspace_bytes. */
typedef struct {
    tec_activation act;
    int64_t rows, cols;
    tec_dtype dtype;
    const void *dy;
    const void *x;
    void *dx;
    void *dbias;
    void *workspace;
    size_t workspace_bytes;
    float limit, alpha, glu_offset;
} tec_act_bwd_args;

/* Validate, then run on the device's backend (the CPU, or the loaded CUDA
 * library). `stream` as for every backend call. */
tec_status tec_act_fwd(int device, const tec_act_fwd_args *a, void *stream);
tec_status tec_act_bwd(int device, const tec_act_bwd_args *a, void *stream);
/* Workspace of a backward with dbias (0 if the backend is not loaded). */
size_t tec_act_bwd_workspace_bytes(int device, tec_activation act, int64_t rows, int64_t cols);

/* ------------------------------------------------- rotary position embedding
 *
 * RoPE's apply, forward and backward (csrc/core/rope.c checks and
 * dispatches; cpu/rope.c, cuda/rope.cu; tests/test_rope.py). For each token
 * at position p and each head, the first d2 channels turn pairwise by the
 * angles freqs[p, 0..d2): y[c] = x[c] cos f[c] + r[c] sin f[c], where r is
 * (-x[c + d2/2] | x[c - d2/2]) for the halves, or, with `interleaved`,
 * (-x[c + 1] | x[c - 1]) for even | odd c. Channels d2..d are copied. The
 * backward (`backward` = 1) applies the transpose: dx[c] = dy[c] cos f[c]
 * + r'[c], r'[c] = dy[c + d2/2] sin f[c + d2/2] | -dy[c - d2/2] sin f[c - d2/2]
 * (pairs (c, c + 1) alike when interleaved). Arithmetic in float32.
 *
 * Formats: SBHD x[s, b, h, d], BSHD x[b, s, h, d], THD x[t, h, d] with
 * `cu_seqlens` [b + 1] (int32, on the device of x; sequence i holds rows
 * cu_seqlens[i] / cp_size .. cu_seqlens[i + 1] / cp_size of x). x is read
 * through its element strides (stride_b unused for THD); y is contiguous
 * in x's shape. A token's position: its index j in its sequence of local
 * length n, plus start_positions[i] (int32 [b], or NULL); under context
 * parallelism (cp_size > 1) the position in the whole sequence instead:
 * j < n/2 ? cp_rank * n/2 + j : cp_size * n - (cp_rank + 1) * n/2 + j - n/2.
 * Every position must be below freqs_rows (the CPU reports one that is
 * not; callers of CUDA check first). */
typedef enum { TEC_ROPE_SBHD = 0, TEC_ROPE_BSHD = 1, TEC_ROPE_THD = 2 } tec_rope_format;

typedef struct {
    tec_dtype dtype;           /* of x and y */
    tec_rope_format format;
    int interleaved, backward;
    int64_t s, b, h, d;        /* THD: s = tokens t, b = sequences */
    int64_t stride_s, stride_b, stride_h, stride_d; /* of x, in elements */
    const void *x;
    void *y;
    const float *freqs;        /* [freqs_rows, d2], contiguous */
    int64_t freqs_rows, d2;    /* d2 even, 0 < d2 <= d */
    const int32_t *cu_seqlens; /* THD only */
    const int32_t *start_positions; /* [b] or NULL */
    int cp_size, cp_rank;
} tec_rope_args;

tec_status tec_rope(int device, const tec_rope_args *a, void *stream);

/* ------------------------------------------------------ composite steps
 *
 * A layer's steps that chain the operations above, one call each (the
 * Python package's module/_steps.py makes one engine call per step). Each
 * runs its parts in the order given on `stream`, checked as the parts
 * are; what a part has written stays written when a later part fails.
 * csrc/core/steps.c; tests/test_one_path.py. */

/* The backward of Y[m, n] = X[m, k] W[n, k]^T (+ b), all row-major and
 * contiguous in `dtype`: dgrad dx = dy W (when dx is not NULL), then wgrad
 * dw = dy^T X with db = dy's column sums (when dw is not NULL; db may be
 * NULL, and needs dw). The workspace is tec_gemm's. */
typedef struct {
    int64_t m, n, k;
    tec_dtype dtype;
    const void *dy;  /* [m, n] */
    const void *x;   /* [m, k] */
    const void *w;   /* [n, k] */
    void *dx;        /* [m, k] or NULL */
    void *dw;        /* [n, k] or NULL */
    void *db;        /* [n] or NULL */
    void *workspace;
    size_t workspace_bytes;
} tec_linear_bwd_args;
tec_status tec_linear_bwd(int device, const tec_linear_bwd_args *a, void *stream);

/* LayerNorm (beta and mu given) or RMSNorm of x [rows, k] into ln_out (as
 * tec_norm_fwd), then y [rows, n] = ln_out w^T (+ bias) with w [n, k] (as
 * tec_gemm, whose workspace this is). */
typedef struct {
    int64_t rows, k, n;
    tec_dtype dtype;
    const void *x;
    const void *gamma;
    const void *beta;
    void *ln_out;
    float *mu;
    float *rsigma;
    float eps;
    int zero_centered_gamma;
    const void *w;
    const void *bias;
    void *y;
    void *workspace;
    size_t workspace_bytes;
} tec_norm_linear_fwd_args;
tec_status tec_norm_linear_fwd(int device, const tec_norm_linear_fwd_args *a, void *stream);

/* The backward of tec_norm_linear_fwd: dln [rows, k] = dy w (dln: scratch),
 * then dw = dy^T ln_out with db (when dw is not NULL; db may be NULL, and
 * needs dw), then the norm's backward of dln into dx, dgamma and dbeta
 * (dbeta and mu NULL for RMSNorm). norm_workspace: tec_norm_bwd's;
 * workspace: tec_gemm's. */
typedef struct {
    int64_t rows, k, n;
    tec_dtype dtype;
    const void *dy;      /* [rows, n] */
    const void *x;       /* the norm's input [rows, k] */
    const void *ln_out;  /* its output [rows, k] */
    const float *mu;
    const float *rsigma;
    const void *gamma;
    int zero_centered_gamma;
    const void *w;       /* [n, k] */
    void *dln;           /* [rows, k] */
    void *dx;
    void *dgamma;
    void *dbeta;
    void *dw;
    void *db;
    void *norm_workspace;
    size_t norm_workspace_bytes;
    void *workspace;
    size_t workspace_bytes;
} tec_norm_linear_bwd_args;
tec_status tec_norm_linear_bwd(int device, const tec_norm_linear_bwd_args *a, void *stream);

/* ---------------------------------------------------------- communicators
 *
 * A tec_comm owns one registered region per rank of a tensor-parallel group,
 * mapped into every peer, and runs the comm-GEMM overlap schedules on it
 * (csrc/core/comm.c, written once against the transport interface of
 * csrc/core/transport.h, which also documents the region layout and the
 * flag handshakes). Transports: POSIX shared memory + a comm thread on the
 * CPU (csrc/core/cpu/shm_transport.c), cudaMalloc + CUDA IPC on one node
 * (csrc/core/cuda/cuda_transport.cu, supplied by the CUDA backend).
 *
 * All ranks call the same operations in the same order. Every wait has a
 * timeout; a timeout is TEC_ERR_TIMEOUT with a message naming the
 * communicator, the operation, the step and the peer; mismatched shapes
 * across ranks are TEC_ERR_INVALID_ARG before any data moves. Once a wait
 * fails the communicator is broken: later operations return the same
 * error; close it.
 */

#define TEC_COMM_MAX_RANKS 16
#define TEC_COMM_TIMEOUT_MAX 1e6 /* seconds (11.6 days): no wait is unbounded */
#define TEC_COMM_HANDLE_MAX 256 /* bytes of a transport's local handle */

typedef enum { TEC_TRANSPORT_SHM = 0, TEC_TRANSPORT_CUDA_IPC = 1 } tec_transport_kind;

/* ---- the communicator */

typedef struct tec_comm tec_comm;

typedef struct {
    uint64_t ag_overlap, rs_overlap, bulk_ag, bulk_rs; /* overlapped paths run */
    uint64_t non_overlap; /* operations done without overlap (tp_size 1) */
    uint64_t chunks_sent, bytes_sent, waits;
} tec_comm_stats;

/* Create this rank's side: a buffer of `buffer_bytes` (rounded up to 256)
 * on `device`. name: used in error messages (copied). timeout_s in
 * (0, TEC_COMM_TIMEOUT_MAX]: every wait has a finite limit.
 * Then: tec_comm_local_handle -> exchange (all ranks, in rank order) ->
 * tec_comm_open_peers -> barrier -> tec_comm_release_handle. */
tec_status tec_comm_create(tec_comm **out, tec_transport_kind kind, int device, int rank, int tp_size,
                           size_t buffer_bytes, const char *name, double timeout_s);
void tec_comm_destroy(tec_comm *c); /* synchronizes; NULL is a no-op */
/* Handle bytes (<= TEC_COMM_HANDLE_MAX + a header) for the peers. */
tec_status tec_comm_local_handle(tec_comm *c, void *out, size_t cap, size_t *len);
tec_status tec_comm_open_peers(tec_comm *c, const void *const *handles, const size_t *lens);
tec_status tec_comm_release_handle(tec_comm *c);
/* What the schedules pass to tec_gemm: the workspace (device memory of at
 * least the backend's gemm_workspace_bytes, owned by the caller, used on the
 * compute stream only) and the SMs their GEMMs leave free (sm_margin). */
void tec_comm_set_gemm(tec_comm *c, void *ptr, size_t bytes, int sm_margin);

int tec_comm_rank(const tec_comm *c);
int tec_comm_size(const tec_comm *c);
const char *tec_comm_name(const tec_comm *c);
size_t tec_comm_buffer_bytes(const tec_comm *c);
/* Address of rank r's region in this process (buffer at offset 0). */
void *tec_comm_base(const tec_comm *c, int r);
/* Every registered byte range: own region first, then the mapped peers' in
 * rank order; returns n <= max and writes only entries [0, n). */
int tec_comm_ranges(const tec_comm *c, void **ptrs, size_t *bytes, int max);
void tec_comm_get_stats(const tec_comm *c, tec_comm_stats *s);

/* Make `stream` wait until peers finished reading this rank's own slot(s)
 * (CONSUMED of the last all-gather); call before writing the local chunk
 * into the buffer directly (e.g. a norm writing into its slot). */
tec_status tec_comm_acquire(tec_comm *c, void *stream);

/* All-gather + GEMM:  out[tp*rows, n] = gather(A)[tp*rows, k] @ op(B) (+bias)
 * A's chunk p ([rows, k], `dtype`) is slot p of the buffer; this rank's
 * chunk is already in its slot (written after tec_comm_acquire), or in
 * `a_local` (copied into the slot on the comm stream; the local GEMM reads
 * a_local directly). B is [k, n] (ldb >= n) or [n, k] with transb. Output
 * rows of chunk p land at out + p*rows*ldc. Local chunk first; each peer's
 * chunk is pulled straight from its owner while the previous GEMM runs.
 * Afterwards the buffer holds the gathered A (valid until the next use).
 * `local_copy`, if set, receives a copy of this rank's chunk on the comm
 * stream, after the pulls and off the GEMMs' stream (what a layer saves for
 * backward: the buffer itself must never be saved). */
/* FP8 chunk GEMMs of an overlap schedule (tec_ag_gemm_args.fp8,
 * tec_gemm_rs_args.fp8; NULL: the chunk GEMMs are `dtype` GEMMs). A's
 * chunks and B are then FP8 bytes with one scale each (tec_fp8_gemm's TN
 * layout: B is stored [n, k], transb must be 1), so a chunk of A is rows * k
 * bytes; `dtype` is the compute type of the output, of gemm_rs's partials
 * and of the bias. fast_accum as in tec_fp8_gemm_args. */
typedef struct {
    tec_fp8_format a_format, b_format;
    const float *a_scale_inv, *b_scale_inv;
    int fast_accum;
    /* gemm_rs only, partial_scale NULL: the partials are `dtype`. Else they
     * travel as FP8 bytes of partial_format, fp8(partial * *partial_scale)
     * (tec_fp8_gemm_args.c_scale), each with this rank's *partial_scale_inv,
     * which dequantizes it in the peer's reduction (ranks may differ);
     * partial_amax, if given, becomes max(*partial_amax, max |partial|) over
     * every partial this rank computes. One rank has no partials: its GEMM
     * writes out in `dtype` and records no amax. */
    tec_fp8_format partial_format;
    const float *partial_scale, *partial_scale_inv;
    float *partial_amax;
} tec_fp8_chunk_gemm;

typedef struct {
    const void *a_local;  /* NULL: already in the buffer slot */
    void *local_copy;     /* [rows, k] outside the buffer, or NULL */
    int64_t rows, k, n;   /* rows per chunk */
    tec_dtype dtype, out_dtype;
    const void *b; int64_t ldb; int transb;
    void *out; int64_t ldc;
    const void *bias;     /* [n] or NULL */
    const tec_fp8_chunk_gemm *fp8; /* FP8 chunk GEMMs, or NULL */
} tec_ag_gemm_args;
tec_status tec_comm_ag_gemm(tec_comm *c, const tec_ag_gemm_args *a, void *stream);

/* GEMM + reduce-scatter: out[rows, n] = sum over ranks of the partial
 * (A[tp*rows, k] @ op(B))[rank chunk] (+ bias, once), float32 sums (of the
 * dequantized partials with FP8 partials: tec_fp8_chunk_gemm).
 * A is this rank's full [tp*rows, k] (lda >= k). The partial for peer p is
 * computed into staging, pushed into p's slot while the next is computed;
 * this rank's own chunk last; partials reduced in rank order. */
typedef struct {
    const void *a; int64_t lda;
    int64_t rows, k, n;
    tec_dtype dtype;      /* A, B, partials and out */
    const void *b; int64_t ldb; int transb;
    void *out;            /* [rows, n] contiguous */
    const void *bias;
    const tec_fp8_chunk_gemm *fp8; /* FP8 chunk GEMMs (A [tp*rows, k] FP8 bytes), or NULL */
} tec_gemm_rs_args;
tec_status tec_comm_gemm_rs(tec_comm *c, const tec_gemm_rs_args *a, void *stream);

/* Bulk all-gather: all chunks of chunk_bytes into the buffer's slots on the
 * comm stream, while the caller runs its own work on `stream`. src: this
 * rank's chunk (NULL: already in its slot). finish makes `stream` wait. */
tec_status tec_comm_bulk_ag_start(tec_comm *c, const void *src, size_t chunk_bytes, void *stream);
tec_status tec_comm_bulk_ag_finish(tec_comm *c, void *stream);

/* Bulk reduce-scatter of src[tp*rows, cols] (not in the buffer; kept alive
 * by the caller until finish) into out[rows, cols] on the comm stream;
 * finish makes `stream` wait. */
tec_status tec_comm_bulk_rs_start(tec_comm *c, const void *src, int64_t rows, int64_t cols, tec_dtype dtype,
                                  void *out, void *stream);
tec_status tec_comm_bulk_rs_finish(tec_comm *c, void *stream);

/* The host waits for the comm stream and `stream`; reports async failures. */
tec_status tec_comm_synchronize(tec_comm *c, void *stream);

/* First half of a collective close: wait for this rank's work (its pulls
 * from and pushes to peers included), then unmap every peer's region; the
 * communicator accepts no more work. Call on every rank, then a barrier,
 * then tec_comm_destroy: no rank frees its region while a peer maps it
 * (freeing an IPC-exported allocation a peer still maps is undefined). */
tec_status tec_comm_unmap_peers(tec_comm *c, void *stream);

/* ------------------------------------------------- engine collectives
 *
 * An NCCL communicator of the engine's own (csrc/core/cuda/nccl.cu, CUDA
 * backend only; NCCL is the library the process has loaded, found at run
 * time): all-gather, reduce-scatter (sum) and all-reduce (sum) enqueued on
 * the caller's stream, or with `async` on the communicator's side stream
 * after the caller's work so far, joined back by tec_nccl_join. Creating it
 * waits for every rank at most timeout_s (TEC_ERR_TIMEOUT); a collective
 * that has not finished timeout_s after it was enqueued ends the process
 * with a message naming it (a watchdog thread; see nccl.cu). All ranks call
 * the same collectives in the same order.
 */

#define TEC_NCCL_ID_BYTES 128
enum { TEC_NCCL_ALL_GATHER = 0, TEC_NCCL_REDUCE_SCATTER = 1, TEC_NCCL_ALL_REDUCE = 2 };

typedef struct tec_nccl tec_nccl;

/* A new unique id (rank 0 makes it; every rank passes it to create). */
tec_status tec_nccl_unique_id(unsigned char id[TEC_NCCL_ID_BYTES]);
/* label: names the group in messages (copied). */
tec_status tec_nccl_create(int device, const unsigned char id[TEC_NCCL_ID_BYTES], int nranks, int rank,
                           double timeout_s, const char *label, tec_nccl **out);
/* count: elements per rank (all-gather's input, reduce-scatter's output),
 * all of them for all-reduce (send may equal recv). ticket: written when
 * async (for tec_nccl_join; valid for the next 63 collectives of the
 * communicator). During CUDA graph capture an async call runs on the
 * caller's stream. Calls from several threads are serialised; their order
 * must still be the same on every rank. */
tec_status tec_nccl_run(tec_nccl *c, int op, const void *send, void *recv, size_t count, tec_dtype dtype,
                        void *stream, int async, uint64_t *ticket);
tec_status tec_nccl_join(tec_nccl *c, uint64_t ticket, void *stream);
/* Destroy the NCCL communicator (waiting for its unfinished collectives,
 * bounded by the watchdog) or, with `abort`, abort it (nothing waits: at
 * exit, or after a failure); later calls fail as closed. */
void tec_nccl_close(tec_nccl *c, int abort);
void tec_nccl_free(tec_nccl *c);  /* close + free; NULL is a no-op */
int tec_nccl_version(void);       /* NCCL's version code, 0 if it cannot be loaded */

/* ------------------------------------------------------------------ FP8
 *
 * Per-tensor scaled FP8 (csrc/core/fp8.c checks and dispatches; CPU
 * kernels in cpu/fp8.c, CUDA kernels and the cuBLASLt FP8 GEMM in
 * cuda/fp8.cu). Storage is one byte per element in OCP FP8: E4M3 (the
 * "fn" variant: no infinities, max 448) or E5M2 (max 57344). Scales are
 * float32 tensors in the operation's device memory, read and written by
 * the device (no host synchronisation: the calls can be captured in a CUDA
 * graph). Exercised by tests/test_fp8_engine.py.
 */

/* Largest finite value of the format (448 or 57344). */
float tec_fp8_max(tec_fp8_format f);

/* Quantize x [rows, cols] (row-major, contiguous, `dtype`):
 *   out[r, c]   = fp8(x[r, c] * scale)   (rowwise copy, or NULL)
 *   out_t[c, r] = the same value          (the transpose, or NULL)
 * fp8() rounds to nearest even and saturates to +-max (infinities too);
 * NaN stays NaN. amax, if given, becomes max(*amax, max |x|) (NaN inputs
 * are ignored, as fmaxf does): it may be a row of an amax history. scale_inv,
 * if given, receives 1 / *scale. scale: one float. dbias, if given,
 * receives x's column sums [cols] in `dtype` (a bias gradient, summed in
 * float32), with workspace: tec_fp8_quantize_workspace_bytes() bytes of
 * device memory (the partial sums, a fixed order: deterministic).
 * noop, if given, is one float in the operation's device memory, read when
 * the operation runs: nonzero makes the call write nothing at all (no out,
 * out_t, amax, scale_inv or dbias), so a call captured in a CUDA graph can
 * be switched off per replay (TE's noop flag: a cached FP8 weight kept
 * from the first micro-batch). The arguments are checked as without it. */
typedef struct {
    int64_t rows, cols;
    tec_dtype dtype;
    tec_fp8_format format;
    const void *x;
    const float *scale;
    uint8_t *out;
    uint8_t *out_t;
    float *amax;
    float *scale_inv;
    void *dbias;
    void *workspace;
    size_t workspace_bytes;
    const float *noop;
    /* An activation fused ahead of the cast (TEC_FP8_ACT_NONE: none). With
     * TEC_FP8_ACT_FWD the values cast are act(x) and with TEC_FP8_ACT_BWD
     * act'(act_input) * x (x the gradient of the activation's output,
     * act_input its input, [rows, cols] of `dtype`), each computed in
     * float32 as tec_act_fwd / tec_act_bwd do and rounded to `dtype`: out,
     * out_t, amax and scale_inv are bit for bit those of tec_act_fwd /
     * tec_act_bwd (no bias) into a `dtype` tensor followed by this cast of
     * it, without that tensor. dbias then sums the float32 values before
     * the rounding (tec_act_bwd's bias gradient). act: an activation that is
     * not gated. */
    int act_mode;
    tec_activation act;
    const void *act_input;
} tec_fp8_quantize_args;
enum { TEC_FP8_ACT_NONE = 0, TEC_FP8_ACT_FWD = 1, TEC_FP8_ACT_BWD = 2 };
tec_status tec_fp8_quantize(int device, const tec_fp8_quantize_args *a, void *stream);

/* The workspace tec_fp8_quantize needs with dbias: ceil(rows / 64) * cols
 * float32 partial sums (0 when rows or cols is not positive). */
size_t tec_fp8_quantize_workspace_bytes(int64_t rows, int64_t cols);

/* *amax = max |x| over n elements of `dtype` (overwritten; 0 for n == 0). */
tec_status tec_fp8_amax(int device, const void *x, int64_t n, tec_dtype dtype, float *amax, void *stream);

/* Current scaling: for each of n amaxes, a = max(amax[i], epsilon);
 * scale[i] = 1 if a is 0, inf or NaN, else fp8_max / a (FLT_MAX when that
 * overflows), rounded down to a power of two with pow2; scale_inv[i] = 1 /
 * scale[i]. scale or scale_inv may be NULL. */
tec_status tec_fp8_scale_from_amax(int device, const float *amax, float *scale, float *scale_inv, int64_t n,
                                   float fp8_max, int pow2, float epsilon, void *stream);

/* Delayed scaling's update of n tensor roles after a step, in place:
 * history is [len, n] float32 row-major (row 0 the step's amaxes). For each
 * role c: amax = the max of its column with NaN entries skipped (its row 0
 * with most_recent); s = (fp8_max / amax) / divisor (FLT_MAX when that
 * overflows); scale[c] = s where amax is finite and > 0, else unchanged;
 * scale_inv[c] = 1 / scale[c]; the column rolls one row up (row 0 to the
 * end) and its new row 0 is zeroed. len <= TEC_FP8_HISTORY_MAX. */
#define TEC_FP8_HISTORY_MAX 8192
tec_status tec_fp8_delayed_update(int device, float *history, float *scale, float *scale_inv, int64_t len, int64_t n,
                                  float fp8_max, float divisor, int most_recent, void *stream);

/* FP8 GEMM, the TN layout of cuBLASLt: row-major
 *   C[m, n] (+)= (a_scale_inv * A[m, k]) @ (b_scale_inv * B[n, k])^T (+ bias)
 * A and B are FP8 (lda, ldb >= k; at most one of them E5M2); scales one
 * float each. C is bf16, f16 or f32 (ldc >= n). bias [n]: bf16 for a bf16
 * or f32 C, f16 for an f16 C (not with accumulate). accumulate: C += the
 * product (a wgrad into an fp32 main_grad). fast_accum: cuBLASLt's fast FP8
 * accumulation (TE uses it for fprop; off is the split accumulator). On
 * the CPU: the dequantized operands multiplied in float32 (exact emulation
 * of the scaled product). */
typedef struct {
    int64_t m, n, k;
    tec_fp8_format a_format, b_format;
    const uint8_t *a; int64_t lda;
    const uint8_t *b; int64_t ldb;
    const float *a_scale_inv, *b_scale_inv;
    void *c; int64_t ldc;
    tec_dtype c_dtype;
    const void *bias;
    int accumulate;
    int fast_accum;
    void *workspace;
    size_t workspace_bytes;
    /* TEC_FP8_SCALE_* of each operand (0, per-tensor, in a zeroed struct):
     * with block scales, a_scale_inv / b_scale_inv hold the operand's block
     * scales in the layout of tec_fp8_block_quantize (A as its `out` of an
     * [m, k] input, B as that of an [n, k] input); not both 128x128. */
    int a_scale_mode, b_scale_mode;
    /* SMs the product leaves free for other streams' work (an overlap
     * schedule's copies and flag kernels), as tec_gemm_args.sm_margin. */
    int sm_margin;
    /* FP8 output (c_scale NULL: C is c_dtype): C is then FP8 bytes of
     * c_format, C[i, j] = fp8(v * *c_scale) with v the float32 product plus
     * the bias (rounded as tec_fp8_quantize rounds; ldc in bytes), and
     * c_amax, if given, becomes max(*c_amax, max |v|) (a row of an amax
     * history). c_dtype is then the bias's dtype, bf16 or f16. Per-tensor
     * scales only, not with accumulate. */
    tec_fp8_format c_format;
    const float *c_scale;
    float *c_amax;
} tec_fp8_gemm_args;
tec_status tec_fp8_gemm(int device, const tec_fp8_gemm_args *a, void *stream);

/* The FP8 steps of a linear layer, each one engine call (fp8_steps.c
 * chains the operations above; the CPU emulation and the CUDA kernels are
 * theirs, so the results are bit for bit those of the separate calls).
 *
 * One tensor's cast in such a step: x [rows, cols] of the step's dtype
 * (NULL: not cast, `data` / `data_t` / `scale_inv` already hold a cast)
 * into `format` bytes, rowwise (data) and/or transposed (data_t), with:
 *  - delayed scaling (current NULL): *scale, amax (if given) maxed into
 *    one entry of an amax history, as tec_fp8_quantize;
 *  - current scaling (current: two floats of device memory): current[0] =
 *    x's amax (of act(x) with a fused activation), current[1] its scale
 *    (tec_fp8_scale_from_amax with pow2 and epsilon), then the cast with
 *    it; `scale` is not read.
 * scale_inv receives 1 / the scale used. act_mode / act / act_input: an
 * activation fused ahead of the cast, as tec_fp8_quantize_args. */
typedef struct {
    const void *x;
    tec_fp8_format format;
    const float *scale;
    float *amax;
    float *scale_inv;
    uint8_t *data;
    uint8_t *data_t;
    float *current;
    int pow2;
    float epsilon;
    int act_mode;
    tec_activation act;
    const void *act_input;
} tec_fp8_cast;

/* Forward: with `norm` (else NULL) first that norm of its x [rows, k]
 * into its y (tec_norm_fwd; cols k, the step's dtype), which is then the
 * x cast (x.x is not read); the casts of x [rows, k] and (unless w.x is
 * NULL: a cached cast) of w [n, k], then y [rows, n] = X W^T (+ bias) as
 * tec_fp8_gemm (bias: its dtype rule), fast_accum as there. x.data and
 * w.data are required (the GEMM reads them). */
typedef struct {
    int64_t rows, n, k;
    tec_dtype dtype;
    const tec_norm_fwd_args *norm;
    tec_fp8_cast x, w;
    const void *bias;
    void *y;
    int fast_accum;
    void *workspace;
    size_t workspace_bytes;
} tec_fp8_linear_fwd_args;
tec_status tec_fp8_linear_fwd(int device, const tec_fp8_linear_fwd_args *a, void *stream);

/* Backward: the cast of dy [rows, n] (dy.data for dgrad, dy.data_t for
 * wgrad; dbias, if given, dy's column sums with its workspace, as
 * tec_fp8_quantize), then, when dx is given, dgrad dx [rows, k] = dY W
 * from w_t (W's transposed bytes [k, n]), and, when dw is given, wgrad
 * dw [n, k] (+)= dY^T X from x_t (X's transposed bytes [k, rows]; rows a
 * multiple of 16), into a dw_dtype tensor (accumulate: added, e.g. an fp32
 * main_grad). Each GEMM's split accumulation as its flag says. With `norm`
 * (else NULL; it needs dx) then that norm's backward (tec_norm_bwd; cols
 * k) of dx, which is its dy (norm->dy is not read): the backward of a
 * norm whose output the forward's x was. */
typedef struct {
    int64_t rows, n, k;
    tec_dtype dtype;
    const tec_norm_bwd_args *norm;
    tec_fp8_cast dy;
    void *dbias;
    void *dbias_workspace;
    size_t dbias_workspace_bytes;
    const uint8_t *w_t;
    const float *w_scale_inv;
    tec_fp8_format w_format;
    void *dx;
    int dgrad_fast_accum;
    const uint8_t *x_t;
    const float *x_scale_inv;
    tec_fp8_format x_format;
    void *dw;
    tec_dtype dw_dtype;
    int accumulate;
    int wgrad_fast_accum;
    void *workspace;
    size_t workspace_bytes;
} tec_fp8_linear_bwd_args;
tec_status tec_fp8_linear_bwd(int device, const tec_fp8_linear_bwd_args *a, void *stream);

/* Block-scaled FP8 (TransformerEngine's Float8BlockScaling; csrc/core/
 * fp8_block.c checks and dispatches, cpu/fp8_block.c and cuda/fp8_block.cu
 * quantize). A scale mode says how an FP8 operand's scale_inv is laid out: */
enum {
    TEC_FP8_SCALE_TENSOR = 0, /* one float */
    TEC_FP8_SCALE_1D = 1,     /* 1x128: one float per 128 consecutive elements of a row */
    TEC_FP8_SCALE_2D = 2,     /* 128x128: one float per 128x128 tile */
};
#define TEC_FP8_BLOCK 128

/* Quantize x [rows, cols] (row-major, contiguous, `dtype`) in blocks
 * (block_dim 1: 1x128, 2: 128x128; blocks at the right and bottom edges
 * hold what is left). For each block b: amax = max |x| over b (NaN
 * ignored), a = max(amax, epsilon); scale = 1 if a is 0, inf or NaN, else
 * fp8_max / a (the largest finite value of `dtype` when that overflows),
 * rounded down to a power of two with pow2; fp8 = fp8(x * scale) (round to
 * nearest even, saturating); scale_inv = 1 / scale.
 *
 *   out [rows, cols], scale_inv (out may be NULL: then scale_inv is unused)
 *     1x128:   scale_inv[cb * ld + r],  cb = c / 128, ld = round_up(rows, 4),
 *              ceil(cols / 128) * ld floats;
 *     128x128: scale_inv[rb * ld + cb], rb = r / 128, ld = round_up(ceil(cols / 128), 4),
 *              ceil(rows / 128) * ld floats.
 *   out_t [cols, rows], scale_inv_t: the columnwise copy (or NULL), laid out
 *     as `out` of the transpose. With 1x128 it quantizes 128x1 blocks of x
 *     (its own amaxes); with 128x128 it is the transpose of out's bytes and
 *     scale_inv_t the transpose of scale_inv's grid.
 * The padding entries of the scale tensors are not written. This is cuBLASLt's
 * layout for CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F / BLK128x128_32F and
 * TE's Float8BlockQuantizer's (GEMM-ready). */
typedef struct {
    int64_t rows, cols;
    tec_dtype dtype;
    tec_fp8_format format;
    int block_dim;
    int pow2;
    float epsilon;
    const void *x;
    uint8_t *out;
    float *scale_inv;
    uint8_t *out_t;
    float *scale_inv_t;
} tec_fp8_block_quantize_args;
tec_status tec_fp8_block_quantize(int device, const tec_fp8_block_quantize_args *a, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* TEC_H */
