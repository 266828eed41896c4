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
#include <stdio.h>

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
    /* SMs the product leaves free for work on other streams (CUDA: the
     * flag kernels and copies of an overlap schedule); 0: it may use all.
     * The CPU backend ignores it. */
    int sm_margin;
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

#define TEC_BACKEND_ABI 2 /* 2: tec_gemm_args.sm_margin */

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


/* ---------------------------------------------------------- communicators
 *
 * A tec_comm owns one registered region per rank of a tensor-parallel group,
 * mapped into every peer, and runs the comm-GEMM overlap schedules on it.
 * The schedules (csrc/core/comm.c) are written once against the transport
 * interface below; the CPU transport (POSIX shared memory + a comm thread,
 * csrc/core/cpu/shm_transport.c) and the CUDA transport (cudaMalloc + CUDA
 * IPC, csrc/core/cuda/, found via tec_cuda_symbol) implement it.
 *
 * Region layout (bytes, every offset 256-aligned), identical on all ranks:
 *   [0, data)            the user-visible buffer (get_buffer); split into
 *                        tp "slots" of chunk_bytes each by every operation
 *   [data, 2*data)       private staging for GEMM+RS partials (never read by
 *                        peers; written by this rank, copied to peers)
 *   [2*data, +flags)     TEC_COMM_NFLAGS kinds x TEC_COMM_MAX_RANKS uint64
 *                        flags; flag[kind][src] is written only by rank src
 * The region must start zero-filled (flags start at epoch 0).
 *
 * Handshakes. Every operation takes the next epoch e (a per-communicator
 * uint64 counter; all ranks call the same operations in the same order).
 * A flag value is (epoch << 32) | tag; the tag carries the operation and
 * its chunk byte size so mismatched shapes across ranks are detected
 * before any data moves:
 *   READY[src]    in rank b's region: src's chunk for epoch e is readable
 *                 (all-gather: src's own slot; reduce-scatter: src has
 *                 pushed its partial into b's slot src)
 *   CONSUMED[src] in rank b's region: src finished reading b's own slot
 *                 (all-gather pull done); b waits for it before it
 *                 overwrites its own slot again
 *   FREE[src]     in rank b's region: src's slot b may now be written
 *                 by b for epoch e (reduce-scatter push)
 * Flags are never reset: epochs only grow.
 *
 * Errors: every wait has a timeout; a timeout is TEC_ERR_TIMEOUT with a
 * message naming the communicator, the operation, the step and the peer
 * (tec_format_wait_error). Once a wait fails the communicator is broken:
 * later operations return the same error; close it.
 */

#define TEC_COMM_MAX_RANKS 16
#define TEC_COMM_HANDLE_MAX 256 /* bytes of a transport's local handle */
#define TEC_COMM_NEVENTS (TEC_COMM_MAX_RANKS + 8)

/* ARRIVED[rank] (own region): the last epoch this rank started; read by the
 * core on the CPU to name the peers that never arrived after a timeout. */
enum { TEC_FLAG_READY = 0, TEC_FLAG_CONSUMED = 1, TEC_FLAG_FREE = 2, TEC_FLAG_ARRIVED = 3, TEC_COMM_NFLAGS = 4 };

typedef enum { TEC_TRANSPORT_SHM = 0, TEC_TRANSPORT_CUDA_IPC = 1 } tec_transport_kind;

/* Where a wait sits in a schedule; passed by value to the transport so an
 * asynchronous (GPU) wait can report it later. Strings are static or live
 * as long as the communicator. */
typedef struct {
    const char *comm;   /* communicator name */
    const char *op;     /* "ag_gemm", "gemm_rs", "bulk_ag", "bulk_rs", "acquire" */
    const char *what;   /* "chunk ready", "chunk consumed", "slot free" */
    int rank, peer, step;
} tec_wait_site;

/* One step of a flag sequence (tec_transport_ops.flags): a signal
 * (*flag = value) or a wait (until flag's epoch reaches value's). */
typedef struct {
    uint64_t *flag;
    uint64_t value;
    int wait;           /* 1: wait, reported at `site`; 0: signal */
    int pad;
    tec_wait_site site;
} tec_flag_step;

