/* gemm_tune.h - the GEMM algorithm sweep's choice (gemm.cu), free of CUDA so
 * that the CPU tests check it (tests/c/gemm_tune_test.c). */
#ifndef TEC_GEMM_TUNE_H
#define TEC_GEMM_TUNE_H

/* The index of the fastest candidate: t[i] is candidate i's total time over
 * the sweep's rounds, ok[i] whether it was timed in every round. 0 (the
 * heuristic's first answer) when none was. */
static inline int tec_tune_pick(const float *t, const int *ok, int n)
{
    int best = -1;
    for (int i = 0; i < n; i++)
        if (ok[i] && (best < 0 || t[i] < t[best]))
            best = i;
    return best < 0 ? 0 : best;
}

#endif
