/* comm.c - the CommOverlap heap type: owns a tec_comm, exposes its buffer
 * (_pin: an address and a token that keeps the mapping alive while a view
 * of it lives; userbuffers.py wraps it for torch on the CPU and on CUDA), and the
 * overlap schedules as positional METH_FASTCALL methods with addresses as
 * ints. The friendly class is transformer_engine_c.userbuffers.CommOverlap;
 * tests/test_comm*.py and tests/distributed/ (the overlap runners) exercise this file. */
#include "module.h"

#define ARGC(fn, n) if (!tec_arg_count(fn, nargs, n)) return NULL
#define I64(i, v) if (!tec_arg_i64(args, i, &(v))) return NULL
#define PTR(i, v) if (!tec_arg_ptr(args, i, (void **)&(v))) return NULL
#define DBL(i, v) if (!tec_arg_double(args, i, &(v))) return NULL
#define INT(i, v, lo, hi, what) if (!tec_arg_int(args, i, lo, hi, what, &(v))) return NULL
#define DTYPE(i, v, what) do { int d_; INT(i, d_, 0, TEC_ARG_DTYPE_MAX, what); (v) = (tec_dtype)d_; } while (0)
#define BOOL(i, v, what) INT(i, v, 0, 1, what)
/* An engine call without the GIL. `busy` counts such calls so that close()
 * from another thread defers the destruction until the last one returns.
 * A second engine call on the same communicator while one runs (another
 * thread: the GIL is released inside) is refused: a tec_comm runs one
 * operation at a time (the Python class serialises its calls with a lock). */
#define CALL(expr) do {                                                     \
        CommObject *o_ = (CommObject *)self;                                \
        if (o_->busy)                                                       \
            return in_use(o_);                                              \
        o_->busy++;                                                         \
        Py_BEGIN_ALLOW_THREADS st = (expr); Py_END_ALLOW_THREADS            \
        if (--o_->busy == 0 && o_->closed && o_->exports == 0)              \
            destroy_now(o_);                                                \
    } while (0)

typedef struct {
    PyObject_HEAD
    tec_comm *comm;
    int closed;
    Py_ssize_t exports; /* live buffer views (_pin): the mapping outlives close() until 0 */
    Py_ssize_t busy;    /* engine calls running without the GIL (CALL) */
    int device;
    char name[96]; /* kept for messages after close() */
} CommObject;

/* The module that defined the CommOverlap base type (works for subclasses). */
static PyObject *defining_module(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    while (tp && !PyType_GetModule(tp)) {
        PyErr_Clear();
        tp = (PyTypeObject *)PyType_GetSlot(tp, Py_tp_base);
    }
    return tp ? PyType_GetModule(tp) : NULL;
}

static PyObject *raise(PyObject *self, tec_status st) { return tec_raise(defining_module(self), st); }

static PyObject *in_use(CommObject *o)
{
    tec_module_state *s = tec_state(defining_module((PyObject *)o));
    PyErr_Format(s->EngineError,
                 "communicator '%s' is in use by another thread (one operation at a time; "
                 "transformer_engine_c.CommOverlap serialises its own calls)", o->name[0] ? o->name : "?");
    return NULL;
}

static void destroy_now(CommObject *o)
{
    tec_comm *c = o->comm;
    o->comm = NULL;
    if (c) {
        Py_BEGIN_ALLOW_THREADS
        tec_comm_destroy(c);
        Py_END_ALLOW_THREADS
    }
}

/* The communicator, or NULL with "closed"/"not created" set. */
static tec_comm *live(CommObject *o)
{
    if (o->closed || !o->comm) {
        tec_module_state *s = tec_state(defining_module((PyObject *)o));
        PyErr_Format(s->EngineError, "communicator '%s' is %s", o->name[0] ? o->name : "?",
                     o->closed ? "closed" : "not created");
        return NULL;
    }
    return o->comm;
}

#define LIVE(c) tec_comm *c = live((CommObject *)self); if (!c) return NULL

static PyObject *comm_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    CommObject *o = (CommObject *)alloc(type, 0);
    if (o)
        o->device = TEC_DEVICE_CPU;
    return (PyObject *)o;
}

static void comm_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    destroy_now((CommObject *)self);
    ((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
    Py_DECREF(tp);
}

static int comm_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return 0;
}

