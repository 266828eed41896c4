// LayerNorm forward kernel variants (vectors per thread x threads per row) against a device copy,
// bf16, 2048/4096 columns (a diagnostic, one GPU; it compiles norm.cu into itself):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 --expt-relaxed-constexpr -I csrc/core \
//        scripts/experiments/norm_variants.cu -o /tmp/norm_variants && /tmp/norm_variants
// "(old)" marks what the dispatch used before the third session; it now uses 4x64 and 4x128.
#include "../../csrc/core/cuda/cuda_common.cu"
#include "../../csrc/core/cuda/norm.cu"
#include <stdio.h>

template <int NV, int TPR> float run(fwd_params p, int reps) {
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int i = 0; i < 5; i++) launch_fwd<__nv_bfloat16, 8, NV, TPR>(p, 0);
    cudaEventRecord(a);
    for (int i = 0; i < reps; i++) launch_fwd<__nv_bfloat16, 8, NV, TPR>(p, 0);
    cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); return ms * 1000 / reps;
}
int main() {
    const int reps = 200;
    for (long rows : {4096L, 8192L, 16384L}) for (long cols : {2048L, 4096L}) {
        size_t n = rows * cols, bytes = n * 2;
        void *x, *y, *g, *bt; float *mu, *rs;
        cudaMalloc(&x, bytes); cudaMalloc(&y, bytes); cudaMalloc(&g, cols * 2); cudaMalloc(&bt, cols * 2);
        cudaMalloc(&mu, rows * 4); cudaMalloc(&rs, rows * 4);
        cudaMemset(x, 0x3c, bytes); cudaMemset(g, 0x3c, cols * 2); cudaMemset(bt, 0, cols * 2);
        fwd_params p{x, g, bt, y, mu, rs, rows, cols, 1e-5f, 0.f};
        cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
        for (int i = 0; i < 5; i++) cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice);
        cudaEventRecord(a);
        for (int i = 0; i < reps; i++) cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice);
        cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); float copy = ms * 1000 / reps;
        printf("%ldx%ld copy %.1f us", rows, cols, copy);
        if (cols == 4096) {
            float t[4] = {run<16, 32>(p, reps), run<8, 64>(p, reps), run<4, 128>(p, reps), run<2, 256>(p, reps)};
            const char *nm[4] = {"16x32(old)", "8x64", "4x128", "2x256"};
            for (int i = 0; i < 4; i++) printf(" | %s %.1f us %.0f%%", nm[i], t[i], 100 * copy / t[i]);
        } else {
            float t[3] = {run<8, 32>(p, reps), run<4, 64>(p, reps), run<2, 128>(p, reps)};
            const char *nm[3] = {"8x32(old)", "4x64", "2x128"};
            for (int i = 0; i < 3; i++) printf(" | %s %.1f us %.0f%%", nm[i], t[i], 100 * copy / t[i]);
        }
        printf("  [%s]\n", cudaGetErrorString(cudaGetLastError()));
        cudaFree(x); cudaFree(y); cudaFree(g); cudaFree(bt); cudaFree(mu); cudaFree(rs);
    }
}
