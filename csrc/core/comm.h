/* comm.h - internal: the communicator's state (struct tec_comm), shared by
 * comm_lifetime.c (create, handles, peers, destroy, accessors) and comm.c
 * (the operations and the schedules). Never included by csrc/python.
 * Exercised by tests/c/comm_schedule_test.c. */
#ifndef TEC_COMM_H
#define TEC_COMM_H

#include "tec.h"
#include "transport.h"

struct tec_comm {
    const tec_transport_ops *ops;
    tec_transport *t;
    tec_transport_kind kind;
    int device, rank, size;
    char name[96];
    double timeout;
    size_t data_bytes, region_bytes, flags_off;
    void *bases[TEC_COMM_MAX_RANKS];
    int mapped;
    uint64_t epoch;        /* last epoch used */
    uint64_t last_publish; /* epoch of the last all-gather of our own slot */
    int pending;           /* a bulk operation between start and finish */
    tec_status broken;     /* sticky failure */
    char broken_msg[768];
    tec_comm_stats stats;
    void *gemm_ws;         /* tec_comm_set_gemm */
    size_t gemm_ws_bytes;
    int gemm_sm_margin;
};

#endif /* TEC_COMM_H */
