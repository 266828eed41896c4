/* cuda_transport.cu - the CUDA IPC transport of tec_comm (one node): regions
 * from cudaMalloc shared through cudaIpcGetMemHandle/cudaIpcOpenMemHandle,
 * copies with cudaMemcpyAsync (copy engines), signals (flag stores) and
 * waits (spins with a %globaltimer timeout whose failures land in pinned host
 * memory for check()) as steps of one-thread kernels. Exercised by
 * tests/cuda/transport_test.cu (two processes, one or two GPUs; build line
 * there) and by the communicator tests run with the CUDA transport.
 *
 * Ordering (see transport.h "Streams"). One <<<1,1>>> kernel runs a sequence of
 * steps on `stream` (flags(); signal() and wait() are sequences of one):
 *   signal  once the kernel starts, after every earlier
 *           operation of the stream has completed (copies included), then
 *           __threadfence_system() and st.release.sys of the 8-byte flag
 *           (usually in a peer's region, through the IPC mapping).
 *   wait    the kernel polls the flag with
 *           ld.acquire.sys until its epoch reaches the wanted one; later work
 *           on `stream` starts after the kernel ends. A tag mismatch at the
 *           same epoch or a timeout records the first failure (site, seen,
 *           wanted) into a host-mapped record and ends the kernel: the stream
 *           goes on, check()/synchronize() report the failure from then on.
 *   Steps run in order; a failed wait ends its kernel (a schedule's
 *   handshakes cost one launch instead of one per peer and step).
 *   Epochs (TEC_TRANSPORT_DEVICE_EPOCHS): the kernel builds each step's
 *   value from the rank's EPOCH words when it runs, and ADVANCE steps move
 *   them on, so launches carry no epoch and captured graphs replay.
 *   After a failure the transport is broken: later waits return at once and
 *   signals are suppressed (peers then time out rather than read data of a
 *   broken schedule); copies still run (data in a broken communicator is
 *   undefined).
 */
#include <atomic>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "cuda_common.h"
#include "cuda_transport.h"

static_assert(sizeof(tec_cuda_handle) <= TEC_COMM_HANDLE_MAX, "CUDA IPC handle too large");

/* The first failure of a wait kernel; written by the device (status last),
 * read by check() on the host. Pinned, mapped into the device. */
typedef struct {
    volatile int status; /* 0, TEC_ERR_TIMEOUT or TEC_ERR_INVALID_ARG */
    int pad;
    uint64_t seen, want;
    double timeout_s;
    tec_wait_site site;  /* strings live as long as the communicator */
} ct_record;

struct tec_transport {
    int device, rank, size, sm_count;
    size_t bytes;       /* region bytes asked for (what peers may touch) */
    size_t alloc_bytes; /* allocated: bytes rounded up to 2 MiB */
    void *base;
    void *peer[TEC_COMM_MAX_RANKS];          /* peer regions here (peer[rank] = base) */
    unsigned char opened[TEC_COMM_MAX_RANKS]; /* peer[i] came from cudaIpcOpenMemHandle */
    cudaStream_t stream;                      /* the comm stream */
    cudaEvent_t events[TEC_COMM_NEVENTS];
    unsigned int *failed; /* device word: nonzero once a wait failed */
    ct_record *rec;       /* host view */
    ct_record *rec_dev;   /* device view of the same record */
};

namespace {

const size_t CT_ALLOC_ROUND = (size_t)2 << 20;

/* ================================================================ kernels */

__device__ __forceinline__ uint64_t ct_globaltimer()
{
    uint64_t ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return ns;
}

__device__ __forceinline__ uint64_t ct_load_acquire(const uint64_t *p)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#else
    uint64_t v = *(const volatile uint64_t *)p;
    __threadfence_system();
    return v;
#endif
}

__device__ __forceinline__ void ct_store_release(uint64_t *p, uint64_t v)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("st.release.sys.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
#else
    __threadfence_system();
    *(volatile uint64_t *)p = v;
#endif
}

__device__ __forceinline__ void ct_pause()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    __nanosleep(128);
#endif
}

/* First failure wins (the claim is a device-memory word: every kernel that
 * touches it runs on this transport's device). */
