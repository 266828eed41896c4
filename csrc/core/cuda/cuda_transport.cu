/* cuda_transport.cu - the CUDA IPC transport of tec_comm (one node): regions
 * from cudaMalloc shared through cudaIpcGetMemHandle/cudaIpcOpenMemHandle,
 * copies with cudaMemcpyAsync (copy engines), signals (flag stores) and
 * waits (spins with a %globaltimer timeout whose failures land in pinned host
 * memory for check()) as steps of one-thread kernels. Exercised by
 * tests/cuda/transport_test.cu (two processes, one or two GPUs; build line
 * there) and by the communicator tests run with the CUDA transport.
 *
 * Ordering (see tec.h "Streams"). One <<<1,1>>> kernel runs a sequence of
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
 *   After a failure the transport is broken: later waits return at once and
 *   signals are suppressed (peers then time out rather than read data of a
 *   broken schedule); copies still run (data in a broken communicator is
 *   undefined).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

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
const int CT_REDUCE_THREADS = 256;

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
    const uint64_t want_epoch = want >> 32;
    const uint64_t start = ct_globaltimer();
    for (unsigned int it = 1;; it++) {
        const uint64_t seen = ct_load_acquire(flag);
        if ((seen >> 32) > want_epoch)
            return true;
        if ((seen >> 32) == want_epoch) {
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
 * first failed wait (later signals are then suppressed anyway). */
struct ct_flags_args {
    tec_flag_step steps[TEC_FLAG_STEPS_MAX];
    int n;
    uint64_t timeout_ns;
    double timeout_s;
    unsigned int *failed;
    ct_record *rec;
};
static_assert(sizeof(ct_flags_args) <= 4000, "ct_flags_args exceeds the kernel parameter space");

__global__ void __launch_bounds__(1) ct_flags_kernel(ct_flags_args a)
{
    for (int i = 0; i < a.n; i++) {
        const tec_flag_step &s = a.steps[i];
        if (s.wait) {
            if (!ct_spin(s.flag, s.value, a.timeout_ns, a.timeout_s, a.failed, a.rec, s.site))
                return;
        } else {
            ct_raise(s.flag, s.value, a.failed);
        }
    }
}

/* ---- reduce */

struct ct_reduce_args {
    const void *srcs[TEC_COMM_MAX_RANKS];
    void *out;
    const void *bias;
    int64_t n;    /* rows * cols elements */
    int64_t cols;
    int nsrc;
};

