/* gemm_tune.h - the GEMM algorithm sweep's schedule and choice (gemm.cu),
 * free of CUDA so that the CPU tests check them (tests/c/gemm_tune_test.c). */
#ifndef TEC_GEMM_TUNE_H
#define TEC_GEMM_TUNE_H

/* The candidate launched at position j of round r (of n candidates): round
 * r >= 0 starts at candidate r, so that no candidate always runs first; the
 * untimed round r = -1 starts at 0. */
static inline int tec_tune_candidate(int r, int j, int n)
{
    return (j + (r > 0 ? r : 0)) % n;
}

/* Each candidate's best timed round: ms[r * n + j] is the time of round r's
 * launch at position j, got[r * n + j] whether it was timed. ok[i] on entry:
 * candidate i took part; on return: and was timed in every round, its best
 * time in t[i]. */
static inline void tec_tune_reduce(const float *ms, const int *got, int n, int rounds, float *t, int *ok)
{
    for (int i = 0; i < n; i++)
        t[i] = 0.0f;
    for (int r = 0; r < rounds; r++)
        for (int j = 0; j < n; j++) {
            const int i = tec_tune_candidate(r, j, n), k = r * n + j;
            if (!got[k])
                ok[i] = 0;
            else if (r == 0 || ms[k] < t[i])
                t[i] = ms[k];
        }
}

/* The candidate to keep: t[i] is candidate i's time, ok[i] whether it was
 * timed in every round. Candidate 0, the heuristic's first answer, stays
 * unless another is faster by more than the fraction `margin` of its time
 * (timing noise must not move the choice); if candidate 0 was not timed,
 * the fastest that was; 0 when none was. */
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
