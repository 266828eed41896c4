/* The mock of tests/c/comm_mock.c as tests/c/comm_schedule_test.c's scenarios use it:
 * the failure count and its CHECK, the switches of the negative checks, the
 * scheduler's seed, draining the queues, recording and replaying a "graph". */
#ifndef TEC_TEST_COMM_MOCK_H
#define TEC_TEST_COMM_MOCK_H

#include <stdint.h>
#include <stdio.h>

#include "backend.h"
#include "error.h"
#include "transport.h"

extern int failures;
#define CHECK(cond, ...)                                                                          \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                           \
            printf(__VA_ARGS__);                                                                  \
            printf("\n");                                                                         \
            failures++;                                                                           \
        }                                                                                         \
    } while (0)

enum { NRANKS = TEC_COMM_MAX_RANKS };

extern tec_transport *g_rank[NRANKS]; /* rank -> its mock transport */
extern tec_transport_ops mock_transport;
extern int g_ignore_waits;  /* the negative check: waits never hold anything back */
extern int g_quiet;         /* negative checks: failures expected, not reported */
extern uint64_t g_rng;      /* the scheduler's seed */
extern int g_ncap, g_capturing; /* a "graph" being recorded, and its length */

uint64_t rng(void);
int drain(void);              /* run every queued op; nonzero where a rank's queue cannot finish */
tec_status replay(void);      /* launch the recorded "graph" again */
void *mock_compute_stream(int rank);

#endif
