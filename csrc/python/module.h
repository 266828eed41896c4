/* module.h - what the CPython files of transformer_engine_c._C share: the
 * module state, argument converters for METH_FASTCALL entry points and the
 * one helper that turns a tec_status into a Python exception.
 *
 * The module is built on CPython's limited API (stable ABI) of 3.10: one
 * `_C.abi3.so` serves every CPython >= 3.10. Only what the limited headers
 * declare may be used here: no private `_Py*` calls, no type-struct fields
 * (PyType_GetSlot instead), no unchecked tuple/list macros. */
#ifndef TEC_PY_MODULE_H
#define TEC_PY_MODULE_H

#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../core/tec.h"

typedef struct {
    /* module.c */
    PyObject *EngineError;      /* RuntimeError subclass: engine failures */
    PyObject *CommTimeoutError; /* EngineError + TimeoutError: a peer did not arrive */
    PyObject *tensor_type;      /* torch.Tensor, set by _init() */
    PyObject *parameter_type;   /* torch.nn.Parameter, set by _init() */
    /* comm.c (visited and cleared by tec_comm_traverse/clear) */
    PyObject *CommOverlap_type; /* heap type of the engine-side communicator */
    /* saving.c (visited and cleared by tec_saving_traverse/clear) */
    PyObject *str_is_distributed_weight; /* interned attribute names */
    PyObject *str_prepare_for_saving;
    PyObject *str_restore_from_saved;
    PyObject *SavedObjects_type;         /* heap type of the objects container */
} tec_module_state;

static inline tec_module_state *tec_state(PyObject *module)
{
    return (tec_module_state *)PyModule_GetState(module);
}

/* Set a Python exception for `st` with the engine's last error message and
 * return NULL. INVALID_ARG -> ValueError, TIMEOUT -> CommTimeoutError,
 * everything else -> EngineError. */
PyObject *tec_raise(PyObject *module, tec_status st);

/* The name of o's type (a new str reference; "?" if it has none) for error
 * messages: the limited API has no tp_name. Call it with no exception set. */
PyObject *tec_type_name(PyObject *o);

/* Positional-argument converters; each returns 0 and sets an exception
 * naming argument `i` of `fn` on failure. */
int tec_arg_count(const char *fn, Py_ssize_t nargs, Py_ssize_t want);
int tec_arg_i64(PyObject *const *args, Py_ssize_t i, int64_t *out); /* TypeError / OverflowError */
/* Range-checked integers (ValueError naming argument i and `what`): no
 * value is ever truncated on its way into the engine. */
int tec_arg_range(PyObject *const *args, Py_ssize_t i, int64_t lo, int64_t hi, const char *what, int64_t *out);
int tec_arg_int(PyObject *const *args, Py_ssize_t i, int lo, int hi, const char *what, int *out);
int tec_arg_size(PyObject *const *args, Py_ssize_t i, const char *what, size_t *out); /* >= 0 */
/* Shared bounds: device codes (TEC_DEVICE_CPU or a CUDA ordinal), dtype codes, flags. */
#define TEC_ARG_DEVICE_MAX 65535
#define TEC_ARG_DTYPE_MAX 2
int tec_arg_ptr(PyObject *const *args, Py_ssize_t i, void **out); /* int address, 0 = NULL */
int tec_arg_double(PyObject *const *args, Py_ssize_t i, double *out);

/* Method tables of the other files, added in module exec. */
extern PyMethodDef tec_ops_methods[];
extern PyMethodDef tec_saving_methods[];
extern PyMethodDef tec_ranges_methods[];
extern PyMethodDef tec_nccl_methods[];
extern PyMethodDef tec_fp8_methods[];

/* Per-file exec hooks (types, constants); 0 on success, -1 with an exception. */
int tec_comm_exec(PyObject *module);
int tec_comm_traverse(tec_module_state *st, visitproc visit, void *arg);
void tec_comm_clear(tec_module_state *st);
int tec_saving_exec(PyObject *module);
int tec_saving_traverse(tec_module_state *st, visitproc visit, void *arg);
void tec_saving_clear(tec_module_state *st);

/* An engine operation's call from a binding, its status into st. On the CPU
 * (dev < 0) the work runs on the calling thread, so the GIL is released
 * while it runs (other Python threads go on). On CUDA the call only enqueues
 * work, and it keeps the GIL: releasing it for a few microseconds hands it to
 * any thread waiting for it (after a backward, autograd's device thread) and
 * the caller then waits to get it back, which cost more than the launch. */
#define TEC_ENGINE_CALL(dev, st, expr)                                          \
    do {                                                                       \
        if ((dev) < 0) {                                                       \
            Py_BEGIN_ALLOW_THREADS (st) = (expr); Py_END_ALLOW_THREADS         \
        } else {                                                               \
            (st) = (expr);                                                     \
        }                                                                      \
    } while (0)

#endif
