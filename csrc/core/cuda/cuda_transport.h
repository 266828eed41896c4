/* cuda_transport.h - private header of the CUDA IPC transport of tec_comm
 * (csrc/core/cuda/cuda_transport.cu): the layout of the handle a rank passes
 * to its peers, and the entry of the reduce's kernels (transport_reduce.cu).
 * The table itself, tec_cuda_transport, is declared in cuda_common.h and
 * reaches the core through the backend table. Used by the transport and by
 * tests/cuda/transport_test.cu (build line in that file). */
#ifndef TEC_CUDA_TRANSPORT_H
#define TEC_CUDA_TRANSPORT_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_common.h"

/* What local_handle() writes (opaque to everyone else). A peer in another
 * process opens `ipc`; a peer in the same process (same pid and process
 * token) uses `base` directly, since CUDA IPC handles cannot be opened by the
 * process that exported them. */
#define TEC_CUDA_HANDLE_MAGIC 0x7463697063763031ull /* "tcipcv01" */
typedef struct {
    uint64_t magic;
    uint64_t bytes;        /* region bytes requested at create */
    uint64_t alloc_bytes;  /* bytes actually allocated (>= bytes) */
    uint64_t proc_token;   /* random per process (with pid: "same process") */
    uint64_t base;         /* region address in the owner's process */
    int32_t pid;
    int32_t device;        /* CUDA ordinal in the owner's process */
    char pci_bus_id[32];   /* to find the owner's device in this process */
    cudaIpcMemHandle_t ipc;
} tec_cuda_handle;

/* The reduce's kernels (transport_reduce.cu), on `s`; ct_reduce checked the
 * arguments (at most TEC_COMM_MAX_RANKS sources, none NULL, rows * cols > 0)
 * and made the device current. */
tec_status ct_reduce_run(void *out, const void *const *srcs, int nsrc, int64_t rows, int64_t cols, tec_dtype dtype,
                         const void *bias, const tec_reduce_fp8 *fp8, int sm_count, cudaStream_t s);

#endif /* TEC_CUDA_TRANSPORT_H */
