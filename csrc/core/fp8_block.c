/* fp8_block.c - argument checks and device dispatch of block-scaled FP8
 * quantization (tec.h, tec_fp8_block_quantize) through the backend tables
 * (backend.h); the FP8 GEMM's block scale modes are checked in fp8.c.
 * Exercised by tests/test_fp8_block.py. */
#include "backend.h"
#include "checked.h"
#include "error.h"

tec_status tec_fp8_block_quantize(int device, const tec_fp8_block_quantize_args *a, void *stream)
{
    tec_status st = tec_backend_check(device);
    if (st)
        return st;
    const tec_backend *b = tec_backend_for(device);
    if (!b->fp8_block)
        return tec_set_error(TEC_ERR_NOT_SUPPORTED, "fp8 block quantize: the %s backend has no block-scaled FP8",
                             b->name);
    size_t bytes;
    if (a->rows < 0 || a->cols < 0 || !tec_mul3(a->rows, a->cols, 4, &bytes))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 block quantize: bad shape rows=%lld cols=%lld",
                             (long long)a->rows, (long long)a->cols);
    if (a->dtype != TEC_F32 && a->dtype != TEC_BF16 && a->dtype != TEC_F16)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 block quantize: unknown input dtype %d", (int)a->dtype);
    if (a->format != TEC_FP8_E4M3 && a->format != TEC_FP8_E5M2)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 block quantize: unknown FP8 format %d", (int)a->format);
    if (a->block_dim != 1 && a->block_dim != 2)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 block quantize: block_dim must be 1 (1x128) or 2 (128x128), "
                             "got %d", a->block_dim);
    if (!(a->epsilon >= 0.0f && a->epsilon < 3.4e38f))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 block quantize: epsilon must be finite and >= 0, got %g",
                             (double)a->epsilon);
    if (!a->out && !a->out_t)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 block quantize: no output (out or out_t)");
    if ((a->out && !a->scale_inv) || (a->out_t && !a->scale_inv_t))
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 block quantize: an output without its scale_inv");
    if (a->rows * a->cols == 0)
        return TEC_OK;
    if (!a->x)
        return tec_set_error(TEC_ERR_INVALID_ARG, "fp8 block quantize: missing input");
    return b->fp8_block->quantize(device, a, stream);
}