/* Longest sequence a schedule hands to flags() at once (the longest is
 * three steps per peer: consumed waits, free signals, free waits). */
#define TEC_FLAG_STEPS_MAX (3 * TEC_COMM_MAX_RANKS)

/* The flag value for an epoch and tag. */
static inline uint64_t tec_flag_value(uint64_t epoch, uint32_t tag) { return (epoch << 32) | tag; }

/* Opaque transport state (one per communicator and rank). */
typedef struct tec_transport tec_transport;

/* Streams. Every data-moving call takes `stream`: either the transport's
 * own comm stream (the value comm_stream() returns) or a compute stream
 * (CUDA: the caller's cudaStream_t, NULL is the legacy default stream;
 * CPU: ignored, meaning "the calling thread"). Work on a stream runs in
 * the order it was enqueued; nothing here waits on the host unless said.
 *   CUDA: comm stream = a high-priority non-blocking stream of the
 *         transport; copies are cudaMemcpyAsync (copy engines), signals are
 *         8-byte flag writes into the mapped peer region issued on the
 *         stream (ordered after prior copies on that stream, with the
 *         needed system/device fence), waits are small spin kernels with a
 *         timeout (%globaltimer) that record failures for check().
 *   CPU:  comm stream = a FIFO executed by a comm thread; a compute-stream
 *         call runs synchronously on the calling thread. */
typedef struct tec_transport_ops {
    int abi_version; /* TEC_TRANSPORT_ABI */
    const char *name;
    /* Allocate this rank's zero-filled region of `bytes` on `device`. */
    tec_status (*create)(tec_transport **out, int device, int rank, int size, size_t bytes);
    /* Synchronize, unmap peers, free the region. NULL is a no-op. */
    void (*destroy)(tec_transport *t);
    /* Opaque bytes (<= TEC_COMM_HANDLE_MAX) a peer passes to map_peers. */
    tec_status (*local_handle)(tec_transport *t, void *out, size_t *len);
    /* Map every peer's region: handles[i]/lens[i] from rank i (own entry
     * ignored). bases[i] receives rank i's region address in this process
     * (bases[rank] = own region). */
    tec_status (*map_peers)(tec_transport *t, const void *const *handles, const size_t *lens, void **bases);
    /* Every peer has mapped this region: drop what keeps it openable by
     * name (CPU: shm_unlink). Optional (NULL). */
    tec_status (*release_handle)(tec_transport *t);
    /* Unmap peers (idempotent; destroy calls it). */
    void (*unmap_peers)(tec_transport *t);
    void *(*comm_stream)(tec_transport *t);
    /* Asynchronous copy of `bytes` (either side may be a mapped peer). */
    tec_status (*copy)(tec_transport *t, void *dst, const void *src, size_t bytes, void *stream);
    /* *flag = value (flag usually in a peer's region), ordered after all
     * earlier work on `stream` and visible to the peer after it. */
    tec_status (*signal)(tec_transport *t, uint64_t *flag, uint64_t value, void *stream);
    /* Make `stream` wait until (*flag >> 32) >= (value >> 32). When the
     * epochs are equal but the low 32 bits (tag) differ it fails with
     * TEC_ERR_INVALID_ARG (mismatched operation/shape); after timeout_s it
     * fails with TEC_ERR_TIMEOUT. Both messages via tec_format_wait_error.
     * On CUDA the failure is reported by check()/synchronize() and the
     * stream continues (the schedules then fail at their next call). */
    tec_status (*wait)(tec_transport *t, const uint64_t *flag, uint64_t value, double timeout_s,
                       tec_wait_site site, void *stream);
    /* Events 0..TEC_COMM_NEVENTS-1: record on one stream, make another
     * stream wait for the latest record (cudaEventRecord/cudaStreamWaitEvent
     * semantics: the wait captures the record made before it). */
    tec_status (*event_record)(tec_transport *t, int event, void *stream);
    tec_status (*event_wait)(tec_transport *t, int event, void *stream);
    /* out[r, c] = sum_{i < nsrc} srcs[i][r, c] (+ bias[c]) in float32, all
     * [rows, cols] contiguous of `dtype` (bias: [cols] or NULL), summed in
     * index order. */
    tec_status (*reduce)(tec_transport *t, void *out, const void *const *srcs, int nsrc, int64_t rows,
                         int64_t cols, tec_dtype dtype, const void *bias, void *stream);
    /* The host waits for all work on `stream`, then reports check(). */
    tec_status (*synchronize)(tec_transport *t, void *stream);
    /* Non-blocking: a failure recorded by asynchronous work (sticky). */
    tec_status (*check)(tec_transport *t);
    /* The calling thread's last error message inside the transport. */
    const char *(*last_error)(void);
    /* steps[0..n) in order on `stream`, each as signal() / wait() would run
     * it (timeout_s for every wait), as one operation: CUDA launches one
     * kernel for the whole sequence instead of one per step. After a failed
     * wait the rest of the sequence is skipped (the transport is broken). */
    tec_status (*flags)(tec_transport *t, const tec_flag_step *steps, int n, double timeout_s, void *stream);
} tec_transport_ops;

