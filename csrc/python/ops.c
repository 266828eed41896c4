/* ops.c - CPython entry points for the engine's stateless operations
 * (normalisation, GEMM, activations, RoPE, backend loading, and the layers'
 * composite steps: linear_bwd, norm_linear_fwd/bwd), one tec.h call each,
 * arguments converted and nothing composed here. Positional METH_FASTCALL with
 * addresses as ints; friendly checks live in transformer_engine_c/_engine.py
 * and module/_steps.py. tests/test_kernels.py exercises every function here,
 * tests/test_one_path.py the composite steps, tests/test_rope.py RoPE. */
#include "module.h"

#define ARGC(fn, n) if (!tec_arg_count(fn, nargs, n)) return NULL
#define I64(i, v) if (!tec_arg_i64(args, i, &(v))) return NULL
#define PTR(i, v) if (!tec_arg_ptr(args, i, (void **)&(v))) return NULL
#define DBL(i, v) if (!tec_arg_double(args, i, &(v))) return NULL
#define INT(i, v, lo, hi, what) if (!tec_arg_int(args, i, lo, hi, what, &(v))) return NULL
#define DEV(i, v) INT(i, v, TEC_DEVICE_CPU, TEC_ARG_DEVICE_MAX, "device")
#define DTYPE(i, v, what) do { int d_; INT(i, d_, 0, TEC_ARG_DTYPE_MAX, what); (v) = (tec_dtype)d_; } while (0)
#define BOOL(i, v, what) INT(i, v, 0, 1, what)
#define SIZE(i, v, what) if (!tec_arg_size(args, i, what, &(v))) return NULL

static PyObject *run(PyObject *module, tec_status st)
{
    if (st != TEC_OK)
        return tec_raise(module, st);
    Py_RETURN_NONE;
}

/* Release the GIL around engine calls: CPU kernels take real time and the
 * comm thread of a shared-memory communicator may need the interpreter. */
#define CALL(expr) TEC_ENGINE_CALL(dev, st, expr)

/* norm_fwd(device, dtype, rows, cols, x, gamma, beta, y, mu, rsigma, eps,
 *          zero_centered_gamma, stream) */
static PyObject *py_norm_fwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("norm_fwd", 13);
    int dev;
    double eps;
    tec_norm_fwd_args a = {0};
    void *stream;
    DEV(0, dev); DTYPE(1, a.dtype, "dtype"); I64(2, a.rows); I64(3, a.cols);
    PTR(4, a.x); PTR(5, a.gamma); PTR(6, a.beta); PTR(7, a.y); PTR(8, a.mu); PTR(9, a.rsigma);
    DBL(10, eps); BOOL(11, a.zero_centered_gamma, "zero_centered_gamma"); PTR(12, stream);
    if (!(eps >= 0.0 && eps <= 3.4e38))
        return PyErr_Format(PyExc_ValueError, "argument 10 (eps) must be a finite float >= 0, got %R", args[10]);
    a.eps = (float)eps;
    tec_status st;
    CALL(tec_norm_fwd(dev, &a, stream));
    return run(m, st);
}

/* norm_bwd(device, dtype, rows, cols, dy, x, mu, rsigma, gamma, dx, dgamma,
 *          dbeta, zero_centered_gamma, workspace, workspace_bytes, stream) */
static PyObject *py_norm_bwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("norm_bwd", 16);
    int dev;
    tec_norm_bwd_args a = {0};
    void *stream;
    DEV(0, dev); DTYPE(1, a.dtype, "dtype"); I64(2, a.rows); I64(3, a.cols);
    PTR(4, a.dy); PTR(5, a.x); PTR(6, a.mu); PTR(7, a.rsigma); PTR(8, a.gamma);
    PTR(9, a.dx); PTR(10, a.dgamma); PTR(11, a.dbeta); BOOL(12, a.zero_centered_gamma, "zero_centered_gamma");
    PTR(13, a.workspace); SIZE(14, a.workspace_bytes, "workspace_bytes"); PTR(15, stream);
    tec_status st;
    CALL(tec_norm_bwd(dev, &a, stream));
    return run(m, st);
}