__device__ void ct_record_failure(unsigned int *failed, ct_record *r, uint64_t want, double timeout_s,
                                  const tec_wait_site &site, int status, uint64_t seen)
{
    if (atomicCAS(failed, 0u, 1u) != 0u)
        return;
    r->seen = seen;
    r->want = want;
    r->timeout_s = timeout_s;
    r->site = site;
    __threadfence_system();
    r->status = status;
    __threadfence_system();
}

/* Spin until (*flag >> 32) >= (want >> 32); see the file comment. Returns
 * false once the transport is broken (by this wait or another). */
__device__ bool ct_spin(const uint64_t *flag, uint64_t want, uint64_t timeout_ns, double timeout_s,
                        unsigned int *failed, ct_record *rec, const tec_wait_site &site)
{
    const volatile unsigned int *vfailed = failed;
    if (*vfailed)
        return false;
    const uint64_t want_epoch = tec_flag_epoch(want);
    const uint64_t start = ct_globaltimer();
    for (unsigned int it = 1;; it++) {
        const uint64_t seen = ct_load_acquire(flag);
        if (tec_flag_epoch(seen) > want_epoch)
            return true;
        if (tec_flag_epoch(seen) == want_epoch) {
            if ((uint32_t)seen == (uint32_t)want)
                return true;
            ct_record_failure(failed, rec, want, timeout_s, site, TEC_ERR_INVALID_ARG, seen);
            return false;
        }
        if ((it & 31u) == 0u) {
            if (*vfailed)
                return false; /* another wait already broke the transport */
            if (ct_globaltimer() - start >= timeout_ns) {
                ct_record_failure(failed, rec, want, timeout_s, site, TEC_ERR_TIMEOUT, seen);
                return false;
            }
        }
        if (it > 2048u)
            ct_pause();
    }
}

/* *flag = value after all earlier work of the stream (kernel start order),
 * visible system-wide; suppressed once the transport is broken. */
__device__ __forceinline__ void ct_raise(uint64_t *flag, uint64_t value, const unsigned int *failed)
{
    if (*(const volatile unsigned int *)failed)
        return;
    __threadfence_system();
    ct_store_release(flag, value);
}

/* A whole flag sequence in one kernel: steps in order, stopping at the
 * first failed wait (later signals are then suppressed anyway). With
 * `epochs` (the rank's EPOCH words, transport.h) a step's epoch is read
 * here, when the step runs, so a captured graph replays with fresh epochs;
 * without, the values are used as given (ct_signal, ct_wait). */
struct ct_flags_args {
    tec_flag_step steps[TEC_FLAG_STEPS_MAX];
    int n;
    uint64_t timeout_ns;
    double timeout_s;
    unsigned int *failed;
    ct_record *rec;
    uint64_t *epochs;
};
static_assert(sizeof(ct_flags_args) <= 4000, "ct_flags_args exceeds the kernel parameter space");

__global__ void __launch_bounds__(1) ct_flags_kernel(ct_flags_args a)
{
    for (int i = 0; i < a.n; i++) {
        const tec_flag_step &s = a.steps[i];
        uint64_t value = s.value;
        if (a.epochs) {
            /* Earlier kernels wrote the words (stream / event order); this
             * thread is the only one touching them now. */
            volatile uint64_t *ep = a.epochs;
            if (s.kind == TEC_STEP_ADVANCE) {
                const uint64_t e = ep[0] + 1;
                ep[0] = e;
                if (s.value)
                    ep[1] = e;
                continue;
            }
            const uint64_t e = s.epoch == TEC_EPOCH_PUBLISHED ? ep[1] : ep[0] + 1;
            if (s.epoch == TEC_EPOCH_PUBLISHED && e == 0)
                continue; /* nothing published yet: nothing to wait for */
            value = tec_flag_value(e, (uint32_t)s.value);
        }
        if (s.kind == TEC_STEP_WAIT) {
            if (!ct_spin(s.flag, value, a.timeout_ns, a.timeout_s, a.failed, a.rec, s.site))
                return;
        } else if (s.kind == TEC_STEP_SIGNAL) {
            ct_raise(s.flag, value, a.failed);
        }
    }
}