/* _create(transport, device, rank, tp_size, buffer_bytes, name, timeout_s) */
static PyObject *py_create(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CommObject *o = (CommObject *)self;
    ARGC("_create", 7);
    int kind, dev, rank, tp;
    int64_t nbytes;
    double timeout;
    INT(0, kind, 0, 255, "transport"); INT(1, dev, TEC_DEVICE_CPU, TEC_ARG_DEVICE_MAX, "device");
    INT(3, tp, 1, TEC_COMM_MAX_RANKS, "tp_size"); INT(2, rank, 0, tp - 1, "rank");
    if (!tec_arg_range(args, 4, 1, INT64_MAX, "buffer_bytes", &nbytes))
        return NULL;
    if (!PyUnicode_Check(args[5]))
        return PyErr_Format(PyExc_TypeError, "argument 5 (name) must be a str");
    Py_ssize_t name_len;
    const char *name = PyUnicode_AsUTF8AndSize(args[5], &name_len);
    if (!name)
        return NULL;
    if ((size_t)name_len != strlen(name))
        return PyErr_Format(PyExc_ValueError, "argument 5 (name) contains a NUL character");
    if (name_len >= (Py_ssize_t)sizeof o->name)
        return PyErr_Format(PyExc_ValueError, "argument 5 (name) is %zd bytes long; at most %zd allowed", name_len,
                            (Py_ssize_t)sizeof o->name - 1);
    DBL(6, timeout);
    if (!(timeout > 0 && timeout <= TEC_COMM_TIMEOUT_MAX))
        return PyErr_Format(PyExc_ValueError, "argument 6 (timeout) must be in (0, %g] seconds, got %R",
                            TEC_COMM_TIMEOUT_MAX, args[6]);
    if (o->comm || o->closed)
        return PyErr_Format(PyExc_RuntimeError, "_create() called twice");
    tec_status st;
    tec_comm *c = NULL;
    CALL(tec_comm_create(&c, (tec_transport_kind)kind, dev, rank, tp, (size_t)nbytes, name, timeout));
    if (st)
        return raise(self, st);
    o->comm = c;
    o->device = (int)dev;
    snprintf(o->name, sizeof o->name, "%s", tec_comm_name(c));
    Py_RETURN_NONE;
}

static PyObject *py_local_handle(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_local_handle", 0);
    LIVE(c);
    char buf[TEC_COMM_HANDLE_MAX + 128];
    size_t len = 0;
    tec_status st = tec_comm_local_handle(c, buf, sizeof buf, &len);
    if (st)
        return raise(self, st);
    return PyBytes_FromStringAndSize(buf, (Py_ssize_t)len);
}

/* _open_peers(handles: sequence of bytes, one per rank in rank order) */
static PyObject *py_open_peers(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_open_peers", 1);
    LIVE(c);
    PyObject *seq = PySequence_Tuple(args[0]);
    if (!seq)
        return NULL;
    Py_ssize_t n = PyTuple_Size(seq);
    if (n != tec_comm_size(c)) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "_open_peers() got %zd handles for %d ranks", n, tec_comm_size(c));
    }
    const void *h[TEC_COMM_MAX_RANKS];
    size_t l[TEC_COMM_MAX_RANKS];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyTuple_GetItem(seq, i);
        char *bytes;
        Py_ssize_t len;
        if (!PyBytes_Check(b) || PyBytes_AsStringAndSize(b, &bytes, &len) < 0) {
            Py_DECREF(seq);
            return PyErr_Format(PyExc_TypeError, "handle %zd is not bytes", i);
        }
        h[i] = bytes;
        l[i] = (size_t)len;
    }
    tec_status st;
    CALL(tec_comm_open_peers(c, h, l));
    Py_DECREF(seq);
    if (st)
        return raise(self, st);
    Py_RETURN_NONE;
}

static PyObject *py_release_handle(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_release_handle", 0);
    LIVE(c);
    tec_status st = tec_comm_release_handle(c);
    if (st)
        return raise(self, st);
    Py_RETURN_NONE;
}

/* _set_gemm(ptr, nbytes, sm_margin): the caller keeps the memory alive */
static PyObject *py_set_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_set_gemm", 3);
    LIVE(c);
    void *ptr;
    size_t n;
    int64_t margin;
    if (!tec_arg_ptr(args, 0, &ptr) || !tec_arg_size(args, 1, "nbytes", &n) || !tec_arg_i64(args, 2, &margin))
        return NULL;
    if (margin < 0 || margin > 65535) { /* userbuffers.py checks it against the device first */
        PyErr_Format(PyExc_ValueError, "gemm_sm_margin must be in [0, 65535], got %lld", (long long)margin);
        return NULL;
    }
    tec_comm_set_gemm(c, ptr, n, (int)margin);
    Py_RETURN_NONE;
}

