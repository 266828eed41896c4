// LayerNorm backward launch shapes (vectors per thread x threads per row, and
// how many row groups share the rows) at the layers' shapes, bf16 (a
// diagnostic, one GPU; it compiles norm.cu into itself). Each row group
// writes fp32 partial dgamma / dbeta rows that the second kernel sums: more
// groups, more parallelism but more partial traffic. Prints µs for both
// kernels and the bandwidth of dy + x + dx over that time.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 --expt-relaxed-constexpr -I csrc/core \
//        scripts/experiments/norm_bwd_variants.cu -o /tmp/norm_bwd_variants && /tmp/norm_bwd_variants
#include "../../csrc/core/cuda/cuda_common.cu"
#include "../../csrc/core/cuda/norm.cu"
#include <stdio.h>

static float time_us(void (*launch)(bwd_params &, int64_t), bwd_params p, int64_t groups, void *dg, void *db,
                     int reps)
{
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (int i = 0; i < 5; i++) {
        launch(p, groups);
        launch_bwd_reduce<__nv_bfloat16>(p, dg, db, 0);
    }
    cudaEventRecord(a);
    for (int i = 0; i < reps; i++) {
        bwd_params q = p;
        launch(q, groups);
        launch_bwd_reduce<__nv_bfloat16>(q, dg, db, 0);
    }
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    return ms * 1000 / reps;
}

template <int NV, int TPR> static void launch(bwd_params &p, int64_t groups)
{
    launch_bwd_groups<__nv_bfloat16, 8, NV, TPR>(p, groups, 0);
}

struct variant {
    const char *name;
    void (*fn)(bwd_params &, int64_t);
    long nvec_max;
};

int main()
{
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const variant vs[] = {{"4x32", launch<4, 32>, 128},   {"2x64", launch<2, 64>, 128},   {"1x128", launch<1, 128>, 128},
                          {"4x64", launch<4, 64>, 256},   {"2x128", launch<2, 128>, 256}, {"1x256", launch<1, 256>, 256},
                          {"4x128", launch<4, 128>, 512}, {"2x256", launch<2, 256>, 512}, {"1x512", launch<1, 512>, 512}};
    for (long rows : {1024L, 2048L, 4096L, 8192L})
        for (long cols : {1024L, 2048L, 4096L}) {
            const long nvec = cols / 8;
            size_t n = rows * cols, bytes = n * 2;
            void *x, *dy, *dx, *g, *dg, *db;
            float *mu, *rs, *ws;
            cudaMalloc(&x, bytes);
            cudaMalloc(&dy, bytes);
            cudaMalloc(&dx, bytes);
            cudaMalloc(&g, cols * 2);
            cudaMalloc(&dg, cols * 2);
            cudaMalloc(&db, cols * 2);
            cudaMalloc(&mu, rows * 4);
            cudaMalloc(&rs, rows * 4);
            cudaMalloc(&ws, (size_t)rows * cols * 8);
            cudaMemset(x, 0x3c, bytes);
            cudaMemset(dy, 0x3c, bytes);
            cudaMemset(g, 0x3c, cols * 2);
            cudaMemset(mu, 0, rows * 4);
            cudaMemset(rs, 0, rows * 4);
            bwd_params p{dy, x, g, mu, rs, dx, ws, rows, cols, 0, 0.f, 1};
            printf("%ldx%ld (dy+x+dx %.1f MB):", rows, cols, 3.0 * bytes / 1e6);
            for (const variant &v : vs) {
                if (v.nvec_max != (nvec <= 128 ? 128 : nvec <= 256 ? 256 : nvec <= 512 ? 512 : 0))
                    continue;
                for (long per : {0L, 1L, 2L, 4L, 8L}) { /* 0: the dispatch's choice; else per / 2 groups per SM */
                    long groups = per ? (long)sms * per / 2 : -1;
                    if (!per) { /* what bwd_dispatch picks */
                        bwd_params q = p;
                        bwd_dispatch<__nv_bfloat16>(q, true, sms, 0);
                        cudaDeviceSynchronize();
                        groups = q.groups;
                    }
                    float us = time_us(v.fn, p, groups, dg, db, 100);
                    printf(" | %s g=%ld %.1f us %.0f GB/s", v.name, groups < rows ? groups : rows, us,
                           3.0 * bytes / us / 1e3);
                }
            }
            printf("  [%s]\n", cudaGetErrorString(cudaGetLastError()));
            cudaFree(x); cudaFree(dy); cudaFree(dx); cudaFree(g); cudaFree(dg); cudaFree(db);
            cudaFree(mu); cudaFree(rs); cudaFree(ws);
        }
}
