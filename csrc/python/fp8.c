/* fp8.c - CPython entry points for the engine's FP8 operations (tec.h:
 * quantize, amax, current-scaling scales, FP8 GEMM; block quantize and the
 * block-scaled GEMM, tests/test_fp8_block.py). Positional
 * METH_FASTCALL with addresses as ints; the checks a user sees live in
 * transformer_engine_c/_fp8_engine.py. tests/test_fp8_engine.py exercises
 * every function here. */
#include "module.h"

#include <string.h>

#define ARGC(fn, n) if (!tec_arg_count(fn, nargs, n)) return NULL
#define I64(i, v) if (!tec_arg_i64(args, i, &(v))) return NULL
#define PTR(i, v) if (!tec_arg_ptr(args, i, (void **)&(v))) return NULL
#define DBL(i, v) if (!tec_arg_double(args, i, &(v))) return NULL
#define INT(i, v, lo, hi, what) if (!tec_arg_int(args, i, lo, hi, what, &(v))) return NULL
#define DEV(i, v) INT(i, v, TEC_DEVICE_CPU, TEC_ARG_DEVICE_MAX, "device")
#define DTYPE(i, v, what) do { int d_; INT(i, d_, 0, TEC_ARG_DTYPE_MAX, what); (v) = (tec_dtype)d_; } while (0)
#define FMT(i, v, what) do { int f_; INT(i, f_, 0, 1, what); (v) = (tec_fp8_format)f_; } while (0)
#define BOOL(i, v, what) INT(i, v, 0, 1, what)
#define SIZE(i, v, what) if (!tec_arg_size(args, i, what, &(v))) return NULL
#define CALL(expr) TEC_ENGINE_CALL(dev, st, expr)

static PyObject *run(PyObject *module, tec_status st)
{
    if (st != TEC_OK)
        return tec_raise(module, st);
    Py_RETURN_NONE;
}

/* fp8_quantize(device, dtype, format, rows, cols, x, scale, out, out_t, amax,
 *              scale_inv, dbias, workspace, workspace_bytes, noop, act_mode,
 *              act, act_input, stream) */
static PyObject *py_fp8_quantize(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("fp8_quantize", 19);
    int dev, act;
    tec_fp8_quantize_args a = {0};
    void *stream;
    DEV(0, dev); DTYPE(1, a.dtype, "dtype"); FMT(2, a.format, "format"); I64(3, a.rows); I64(4, a.cols);
    PTR(5, a.x); PTR(6, a.scale); PTR(7, a.out); PTR(8, a.out_t); PTR(9, a.amax); PTR(10, a.scale_inv);
    PTR(11, a.dbias); PTR(12, a.workspace); SIZE(13, a.workspace_bytes, "workspace_bytes"); PTR(14, a.noop);
    INT(15, a.act_mode, TEC_FP8_ACT_NONE, TEC_FP8_ACT_BWD, "act_mode"); INT(16, act, 0, 31, "act");
    a.act = (tec_activation)act;
    PTR(17, a.act_input); PTR(18, stream);
    tec_status st;
    CALL(tec_fp8_quantize(dev, &a, stream));
    return run(m, st);
}

/* fp8_quantize_workspace_bytes(rows, cols) */
static PyObject *py_fp8_quantize_workspace_bytes(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    ARGC("fp8_quantize_workspace_bytes", 2);
    int64_t rows, cols;
    I64(0, rows); I64(1, cols);
    return PyLong_FromSize_t(tec_fp8_quantize_workspace_bytes(rows, cols));
}

/* fp8_amax(device, dtype, n, x, amax, stream) */
static PyObject *py_fp8_amax(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("fp8_amax", 6);
    int dev;
    tec_dtype dt;
    int64_t n;
    void *x, *amax, *stream;
    DEV(0, dev); DTYPE(1, dt, "dtype"); I64(2, n); PTR(3, x); PTR(4, amax); PTR(5, stream);
    tec_status st;
    CALL(tec_fp8_amax(dev, x, n, dt, (float *)amax, stream));
    return run(m, st);
}

/* fp8_scale_from_amax(device, n, amax, scale, scale_inv, fp8_max, pow2,
 *                     epsilon, stream) */