struct ct_f32 {
    typedef uint32_t raw;
    static __device__ __forceinline__ float load(raw r) { return __uint_as_float(r); }
    static __device__ __forceinline__ raw store(float f) { return __float_as_uint(f); }
};
struct ct_bf16 {
    typedef unsigned short raw;
    static __device__ __forceinline__ float load(raw r) { return __bfloat162float(__ushort_as_bfloat16(r)); }
    static __device__ __forceinline__ raw store(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};
struct ct_f16 {
    typedef unsigned short raw;
    static __device__ __forceinline__ float load(raw r) { return __half2float(__ushort_as_half(r)); }
    static __device__ __forceinline__ raw store(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

template <typename T, int V> struct alignas(sizeof(T) * V) ct_vec {
    T e[V];
};

/* One element j, in fp32, sources in index order, bias last. */
template <typename R> __device__ __forceinline__ void ct_reduce_one(const ct_reduce_args &a, int64_t j)
{
    typedef typename R::raw raw;
    float acc = R::load(static_cast<const raw *>(a.srcs[0])[j]);
    for (int s = 1; s < a.nsrc; s++)
        acc += R::load(static_cast<const raw *>(a.srcs[s])[j]);
    if (a.bias)
        acc += R::load(static_cast<const raw *>(a.bias)[j % a.cols]);
    static_cast<raw *>(a.out)[j] = R::store(acc);
}

/* V elements per thread and step (16-byte accesses when V > 1: every
 * pointer 16-aligned and, with a bias, cols % V == 0); the n % V tail is
 * summed element by element. */
template <typename R, int V> __global__ void __launch_bounds__(CT_REDUCE_THREADS) ct_reduce_kernel(ct_reduce_args a)
{
    typedef typename R::raw raw;
    typedef ct_vec<raw, V> vec;
    const int64_t items = a.n / V;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t i = first; i < items; i += stride) {
        float acc[V];
        vec v = static_cast<const vec *>(a.srcs[0])[i];
#pragma unroll
        for (int k = 0; k < V; k++)
            acc[k] = R::load(v.e[k]);
        for (int s = 1; s < a.nsrc; s++) {
            v = static_cast<const vec *>(a.srcs[s])[i];
#pragma unroll
            for (int k = 0; k < V; k++)
                acc[k] += R::load(v.e[k]);
        }
        if (a.bias) {
            v = *reinterpret_cast<const vec *>(static_cast<const raw *>(a.bias) + (i * V) % a.cols);
#pragma unroll
            for (int k = 0; k < V; k++)
                acc[k] += R::load(v.e[k]);
        }
        vec o;
#pragma unroll
        for (int k = 0; k < V; k++)
            o.e[k] = R::store(acc[k]);
        static_cast<vec *>(a.out)[i] = o;
    }
    if (V > 1 && first < a.n - items * V)
        ct_reduce_one<R>(a, items * V + first);
}

/* ================================================================= errors */

thread_local char ct_errbuf[1024];

/* "file:line: message" into the calling thread's transport error. */
__attribute__((format(printf, 4, 5))) tec_status ct_fail(tec_status st, const char *file, int line, const char *fmt,
                                                         ...)
{
    const char *slash = strrchr(file, '/');
    int n = snprintf(ct_errbuf, sizeof ct_errbuf, "%s:%d: CUDA IPC transport: ", slash ? slash + 1 : file, line);
    if (n < 0 || (size_t)n >= sizeof ct_errbuf)
        n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ct_errbuf + n, sizeof ct_errbuf - (size_t)n, fmt, ap);
    va_end(ap);
    return st;
}

tec_status ct_status_of(cudaError_t e) { return e == cudaErrorMemoryAllocation ? TEC_ERR_NO_MEMORY : TEC_ERR_CUDA; }

#define CT_FAIL(st, ...) ct_fail((st), __FILE__, __LINE__, __VA_ARGS__)

/* CUDA runtime calls. cudaGetLastError() resets the runtime's last-error
 * state so that a failure does not leak into the next, unrelated check. */
#define CT_CUDA_CHECK(call)                                                                       \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            (void)cudaGetLastError();                                                             \
            return CT_FAIL(ct_status_of(e_), "%s: %s (%s)", #call, cudaGetErrorString(e_),        \
                           cudaGetErrorName(e_));                                                 \
        }                                                                                         \
    } while (0)

#define CT_CUDA_CHECK_GOTO(call, st, label)                                                       \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            (void)cudaGetLastError();                                                             \
            (st) = CT_FAIL(ct_status_of(e_), "%s: %s (%s)", #call, cudaGetErrorString(e_),        \
                           cudaGetErrorName(e_));                                                 \
            goto label;                                                                           \
        }                                                                                         \
    } while (0)

void ct_ignore(cudaError_t e)
{
    if (e != cudaSuccess)
        (void)cudaGetLastError();
}

/* Make `device` current for the scope, restore the caller's on exit. */
class ct_device_scope {
  public:
    explicit ct_device_scope(int device) : device_(device)
    {
        err_ = cudaGetDevice(&prev_);
        if (err_ == cudaSuccess && prev_ != device)
            err_ = cudaSetDevice(device);
        if (err_ != cudaSuccess) {
            (void)cudaGetLastError();
            prev_ = device;
        }
    }
    ~ct_device_scope()
    {
        if (prev_ != device_)
            ct_ignore(cudaSetDevice(prev_));
    }
    cudaError_t error() const { return err_; }
    ct_device_scope(const ct_device_scope &) = delete;
    ct_device_scope &operator=(const ct_device_scope &) = delete;