/* norm_bwd_workspace_bytes(device, rows, cols) -> int */
static PyObject *py_norm_bwd_ws(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("norm_bwd_workspace_bytes", 3);
    int dev;
    int64_t rows, cols;
    DEV(0, dev);
    if (!tec_arg_range(args, 1, 0, INT64_MAX, "rows", &rows) || !tec_arg_range(args, 2, 1, INT64_MAX, "cols", &cols))
        return NULL;
    tec_status st = tec_backend_check(dev);
    if (st)
        return tec_raise(m, st);
    size_t n = tec_norm_bwd_workspace_bytes(dev, rows, cols);
    if (n == SIZE_MAX)
        return PyErr_Format(PyExc_ValueError, "norm_bwd_workspace_bytes: rows=%lld x cols=%lld is too large",
                            (long long)rows, (long long)cols);
    return PyLong_FromSize_t(n);
}

/* gemm(device, ab_dtype, c_dtype, transa, transb, m, n, k, a, lda, b, ldb,
 *      c, ldc, bias, bias_grad, accumulate, workspace, workspace_bytes, stream) */
static PyObject *py_gemm(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("gemm", 20);
    int dev;
    tec_gemm_args a = {0};
    void *stream;
    DEV(0, dev); DTYPE(1, a.ab_dtype, "ab_dtype"); DTYPE(2, a.c_dtype, "c_dtype");
    BOOL(3, a.transa, "transa"); BOOL(4, a.transb, "transb");
    I64(5, a.m); I64(6, a.n); I64(7, a.k);
    PTR(8, a.a); I64(9, a.lda); PTR(10, a.b); I64(11, a.ldb); PTR(12, a.c); I64(13, a.ldc);
    PTR(14, a.bias); PTR(15, a.bias_grad); BOOL(16, a.accumulate, "accumulate"); PTR(17, a.workspace);
    SIZE(18, a.workspace_bytes, "workspace_bytes");
    PTR(19, stream);
    tec_status st;
    CALL(tec_gemm(dev, &a, stream));
    return run(m, st);
}

/* linear_bwd(device, dtype, m, n, k, dy, x, w, dx, dw, db, workspace,
 *            workspace_bytes, stream): tec_linear_bwd (0 for a NULL). */
static PyObject *py_linear_bwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("linear_bwd", 14);
    int dev;
    tec_linear_bwd_args a = {0};
    void *stream;
    DEV(0, dev); DTYPE(1, a.dtype, "dtype"); I64(2, a.m); I64(3, a.n); I64(4, a.k);
    PTR(5, a.dy); PTR(6, a.x); PTR(7, a.w); PTR(8, a.dx); PTR(9, a.dw); PTR(10, a.db); PTR(11, a.workspace);
    SIZE(12, a.workspace_bytes, "workspace_bytes"); PTR(13, stream);
    tec_status st;
    CALL(tec_linear_bwd(dev, &a, stream));
    return run(m, st);
}

/* norm_linear_fwd(device, dtype, rows, k, n, x, gamma, beta, ln_out, mu, rsigma,
 *                 eps, zero_centered_gamma, w, b, y, workspace, workspace_bytes,
 *                 stream): tec_norm_linear_fwd. */
static PyObject *py_norm_linear_fwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("norm_linear_fwd", 19);
    int dev;
    double eps;
    tec_norm_linear_fwd_args a = {0};
    void *stream;
    DEV(0, dev); DTYPE(1, a.dtype, "dtype"); I64(2, a.rows); I64(3, a.k); I64(4, a.n);
    PTR(5, a.x); PTR(6, a.gamma); PTR(7, a.beta); PTR(8, a.ln_out); PTR(9, a.mu); PTR(10, a.rsigma);
    DBL(11, eps); BOOL(12, a.zero_centered_gamma, "zero_centered_gamma"); PTR(13, a.w); PTR(14, a.bias);
    PTR(15, a.y); PTR(16, a.workspace); SIZE(17, a.workspace_bytes, "workspace_bytes"); PTR(18, stream);
    if (!(eps >= 0.0 && eps <= 3.4e38))
        return PyErr_Format(PyExc_ValueError, "argument 11 (eps) must be a finite float >= 0, got %R", args[11]);
    a.eps = (float)eps;
    tec_status st;
    CALL(tec_norm_linear_fwd(dev, &a, stream));
    return run(m, st);
}

/* norm_linear_bwd(device, dtype, rows, k, n, dy, x, ln_out, mu, rsigma, gamma,
 *                 zero_centered_gamma, w, dln, dx, dgamma, dbeta, dw, db,
 *                 norm_workspace, norm_workspace_bytes, workspace,
 *                 workspace_bytes, stream): tec_norm_linear_bwd. */
