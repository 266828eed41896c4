/* comm_lifetime.c - a communicator's lifetime (tec_comm of tec.h): create
 * (the region layout of transport.h), the handle exchanged with the peers,
 * mapping them, destroy, and the accessors. Its operations are comm.c.
 * Exercised by tests/c/comm_schedule_test.c and tests/test_comm.py. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "checked.h"
#include "comm.h"
#include "error.h"

#define HANDLE_MAGIC 0x7465636f6d6d3031ull /* "tecomm01" */

typedef struct {
    uint64_t magic;
    int32_t rank, size, kind, pad;
    uint64_t data_bytes, region_bytes, tlen;
} handle_header;

tec_status tec_comm_create(tec_comm **out, tec_transport_kind kind, int device, int rank, int tp_size,
                           size_t buffer_bytes, const char *name, double timeout_s)
{
    *out = NULL;
    if (tp_size < 1 || tp_size > TEC_COMM_MAX_RANKS || rank < 0 || rank >= tp_size)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator: rank %d of tp_size %d (1..%d ranks supported)",
                             rank, tp_size, TEC_COMM_MAX_RANKS);
    if (!buffer_bytes)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator: empty buffer");
    if (!(timeout_s > 0 && timeout_s <= TEC_COMM_TIMEOUT_MAX))
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator: timeout must be in (0, %g] seconds, got %g",
                             TEC_COMM_TIMEOUT_MAX, timeout_s);
    /* Each device kind's backend supplies its transport: the CPU's the
     * shared-memory one, the CUDA library's the CUDA IPC one. */
    const tec_backend *be = NULL;
    if (kind == TEC_TRANSPORT_SHM) {
        if (device != TEC_DEVICE_CPU)
            return tec_set_error(TEC_ERR_INVALID_ARG, "communicator: the shared-memory transport is CPU only");
        be = tec_backend_for(TEC_DEVICE_CPU);
    } else if (kind == TEC_TRANSPORT_CUDA_IPC) {
        if (device == TEC_DEVICE_CPU)
            return tec_set_error(TEC_ERR_INVALID_ARG, "communicator: the CUDA IPC transport needs a CUDA device");
        be = tec_backend_for(device);
        if (!be || !be->transport)
            return tec_set_error(TEC_ERR_NOT_SUPPORTED,
                                 "communicator: the CUDA IPC transport is not available (CUDA backend not loaded)");
    } else {
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator: unknown transport %d", (int)kind);
    }
    const tec_transport_ops *ops = be->transport;
    if (ops->abi_version != TEC_TRANSPORT_ABI)
        return tec_set_error(TEC_ERR_NOT_SUPPORTED, "communicator: transport %s has ABI %d, expected %d",
                             ops->name, ops->abi_version, TEC_TRANSPORT_ABI);
    tec_status st;
    tec_comm *c = calloc(1, sizeof *c);
    if (!c)
        return tec_set_error(TEC_ERR_NO_MEMORY, "communicator: no memory");
    c->ops = ops;
    c->kind = kind;
    c->device = device;
    c->rank = rank;
    c->size = tp_size;
    c->timeout = timeout_s;
    snprintf(c->name, sizeof c->name, "%s", name && name[0] ? name : "comm");
    /* Region layout (transport.h): data, staging of the same size, flags;
     * each part rounded to 256 bytes. Checked: a wrapped sum would map a
     * small region and let every offset past it land anywhere. */
    const size_t flag_bytes = ((size_t)TEC_COMM_NFLAGS * TEC_COMM_MAX_RANKS * 8 + 255) & ~(size_t)255;
    size_t rounded, twice;
    if (!tec_add_bytes(buffer_bytes, 255, &rounded) || !tec_add_bytes(rounded & ~(size_t)255, rounded & ~(size_t)255, &twice) ||
        !tec_add_bytes(twice, flag_bytes, &c->region_bytes)) {
        free(c);
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator: a buffer of %zu bytes is too large", buffer_bytes);
    }
    c->data_bytes = rounded & ~(size_t)255;
    c->flags_off = twice;
    st = ops->create(&c->t, device, rank, tp_size, c->region_bytes);
    if (st)
        goto fail;
    *out = c;
    return TEC_OK;
fail:
    free(c);
    return st;
}

void tec_comm_destroy(tec_comm *c)
{
    if (!c)
        return;
    if (c->t)
        c->ops->destroy(c->t);
    free(c);
}

