/* transport.h - internal: the interface a communication transport implements
 * for the schedules of csrc/core/comm.c, the layout of a communicator's
 * region and the flag wire format (the one place both are written down).
 * Implemented by csrc/core/cpu/shm_transport.c and
 * csrc/core/cuda/cuda_transport.cu; tests/c/comm_schedule_test.c drives the
 * schedules against a mock of it. Never included by csrc/python.
 *
 * Region layout (bytes, every offset 256-aligned), identical on all ranks:
 *   [0, data)            the user-visible buffer (get_buffer); split into
 *                        tp "slots" of chunk_bytes each by every operation
 *   [data, 2*data)       private staging for GEMM+RS partials (never read by
 *                        peers; written by this rank, copied to peers)
 *   [2*data, +flags)     TEC_COMM_NFLAGS kinds x TEC_COMM_MAX_RANKS uint64
 *                        flags; flag[kind][src] is written only by rank src
 *                        (EPOCH: this rank's own words, see below)
 * The region must start zero-filled (flags start at epoch 0).
 *
 * Handshakes. Every operation takes the next epoch e (a per-communicator
 * uint64 counter; all ranks call the same operations in the same order).
 * A flag value is tec_flag_value(e, tag); the tag carries the operation and
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
 *   ARRIVED[rank] (own region): the last epoch this rank started; read by
 *                 the core on the host to name the peers that never arrived
 *                 after a timeout (transports with TEC_TRANSPORT_HOST_FLAGS)
 * Flags are never reset: epochs only grow.
 *
 * Where the epoch comes from. Host transports take it from the values the
 * core computed (the core's counter). A transport with
 * TEC_TRANSPORT_DEVICE_EPOCHS takes it on the device when a step runs, from
 * this rank's EPOCH words: EPOCH[0] = the last epoch this rank completed,
 * EPOCH[1] = the epoch of the last all-gather of its own slot (0: none). A
 * step's value then contributes only its tag; its epoch is EPOCH[0] + 1
 * (TEC_EPOCH_OP) or EPOCH[1] (TEC_EPOCH_PUBLISHED, the CONSUMED waits). Every
 * operation over more than one rank ends with an ADVANCE step on the
 * caller's stream after the comm stream has joined it (EPOCH[0] += 1, and
 * EPOCH[1] = EPOCH[0] when the operation published our slot), so every step
 * of an operation sees the same epoch and the next operation the next one.
 * Nothing of an epoch is then baked into a launch: a CUDA graph captured
 * over the operations replays with fresh epochs every time, and eager calls
 * in between continue the same count.
 */
#ifndef TEC_TRANSPORT_H
#define TEC_TRANSPORT_H

#include <stdio.h>

#include "tec.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__CUDACC__)
#define TEC_HOST_DEVICE __host__ __device__
#else
#define TEC_HOST_DEVICE
#endif

#define TEC_COMM_NEVENTS (TEC_COMM_MAX_RANKS + 8)

enum { TEC_FLAG_READY = 0, TEC_FLAG_CONSUMED = 1, TEC_FLAG_FREE = 2, TEC_FLAG_ARRIVED = 3, TEC_FLAG_EPOCH = 4,
       TEC_COMM_NFLAGS = 5 };

/* ---------------------------------------------------------- wire format
 * A flag is 64 bits: the epoch in the high 32, the tag in the low 32; a tag
 * is the operation (3 bits, 1..4: ag_gemm, gemm_rs, bulk_ag, bulk_rs; 0 for
 * CONSUMED/ARRIVED) over the chunk's byte size (29 bits). */
#define TEC_FLAG_CHUNK_MAX 0x1fffffffu