static PyObject *py_norm_linear_bwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("norm_linear_bwd", 24);
    int dev;
    tec_norm_linear_bwd_args a = {0};
    void *stream;
    DEV(0, dev); DTYPE(1, a.dtype, "dtype"); I64(2, a.rows); I64(3, a.k); I64(4, a.n);
    PTR(5, a.dy); PTR(6, a.x); PTR(7, a.ln_out); PTR(8, a.mu); PTR(9, a.rsigma); PTR(10, a.gamma);
    BOOL(11, a.zero_centered_gamma, "zero_centered_gamma"); PTR(12, a.w); PTR(13, a.dln); PTR(14, a.dx);
    PTR(15, a.dgamma); PTR(16, a.dbeta); PTR(17, a.dw); PTR(18, a.db); PTR(19, a.norm_workspace);
    SIZE(20, a.norm_workspace_bytes, "norm_workspace_bytes"); PTR(21, a.workspace);
    SIZE(22, a.workspace_bytes, "workspace_bytes"); PTR(23, stream);
    tec_status st;
    CALL(tec_norm_linear_bwd(dev, &a, stream));
    return run(m, st);
}

/* gemm_workspace_bytes(device) -> int */
static PyObject *py_gemm_ws(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("gemm_workspace_bytes", 1);
    int dev;
    DEV(0, dev);
    tec_status st = tec_backend_check(dev);
    if (st)
        return tec_raise(m, st);
    return PyLong_FromSize_t(tec_gemm_workspace_bytes(dev));
}

/* act_fwd(device, act, dtype, rows, cols, x, bias, y, limit, alpha,
 *         glu_offset, stream) */
static PyObject *py_act_fwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("act_fwd", 12);
    int64_t dev, act, dt;
    double limit, alpha, offset;
    tec_act_fwd_args a = {0};
    void *stream;
    I64(0, dev); I64(1, act); I64(2, dt); I64(3, a.rows); I64(4, a.cols);
    PTR(5, a.x); PTR(6, a.bias); PTR(7, a.y); DBL(8, limit); DBL(9, alpha); DBL(10, offset); PTR(11, stream);
    a.act = (tec_activation)act;
    a.dtype = (tec_dtype)dt;
    a.limit = (float)limit;
    a.alpha = (float)alpha;
    a.glu_offset = (float)offset;
    tec_status st;
    CALL(tec_act_fwd((int)dev, &a, stream));
    return run(m, st);
}

/* act_bwd(device, act, dtype, rows, cols, dy, x, dx, dbias, workspace,
 *         workspace_bytes, limit, alpha, glu_offset, stream) */
static PyObject *py_act_bwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("act_bwd", 15);
    int64_t dev, act, dt, wsb;
    double limit, alpha, offset;
    tec_act_bwd_args a = {0};
    void *stream;
    I64(0, dev); I64(1, act); I64(2, dt); I64(3, a.rows); I64(4, a.cols);
    PTR(5, a.dy); PTR(6, a.x); PTR(7, a.dx); PTR(8, a.dbias); PTR(9, a.workspace); I64(10, wsb);
    DBL(11, limit); DBL(12, alpha); DBL(13, offset); PTR(14, stream);
    a.act = (tec_activation)act;
    a.dtype = (tec_dtype)dt;
    a.workspace_bytes = (size_t)wsb;
    a.limit = (float)limit;
    a.alpha = (float)alpha;
    a.glu_offset = (float)offset;
    tec_status st;
    CALL(tec_act_bwd((int)dev, &a, stream));
    return run(m, st);
}

/* act_bwd_workspace_bytes(device, act, rows, cols) -> int */
static PyObject *py_act_bwd_ws(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("act_bwd_workspace_bytes", 4);
    int64_t dev, act, rows, cols;
    I64(0, dev); I64(1, act); I64(2, rows); I64(3, cols);
    tec_status st = tec_backend_check((int)dev);
    if (st)
        return tec_raise(m, st);
    return PyLong_FromSize_t(tec_act_bwd_workspace_bytes((int)dev, (tec_activation)act, rows, cols));
}

/* rope(device, dtype, format, interleaved, backward, s, b, h, d, stride_s,
 *      stride_b, stride_h, stride_d, x, y, freqs, freqs_rows, d2,
 *      cu_seqlens, start_positions, cp_size, cp_rank, stream) */