static PyObject *done(PyObject *self, tec_status st)
{
    if (st)
        return raise(self, st);
    Py_RETURN_NONE;
}

/* _acquire(stream) */
static PyObject *py_acquire(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_acquire", 1);
    LIVE(c);
    void *stream;
    PTR(0, stream);
    tec_status st;
    CALL(tec_comm_acquire(c, stream));
    return done(self, st);
}

/* The FP8 chunk GEMMs of an overlap call from five trailing arguments
 * (a_format, b_format, a_scale_inv, b_scale_inv, fast_accum): NULL when
 * a_format is -1 (the chunk GEMMs in the call's dtype). */
static int fp8_chunk_args(PyObject *const *args, Py_ssize_t i, tec_fp8_chunk_gemm *f,
                          const tec_fp8_chunk_gemm **out)
{
    int af, bf, fast;
    void *as, *bs;
    if (!tec_arg_int(args, i, -1, 1, "a_format", &af) || !tec_arg_int(args, i + 1, -1, 1, "b_format", &bf) ||
        !tec_arg_ptr(args, i + 2, &as) || !tec_arg_ptr(args, i + 3, &bs) ||
        !tec_arg_int(args, i + 4, 0, 1, "fast_accum", &fast))
        return -1;
    *out = NULL;
    if (af < 0)
        return 0;
    *f = (tec_fp8_chunk_gemm){0};
    f->a_format = (tec_fp8_format)af; f->b_format = (tec_fp8_format)(bf < 0 ? 0 : bf);
    f->a_scale_inv = (const float *)as; f->b_scale_inv = (const float *)bs;
    f->fast_accum = fast;
    *out = f;
    return 0;
}

/* _ag_gemm(a_local, rows, k, n, dtype, out_dtype, b, ldb, transb, out, ldc, bias, local_copy, stream,
 *          a_format, b_format, a_scale_inv, b_scale_inv, fast_accum) */
static PyObject *py_ag_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_ag_gemm", 19);
    LIVE(c);
    tec_ag_gemm_args a = {0};
    tec_fp8_chunk_gemm f;
    void *stream;
    PTR(0, a.a_local); I64(1, a.rows); I64(2, a.k); I64(3, a.n); DTYPE(4, a.dtype, "dtype");
    DTYPE(5, a.out_dtype, "out_dtype");
    PTR(6, a.b); I64(7, a.ldb); BOOL(8, a.transb, "transb"); PTR(9, a.out); I64(10, a.ldc); PTR(11, a.bias);
    PTR(12, a.local_copy); PTR(13, stream);
    if (fp8_chunk_args(args, 14, &f, &a.fp8))
        return NULL;
    tec_status st;
    CALL(tec_comm_ag_gemm(c, &a, stream));
    return done(self, st);
}

/* _gemm_rs(a, lda, rows, k, n, dtype, b, ldb, transb, out, bias, stream,
 *          a_format, b_format, a_scale_inv, b_scale_inv, fast_accum,
 *          partial_format, partial_scale, partial_scale_inv, partial_amax)
 * partial_format -1: the partials in dtype; else FP8 partials (tec.h). */
static PyObject *py_gemm_rs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_gemm_rs", 21);
    LIVE(c);
    tec_gemm_rs_args a = {0};
    tec_fp8_chunk_gemm f;
    void *stream, *ps, *psi, *pa;
    int pf;
    PTR(0, a.a); I64(1, a.lda); I64(2, a.rows); I64(3, a.k); I64(4, a.n); DTYPE(5, a.dtype, "dtype");
    PTR(6, a.b); I64(7, a.ldb); BOOL(8, a.transb, "transb"); PTR(9, a.out); PTR(10, a.bias); PTR(11, stream);
    if (fp8_chunk_args(args, 12, &f, &a.fp8))
        return NULL;
    if (!tec_arg_int(args, 17, -1, 1, "partial_format", &pf) || !tec_arg_ptr(args, 18, &ps) ||
        !tec_arg_ptr(args, 19, &psi) || !tec_arg_ptr(args, 20, &pa))
        return NULL;
    if (pf >= 0) {
        if (!a.fp8) {
            PyErr_SetString(PyExc_ValueError, "_gemm_rs: FP8 partials need FP8 chunk GEMMs (a_format >= 0)");
            return NULL;
        }
        f.partial_format = (tec_fp8_format)pf;
        f.partial_scale = (const float *)ps; f.partial_scale_inv = (const float *)psi; f.partial_amax = (float *)pa;
    }
    tec_status st;
    CALL(tec_comm_gemm_rs(c, &a, stream));
    return done(self, st);
}