static PyObject *py_fp8_scale_from_amax(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("fp8_scale_from_amax", 9);
    int dev, pow2;
    int64_t n;
    void *amax, *scale, *scale_inv, *stream;
    double fp8_max, eps;
    DEV(0, dev); I64(1, n); PTR(2, amax); PTR(3, scale); PTR(4, scale_inv); DBL(5, fp8_max);
    BOOL(6, pow2, "pow2"); DBL(7, eps); PTR(8, stream);
    tec_status st;
    CALL(tec_fp8_scale_from_amax(dev, (const float *)amax, (float *)scale, (float *)scale_inv, n, (float)fp8_max,
                                 pow2, (float)eps, stream));
    return run(m, st);
}

/* fp8_delayed_update(device, history, scale, scale_inv, len, n, fp8_max,
 *                    divisor, most_recent, stream) */
static PyObject *py_fp8_delayed_update(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("fp8_delayed_update", 10);
    int dev, recent;
    int64_t len, n;
    void *hist, *scale, *scale_inv, *stream;
    double fp8_max, divisor;
    DEV(0, dev); PTR(1, hist); PTR(2, scale); PTR(3, scale_inv); I64(4, len); I64(5, n); DBL(6, fp8_max);
    DBL(7, divisor); BOOL(8, recent, "most_recent"); PTR(9, stream);
    tec_status st;
    CALL(tec_fp8_delayed_update(dev, (float *)hist, (float *)scale, (float *)scale_inv, len, n, (float)fp8_max,
                                (float)divisor, recent, stream));
    return run(m, st);
}

/* The delayed updates of several sets of tensors in one call, each a record
 * of TEC_UPDATE_FIELDS int64s: history, scale, scale_inv (addresses), len,
 * n, most_recent, then fp8_max and divisor as the bits of IEEE doubles.
 * Each runs as fp8_delayed_update (its checks), in order; the first error
 * stops the rest and is raised. */
#define TEC_UPDATE_FIELDS 8

static tec_status delayed_updates(int dev, const int64_t *r, int64_t count, void *stream)
{
    for (int64_t i = 0; i < count; i++, r += TEC_UPDATE_FIELDS) {
        double fp8_max, divisor;
        memcpy(&fp8_max, &r[6], sizeof fp8_max);
        memcpy(&divisor, &r[7], sizeof divisor);
        tec_status st = tec_fp8_delayed_update(dev, (float *)(intptr_t)r[0], (float *)(intptr_t)r[1],
                                               (float *)(intptr_t)r[2], r[3], r[4], (float)fp8_max, (float)divisor,
                                               r[5] != 0, stream);
        if (st != TEC_OK)
            return st;
    }
    return TEC_OK;
}

/* fp8_delayed_updates(device, records, stream): records a bytes object of
 * whole records (above), read where it lies in host memory. Taking bytes,
 * not an address, means a device tensor's address cannot be handed in by
 * mistake (a table built under a CUDA default device). */
static PyObject *py_fp8_delayed_updates(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("fp8_delayed_updates", 3);
    int dev;
    char *bytes;
    Py_ssize_t len;
    void *stream;
    DEV(0, dev);
    if (!PyBytes_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "fp8_delayed_updates: records must be bytes (records of %d int64 "
                            "in host memory), not an address or a tensor", TEC_UPDATE_FIELDS);
    if (PyBytes_AsStringAndSize(args[1], &bytes, &len) < 0)
        return NULL;
    PTR(2, stream);
    const Py_ssize_t record = TEC_UPDATE_FIELDS * (Py_ssize_t)sizeof(int64_t);
    if (len % record != 0 || len / record > ((Py_ssize_t)1 << 24))
        return PyErr_Format(PyExc_ValueError, "fp8_delayed_updates: records is %zd bytes; expected a whole number "
                            "of %zd-byte records, at most 2**24 of them", len, record);
    int64_t count = (int64_t)(len / record);
    const int64_t *records = (const int64_t *)bytes;
    tec_status st;
    CALL(delayed_updates(dev, records, count, stream));
    return run(m, st);
}

/* fp8_gemm(device, m, n, k, a_format, b_format, a, lda, b, ldb, a_scale_inv,
 *          b_scale_inv, c, ldc, c_dtype, bias, accumulate, fast_accum,
 *          workspace, workspace_bytes, stream), and with `modes` the two
 *          scale modes after them (fp8_block_gemm). */
