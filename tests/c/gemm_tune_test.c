/* The GEMM algorithm sweep's schedule and choice (csrc/core/cuda/gemm_tune.h), on the CPU:
 * built and run by tests/test_gemm_tune.py. Prints "PASS gemm_tune_test". */
#include <stdio.h>

#include "cuda/gemm_tune.h"

static int failures;

static void expect(const char *what, const float *t, const int *ok, int n, float margin, int want)
{
    const int got = tec_tune_pick(t, ok, n, margin);
    if (got != want) {
        printf("FAIL %s: picked %d, expected %d\n", what, got, want);
        failures++;
    }
}

/* A sweep of n candidates over `rounds` rounds in tec_tune_candidate's order,
 * candidate i taking base[i] + r (round r) except where `miss` (candidate,
 * round) was not timed: the reduction must give each its best round. */
static void expect_reduce(int n, int rounds, int miss_i, int miss_r)
{
    float ms[64], t[8];
    int got[64], ok[8];
    const float base[8] = {9, 4, 7, 3, 8, 5, 6, 2};
    for (int r = 0; r < rounds; r++)
        for (int j = 0; j < n; j++) {
            const int i = tec_tune_candidate(r, j, n);
            ms[r * n + j] = base[i] + (float)(rounds - r); /* the last round is each one's best */
            got[r * n + j] = !(i == miss_i && r == miss_r);
        }
    for (int i = 0; i < n; i++)
        ok[i] = 1;
    tec_tune_reduce(ms, got, n, rounds, t, ok);
    for (int i = 0; i < n; i++) {
        const int want_ok = i != miss_i;
        if (ok[i] != want_ok || (want_ok && t[i] != base[i] + 1.0f)) {
            printf("FAIL reduce n=%d rounds=%d: candidate %d ok %d t %g, expected ok %d t %g\n", n, rounds, i, ok[i],
                   t[i], want_ok, base[i] + 1.0f);
            failures++;
        }
    }
}

int main(void)
{
    /* Every round visits each candidate once; the untimed round starts at 0. */
    for (int n = 1; n <= 8; n++)
        for (int r = -1; r < 3; r++) {
            int seen[8] = {0};
            for (int j = 0; j < n; j++)
                seen[tec_tune_candidate(r, j, n)]++;
            for (int i = 0; i < n; i++)
                if (seen[i] != 1) {
                    printf("FAIL round %d of %d candidates visits %d %d times\n", r, n, i, seen[i]);
                    failures++;
                }
        }
    if (tec_tune_candidate(-1, 0, 5) != 0 || tec_tune_candidate(1, 0, 5) != 1 || tec_tune_candidate(2, 4, 5) != 1) {
        printf("FAIL the rounds' starting candidates\n");
        failures++;
    }
    expect_reduce(8, 3, -1, -1);
    expect_reduce(5, 3, 3, 1);
    expect_reduce(3, 3, 0, 2);
    expect_reduce(1, 3, -1, -1);
    const int all[4] = {1, 1, 1, 1};
    expect("a later candidate is fastest", (const float[]){5, 3, 4, 6}, all, 4, 0.0f, 1);
    expect("the last is fastest", (const float[]){5, 3, 4, 2}, all, 4, 0.0f, 3);
    expect("the heuristic's is fastest", (const float[]){1, 3, 4, 2}, all, 4, 0.0f, 0);
    expect("a candidate not timed every round is skipped", (const float[]){5, 1, 4, 6}, (const int[]){1, 0, 1, 1},
           4, 0.0f, 2);
    expect("the first not timed", (const float[]){1, 3, 2, 6}, (const int[]){0, 1, 1, 1}, 4, 0.02f, 2);
    expect("none timed: the heuristic's", (const float[]){1, 2, 3, 4}, (const int[]){0, 0, 0, 0}, 4, 0.02f, 0);
    expect("one candidate", (const float[]){7}, all, 1, 0.02f, 0);
    expect("faster by less than the margin: the heuristic's stays", (const float[]){100, 99, 101, 100}, all, 4,
           0.02f, 0);
    expect("faster by more than the margin: it wins", (const float[]){100, 97, 101, 100}, all, 4, 0.02f, 1);
    expect("faster by exactly the margin: the heuristic's stays", (const float[]){4, 3}, all, 2, 0.25f, 0);
    expect("just beyond the margin: it wins", (const float[]){4, 2.9f}, all, 2, 0.25f, 1);
    if (failures)
        return 1;
    printf("PASS gemm_tune_test\n");
    return 0;
}
