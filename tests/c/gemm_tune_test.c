/* The GEMM algorithm sweep's choice (csrc/core/cuda/gemm_tune.h), on the CPU:
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

int main(void)
{
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
    if (failures)
        return 1;
    printf("PASS gemm_tune_test\n");
    return 0;
}