static PyObject *gemm_call(PyObject *m, PyObject *const *args, Py_ssize_t nargs, const char *fn, int modes)
{
    ARGC(fn, modes ? 23 : 21);
    int dev;
    tec_fp8_gemm_args a = {0};
    void *stream;
    DEV(0, dev); I64(1, a.m); I64(2, a.n); I64(3, a.k); FMT(4, a.a_format, "a_format"); FMT(5, a.b_format, "b_format");
    PTR(6, a.a); I64(7, a.lda); PTR(8, a.b); I64(9, a.ldb); PTR(10, a.a_scale_inv); PTR(11, a.b_scale_inv);
    PTR(12, a.c); I64(13, a.ldc); DTYPE(14, a.c_dtype, "c_dtype"); PTR(15, a.bias);
    BOOL(16, a.accumulate, "accumulate"); BOOL(17, a.fast_accum, "fast_accum"); PTR(18, a.workspace);
    SIZE(19, a.workspace_bytes, "workspace_bytes"); PTR(20, stream);
    if (modes) {
        INT(21, a.a_scale_mode, 0, 2, "a_scale_mode"); INT(22, a.b_scale_mode, 0, 2, "b_scale_mode");
    }
    tec_status st;
    CALL(tec_fp8_gemm(dev, &a, stream));
    return run(m, st);
}

static PyObject *py_fp8_gemm(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    return gemm_call(m, args, nargs, "fp8_gemm", 0);
}

/* fp8_block_quantize(device, dtype, format, block_dim, rows, cols, x, out,
 *                    scale_inv, out_t, scale_inv_t, pow2, epsilon, stream) */
static PyObject *py_fp8_block_quantize(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("fp8_block_quantize", 14);
    int dev;
    tec_fp8_block_quantize_args a = {0};
    double eps;
    void *stream;
    DEV(0, dev); DTYPE(1, a.dtype, "dtype"); FMT(2, a.format, "format"); INT(3, a.block_dim, 1, 2, "block_dim");
    I64(4, a.rows); I64(5, a.cols); PTR(6, a.x); PTR(7, a.out); PTR(8, a.scale_inv); PTR(9, a.out_t);
    PTR(10, a.scale_inv_t); BOOL(11, a.pow2, "pow2"); DBL(12, eps); PTR(13, stream);
    a.epsilon = (float)eps;
    tec_status st;
    CALL(tec_fp8_block_quantize(dev, &a, stream));
    return run(m, st);
}

/* fp8_block_gemm(the 21 arguments of fp8_gemm, a_scale_mode, b_scale_mode) */
static PyObject *py_fp8_block_gemm(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    return gemm_call(m, args, nargs, "fp8_block_gemm", 1);
}

/* One tec_fp8_cast from 13 arguments at i: x, format, scale, amax,
 * scale_inv, data, data_t, current, pow2, epsilon, act_mode, act,
 * act_input. */
static int cast_arg(PyObject *const *args, Py_ssize_t i, tec_fp8_cast *c)
{
    int f, act;
    double eps;
    if (!tec_arg_ptr(args, i, (void **)&c->x) || !tec_arg_int(args, i + 1, 0, 1, "format", &f) ||
        !tec_arg_ptr(args, i + 2, (void **)&c->scale) || !tec_arg_ptr(args, i + 3, (void **)&c->amax) ||
        !tec_arg_ptr(args, i + 4, (void **)&c->scale_inv) || !tec_arg_ptr(args, i + 5, (void **)&c->data) ||
        !tec_arg_ptr(args, i + 6, (void **)&c->data_t) || !tec_arg_ptr(args, i + 7, (void **)&c->current) ||
        !tec_arg_int(args, i + 8, 0, 1, "pow2", &c->pow2) || !tec_arg_double(args, i + 9, &eps) ||
        !tec_arg_int(args, i + 10, TEC_FP8_ACT_NONE, TEC_FP8_ACT_BWD, "act_mode", &c->act_mode) ||
        !tec_arg_int(args, i + 11, 0, 31, "act", &act) || !tec_arg_ptr(args, i + 12, (void **)&c->act_input))
        return 0;
    c->format = (tec_fp8_format)f;
    c->act = (tec_activation)act;
    c->epsilon = (float)eps;
    return 1;
}

