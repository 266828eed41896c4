/* rope.c - argument checks and device dispatch of RoPE's apply (tec.h,
 * tec_rope) through the backend tables (backend.h). Exercised by
 * tests/test_rope.py. */
#include "rope.h"

#include "backend.h"
#include "error.h"

tec_status tec_rope(int device, const tec_rope_args *a, void *stream)
{
    tec_status st = tec_backend_check(device);
    if (st)
        return st;
    const tec_backend *b = tec_backend_for(device);
    if (!a)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: no arguments");
    if (a->dtype != TEC_F32 && a->dtype != TEC_BF16 && a->dtype != TEC_F16)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: unknown dtype %d", (int)a->dtype);
    if (a->format != TEC_ROPE_SBHD && a->format != TEC_ROPE_BSHD && a->format != TEC_ROPE_THD)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: unknown format %d", (int)a->format);
    if (a->s < 0 || a->b < 0 || a->h < 0 || a->d <= 0)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: bad shape s=%lld b=%lld h=%lld d=%lld", (long long)a->s,
                             (long long)a->b, (long long)a->h, (long long)a->d);
    if (a->d2 <= 0 || a->d2 % 2 || a->d2 > a->d)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: d2=%lld must be even, positive and at most d=%lld",
                             (long long)a->d2, (long long)a->d);
    if (a->freqs_rows < 0)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: freqs_rows=%lld", (long long)a->freqs_rows);
    if (a->cp_size < 1 || a->cp_rank < 0 || a->cp_rank >= a->cp_size)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: cp_rank=%d with cp_size=%d", a->cp_rank, a->cp_size);
    if (a->cp_size > 1 && a->start_positions)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: start_positions cannot be combined with cp_size > 1");
    if (a->format == TEC_ROPE_THD && !a->cu_seqlens)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: the THD format needs cu_seqlens");
    if (a->format != TEC_ROPE_THD && a->cp_size > 1 && a->s % 2)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: under context parallelism the local length (%lld) must be "
                             "even", (long long)a->s);
    int64_t tokens = a->format == TEC_ROPE_THD ? a->s : a->s * a->b;
    if (tokens == 0 || a->h == 0)
        return TEC_OK;
    if (!a->x || !a->y || !a->freqs)
        return tec_set_error(TEC_ERR_INVALID_ARG, "rope: missing x, y or freqs pointer");
    if (!b->rope)
        return tec_set_error(TEC_ERR_NOT_SUPPORTED, "rope: the %s backend has no RoPE kernel", b->name);
    return b->rope(device, a, stream);
}