/* ================================================================ helpers */

/* Random per process; with the pid it tells "this very process" apart from
 * a forked child or a process with the same pid in another namespace. */
uint64_t ct_proc_token()
{
    static const uint64_t token = [] {
        uint64_t v = 0;
        if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v)
            v = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)&v;
        return v | 1u;
    }();
    return token;
}

/* ============================================================= launchers */

/* =============================================================== the ops */

tec_status ct_check(tec_transport *t);

void ct_unmap_peers(tec_transport *t)
{
    if (!t)
        return;
    tec_cuda_device_scope scope(t->device);
    bool any = false;
    for (int i = 0; i < t->size; i++)
        any = any || (i != t->rank && t->peer[i]);
    if (!any)
        return;
    /* Nothing of ours may still be reading or writing a peer region. */
    tec_cuda_ignore(cudaDeviceSynchronize());
    for (int i = 0; i < t->size; i++) {
        if (i == t->rank)
            continue;
        if (t->peer[i] && t->opened[i])
            tec_cuda_ignore(cudaIpcCloseMemHandle(t->peer[i]));
        t->peer[i] = NULL;
        t->opened[i] = 0;
    }
}

void ct_destroy(tec_transport *t)
{
    if (!t)
        return;
    {
        tec_cuda_device_scope scope(t->device);
        /* Waits or copies of any stream may still use the region or the
         * record: let the device drain (a failed wait ends at its timeout). */
        tec_cuda_ignore(cudaDeviceSynchronize());
        ct_unmap_peers(t);
        for (int i = 0; i < TEC_COMM_NEVENTS; i++)
            if (t->events[i])
                tec_cuda_ignore(cudaEventDestroy(t->events[i]));
        if (t->stream)
            tec_cuda_ignore(cudaStreamDestroy(t->stream));
        if (t->base)
            tec_cuda_ignore(cudaFree(t->base));
        if (t->failed)
            tec_cuda_ignore(cudaFree(t->failed));
        if (t->rec)
            tec_cuda_ignore(cudaFreeHost(t->rec));
    }
    free(t);
}

tec_status ct_create(tec_transport **out, int device, int rank, int size, size_t bytes)
{
    tec_status st = TEC_OK;
    tec_transport *t = NULL;
    int ndev = 0, least = 0, greatest = 0;
    TEC_CUDA_REQUIRE(out, "create: no output pointer");
    *out = NULL;
    TEC_CUDA_REQUIRE(size >= 1 && size <= TEC_COMM_MAX_RANKS && rank >= 0 && rank < size,
               "create: rank %d of %d (1..%d ranks supported)", rank, size, TEC_COMM_MAX_RANKS);
    TEC_CUDA_REQUIRE(bytes > 0 && bytes <= SIZE_MAX - CT_ALLOC_ROUND, "create: region of %zu bytes", bytes);
    TEC_CUDA_CHECK(cudaGetDeviceCount(&ndev));
    TEC_CUDA_REQUIRE(device >= 0 && device < ndev, "create: device cuda:%d does not exist (%d visible)", device, ndev);
    TEC_CUDA_ENTER(device);
    t = (tec_transport *)calloc(1, sizeof *t);
    if (!t)
        return TEC_CUDA_FAIL(TEC_ERR_NO_MEMORY, "create: no host memory");
    t->device = device;
    t->rank = rank;
    t->size = size;
    t->bytes = bytes;
    t->alloc_bytes = (bytes + CT_ALLOC_ROUND - 1) / CT_ALLOC_ROUND * CT_ALLOC_ROUND;
    if ((st = tec_cuda_sm_count(device, &t->sm_count)) != TEC_OK)
        goto fail;
    TEC_CUDA_CHECK_GOTO(cudaMalloc(&t->base, t->alloc_bytes), st, fail);
    TEC_CUDA_CHECK_GOTO(cudaMemset(t->base, 0, t->alloc_bytes), st, fail);
    TEC_CUDA_CHECK_GOTO(cudaMalloc((void **)&t->failed, 256), st, fail);
    TEC_CUDA_CHECK_GOTO(cudaMemset(t->failed, 0, 256), st, fail);
    TEC_CUDA_CHECK_GOTO(cudaHostAlloc((void **)&t->rec, sizeof(ct_record), cudaHostAllocMapped), st, fail);
    memset((void *)t->rec, 0, sizeof(ct_record));
    TEC_CUDA_CHECK_GOTO(cudaHostGetDevicePointer((void **)&t->rec_dev, (void *)t->rec, 0), st, fail);
    TEC_CUDA_CHECK_GOTO(cudaDeviceGetStreamPriorityRange(&least, &greatest), st, fail);
    TEC_CUDA_CHECK_GOTO(cudaStreamCreateWithPriority(&t->stream, cudaStreamNonBlocking, greatest), st, fail);
    for (int i = 0; i < TEC_COMM_NEVENTS; i++)
        TEC_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&t->events[i], cudaEventDisableTiming), st, fail);
    /* The zero fill must be complete before any peer can see the region. */
    TEC_CUDA_CHECK_GOTO(cudaDeviceSynchronize(), st, fail);
    t->peer[rank] = t->base;
    *out = t;
    return TEC_OK;