static inline TEC_HOST_DEVICE uint64_t tec_flag_value(uint64_t epoch, uint32_t tag) { return (epoch << 32) | tag; }
static inline TEC_HOST_DEVICE uint32_t tec_flag_tag(unsigned op, size_t chunk)
{
    return ((uint32_t)op << 29) | (uint32_t)(chunk & TEC_FLAG_CHUNK_MAX);
}
static inline TEC_HOST_DEVICE uint64_t tec_flag_epoch(uint64_t v) { return v >> 32; }
static inline TEC_HOST_DEVICE unsigned tec_flag_op(uint64_t v) { return (unsigned)(v & 0xffffffffu) >> 29; }
static inline TEC_HOST_DEVICE uint64_t tec_flag_chunk(uint64_t v) { return v & TEC_FLAG_CHUNK_MAX; }

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
 * (*flag = value), a wait (until flag's epoch reaches value's) or, on
 * device-epoch transports only, the end of an operation (ADVANCE: the EPOCH
 * words move on; `flag` is EPOCH[0], `value` 1 when the operation published
 * this rank's slot). */
enum { TEC_STEP_SIGNAL = 0, TEC_STEP_WAIT = 1, TEC_STEP_ADVANCE = 2 };
/* Where a device-epoch transport takes a step's epoch from (see above). */
enum { TEC_EPOCH_OP = 0, TEC_EPOCH_PUBLISHED = 1 };
typedef struct {
    uint64_t *flag;
    uint64_t value;
    int kind;           /* TEC_STEP_*; a wait is reported at `site` */
    int epoch;          /* TEC_EPOCH_* */
    tec_wait_site site;
} tec_flag_step;

/* Longest sequence a schedule hands to flags() at once (the longest is
 * three steps per peer: consumed waits, free signals, free waits). */
#define TEC_FLAG_STEPS_MAX (3 * TEC_COMM_MAX_RANKS)

/* The message every transport gives a failed wait (snprintf into buf):
 * st is TEC_ERR_TIMEOUT, or TEC_ERR_INVALID_ARG for a tag mismatch. */
static inline int tec_format_wait_error(char *buf, size_t n, tec_status st, tec_wait_site s,
                                        double timeout_s, uint64_t seen, uint64_t want)
{
    if (st == TEC_ERR_TIMEOUT)
        return snprintf(buf, n,
            "communicator '%s' rank %d: %s step %d timed out after %.3g s waiting for peer %d "
            "(%s for epoch %llu; the flag is at epoch %llu)",
            s.comm, s.rank, s.op, s.step, timeout_s, s.peer, s.what,
            (unsigned long long)tec_flag_epoch(want), (unsigned long long)tec_flag_epoch(seen));
    return snprintf(buf, n,
        "communicator '%s' rank %d: %s step %d: peer %d is at the same epoch with a different "
        "operation or shape (%s): peer op %u chunk %llu bytes, here op %u chunk %llu bytes "
        "(mismatched shapes across ranks?)",
        s.comm, s.rank, s.op, s.step, s.peer, s.what, tec_flag_op(seen),
        (unsigned long long)tec_flag_chunk(seen), tec_flag_op(want), (unsigned long long)tec_flag_chunk(want));
}

/* ------------------------------------------------------------ the table */

/* Opaque transport state (one per communicator and rank). */
typedef struct tec_transport tec_transport;

/* What a transport can do (tec_transport_ops.caps); the schedules choose
 * their issue order from these, never from the device type. */
enum {
    /* A call on a compute stream is enqueued and returns at once (CUDA);
     * without it the call runs to completion on the calling thread (CPU).
     * The schedules then issue a compute stream's first GEMM before the
     * handshakes and copies instead of after them. */
    TEC_TRANSPORT_ASYNC = 1u << 0,
    /* The flags live in host memory the core may read directly (CPU):
     * each operation marks ARRIVED, and a timeout names the peers that
     * never arrived. */
    TEC_TRANSPORT_HOST_FLAGS = 1u << 1,
    /* Epochs are taken on the device when a step runs (see "Where the
     * epoch comes from"): the schedules end every operation with an
     * ADVANCE step, and a captured CUDA graph replays correctly. */
    TEC_TRANSPORT_DEVICE_EPOCHS = 1u << 2,
};

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
 *         call runs synchronously on the calling thread.
 * Errors: a failing call returns its status with the message set through
 * the core's tec_set_error (the CUDA library reaches it through the hooks
 * of backend.h). */
/* FP8 sources of a reduce (tec_transport_ops.reduce; NULL: sources of the
 * reduce's dtype): FP8 bytes of `format`, and source i's scale_inv the float
 * at (const char *)srcs[i] + scale_inv_offset (4-byte aligned), in the
 * source's own memory so that it travels with its bytes. */
typedef struct {
    tec_fp8_format format;
    size_t scale_inv_offset;
} tec_reduce_fp8;

typedef struct tec_transport_ops {
    int abi_version; /* TEC_TRANSPORT_ABI */
    const char *name;
    unsigned caps;   /* TEC_TRANSPORT_* */
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
     * peers (CPU: close the memfd's descriptor). Optional (NULL). */
    tec_status (*release_handle)(tec_transport *t);
    /* Unmap peers (idempotent; destroy calls it). */
    void (*unmap_peers)(tec_transport *t);
    void *(*comm_stream)(tec_transport *t);
    /* Asynchronous copy of `bytes` (either side may be a mapped peer). */
    tec_status (*copy)(tec_transport *t, void *dst, const void *src, size_t bytes, void *stream);
    /* *flag = value (flag usually in a peer's region), ordered after all
     * earlier work on `stream` and visible to the peer after it. */
    tec_status (*signal)(tec_transport *t, uint64_t *flag, uint64_t value, void *stream);
    /* Make `stream` wait until flag's epoch reaches value's. When the
     * epochs are equal but the tags differ it fails with
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
     * index order. With fp8 the sources are FP8 bytes instead, each value
     * decoded and multiplied by its source's scale_inv (tec_reduce_fp8)
     * before it is added; out and bias stay `dtype`. */
    tec_status (*reduce)(tec_transport *t, void *out, const void *const *srcs, int nsrc, int64_t rows,
                         int64_t cols, tec_dtype dtype, const void *bias, const tec_reduce_fp8 *fp8, void *stream);
    /* The host waits for all work on `stream`, then reports check(). */
    tec_status (*synchronize)(tec_transport *t, void *stream);
    /* Non-blocking: a failure recorded by asynchronous work (sticky). */
    tec_status (*check)(tec_transport *t);
    /* steps[0..n) in order on `stream`, each as signal() / wait() would run
     * it (timeout_s for every wait), as one operation: CUDA launches one
     * kernel for the whole sequence instead of one per step. After a failed
     * wait the rest of the sequence is skipped (the transport is broken).
     * `epochs`: this rank's EPOCH words, where a device-epoch transport
     * takes the steps' epochs from (NULL: the values' own epochs). */
    tec_status (*flags)(tec_transport *t, const tec_flag_step *steps, int n, double timeout_s, uint64_t *epochs,
                        void *stream);
} tec_transport_ops;

#define TEC_TRANSPORT_ABI 4 /* 4: device epochs (flags' epochs, step kinds); 3: caps; no last_error */

extern const tec_transport_ops tec_shm_transport;

#ifdef __cplusplus
}
#endif
#endif /* TEC_TRANSPORT_H */
