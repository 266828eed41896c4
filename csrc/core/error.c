/* error.c - the engine's one error channel: status strings and the calling
 * thread's last error message. The core calls tec_set_error directly; the
 * CUDA library calls it through the hooks tec.c hands it on load
 * (backend.h), so a message set in either library is the one
 * tec_last_error() returns. Exercised by every test that expects an error. */
#include <stdarg.h>
#include <stdio.h>

#include "error.h"

static _Thread_local char tec_errbuf[1024];

const char *tec_status_string(tec_status s)
{
    switch (s) {
    case TEC_OK: return "ok";
    case TEC_ERR_INVALID_ARG: return "invalid argument";
    case TEC_ERR_NOT_SUPPORTED: return "not supported";
    case TEC_ERR_NO_MEMORY: return "out of memory";
    case TEC_ERR_SYSTEM: return "system error";
    case TEC_ERR_CUDA: return "CUDA error";
    case TEC_ERR_CUBLAS: return "cuBLAS error";
    case TEC_ERR_NCCL: return "NCCL error";
    case TEC_ERR_TIMEOUT: return "timeout";
    case TEC_ERR_CLOSED: return "closed";
    case TEC_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

const char *tec_last_error(void) { return tec_errbuf; }

tec_status tec_set_error(tec_status s, const char *fmt, ...)
{
    /* Format into a copy first: an argument may be tec_last_error() itself. */
    char msg[sizeof tec_errbuf];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(tec_errbuf, msg, sizeof msg);
    return s;
}