  private:
    int device_, prev_ = -1;
    cudaError_t err_;
};

#define CT_ENTER(device)                                                                          \
    ct_device_scope ct_scope_(device);                                                            \
    if (ct_scope_.error() != cudaSuccess)                                                         \
    return CT_FAIL(TEC_ERR_CUDA, "cannot make cuda:%d current: %s (%s)", (device),                \
                   cudaGetErrorString(ct_scope_.error()), cudaGetErrorName(ct_scope_.error()))

#define CT_REQUIRE(cond, ...)                                                                     \
    do {                                                                                          \
        if (!(cond))                                                                              \
            return CT_FAIL(TEC_ERR_INVALID_ARG, __VA_ARGS__);                                     \
    } while (0)

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

bool ct_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* ============================================================= launchers */

template <typename R> tec_status ct_reduce_launch(const ct_reduce_args &a, int sm_count, cudaStream_t stream)
{
    constexpr int V = 16 / (int)sizeof(typename R::raw);
    bool vec = ct_aligned16(a.out) && (!a.bias || (ct_aligned16(a.bias) && a.cols % V == 0));
    for (int i = 0; i < a.nsrc; i++)
        vec = vec && ct_aligned16(a.srcs[i]);
    const int64_t items = vec ? (a.n + V - 1) / V : a.n;
    int64_t blocks = (items + CT_REDUCE_THREADS - 1) / CT_REDUCE_THREADS;
    const int64_t cap = (int64_t)(sm_count > 0 ? sm_count : 132) * 8;
    if (blocks > cap)
        blocks = cap;
    void *args[] = {(void *)&a};
    const void *fn = vec ? (const void *)ct_reduce_kernel<R, V> : (const void *)ct_reduce_kernel<R, 1>;
    CT_CUDA_CHECK(cudaLaunchKernel(fn, dim3((unsigned)blocks), dim3(CT_REDUCE_THREADS), args, 0, stream));
    return TEC_OK;
}

/* =============================================================== the ops */

tec_status ct_check(tec_transport *t);

void ct_unmap_peers(tec_transport *t)
{
    if (!t)
        return;
    ct_device_scope scope(t->device);
    bool any = false;
    for (int i = 0; i < t->size; i++)
        any = any || (i != t->rank && t->peer[i]);
    if (!any)
        return;
    /* Nothing of ours may still be reading or writing a peer region. */
    ct_ignore(cudaDeviceSynchronize());
    for (int i = 0; i < t->size; i++) {
        if (i == t->rank)
            continue;
        if (t->peer[i] && t->opened[i])
            ct_ignore(cudaIpcCloseMemHandle(t->peer[i]));
        t->peer[i] = NULL;
        t->opened[i] = 0;
    }
}

void ct_destroy(tec_transport *t)
{
    if (!t)
        return;
    {
        ct_device_scope scope(t->device);
        /* Waits or copies of any stream may still use the region or the
         * record: let the device drain (a failed wait ends at its timeout). */
        ct_ignore(cudaDeviceSynchronize());
        ct_unmap_peers(t);
        for (int i = 0; i < TEC_COMM_NEVENTS; i++)
            if (t->events[i])
                ct_ignore(cudaEventDestroy(t->events[i]));
        if (t->stream)
            ct_ignore(cudaStreamDestroy(t->stream));
        if (t->base)
            ct_ignore(cudaFree(t->base));
        if (t->failed)
            ct_ignore(cudaFree(t->failed));
        if (t->rec)
            ct_ignore(cudaFreeHost(t->rec));
    }
    free(t);
}

