// Which cuBLASLt algorithm is fastest for a layer's forward GEMM, and how far the heuristic's
// first answer (what csrc/core/cuda/gemm.cu uses) is from it; cublasGemmEx (what torch.matmul
// calls) beside them. Each algorithm is timed alone and, where a second GPU is present, while a
// peer copy into this GPU runs on another stream (the pull of an AG+GEMM chunk). A diagnostic:
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90,code=sm_90 scripts/experiments/gemm_algos.cu \
//        -o /tmp/gemm_algos -lcublasLt -lcublas && /tmp/gemm_algos 8192x6144x4096 4096x6144x4096
// A shape MxNxK is row-major C[M,N] = A[M,K] @ B[N,K]^T, bf16 in and out, fp32 compute.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>

#define CK(x)                                                                               \
    do {                                                                                    \
        cudaError_t e_ = (x);                                                               \
        if (e_ != cudaSuccess) {                                                            \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)
#define CB(x)                                                                      \
    do {                                                                           \
        int s_ = (int)(x);                                                         \
        if (s_ != 0) {                                                             \
            fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, s_); \
            exit(1);                                                               \
        }                                                                          \
    } while (0)

static const size_t kWs = (size_t)32 << 20;

__global__ void fill(__nv_bfloat16 *p, size_t n, unsigned seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        p[i] = __float2bfloat16(((h >> 8) & 0xffff) / 65536.0f - 0.5f);
    }
}

struct Copier { // keeps a peer copy running on its own stream while the timed work runs
    void *src = nullptr, *dst = nullptr;
    size_t bytes = 0;
    cudaStream_t s = nullptr;
};