#define TEC_TRANSPORT_ABI 2

extern const tec_transport_ops tec_shm_transport;

/* The CUDA transport comes from the CUDA backend library:
 *   const tec_transport_ops *tec_cuda_transport_get(void);
 * looked up with tec_cuda_symbol("tec_cuda_transport_get"). `device` is the
 * CUDA ordinal; regions are cudaMalloc'd and shared with
 * cudaIpcGetMemHandle/cudaIpcOpenMemHandle. */
typedef const tec_transport_ops *(*tec_cuda_transport_get_fn)(void);

/* The message every transport gives a failed wait (snprintf into buf). */
static inline int tec_format_wait_error(char *buf, size_t n, tec_status st, tec_wait_site s,
                                        double timeout_s, uint64_t seen, uint64_t want)
{
    if (st == TEC_ERR_TIMEOUT)
        return snprintf(buf, n,
            "communicator '%s' rank %d: %s step %d timed out after %.3g s waiting for peer %d "
            "(%s for epoch %llu; the flag is at epoch %llu)",
            s.comm, s.rank, s.op, s.step, timeout_s, s.peer, s.what,
            (unsigned long long)(want >> 32), (unsigned long long)(seen >> 32));
    unsigned st_op = (unsigned)(seen & 0xffffffffu) >> 29, want_op = (unsigned)(want & 0xffffffffu) >> 29;
    return snprintf(buf, n,
        "communicator '%s' rank %d: %s step %d: peer %d is at the same epoch with a different "
        "operation or shape (%s): peer op %u chunk %llu bytes, here op %u chunk %llu bytes "
        "(mismatched shapes across ranks?)",
        s.comm, s.rank, s.op, s.step, s.peer, s.what, st_op,
        (unsigned long long)(seen & 0x1fffffffu), want_op, (unsigned long long)(want & 0x1fffffffu));
}

/* ---- the communicator */

typedef struct tec_comm tec_comm;

typedef struct {
    uint64_t ag_overlap, rs_overlap, bulk_ag, bulk_rs; /* overlapped paths run */
    uint64_t non_overlap; /* operations done without overlap (tp_size 1) */
    uint64_t chunks_sent, bytes_sent, waits;
} tec_comm_stats;

/* Create this rank's side: a buffer of `buffer_bytes` (rounded up to 256)
 * on `device`. name: used in error messages (copied). timeout_s > 0.
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
/* Every registered byte range: own region and mapped peers' (n <= MAX). */
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
typedef struct {
    const void *a_local;  /* NULL: already in the buffer slot */
    void *local_copy;     /* [rows, k] outside the buffer, or NULL */
    int64_t rows, k, n;   /* rows per chunk */
    tec_dtype dtype, out_dtype;
    const void *b; int64_t ldb; int transb;
    void *out; int64_t ldc;
    const void *bias;     /* [n] or NULL */
} tec_ag_gemm_args;
tec_status tec_comm_ag_gemm(tec_comm *c, const tec_ag_gemm_args *a, void *stream);

/* GEMM + reduce-scatter: out[rows, n] = sum over ranks of the partial
 * (A[tp*rows, k] @ op(B))[rank chunk] (+ bias, once), float32 sums.
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

#ifdef __cplusplus
}
#endif
#endif /* TEC_H */