tec_status ct_create(tec_transport **out, int device, int rank, int size, size_t bytes)
{
    tec_status st = TEC_OK;
    tec_transport *t = NULL;
    int ndev = 0, least = 0, greatest = 0;
    CT_REQUIRE(out, "create: no output pointer");
    *out = NULL;
    CT_REQUIRE(size >= 1 && size <= TEC_COMM_MAX_RANKS && rank >= 0 && rank < size,
               "create: rank %d of %d (1..%d ranks supported)", rank, size, TEC_COMM_MAX_RANKS);
    CT_REQUIRE(bytes > 0 && bytes <= SIZE_MAX - CT_ALLOC_ROUND, "create: region of %zu bytes", bytes);
    CT_CUDA_CHECK(cudaGetDeviceCount(&ndev));
    CT_REQUIRE(device >= 0 && device < ndev, "create: device cuda:%d does not exist (%d visible)", device, ndev);
    CT_ENTER(device);
    t = (tec_transport *)calloc(1, sizeof *t);
    if (!t)
        return CT_FAIL(TEC_ERR_NO_MEMORY, "create: no host memory");
    t->device = device;
    t->rank = rank;
    t->size = size;
    t->bytes = bytes;
    t->alloc_bytes = (bytes + CT_ALLOC_ROUND - 1) / CT_ALLOC_ROUND * CT_ALLOC_ROUND;
    CT_CUDA_CHECK_GOTO(cudaDeviceGetAttribute(&t->sm_count, cudaDevAttrMultiProcessorCount, device), st, fail);
    CT_CUDA_CHECK_GOTO(cudaMalloc(&t->base, t->alloc_bytes), st, fail);
    CT_CUDA_CHECK_GOTO(cudaMemset(t->base, 0, t->alloc_bytes), st, fail);
    CT_CUDA_CHECK_GOTO(cudaMalloc((void **)&t->failed, 256), st, fail);
    CT_CUDA_CHECK_GOTO(cudaMemset(t->failed, 0, 256), st, fail);
    CT_CUDA_CHECK_GOTO(cudaHostAlloc((void **)&t->rec, sizeof(ct_record), cudaHostAllocMapped), st, fail);
    memset((void *)t->rec, 0, sizeof(ct_record));
    CT_CUDA_CHECK_GOTO(cudaHostGetDevicePointer((void **)&t->rec_dev, (void *)t->rec, 0), st, fail);
    CT_CUDA_CHECK_GOTO(cudaDeviceGetStreamPriorityRange(&least, &greatest), st, fail);
    CT_CUDA_CHECK_GOTO(cudaStreamCreateWithPriority(&t->stream, cudaStreamNonBlocking, greatest), st, fail);
    for (int i = 0; i < TEC_COMM_NEVENTS; i++)
        CT_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&t->events[i], cudaEventDisableTiming), st, fail);
    /* The zero fill must be complete before any peer can see the region. */
    CT_CUDA_CHECK_GOTO(cudaDeviceSynchronize(), st, fail);
    t->peer[rank] = t->base;
    *out = t;
    return TEC_OK;
fail:
    ct_destroy(t);
    return st;
}

tec_status ct_local_handle(tec_transport *t, void *out, size_t *len)
{
    CT_REQUIRE(t && out && len, "local_handle: null argument");
    CT_ENTER(t->device);
    tec_cuda_handle h;
    memset(&h, 0, sizeof h);
    h.magic = TEC_CUDA_HANDLE_MAGIC;
    h.bytes = t->bytes;
    h.alloc_bytes = t->alloc_bytes;
    h.proc_token = ct_proc_token();
    h.base = (uint64_t)(uintptr_t)t->base;
    h.pid = (int32_t)getpid();
    h.device = t->device;
    CT_CUDA_CHECK(cudaDeviceGetPCIBusId(h.pci_bus_id, (int)sizeof h.pci_bus_id, t->device));
    CT_CUDA_CHECK(cudaIpcGetMemHandle(&h.ipc, t->base));
    memcpy(out, &h, sizeof h);
    *len = sizeof h;
    return TEC_OK;
}