/* _bulk_ag_start(src, chunk_bytes, stream) */
static PyObject *py_bulk_ag_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_bulk_ag_start", 3);
    LIVE(c);
    void *src, *stream;
    size_t nbytes;
    PTR(0, src);
    if (!tec_arg_size(args, 1, "chunk_bytes", &nbytes))
        return NULL;
    PTR(2, stream);
    tec_status st;
    CALL(tec_comm_bulk_ag_start(c, src, nbytes, stream));
    return done(self, st);
}

/* _bulk_rs_start(src, rows, cols, dtype, out, stream) */
static PyObject *py_bulk_rs_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_bulk_rs_start", 6);
    LIVE(c);
    void *src, *out, *stream;
    int64_t rows, cols;
    tec_dtype dt;
    PTR(0, src); I64(1, rows); I64(2, cols); DTYPE(3, dt, "dtype"); PTR(4, out); PTR(5, stream);
    tec_status st;
    CALL(tec_comm_bulk_rs_start(c, src, rows, cols, dt, out, stream));
    return done(self, st);
}

static PyObject *py_bulk_ag_finish(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_bulk_ag_finish", 1);
    LIVE(c);
    void *stream;
    PTR(0, stream);
    tec_status st;
    CALL(tec_comm_bulk_ag_finish(c, stream));
    return done(self, st);
}

static PyObject *py_bulk_rs_finish(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_bulk_rs_finish", 1);
    LIVE(c);
    void *stream;
    PTR(0, stream);
    tec_status st;
    CALL(tec_comm_bulk_rs_finish(c, stream));
    return done(self, st);
}

static PyObject *py_synchronize(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_synchronize", 1);
    LIVE(c);
    void *stream;
    PTR(0, stream);
    tec_status st;
    CALL(tec_comm_synchronize(c, stream));
    return done(self, st);
}

/* _unmap_peers(stream): first half of a collective close (tec.h) */
static PyObject *py_unmap_peers(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_unmap_peers", 1);
    LIVE(c);
    void *stream;
    PTR(0, stream);
    tec_status st;
    CALL(tec_comm_unmap_peers(c, stream));
    return done(self, st);
}

/* buffer_ranges() -> [(ptr, nbytes), ...]: own region first, then peers. */
static PyObject *py_buffer_ranges(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("buffer_ranges", 0);
    CommObject *o = (CommObject *)self;
    if (!o->comm)
        return PyList_New(0);
    void *p[TEC_COMM_MAX_RANKS];
    size_t b[TEC_COMM_MAX_RANKS];
    const int n = tec_comm_ranges(o->comm, p, b, TEC_COMM_MAX_RANKS); /* own range first */
    PyObject *list = PyList_New(0);
    for (int i = 0; list && i < n; i++) {
        PyObject *t = Py_BuildValue("(NK)", PyLong_FromVoidPtr(p[i]), (unsigned long long)b[i]);
        if (!t || PyList_Append(list, t) < 0) {
            Py_XDECREF(t);
            Py_CLEAR(list);
            break;
        }
        Py_DECREF(t);
    }
    return list;
}

/* _overlaps(start, end) -> bool: whether bytes [start, end) meet any of
 * buffer_ranges() (the layers ask it on every call: no list is built). An
 * empty range meets nothing. */
static PyObject *py_overlaps(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_overlaps", 2);
    CommObject *o = (CommObject *)self;
    unsigned long long lo = PyLong_AsUnsignedLongLong(args[0]), hi;
    if (PyErr_Occurred())
        return NULL;
    hi = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (o->comm && lo < hi) {
        void *p[TEC_COMM_MAX_RANKS];
        size_t b[TEC_COMM_MAX_RANKS];
        const int n = tec_comm_ranges(o->comm, p, b, TEC_COMM_MAX_RANKS);
        for (int i = 0; i < n; i++) {
            const unsigned long long s = (unsigned long long)(uintptr_t)p[i];
            if (b[i] && s < hi && lo < s + b[i])
                Py_RETURN_TRUE;
        }
    }
    Py_RETURN_FALSE;
}