int main(int argc, char **argv)
{
    int ngpu = 0;
    CK(cudaGetDeviceCount(&ngpu));
    CK(cudaSetDevice(0));
    cublasLtHandle_t lt;
    cublasHandle_t bl;
    CB(cublasLtCreate(&lt));
    CB(cublasCreate(&bl));
    void *ws;
    CK(cudaMalloc(&ws, kWs));
    CB(cublasSetWorkspace(bl, ws, kWs));
    cudaStream_t s, cs;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    CB(cublasSetStream(bl, s));
    Copier cp;
    if (ngpu >= 2) {
        CK(cudaDeviceEnablePeerAccess(1, 0));
        cp.bytes = (size_t)64 << 20;
        CK(cudaMalloc(&cp.dst, cp.bytes));
        CK(cudaSetDevice(1));
        CK(cudaMalloc(&cp.src, cp.bytes));
        CK(cudaDeviceEnablePeerAccess(0, 0));
        CK(cudaSetDevice(0));
        cp.s = cs;
    }
    printf("gpus %d; times in us, median of 9 round-robin runs of 5 [min-max]; 'copy' = with 64 MiB peer pulls beside it; 'sweep' = fastest over 3 single runs\n",
           ngpu);
    for (int ai = 1; ai < argc; ai++) {
        long long M, N, K;
        if (sscanf(argv[ai], "%lldx%lldx%lld", &M, &N, &K) != 3) {
            fprintf(stderr, "bad shape %s (want MxNxK)\n", argv[ai]);
            return 2;
        }
        __nv_bfloat16 *A, *B, *C;
        CK(cudaMalloc(&A, M * K * 2));
        CK(cudaMalloc(&B, N * K * 2));
        CK(cudaMalloc(&C, M * N * 2));
        fill<<<1024, 256>>>(A, M * K, 1);
        fill<<<1024, 256>>>(B, N * K, 2);
        CK(cudaDeviceSynchronize());
        // Column-major view as in gemm.cu: C^T[N,M] = B^T... i.e. op(A_lt)=T on B stored KxN, B_lt = A stored KxM.
        cublasLtMatmulDesc_t d;
        cublasLtMatrixLayout_t la, lb, lc;
        cublasOperation_t T = CUBLAS_OP_T, Nn = CUBLAS_OP_N;
        CB(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        CB(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof T));
        CB(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &Nn, sizeof Nn));
        CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K));
        CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K));
        CB(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N));
        cublasLtMatmulPreference_t pref;
        CB(cublasLtMatmulPreferenceCreate(&pref));
        uint64_t wsb = kWs;
        CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
        cublasLtMatmulHeuristicResult_t res[16];
        int nres = 0;
        if (cublasLtMatmulAlgoGetHeuristic(lt, d, la, lb, lc, lc, pref, 16, res, &nres) != CUBLAS_STATUS_SUCCESS)
            nres = 0; /* NOT_SUPPORTED: no algorithm for this shape */
        const float one = 1.f, zero = 0.f;
        const double gflop = 2.0 * M * N * K / 1e9;
        printf("\n%s  (%.1f GFLOP, %d algorithms)\n", argv[ai], gflop, nres);
        if (nres == 0)
            continue; /* (this shape's buffers and descriptors are left to the process's end) */
        printf("  %-3s %-6s %-6s %-7s %-6s %-8s %-6s %9s %7s %9s\n", "#", "tile", "stages", "splitk", "swizz",
               "cluster", "waves", "alone", "TFLOPS", "copy");
        auto gemmex = [&] {
            CB(cublasGemmEx(bl, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)M, (int)K, &one, B, CUDA_R_16BF, (int)K, A,
                            CUDA_R_16BF, (int)K, &zero, C, CUDA_R_16BF, (int)N, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT_TENSOR_OP));
        };
        // Round-robin over the candidates (GemmEx last) so clock and thermal drift hit all alike.
        const int nc = nres + 1, rounds = 9, reps = 5;
        std::vector<std::vector<float>> t(nc), tc(nc);
        std::vector<float> first(nc, 0.f); // what a one-shot sweep would see: rounds 0-2, one GEMM each
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        auto launch = [&](int i) {
            if (i == nres)
                gemmex();
            else
                CB(cublasLtMatmul(lt, d, &one, B, la, A, lb, &zero, C, lc, C, lc, &res[i].algo, ws, kWs, s));
        };
        for (int i = 0; i < nc; i++)
            for (int w = 0; w < 3; w++)
                launch(i);
        for (int withcopy = 0; withcopy <= (cp.s ? 1 : 0); withcopy++)
            for (int r = 0; r < rounds; r++)
                for (int i = 0; i < nc; i++) {
                    if (withcopy)
                        for (int c = 0; c < reps; c++)
                            CK(cudaMemcpyAsync(cp.dst, cp.src, cp.bytes, cudaMemcpyDeviceToDevice, cp.s));
                    if (!withcopy && r < 3) {
                        CK(cudaEventRecord(e0, s));
                        launch(i);
                        CK(cudaEventRecord(e1, s));
                        CK(cudaEventSynchronize(e1));
                        float ms;
                        CK(cudaEventElapsedTime(&ms, e0, e1));
                        first[i] += ms;
                    }
                    CK(cudaEventRecord(e0, s));
                    for (int k = 0; k < reps; k++)
                        launch(i);
                    CK(cudaEventRecord(e1, s));
                    CK(cudaEventSynchronize(e1));
                    if (withcopy)
                        CK(cudaStreamSynchronize(cp.s));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    (withcopy ? tc : t)[i].push_back(ms * 1000 / reps);
                }
        auto med = [](std::vector<float> v) {
            if (v.empty())
                return 0.f;
            std::sort(v.begin(), v.end());
            return v[v.size() / 2];
        };
        int besti = 0, sweepi = 0;
        for (int i = 0; i < nres; i++) {
            if (med(t[i]) < med(t[besti]))
                besti = i;
            if (first[i] < first[sweepi])
                sweepi = i;
        }
        for (int i = 0; i < nres; i++) {
            int tile = 0, stages = 0, splitk = 0, swz = 0, cluster = 0;
            size_t w;
            cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
            cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages,
                                                 sizeof stages, &w);
            cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk,
                                                 sizeof splitk, &w);
            cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof swz,
                                                 &w);
            cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster,
                                                 sizeof cluster, &w);
            printf("  %-3d %-6d %-6d %-7d %-6d %-8d %-6.2f %9.1f %7.0f %9.1f  [%.0f-%.0f]%s%s%s\n", i, tile, stages,
                   splitk, swz, cluster, res[i].wavesCount, med(t[i]), gflop / med(t[i]) * 1e3, med(tc[i]),
                   *std::min_element(t[i].begin(), t[i].end()), *std::max_element(t[i].begin(), t[i].end()),
                   i == 0 ? "  <- heuristic" : "", i == besti ? "  <- best" : "", i == sweepi ? "  <- sweep" : "");
        }
        printf("  cublasGemmEx %44.1f %7.0f %9.1f\n", med(t[nres]), gflop / med(t[nres]) * 1e3, med(tc[nres]));
        printf("  heuristic/best %.3f  sweep pick/best %.3f  heuristic/GemmEx %.3f  best/GemmEx %.3f\n",
               med(t[0]) / med(t[besti]), med(t[sweepi]) / med(t[besti]), med(t[0]) / med(t[nres]),
               med(t[besti]) / med(t[nres]));
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(d);
        cudaFree(A);
        cudaFree(B);
        cudaFree(C);
    }
    return 0;
}