/* Map rank i's region into t->peer[i]. The caller's device is current. */
tec_status ct_map_one(tec_transport *t, int i, const void *hp, size_t len)
{
    tec_cuda_handle h;
    CT_REQUIRE(hp && len == sizeof h, "map_peers: rank %d's handle has %zu bytes, a CUDA IPC handle has %zu", i, len,
               sizeof h);
    memcpy(&h, hp, sizeof h);
    CT_REQUIRE(h.magic == TEC_CUDA_HANDLE_MAGIC, "map_peers: rank %d's handle is not a CUDA IPC handle", i);
    CT_REQUIRE(h.bytes == t->bytes && h.alloc_bytes >= h.bytes,
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
        CT_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, t->device, pdev));
        if (!can)
            return CT_FAIL(TEC_ERR_NOT_SUPPORTED,
                           "map_peers: cuda:%d cannot access rank %d's device cuda:%d (%s) directly (no peer "
                           "access between them); use the NCCL transport",
                           t->device, i, pdev, h.pci_bus_id);
        cudaError_t e = cudaDeviceEnablePeerAccess(pdev, 0);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            if (e != cudaErrorPeerAccessAlreadyEnabled)
                return CT_FAIL(TEC_ERR_CUDA, "map_peers: enabling peer access cuda:%d -> cuda:%d: %s (%s)",
                               t->device, pdev, cudaGetErrorString(e), cudaGetErrorName(e));
        }
    }
    if (h.pid == (int32_t)getpid() && h.proc_token == ct_proc_token()) {
        /* Same process: CUDA refuses to open our own handles, and the
         * address is valid here anyway (unified addressing). */
        CT_REQUIRE(pdev >= 0, "map_peers: rank %d is in this process but its device %s is not visible", i,
                   h.pci_bus_id);
        t->peer[i] = (void *)(uintptr_t)h.base;
        t->opened[i] = 0;
        return TEC_OK;
    }
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h.ipc, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return CT_FAIL(TEC_ERR_CUDA,
                       "map_peers: cudaIpcOpenMemHandle of rank %d's region (pid %d, device %s) on cuda:%d: %s (%s); "
                       "ranks on other nodes or without peer access need the NCCL transport",
                       i, (int)h.pid, h.pci_bus_id, t->device, cudaGetErrorString(e), cudaGetErrorName(e));
    }
    t->peer[i] = p;
    t->opened[i] = 1;
    return TEC_OK;
}

tec_status ct_map_peers(tec_transport *t, const void *const *handles, const size_t *lens, void **bases)
{
    tec_status st = TEC_OK;
    CT_REQUIRE(t && handles && lens && bases, "map_peers: null argument");
    for (int i = 0; i < t->size; i++)
        CT_REQUIRE(i == t->rank || !t->peer[i], "map_peers: peers are already mapped");
    {
        CT_ENTER(t->device);
        for (int i = 0; i < t->size; i++) {
            if (i != t->rank && (st = ct_map_one(t, i, handles[i], lens[i])) != TEC_OK)
                break;
        }
    }
    if (st != TEC_OK) {
        char msg[sizeof ct_errbuf];
        memcpy(msg, ct_errbuf, sizeof msg);
        ct_unmap_peers(t);
        memcpy(ct_errbuf, msg, sizeof msg);
        return st;
    }
    for (int i = 0; i < t->size; i++)
        bases[i] = t->peer[i];
    return TEC_OK;
}

void *ct_comm_stream(tec_transport *t) { return t ? (void *)t->stream : NULL; }