/* fp8_linear_fwd(device, dtype, rows, n, k, <x's cast: 13>, <w's cast: 13>,
 *                bias, y, fast_accum, workspace, workspace_bytes, stream,
 *                norm_x, gamma, beta, ln_out, mu, rsigma, eps,
 *                zero_centered_gamma): norm_x 0 for no norm. */
static PyObject *py_fp8_linear_fwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("fp8_linear_fwd", 45);
    int dev;
    tec_fp8_linear_fwd_args a = {0};
    tec_norm_fwd_args nf = {0};
    void *stream;
    double eps;
    DEV(0, dev); DTYPE(1, a.dtype, "dtype"); I64(2, a.rows); I64(3, a.n); I64(4, a.k);
    if (!cast_arg(args, 5, &a.x) || !cast_arg(args, 18, &a.w))
        return NULL;
    PTR(31, a.bias); PTR(32, a.y); BOOL(33, a.fast_accum, "fast_accum"); PTR(34, a.workspace);
    SIZE(35, a.workspace_bytes, "workspace_bytes"); PTR(36, stream);
    PTR(37, nf.x); PTR(38, nf.gamma); PTR(39, nf.beta); PTR(40, nf.y); PTR(41, nf.mu); PTR(42, nf.rsigma);
    DBL(43, eps); BOOL(44, nf.zero_centered_gamma, "zero_centered_gamma");
    if (!(eps >= 0.0 && eps <= 3.4e38))
        return PyErr_Format(PyExc_ValueError, "argument 43 (eps) must be a finite float >= 0, got %R", args[43]);
    nf.eps = (float)eps;
    if (nf.x)
        a.norm = &nf;
    tec_status st;
    CALL(tec_fp8_linear_fwd(dev, &a, stream));
    return run(m, st);
}

/* fp8_linear_bwd(device, dtype, rows, n, k, <dy's cast: 13>, dbias,
 *                dbias_workspace, dbias_workspace_bytes, w_t, w_scale_inv,
 *                w_format, dx, dgrad_fast_accum, x_t, x_scale_inv, x_format,
 *                dw, dw_dtype, accumulate, wgrad_fast_accum, workspace,
 *                workspace_bytes, stream, norm_x, mu, rsigma, gamma,
 *                norm_dx, dgamma, dbeta, zero_centered_gamma,
 *                norm_workspace, norm_workspace_bytes): norm_x 0 for no
 *                norm. */
static PyObject *py_fp8_linear_bwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ARGC("fp8_linear_bwd", 46);
    int dev;
    tec_fp8_linear_bwd_args a = {0};
    tec_norm_bwd_args nb = {0};
    void *stream;
    DEV(0, dev); DTYPE(1, a.dtype, "dtype"); I64(2, a.rows); I64(3, a.n); I64(4, a.k);
    if (!cast_arg(args, 5, &a.dy))
        return NULL;
    PTR(18, a.dbias); PTR(19, a.dbias_workspace); SIZE(20, a.dbias_workspace_bytes, "dbias_workspace_bytes");
    PTR(21, a.w_t); PTR(22, a.w_scale_inv); FMT(23, a.w_format, "w_format"); PTR(24, a.dx);
    BOOL(25, a.dgrad_fast_accum, "dgrad_fast_accum"); PTR(26, a.x_t); PTR(27, a.x_scale_inv);
    FMT(28, a.x_format, "x_format"); PTR(29, a.dw); DTYPE(30, a.dw_dtype, "dw_dtype");
    BOOL(31, a.accumulate, "accumulate"); BOOL(32, a.wgrad_fast_accum, "wgrad_fast_accum"); PTR(33, a.workspace);
    SIZE(34, a.workspace_bytes, "workspace_bytes"); PTR(35, stream);
    PTR(36, nb.x); PTR(37, nb.mu); PTR(38, nb.rsigma); PTR(39, nb.gamma); PTR(40, nb.dx); PTR(41, nb.dgamma);
    PTR(42, nb.dbeta); BOOL(43, nb.zero_centered_gamma, "zero_centered_gamma"); PTR(44, nb.workspace);
    SIZE(45, nb.workspace_bytes, "norm_workspace_bytes");
    if (nb.x)
        a.norm = &nb;
    tec_status st;
    CALL(tec_fp8_linear_bwd(dev, &a, stream));
    return run(m, st);
}

