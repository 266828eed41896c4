/* gemm_tune.h - the GEMM algorithm sweep's choice (gemm.cu), free of CUDA so
 * that the CPU tests check it (tests/c/gemm_tune_test.c). */
#ifndef TEC_GEMM_TUNE_H
#define TEC_GEMM_TUNE_H

/* The candidate to keep: t[i] is candidate i's time (its best round), ok[i]
 * whether it was timed in every round. Candidate 0, the heuristic's first
 * answer, stays unless another is faster by more than the fraction `margin`
 * of its time (timing noise must not move the choice); if candidate 0 was
 * not timed, the fastest that was; 0 when none was. */
static inline int tec_tune_pick(const float *t, const int *ok, int n, float margin)
{
    int best = -1;
    for (int i = 0; i < n; i++)
        if (ok[i] && (best < 0 || t[i] < t[best]))
            best = i;
    if (best < 0 || (ok[0] && t[best] >= t[0] * (1.0f - margin)))
        return 0;
    return best;
}

#endif