static PyObject *py_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("stats", 0);
    CommObject *o = (CommObject *)self;
    tec_comm_stats s = {0};
    if (o->comm)
        tec_comm_get_stats(o->comm, &s);
    return Py_BuildValue("{sKsKsKsKsKsKsKsK}", "ag_overlap", (unsigned long long)s.ag_overlap,
                         "rs_overlap", (unsigned long long)s.rs_overlap, "bulk_ag", (unsigned long long)s.bulk_ag,
                         "bulk_rs", (unsigned long long)s.bulk_rs, "non_overlap", (unsigned long long)s.non_overlap,
                         "chunks_sent", (unsigned long long)s.chunks_sent, "bytes_sent",
                         (unsigned long long)s.bytes_sent, "waits", (unsigned long long)s.waits);
}

/* close(): idempotent; the mapping lives on while buffer views exist. */
static PyObject *py_close(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("close", 0);
    CommObject *o = (CommObject *)self;
    o->closed = 1;
    if (o->exports == 0 && o->busy == 0)
        destroy_now(o);
    Py_RETURN_NONE;
}

#define PIN_CAPSULE "transformer_engine_c._C.pin"

static void unpin(CommObject *o);

/* The pin token's destructor: the only way a pin is released, so no caller
 * can unmap memory a live view still uses. */
static void pin_release(PyObject *capsule)
{
    CommObject *o = (CommObject *)PyCapsule_GetPointer(capsule, PIN_CAPSULE);
    if (!o) {
        PyErr_Clear();
        return;
    }
    unpin(o);
    Py_DECREF(o);
}

/* _pin() -> (address, token): the mapping stays alive until the token is freed. */
static PyObject *py_pin(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("_pin", 0);
    LIVE(c);
    void *base = tec_comm_base(c, tec_comm_rank(c));
    if (!base)
        return PyErr_Format(tec_state(defining_module(self))->EngineError,
                            "communicator '%s' has no mapped buffer", ((CommObject *)self)->name);
    PyObject *addr = PyLong_FromVoidPtr(base);
    if (!addr)
        return NULL;
    PyObject *token = PyCapsule_New(self, PIN_CAPSULE, pin_release);
    if (!token) {
        Py_DECREF(addr);
        return NULL;
    }
    Py_INCREF(self); /* released by pin_release */
    ((CommObject *)self)->exports++;
    PyObject *r = PyTuple_Pack(2, addr, token);
    Py_DECREF(addr);
    Py_DECREF(token); /* on failure this releases the pin again */
    return r;
}

static void unpin(CommObject *o)
{
    if (--o->exports == 0 && o->closed && o->busy == 0)
        destroy_now(o);
}

/* Before a subclass instance's __dict__ is cleared (it may hold tensors a
 * pending bulk operation still reads): close, which waits for the comm side. */
static void comm_finalize(PyObject *self)
{
    CommObject *o = (CommObject *)self;
    o->closed = 1;
    if (o->exports == 0 && o->busy == 0)
        destroy_now(o);
}

static PyObject *get_rank(PyObject *self, void *x) { LIVE(c); return PyLong_FromLong(tec_comm_rank(c)); }
static PyObject *get_size(PyObject *self, void *x) { LIVE(c); return PyLong_FromLong(tec_comm_size(c)); }
static PyObject *get_name(PyObject *self, void *x) { LIVE(c); return PyUnicode_FromString(tec_comm_name(c)); }
static PyObject *get_nbytes(PyObject *self, void *x) { LIVE(c); return PyLong_FromSize_t(tec_comm_buffer_bytes(c)); }
static PyObject *get_ptr(PyObject *self, void *x)
{
    LIVE(c);
    return PyLong_FromVoidPtr(tec_comm_base(c, tec_comm_rank(c)));
}
static PyObject *get_closed(PyObject *self, void *x) { return PyBool_FromLong(((CommObject *)self)->closed); }

