/* error.h - internal: the core's error reporting (csrc/core/error.c) and its
 * check macros for OS calls (errno). Every failing core function returns a
 * status with a message set here; tec_last_error() (tec.h) reads it back.
 * The CUDA library reports through the same function (backend.h hooks; its
 * macros are in csrc/core/cuda/cuda_common.h). Never included by csrc/python. */
#ifndef TEC_ERROR_H
#define TEC_ERROR_H

#include <errno.h>
#include <string.h>

#include "tec.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Record a failure message for the calling thread and return `s`. */
tec_status tec_set_error(tec_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

#ifdef __cplusplus
}
#endif

/* The status of a failed OS call's errno: ENOMEM is TEC_ERR_NO_MEMORY (the
 * same status as any other allocation failure), anything else
 * TEC_ERR_SYSTEM. */
static inline tec_status tec_errno_status(int e) { return e == ENOMEM ? TEC_ERR_NO_MEMORY : TEC_ERR_SYSTEM; }

/* OS calls that report through errno: `ok` is the success test of the call
 * just made, `what`/... a printf message naming it; the message ends in
 * strerror(errno). RETURN and GOTO forms. */
#define TEC_ERRNO_CHECK(ok, what, ...)                                                            \
    do {                                                                                          \
        if (!(ok)) {                                                                              \
            const int e_ = errno;                                                                 \
            return tec_set_error(tec_errno_status(e_), what ": %s", ##__VA_ARGS__, strerror(e_)); \
        }                                                                                         \
    } while (0)

#define TEC_ERRNO_CHECK_GOTO(ok, st, label, what, ...)                                            \
    do {                                                                                          \
        if (!(ok)) {                                                                              \
            const int e_ = errno;                                                                 \
            (st) = tec_set_error(tec_errno_status(e_), what ": %s", ##__VA_ARGS__, strerror(e_)); \
            goto label;                                                                           \
        }                                                                                         \
    } while (0)

#endif /* TEC_ERROR_H */