fail:
    ct_destroy(t);
    return st;
}

tec_status ct_local_handle(tec_transport *t, void *out, size_t *len)
{
    TEC_CUDA_REQUIRE(t && out && len, "local_handle: null argument");
    TEC_CUDA_ENTER(t->device);
    tec_cuda_handle h;
    memset(&h, 0, sizeof h);
    h.magic = TEC_CUDA_HANDLE_MAGIC;
    h.bytes = t->bytes;
    h.alloc_bytes = t->alloc_bytes;
    h.proc_token = ct_proc_token();
    h.base = (uint64_t)(uintptr_t)t->base;
    h.pid = (int32_t)getpid();
    h.device = t->device;
    TEC_CUDA_CHECK(cudaDeviceGetPCIBusId(h.pci_bus_id, (int)sizeof h.pci_bus_id, t->device));
    TEC_CUDA_CHECK(cudaIpcGetMemHandle(&h.ipc, t->base));
    memcpy(out, &h, sizeof h);
    *len = sizeof h;
    return TEC_OK;
}

/* Map rank i's region into t->peer[i]. The caller's device is current. */
tec_status ct_map_one(tec_transport *t, int i, const void *hp, size_t len)
{
    tec_cuda_handle h;
    TEC_CUDA_REQUIRE(hp && len == sizeof h, "map_peers: rank %d's handle has %zu bytes, a CUDA IPC handle has %zu", i, len,
               sizeof h);
    memcpy(&h, hp, sizeof h);
    TEC_CUDA_REQUIRE(h.magic == TEC_CUDA_HANDLE_MAGIC, "map_peers: rank %d's handle is not a CUDA IPC handle", i);
    TEC_CUDA_REQUIRE(h.bytes == t->bytes && h.alloc_bytes >= h.bytes,
               "map_peers: rank %d's region has %llu bytes, this rank's %zu (mismatched buffer sizes)", i,
               (unsigned long long)h.bytes, t->bytes);
    h.pci_bus_id[sizeof h.pci_bus_id - 1] = 0;
    /* The owner's device as numbered in this process (-1: not visible here,
     * which CUDA IPC allows). */
    int pdev = -1;
    if (cudaDeviceGetByPCIBusId(&pdev, h.pci_bus_id) != cudaSuccess) {
        (void)cudaGetLastError();
        pdev = -1;
    }
    if (pdev >= 0 && pdev != t->device) {
        int can = 0;
        TEC_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, t->device, pdev));
        if (!can)
            return TEC_CUDA_FAIL(TEC_ERR_NOT_SUPPORTED,
                           "map_peers: cuda:%d cannot access rank %d's device cuda:%d (%s) directly (no peer "
                           "access between them); userbuffers overlap needs peer access: build the layers without ub_* flags "
                           "(their collectives then go through NCCL)",
                           t->device, i, pdev, h.pci_bus_id);
        cudaError_t e = cudaDeviceEnablePeerAccess(pdev, 0);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            if (e != cudaErrorPeerAccessAlreadyEnabled)
                return TEC_CUDA_FAIL(TEC_ERR_CUDA, "map_peers: enabling peer access cuda:%d -> cuda:%d: %s (%s)",
                               t->device, pdev, cudaGetErrorString(e), cudaGetErrorName(e));
        }
    }
    if (h.pid == (int32_t)getpid() && h.proc_token == ct_proc_token()) {
        /* Same process: CUDA refuses to open our own handles, and the
         * address is valid here anyway (unified addressing). */
        TEC_CUDA_REQUIRE(pdev >= 0, "map_peers: rank %d is in this process but its device %s is not visible", i,
                   h.pci_bus_id);
        t->peer[i] = (void *)(uintptr_t)h.base;
        t->opened[i] = 0;
        return TEC_OK;
    }
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h.ipc, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return TEC_CUDA_FAIL(TEC_ERR_CUDA,
                       "map_peers: cudaIpcOpenMemHandle of rank %d's region (pid %d, device %s) on cuda:%d: %s (%s); "
                       "userbuffers overlap needs every rank on this node with peer access; without ub_* flags the layers' "
                       "collectives go through NCCL",
                       i, (int)h.pid, h.pci_bus_id, t->device, cudaGetErrorString(e), cudaGetErrorName(e));
    }
    t->peer[i] = p;
    t->opened[i] = 1;
    return TEC_OK;
}