static PyGetSetDef comm_getset[] = {
    {"rank", get_rank, NULL, "This rank in the group.", NULL},
    {"tp_size", get_size, NULL, "Ranks in the group.", NULL},
    {"name", get_name, NULL, "Name used in error messages.", NULL},
    {"buffer_bytes", get_nbytes, NULL, "Bytes of the user-visible buffer.", NULL},
    {"buffer_ptr", get_ptr, NULL, "Address of this rank's buffer.", NULL},
    {"closed", get_closed, NULL, "Whether close() was called.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#define M(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}
static PyMethodDef comm_methods[] = {
    M("_create", py_create, "_create(transport, device, rank, tp_size, buffer_bytes, name, timeout_s)"),
    M("_local_handle", py_local_handle, "_local_handle() -> bytes for the peers"),
    M("_open_peers", py_open_peers, "_open_peers(handles in rank order)"),
    M("_release_handle", py_release_handle, "_release_handle(): every peer mapped us (unlink the name)"),
    M("_set_gemm", py_set_gemm, "_set_gemm(ptr, nbytes, sm_margin)"),
    M("_acquire", py_acquire, "_acquire(stream): wait until peers read our slot"),
    M("_ag_gemm", py_ag_gemm, "_ag_gemm(a_local, rows, k, n, dtype, out_dtype, b, ldb, transb, out, ldc, bias, local_copy, stream, a_format, b_format, a_scale_inv, b_scale_inv, fast_accum)"),
    M("_gemm_rs", py_gemm_rs, "_gemm_rs(a, lda, rows, k, n, dtype, b, ldb, transb, out, bias, stream, a_format, b_format, a_scale_inv, b_scale_inv, fast_accum, partial_format, partial_scale, partial_scale_inv, partial_amax)"),
    M("_bulk_ag_start", py_bulk_ag_start, "_bulk_ag_start(src, chunk_bytes, stream)"),
    M("_bulk_ag_finish", py_bulk_ag_finish, "_bulk_ag_finish(stream)"),
    M("_bulk_rs_start", py_bulk_rs_start, "_bulk_rs_start(src, rows, cols, dtype, out, stream)"),
    M("_bulk_rs_finish", py_bulk_rs_finish, "_bulk_rs_finish(stream)"),
    M("_synchronize", py_synchronize, "_synchronize(stream)"),
    M("_unmap_peers", py_unmap_peers, "_unmap_peers(stream): wait, unmap peers (collective close, first half)"),
    M("_pin", py_pin, "_pin() -> (address, token): the mapping lives while the token does"),
    M("buffer_ranges", py_buffer_ranges, "buffer_ranges() -> [(ptr, nbytes)]: own and mapped peers' regions"),
    M("_overlaps", py_overlaps, "_overlaps(start, end) -> bool: whether bytes [start, end) meet buffer_ranges()"),
    M("stats", py_stats, "stats() -> dict of counters"),
    M("close", py_close, "close(): release the communicator (idempotent)"),
    {NULL, NULL, 0, NULL},
};

static PyType_Slot comm_slots[] = {
    {Py_tp_new, comm_new},
    {Py_tp_dealloc, comm_dealloc},
    {Py_tp_finalize, comm_finalize},
    {Py_tp_traverse, comm_traverse},
    {Py_tp_methods, comm_methods},
    {Py_tp_getset, comm_getset},
    {Py_tp_doc, "A userbuffers communicator (engine side); use transformer_engine_c.CommOverlap."},
    {0, NULL},
};

static PyType_Spec comm_spec = {
    .name = "transformer_engine_c._C.CommOverlap",
    .basicsize = sizeof(CommObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = comm_slots,
};

/* The CommOverlap type (module state's CommOverlap_type) and the transport constants. */
int tec_comm_exec(PyObject *module)
{
    PyObject *type = PyType_FromModuleAndSpec(module, &comm_spec, NULL);
    if (!type)
        return -1;
    tec_state(module)->CommOverlap_type = type;
    if (PyModule_AddObjectRef(module, "CommOverlap", type) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "TRANSPORT_SHM", TEC_TRANSPORT_SHM) < 0 ||
        PyModule_AddIntConstant(module, "TRANSPORT_CUDA_IPC", TEC_TRANSPORT_CUDA_IPC) < 0)
        return -1;
    return 0;
}

int tec_comm_traverse(tec_module_state *st, visitproc visit, void *arg)
{
    Py_VISIT(st->CommOverlap_type);
    return 0;
}

void tec_comm_clear(tec_module_state *st) { Py_CLEAR(st->CommOverlap_type); }
