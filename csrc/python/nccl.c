/* nccl.c - CPython entry points of the engine collectives (tec.h): a
 * communicator is a capsule that frees it when the last reference goes.
 * Positional METH_FASTCALL, addresses as ints; the checks a user needs
 * (tensors, sizes, dtypes) are in transformer_engine_c/distributed.py, the
 * only caller. tests/test_engine_nccl.py exercises every function. */
#include "module.h"

#define CAPSULE_NAME "transformer_engine_c.nccl"

static void capsule_free(PyObject *cap)
{
    tec_nccl *c = (tec_nccl *)PyCapsule_GetPointer(cap, CAPSULE_NAME);
    if (c) {
        Py_BEGIN_ALLOW_THREADS tec_nccl_free(c);
        Py_END_ALLOW_THREADS
    } else {
        PyErr_Clear();
    }
}

static tec_nccl *get(PyObject *const *args)
{
    return (tec_nccl *)PyCapsule_GetPointer(args[0], CAPSULE_NAME); /* ValueError if not one */
}

/* nccl_unique_id() -> bytes */
static PyObject *py_unique_id(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (!tec_arg_count("nccl_unique_id", nargs, 0))
        return NULL;
    unsigned char id[TEC_NCCL_ID_BYTES];
    tec_status st = tec_nccl_unique_id(id);
    if (st)
        return tec_raise(m, st);
    return PyBytes_FromStringAndSize((const char *)id, TEC_NCCL_ID_BYTES);
}

/* nccl_create(device, id, nranks, rank, timeout_s, label) -> capsule */
static PyObject *py_create(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (!tec_arg_count("nccl_create", nargs, 6))
        return NULL;
    int dev, nranks, rank;
    double timeout;
    if (!tec_arg_int(args, 0, 0, TEC_ARG_DEVICE_MAX, "device", &dev) ||
        !tec_arg_int(args, 2, 1, 1 << 20, "nranks", &nranks) || !tec_arg_int(args, 3, 0, nranks - 1, "rank", &rank) ||
        !tec_arg_double(args, 4, &timeout))
        return NULL;
    char *id;
    Py_ssize_t idlen;
    if (PyBytes_AsStringAndSize(args[1], &id, &idlen) < 0)
        return NULL;
    if (idlen != TEC_NCCL_ID_BYTES)
        return PyErr_Format(PyExc_ValueError, "nccl_create: id must be %d bytes, got %zd", TEC_NCCL_ID_BYTES, idlen);
    const char *label = PyUnicode_AsUTF8AndSize(args[5], NULL);
    if (!label)
        return NULL;
    tec_nccl *c = NULL;
    tec_status st;
    Py_BEGIN_ALLOW_THREADS st = tec_nccl_create(dev, (const unsigned char *)id, nranks, rank, timeout, label, &c);
    Py_END_ALLOW_THREADS
    if (st)
        return tec_raise(m, st);
    PyObject *cap = PyCapsule_New(c, CAPSULE_NAME, capsule_free);
    if (!cap)
        tec_nccl_free(c);
    return cap;
}

/* nccl_run(comm, op, send, recv, count, dtype, stream, async) -> ticket (async) or None.
 * Without the GIL: NCCL may block on the host (connecting to peers). */
static PyObject *py_run(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (!tec_arg_count("nccl_run", nargs, 8))
        return NULL;
    tec_nccl *c = get(args);
    int op, dt, async;
    void *send, *recv, *stream;
    size_t count;
    if (!c || !tec_arg_int(args, 1, 0, 2, "op", &op) || !tec_arg_ptr(args, 2, &send) ||
        !tec_arg_ptr(args, 3, &recv) || !tec_arg_size(args, 4, "count", &count) ||
        !tec_arg_int(args, 5, 0, TEC_ARG_DTYPE_MAX, "dtype", &dt) || !tec_arg_ptr(args, 6, &stream) ||
        !tec_arg_int(args, 7, 0, 1, "async", &async))
        return NULL;
    uint64_t ticket = 0;
    tec_status st;
    Py_BEGIN_ALLOW_THREADS st = tec_nccl_run(c, op, send, recv, count, (tec_dtype)dt, stream, async, &ticket);
    Py_END_ALLOW_THREADS
    if (st)
        return tec_raise(m, st);
    if (async)
        return PyLong_FromUnsignedLongLong((unsigned long long)ticket);
    Py_RETURN_NONE;
}

/* nccl_join(comm, ticket, stream) */
static PyObject *py_join(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (!tec_arg_count("nccl_join", nargs, 3))
        return NULL;
    tec_nccl *c = get(args);
    int64_t ticket;
    void *stream;
    if (!c || !tec_arg_range(args, 1, 1, INT64_MAX, "ticket", &ticket) || !tec_arg_ptr(args, 2, &stream))
        return NULL;
    tec_status st;
    Py_BEGIN_ALLOW_THREADS st = tec_nccl_join(c, (uint64_t)ticket, stream);
    Py_END_ALLOW_THREADS
    if (st)
        return tec_raise(m, st);
    Py_RETURN_NONE;
}

/* nccl_close(comm, abort): destroy (abort) the NCCL communicator now (later calls raise). */
static PyObject *py_close(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (!tec_arg_count("nccl_close", nargs, 2))
        return NULL;
    tec_nccl *c = get(args);
    int abort;
    if (!c || !tec_arg_int(args, 1, 0, 1, "abort", &abort))
        return NULL;
    Py_BEGIN_ALLOW_THREADS tec_nccl_close(c, abort);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* nccl_version() -> NCCL's version code (0: NCCL or the CUDA backend missing) */
static PyObject *py_version(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (!tec_arg_count("nccl_version", nargs, 0))
        return NULL;
    return PyLong_FromLong(tec_nccl_version());
}

#define FAST(name, fn) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, NULL}
PyMethodDef tec_nccl_methods[] = {
    FAST("nccl_unique_id", py_unique_id),
    FAST("nccl_create", py_create),
    FAST("nccl_run", py_run),
    FAST("nccl_join", py_join),
    FAST("nccl_close", py_close),
    FAST("nccl_version", py_version),
    {NULL, NULL, 0, NULL},
};