tec_status ct_copy(tec_transport *t, void *dst, const void *src, size_t bytes, void *stream)
{
    CT_REQUIRE(t, "copy: no transport");
    if (!bytes)
        return TEC_OK;
    CT_REQUIRE(dst && src, "copy: null pointer (dst %p, src %p)", dst, src);
    CT_ENTER(t->device);
    /* cudaMemcpyDefault: the direction follows from the (unified) addresses,
     * peer regions included; a copy engine does the work. */
    CT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)stream));
    return TEC_OK;
}

/* One ct_flags_kernel over steps[0..n) (checked by the caller). */
tec_status ct_launch_flags(tec_transport *t, const tec_flag_step *steps, int n, double timeout_s, void *stream)
{
    CT_ENTER(t->device);
    ct_flags_args a;
    memset(&a, 0, sizeof a);
    memcpy(a.steps, steps, (size_t)n * sizeof *steps);
    a.n = n;
    const double ns = timeout_s * 1e9;
    a.timeout_ns = ns >= 9.0e18 ? (uint64_t)9.0e18 : (uint64_t)ns;
    a.timeout_s = timeout_s;
    a.failed = t->failed;
    a.rec = t->rec_dev;
    void *args[] = {(void *)&a};
    CT_CUDA_CHECK(cudaLaunchKernel((const void *)ct_flags_kernel, dim3(1), dim3(1), args, 0, (cudaStream_t)stream));
    return TEC_OK;
}

/* A signal or a wait is a sequence of one step. */
tec_status ct_signal(tec_transport *t, uint64_t *flag, uint64_t value, void *stream)
{
    CT_REQUIRE(t, "signal: no transport");
    CT_REQUIRE(flag && ((uintptr_t)flag & 7u) == 0, "signal: flag %p is not an aligned 8-byte word", (void *)flag);
    tec_flag_step step;
    memset(&step, 0, sizeof step);
    step.flag = flag;
    step.value = value;
    return ct_launch_flags(t, &step, 1, 1.0, stream);
}

tec_status ct_wait(tec_transport *t, const uint64_t *flag, uint64_t value, double timeout_s, tec_wait_site site,
                   void *stream)
{
    CT_REQUIRE(t, "wait: no transport");
    tec_status st = ct_check(t); /* a broken transport stays broken */
    if (st != TEC_OK)
        return st;
    CT_REQUIRE(flag && ((uintptr_t)flag & 7u) == 0, "wait: flag %p is not an aligned 8-byte word", (const void *)flag);
    CT_REQUIRE(timeout_s > 0, "wait: timeout must be > 0 seconds");
    tec_flag_step step;
    memset(&step, 0, sizeof step);
    step.flag = (uint64_t *)flag; /* only read by a wait */
    step.value = value;
    step.wait = 1;
    step.site = site;
    return ct_launch_flags(t, &step, 1, timeout_s, stream);
}

tec_status ct_flags(tec_transport *t, const tec_flag_step *steps, int n, double timeout_s, void *stream)
{
    CT_REQUIRE(t, "flags: no transport");
    CT_REQUIRE(n >= 0 && n <= TEC_FLAG_STEPS_MAX && (steps || !n), "flags: %d steps (0..%d)", n, TEC_FLAG_STEPS_MAX);
    if (!n)
        return TEC_OK;
    int waits = 0;
    for (int i = 0; i < n; i++) {
        CT_REQUIRE(steps[i].flag && ((uintptr_t)steps[i].flag & 7u) == 0,
                   "flags: step %d's flag %p is not an aligned 8-byte word", i, (void *)steps[i].flag);
        waits += steps[i].wait != 0;
    }
    if (waits) {
        tec_status st = ct_check(t); /* a broken transport stays broken */
        if (st != TEC_OK)
            return st;
        CT_REQUIRE(timeout_s > 0, "flags: timeout must be > 0 seconds");
    }
    return ct_launch_flags(t, steps, n, timeout_s, stream);
}