tec_status ct_map_peers(tec_transport *t, const void *const *handles, const size_t *lens, void **bases)
{
    tec_status st = TEC_OK;
    TEC_CUDA_REQUIRE(t && handles && lens && bases, "map_peers: null argument");
    for (int i = 0; i < t->size; i++)
        TEC_CUDA_REQUIRE(i == t->rank || !t->peer[i], "map_peers: peers are already mapped");
    {
        TEC_CUDA_ENTER(t->device);
        for (int i = 0; i < t->size; i++) {
            if (i != t->rank && (st = ct_map_one(t, i, handles[i], lens[i])) != TEC_OK)
                break;
        }
    }
    if (st != TEC_OK) {
        ct_unmap_peers(t); /* sets no message: the failure's stays */
        return st;
    }
    for (int i = 0; i < t->size; i++)
        bases[i] = t->peer[i];
    return TEC_OK;
}

void *ct_comm_stream(tec_transport *t) { return t ? (void *)t->stream : NULL; }

tec_status ct_copy(tec_transport *t, void *dst, const void *src, size_t bytes, void *stream)
{
    TEC_CUDA_REQUIRE(t, "copy: no transport");
    if (!bytes)
        return TEC_OK;
    TEC_CUDA_REQUIRE(dst && src, "copy: null pointer (dst %p, src %p)", dst, src);
    TEC_CUDA_ENTER(t->device);
    /* cudaMemcpyDefault: the direction follows from the (unified) addresses,
     * peer regions included; a copy engine does the work. */
    TEC_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)stream));
    return TEC_OK;
}

/* One ct_flags_kernel over steps[0..n) (checked by the caller). */
tec_status ct_launch_flags(tec_transport *t, const tec_flag_step *steps, int n, double timeout_s, uint64_t *epochs,
                           void *stream)
{
    TEC_CUDA_ENTER(t->device);
    ct_flags_args a;
    memset(&a, 0, sizeof a);
    memcpy(a.steps, steps, (size_t)n * sizeof *steps);
    a.n = n;
    const double ns = timeout_s * 1e9;
    a.timeout_ns = ns >= 9.0e18 ? (uint64_t)9.0e18 : (uint64_t)ns;
    a.timeout_s = timeout_s;
    a.failed = t->failed;
    a.rec = t->rec_dev;
    a.epochs = epochs;
    ct_flags_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(a);
    TEC_CUDA_LAUNCH_CHECK("the flag kernel");
    return TEC_OK;
}