PyMethodDef tec_fp8_methods[] = {
    {"fp8_linear_fwd", (PyCFunction)(void (*)(void))py_fp8_linear_fwd, METH_FASTCALL,
     "fp8_linear_fwd(device, dtype, rows, n, k, x's cast (13), w's cast (13), bias, y, fast_accum, workspace, "
     "workspace_bytes, stream, norm_x, gamma, beta, ln_out, mu, rsigma, eps, zero_centered_gamma); a cast: x, "
     "format, scale, amax, scale_inv, data, data_t, current, pow2, epsilon, act_mode, act, act_input"},
    {"fp8_linear_bwd", (PyCFunction)(void (*)(void))py_fp8_linear_bwd, METH_FASTCALL,
     "fp8_linear_bwd(device, dtype, rows, n, k, dy's cast (13), dbias, dbias_workspace, dbias_workspace_bytes, w_t, "
     "w_scale_inv, w_format, dx, dgrad_fast_accum, x_t, x_scale_inv, x_format, dw, dw_dtype, accumulate, "
     "wgrad_fast_accum, workspace, workspace_bytes, stream, norm_x, mu, rsigma, gamma, norm_dx, dgamma, dbeta, "
     "zero_centered_gamma, norm_workspace, norm_workspace_bytes)"},
    {"fp8_quantize", (PyCFunction)(void (*)(void))py_fp8_quantize, METH_FASTCALL,
     "fp8_quantize(device, dtype, format, rows, cols, x, scale, out, out_t, amax, scale_inv, dbias, workspace, "
     "workspace_bytes, noop, act_mode, act, act_input, stream)"},
    {"fp8_quantize_workspace_bytes", (PyCFunction)(void (*)(void))py_fp8_quantize_workspace_bytes, METH_FASTCALL,
     "fp8_quantize_workspace_bytes(rows, cols)"},
    {"fp8_amax", (PyCFunction)(void (*)(void))py_fp8_amax, METH_FASTCALL, "fp8_amax(device, dtype, n, x, amax, stream)"},
    {"fp8_scale_from_amax", (PyCFunction)(void (*)(void))py_fp8_scale_from_amax, METH_FASTCALL,
     "fp8_scale_from_amax(device, n, amax, scale, scale_inv, fp8_max, pow2, epsilon, stream)"},
    {"fp8_delayed_update", (PyCFunction)(void (*)(void))py_fp8_delayed_update, METH_FASTCALL,
     "fp8_delayed_update(device, history, scale, scale_inv, len, n, fp8_max, divisor, most_recent, stream)"},
    {"fp8_delayed_updates", (PyCFunction)(void (*)(void))py_fp8_delayed_updates, METH_FASTCALL,
     "fp8_delayed_updates(device, records, stream): records a bytes object of records of 8 native int64 (history, "
     "scale, scale_inv, len, n, most_recent, the bits of fp8_max and divisor as doubles)"},
    {"fp8_gemm", (PyCFunction)(void (*)(void))py_fp8_gemm, METH_FASTCALL,
     "fp8_gemm(device, m, n, k, a_format, b_format, a, lda, b, ldb, a_scale_inv, b_scale_inv, c, ldc, c_dtype, "
     "bias, accumulate, fast_accum, workspace, workspace_bytes, stream)"},
    {"fp8_block_quantize", (PyCFunction)(void (*)(void))py_fp8_block_quantize, METH_FASTCALL,
     "fp8_block_quantize(device, dtype, format, block_dim, rows, cols, x, out, scale_inv, out_t, scale_inv_t, pow2, "
     "epsilon, stream)"},
    {"fp8_block_gemm", (PyCFunction)(void (*)(void))py_fp8_block_gemm, METH_FASTCALL,
     "fp8_block_gemm(device, m, n, k, a_format, b_format, a, lda, b, ldb, a_scale_inv, b_scale_inv, c, ldc, c_dtype, "
     "bias, accumulate, fast_accum, workspace, workspace_bytes, stream, a_scale_mode, b_scale_mode)"},
    {NULL, NULL, 0, NULL},
};