tec_status tec_comm_local_handle(tec_comm *c, void *out, size_t cap, size_t *len)
{
    unsigned char th[TEC_COMM_HANDLE_MAX];
    size_t tlen = sizeof th;
    tec_status st = c->ops->local_handle(c->t, th, &tlen);
    if (st)
        return st;
    if (tlen > TEC_COMM_HANDLE_MAX || cap < sizeof(handle_header) + tlen)
        return tec_set_error(TEC_ERR_INTERNAL, "communicator '%s': handle of %zu bytes does not fit", c->name, tlen);
    handle_header h = {HANDLE_MAGIC, c->rank, c->size, (int32_t)c->kind, 0, c->data_bytes, c->region_bytes, tlen};
    memcpy(out, &h, sizeof h);
    memcpy((char *)out + sizeof h, th, tlen);
    *len = sizeof h + tlen;
    return TEC_OK;
}

tec_status tec_comm_open_peers(tec_comm *c, const void *const *handles, const size_t *lens)
{
    if (c->mapped)
        return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': peers are already open", c->name);
    const void *th[TEC_COMM_MAX_RANKS];
    size_t tl[TEC_COMM_MAX_RANKS];
    for (int i = 0; i < c->size; i++) {
        handle_header h;
        if (!handles[i] || lens[i] < sizeof h)
            return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': handle of rank %d is not a handle", c->name, i);
        memcpy(&h, handles[i], sizeof h);
        if (h.magic != HANDLE_MAGIC || lens[i] != sizeof h + h.tlen)
            return tec_set_error(TEC_ERR_INVALID_ARG, "communicator '%s': handle of rank %d is not a handle", c->name, i);
        if (h.rank != i || h.size != c->size || h.kind != (int32_t)c->kind)
            return tec_set_error(TEC_ERR_INVALID_ARG,
                                 "communicator '%s': rank %d's handle says rank %d of %d (transport %d); here rank "
                                 "%d of %d (transport %d): handles out of order or groups differ",
                                 c->name, i, h.rank, h.size, h.kind, c->rank, c->size, (int)c->kind);
        if (h.data_bytes != c->data_bytes || h.region_bytes != c->region_bytes)
            return tec_set_error(TEC_ERR_INVALID_ARG,
                                 "communicator '%s': rank %d has a buffer of %llu bytes, this rank %zu "
                                 "(mismatched shapes across ranks)",
                                 c->name, i, (unsigned long long)h.data_bytes, c->data_bytes);
        th[i] = (const char *)handles[i] + sizeof h;
        tl[i] = h.tlen;
    }
    tec_status st = c->ops->map_peers(c->t, th, tl, c->bases);
    if (st)
        return st;
    c->mapped = 1;
    return TEC_OK;
}

void tec_comm_set_gemm(tec_comm *c, void *ptr, size_t bytes, int sm_margin)
{
    c->gemm_sm_margin = sm_margin > 0 ? sm_margin : 0;
    c->gemm_ws = ptr;
    c->gemm_ws_bytes = ptr ? bytes : 0;
}

tec_status tec_comm_release_handle(tec_comm *c)
{
    return c->ops->release_handle ? c->ops->release_handle(c->t) : TEC_OK;
}

int tec_comm_rank(const tec_comm *c) { return c->rank; }
int tec_comm_size(const tec_comm *c) { return c->size; }
const char *tec_comm_name(const tec_comm *c) { return c->name; }
size_t tec_comm_buffer_bytes(const tec_comm *c) { return c->data_bytes; }
void *tec_comm_base(const tec_comm *c, int r) { return c->mapped && r >= 0 && r < c->size ? c->bases[r] : NULL; }
void tec_comm_get_stats(const tec_comm *c, tec_comm_stats *s) { *s = c->stats; }

int tec_comm_ranges(const tec_comm *c, void **ptrs, size_t *bytes, int max)
{
    /* Own region first, then the mapped peers' in rank order; only entries
     * [0, n) are written. */
    int n = 0;
    for (int k = 0; k < c->size && n < max; k++) {
        const int r = k == 0 ? c->rank : (k <= c->rank ? k - 1 : k);
        if (!c->bases[r] || (r != c->rank && !c->mapped))
            continue;
        ptrs[n] = c->bases[r];
        bytes[n] = c->region_bytes;
        n++;
    }
    return n;
}