/* A signal or a wait is a sequence of one step. */
tec_status ct_signal(tec_transport *t, uint64_t *flag, uint64_t value, void *stream)
{
    TEC_CUDA_REQUIRE(t, "signal: no transport");
    TEC_CUDA_REQUIRE(flag && ((uintptr_t)flag & 7u) == 0, "signal: flag %p is not an aligned 8-byte word", (void *)flag);
    tec_flag_step step;
    memset(&step, 0, sizeof step);
    step.flag = flag;
    step.value = value;
    step.kind = TEC_STEP_SIGNAL;
    return ct_launch_flags(t, &step, 1, 1.0, NULL, stream);
}

tec_status ct_wait(tec_transport *t, const uint64_t *flag, uint64_t value, double timeout_s, tec_wait_site site,
                   void *stream)
{
    TEC_CUDA_REQUIRE(t, "wait: no transport");
    tec_status st = ct_check(t); /* a broken transport stays broken */
    if (st != TEC_OK)
        return st;
    TEC_CUDA_REQUIRE(flag && ((uintptr_t)flag & 7u) == 0, "wait: flag %p is not an aligned 8-byte word", (const void *)flag);
    TEC_CUDA_REQUIRE(timeout_s > 0, "wait: timeout must be > 0 seconds");
    tec_flag_step step;
    memset(&step, 0, sizeof step);
    step.flag = (uint64_t *)flag; /* only read by a wait */
    step.value = value;
    step.kind = TEC_STEP_WAIT;
    step.site = site;
    return ct_launch_flags(t, &step, 1, timeout_s, NULL, stream);
}

tec_status ct_flags(tec_transport *t, const tec_flag_step *steps, int n, double timeout_s, uint64_t *epochs,
                    void *stream)
{
    TEC_CUDA_REQUIRE(t, "flags: no transport");
    TEC_CUDA_REQUIRE(n >= 0 && n <= TEC_FLAG_STEPS_MAX && (steps || !n), "flags: %d steps (0..%d)", n, TEC_FLAG_STEPS_MAX);
    if (!n)
        return TEC_OK;
    int waits = 0;
    for (int i = 0; i < n; i++) {
        TEC_CUDA_REQUIRE(steps[i].flag && ((uintptr_t)steps[i].flag & 7u) == 0,
                   "flags: step %d's flag %p is not an aligned 8-byte word", i, (void *)steps[i].flag);
        TEC_CUDA_REQUIRE(steps[i].kind == TEC_STEP_SIGNAL || steps[i].kind == TEC_STEP_WAIT ||
                             (steps[i].kind == TEC_STEP_ADVANCE && epochs),
                         "flags: step %d of kind %d%s", i, steps[i].kind,
                         steps[i].kind == TEC_STEP_ADVANCE ? " without the epoch words" : "");
        waits += steps[i].kind == TEC_STEP_WAIT;
    }
    if (waits) {
        tec_status st = ct_check(t); /* a broken transport stays broken */
        if (st != TEC_OK)
            return st;
        TEC_CUDA_REQUIRE(timeout_s > 0, "flags: timeout must be > 0 seconds");
    }
    TEC_CUDA_REQUIRE(!epochs || ((uintptr_t)epochs & 7u) == 0, "flags: epoch words %p are not aligned",
                     (void *)epochs);
    return ct_launch_flags(t, steps, n, timeout_s, epochs, stream);
}

tec_status ct_event_record(tec_transport *t, int ev, void *stream)
{
    TEC_CUDA_REQUIRE(t && ev >= 0 && ev < TEC_COMM_NEVENTS, "event_record: event %d out of range 0..%d", ev,
               TEC_COMM_NEVENTS - 1);
    TEC_CUDA_ENTER(t->device);
    TEC_CUDA_CHECK(cudaEventRecord(t->events[ev], (cudaStream_t)stream));
    return TEC_OK;
}

tec_status ct_event_wait(tec_transport *t, int ev, void *stream)
{
    TEC_CUDA_REQUIRE(t && ev >= 0 && ev < TEC_COMM_NEVENTS, "event_wait: event %d out of range 0..%d", ev,
               TEC_COMM_NEVENTS - 1);
    TEC_CUDA_ENTER(t->device);
    TEC_CUDA_CHECK(cudaStreamWaitEvent((cudaStream_t)stream, t->events[ev], 0));
    return TEC_OK;
}