tec_status ct_event_record(tec_transport *t, int ev, void *stream)
{
    CT_REQUIRE(t && ev >= 0 && ev < TEC_COMM_NEVENTS, "event_record: event %d out of range 0..%d", ev,
               TEC_COMM_NEVENTS - 1);
    CT_ENTER(t->device);
    CT_CUDA_CHECK(cudaEventRecord(t->events[ev], (cudaStream_t)stream));
    return TEC_OK;
}

tec_status ct_event_wait(tec_transport *t, int ev, void *stream)
{
    CT_REQUIRE(t && ev >= 0 && ev < TEC_COMM_NEVENTS, "event_wait: event %d out of range 0..%d", ev,
               TEC_COMM_NEVENTS - 1);
    CT_ENTER(t->device);
    CT_CUDA_CHECK(cudaStreamWaitEvent((cudaStream_t)stream, t->events[ev], 0));
    return TEC_OK;
}

tec_status ct_reduce(tec_transport *t, void *out, const void *const *srcs, int nsrc, int64_t rows, int64_t cols,
                     tec_dtype dtype, const void *bias, void *stream)
{
    CT_REQUIRE(t, "reduce: no transport");
    CT_REQUIRE(nsrc >= 1 && nsrc <= TEC_COMM_MAX_RANKS && srcs, "reduce of %d sources (1..%d)", nsrc,
               TEC_COMM_MAX_RANKS);
    CT_REQUIRE(rows >= 0 && cols >= 0 && (cols == 0 || rows <= INT64_MAX / cols), "reduce: bad shape [%lld, %lld]",
               (long long)rows, (long long)cols);
    CT_REQUIRE(dtype == TEC_F32 || dtype == TEC_BF16 || dtype == TEC_F16, "reduce: unknown dtype %d", (int)dtype);
    ct_reduce_args a;
    memset(&a, 0, sizeof a);
    a.n = rows * cols;
    if (a.n == 0)
        return TEC_OK;
    CT_REQUIRE(out, "reduce: no output");
    for (int i = 0; i < nsrc; i++) {
        CT_REQUIRE(srcs[i], "reduce: source %d is null", i);
        a.srcs[i] = srcs[i];
    }
    a.out = out;
    a.bias = bias;
    a.cols = cols;
    a.nsrc = nsrc;
    CT_ENTER(t->device);
    cudaStream_t s = (cudaStream_t)stream;
    switch (dtype) {
    case TEC_F32: return ct_reduce_launch<ct_f32>(a, t->sm_count, s);
    case TEC_BF16: return ct_reduce_launch<ct_bf16>(a, t->sm_count, s);
    case TEC_F16: return ct_reduce_launch<ct_f16>(a, t->sm_count, s);
    }
    return CT_FAIL(TEC_ERR_INTERNAL, "reduce: dtype %d", (int)dtype);
}

tec_status ct_check(tec_transport *t)
{
    CT_REQUIRE(t, "check: no transport");
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
        return CT_FAIL(TEC_ERR_INTERNAL, "check: corrupt failure record (status %d)", status);
    tec_format_wait_error(ct_errbuf, sizeof ct_errbuf, st, s, r->timeout_s, r->seen, r->want);
    return st;
}

tec_status ct_synchronize(tec_transport *t, void *stream)
{
    CT_REQUIRE(t, "synchronize: no transport");
    {
        CT_ENTER(t->device);
        CT_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)stream));
        if ((cudaStream_t)stream != t->stream)
            CT_CUDA_CHECK(cudaStreamSynchronize(t->stream));
    }
    return ct_check(t);
}

const char *ct_last_error(void) { return ct_errbuf; }

const tec_transport_ops ct_ops = {
    TEC_TRANSPORT_ABI,
    "cuda_ipc",
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
    ct_last_error,
    ct_flags,
};

} // namespace

extern "C" __attribute__((visibility("default"))) const tec_transport_ops *tec_cuda_transport_get(void)
{
    return &ct_ops;
}