static PyObject *py_rope(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("rope", 23);
    int dev, fmt;
    tec_rope_args a = {0};
    void *stream;
    DEV(0, dev); DTYPE(1, a.dtype, "dtype"); INT(2, fmt, 0, 2, "format");
    BOOL(3, a.interleaved, "interleaved"); BOOL(4, a.backward, "backward");
    I64(5, a.s); I64(6, a.b); I64(7, a.h); I64(8, a.d);
    I64(9, a.stride_s); I64(10, a.stride_b); I64(11, a.stride_h); I64(12, a.stride_d);
    PTR(13, a.x); PTR(14, a.y); PTR(15, a.freqs); I64(16, a.freqs_rows); I64(17, a.d2);
    PTR(18, a.cu_seqlens); PTR(19, a.start_positions);
    INT(20, a.cp_size, 1, 1 << 20, "cp_size"); INT(21, a.cp_rank, 0, 1 << 20, "cp_rank"); PTR(22, stream);
    a.format = (tec_rope_format)fmt;
    tec_status st;
    CALL(tec_rope(dev, &a, stream));
    return run(m, st);
}

/* load_cuda_backend(path: str, gemm_policy: int) (TEC_GEMM_* bits of tec.h) */
static PyObject *py_load_cuda(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("load_cuda_backend", 2);
    int64_t policy;
    if (!tec_arg_range(args, 1, 0, UINT32_MAX, "gemm_policy", &policy))
        return NULL;
    if (!PyUnicode_Check(args[0]))
        return PyErr_Format(PyExc_TypeError, "argument 0 (path) must be a str");
    Py_ssize_t len;
    const char *path = PyUnicode_AsUTF8AndSize(args[0], &len);
    if (!path)
        return NULL;
    if ((size_t)len != strlen(path))
        return PyErr_Format(PyExc_ValueError, "argument 0 (path) contains a NUL character");
    return run(m, tec_load_cuda_backend(path, (unsigned)policy));
}

/* has_cuda_backend() -> bool */
static PyObject *py_has_cuda(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("has_cuda_backend", 0);
    return PyBool_FromLong(tec_backend_check(0) == TEC_OK);
}

PyMethodDef tec_ops_methods[] = {
    {"norm_fwd", (PyCFunction)(void (*)(void))py_norm_fwd, METH_FASTCALL, "LayerNorm/RMSNorm forward."},
    {"norm_bwd", (PyCFunction)(void (*)(void))py_norm_bwd, METH_FASTCALL, "LayerNorm/RMSNorm backward."},
    {"norm_bwd_workspace_bytes", (PyCFunction)(void (*)(void))py_norm_bwd_ws, METH_FASTCALL, "Workspace of norm_bwd."},
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_FASTCALL, "Row-major GEMM (see tec.h)."},
    {"linear_bwd", (PyCFunction)(void (*)(void))py_linear_bwd, METH_FASTCALL, "A linear layer's backward."},
    {"norm_linear_fwd", (PyCFunction)(void (*)(void))py_norm_linear_fwd, METH_FASTCALL, "Norm then GEMM (+ bias)."},
    {"norm_linear_bwd", (PyCFunction)(void (*)(void))py_norm_linear_bwd, METH_FASTCALL, "Backward of norm_linear_fwd."},
    {"gemm_workspace_bytes", (PyCFunction)(void (*)(void))py_gemm_ws, METH_FASTCALL, "Workspace of gemm."},
    {"act_fwd", (PyCFunction)(void (*)(void))py_act_fwd, METH_FASTCALL, "Activation forward (see tec.h)."},
    {"act_bwd", (PyCFunction)(void (*)(void))py_act_bwd, METH_FASTCALL, "Activation backward, optional dbias."},
    {"act_bwd_workspace_bytes", (PyCFunction)(void (*)(void))py_act_bwd_ws, METH_FASTCALL, "Workspace of act_bwd with dbias."},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL, "RoPE's apply, forward or backward (see tec.h)."},
    {"load_cuda_backend", (PyCFunction)(void (*)(void))py_load_cuda, METH_FASTCALL, "Load the CUDA backend library."},
    {"has_cuda_backend", (PyCFunction)(void (*)(void))py_has_cuda, METH_FASTCALL, "Whether CUDA is loaded."},
    {NULL, NULL, 0, NULL},
};