tec_status ct_reduce(tec_transport *t, void *out, const void *const *srcs, int nsrc, int64_t rows, int64_t cols,
                     tec_dtype dtype, const void *bias, const tec_reduce_fp8 *fp8, void *stream)
{
    TEC_CUDA_REQUIRE(t, "reduce: no transport");
    TEC_CUDA_REQUIRE(nsrc >= 1 && nsrc <= TEC_COMM_MAX_RANKS && srcs, "reduce of %d sources (1..%d)", nsrc,
               TEC_COMM_MAX_RANKS);
    TEC_CUDA_REQUIRE(rows >= 0 && cols >= 0 && (cols == 0 || rows <= INT64_MAX / cols), "reduce: bad shape [%lld, %lld]",
               (long long)rows, (long long)cols);
    TEC_CUDA_REQUIRE(dtype == TEC_F32 || dtype == TEC_BF16 || dtype == TEC_F16, "reduce: unknown dtype %d", (int)dtype);
    if (rows * cols == 0)
        return TEC_OK;
    TEC_CUDA_REQUIRE(out, "reduce: no output");
    for (int i = 0; i < nsrc; i++)
        TEC_CUDA_REQUIRE(srcs[i], "reduce: source %d is null", i);
    if (fp8) {
        TEC_CUDA_REQUIRE(fp8->format == TEC_FP8_E4M3 || fp8->format == TEC_FP8_E5M2, "reduce: FP8 format %d",
                         (int)fp8->format);
        TEC_CUDA_REQUIRE(fp8->scale_inv_offset % 4 == 0, "reduce: scale_inv offset %zu is not 4-byte aligned",
                         fp8->scale_inv_offset);
    }
    TEC_CUDA_ENTER(t->device);
    return ct_reduce_run(out, srcs, nsrc, rows, cols, dtype, bias, fp8, t->sm_count, (cudaStream_t)stream);
}

tec_status ct_check(tec_transport *t)
{
    TEC_CUDA_REQUIRE(t, "check: no transport");
    const int status = t->rec->status;
    if (!status)
        return TEC_OK;
    std::atomic_thread_fence(std::memory_order_acquire);
    const volatile ct_record *r = t->rec;
    tec_wait_site s;
    s.comm = r->site.comm ? r->site.comm : "?";
    s.op = r->site.op ? r->site.op : "?";
    s.what = r->site.what ? r->site.what : "?";
    s.rank = r->site.rank;
    s.peer = r->site.peer;
    s.step = r->site.step;
    const tec_status st = (tec_status)status;
    if (st != TEC_ERR_TIMEOUT && st != TEC_ERR_INVALID_ARG)
        return TEC_CUDA_FAIL(TEC_ERR_INTERNAL, "check: corrupt failure record (status %d)", status);
    char msg[1024];
    tec_format_wait_error(msg, sizeof msg, st, s, r->timeout_s, r->seen, r->want);
    return tec_cuda_report(st, msg); /* worded as the CPU transport words it */
}

tec_status ct_synchronize(tec_transport *t, void *stream)
{
    TEC_CUDA_REQUIRE(t, "synchronize: no transport");
    {
        TEC_CUDA_ENTER(t->device);
        TEC_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)stream));
        if ((cudaStream_t)stream != t->stream)
            TEC_CUDA_CHECK(cudaStreamSynchronize(t->stream));
    }
    return ct_check(t);
}

} // namespace

const tec_transport_ops tec_cuda_transport = {
    TEC_TRANSPORT_ABI,
    "cuda_ipc",
    /* caps: streams run apart from the host; flags live in device memory and
     * so do the epochs (a captured CUDA graph replays with fresh ones) */
    TEC_TRANSPORT_ASYNC | TEC_TRANSPORT_DEVICE_EPOCHS,
    ct_create,
    ct_destroy,
    ct_local_handle,
    ct_map_peers,
    NULL, /* release_handle: an IPC handle cannot be revoked; nothing to drop */
    ct_unmap_peers,
    ct_comm_stream,
    ct_copy,
    ct_signal,
    ct_wait,
    ct_event_record,
    ct_event_wait,
    ct_reduce,
    ct_synchronize,
    ct_check,
    ct_flags,
};
