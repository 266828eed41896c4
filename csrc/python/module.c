/* module.c - the transformer_engine_c._C extension module (limited API,
 * see module.h): multi-phase init, module state, status -> exception
 * mapping and argument converters.
 * `python -c "import transformer_engine_c"` exercises it. */
#include "module.h"

PyObject *tec_raise(PyObject *module, tec_status st)
{
    tec_module_state *s = tec_state(module);
    const char *msg = tec_last_error();
    if (!msg[0])
        msg = tec_status_string(st);
    PyObject *cls = st == TEC_ERR_INVALID_ARG ? PyExc_ValueError
                  : st == TEC_ERR_TIMEOUT ? s->CommTimeoutError
                  : st == TEC_ERR_NO_MEMORY ? PyExc_MemoryError
                  : s->EngineError;
    PyErr_Format(cls, "%s", msg);
    return NULL;
}

PyObject *tec_type_name(PyObject *o)
{
    PyObject *n = PyObject_GetAttrString((PyObject *)Py_TYPE(o), "__name__");
    if (n && PyUnicode_Check(n))
        return n;
    Py_XDECREF(n);
    PyErr_Clear();
    return PyUnicode_FromString("?");
}

int tec_arg_count(const char *fn, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want)
        return 1;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments (%zd given)", fn, want, nargs);
    return 0;
}

int tec_arg_i64(PyObject *const *args, Py_ssize_t i, int64_t *out)
{
    if (!PyLong_Check(args[i])) {
        PyErr_Format(PyExc_TypeError, "argument %zd must be an int", i);
        return 0;
    }
    long long v = PyLong_AsLongLong(args[i]);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "argument %zd does not fit a signed 64-bit integer", i);
        return 0;
    }
    *out = v;
    return 1;
}

int tec_arg_range(PyObject *const *args, Py_ssize_t i, int64_t lo, int64_t hi, const char *what, int64_t *out)
{
    int64_t v;
    if (!tec_arg_i64(args, i, &v))
        return 0;
    if (v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "argument %zd (%s) must be in [%lld, %lld], got %lld", i, what,
                     (long long)lo, (long long)hi, (long long)v);
        return 0;
    }
    *out = v;
    return 1;
}

int tec_arg_int(PyObject *const *args, Py_ssize_t i, int lo, int hi, const char *what, int *out)
{
    int64_t v;
    if (!tec_arg_range(args, i, lo, hi, what, &v))
        return 0;
    *out = (int)v;
    return 1;
}

int tec_arg_size(PyObject *const *args, Py_ssize_t i, const char *what, size_t *out)
{
    int64_t v;
    if (!tec_arg_range(args, i, 0, INT64_MAX, what, &v))
        return 0;
    *out = (size_t)v;
    return 1;
}

static PyObject *tec_zero(void)
{
    static PyObject *zero; /* immortal enough: one small int for the process */
    if (!zero)
        zero = PyLong_FromLong(0);
    return zero;
}

int tec_arg_ptr(PyObject *const *args, Py_ssize_t i, void **out)
{
    if (args[i] == Py_None) {
        *out = NULL;
        return 1;
    }
    if (!PyLong_Check(args[i])) {
        PyErr_Format(PyExc_TypeError, "argument %zd must be an address (int) or None", i);
        return 0;
    }
    if (PyObject_RichCompareBool(args[i], tec_zero(), Py_LT) == 1) {
        PyErr_Format(PyExc_ValueError, "argument %zd must be an address (int >= 0) or None", i);
        return 0;
    }
    void *p = PyLong_AsVoidPtr(args[i]);
    if (!p && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "argument %zd must be an address (int) or None", i);
        return 0;
    }
    *out = p;
    return 1;
}

int tec_arg_double(PyObject *const *args, Py_ssize_t i, double *out)
{
    if (!PyFloat_Check(args[i]) && !PyLong_Check(args[i])) {
        PyErr_Format(PyExc_TypeError, "argument %zd must be a float", i);
        return 0;
    }
    double v = PyFloat_AsDouble(args[i]);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "argument %zd must be a float", i);
        return 0;
    }
    *out = v;
    return 1;
}

/* _init(torch.Tensor, torch.nn.Parameter): the two types prepare_for_saving
 * passes through with a pointer compare. */
static PyObject *tec_init(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!tec_arg_count("_init", nargs, 2))
        return NULL;
    if (!PyType_Check(args[0]) || !PyType_Check(args[1]) ||
        !PyType_IsSubtype((PyTypeObject *)args[1], (PyTypeObject *)args[0]))
        return PyErr_Format(PyExc_TypeError, "_init() expects torch.Tensor and torch.nn.Parameter");
    tec_module_state *s = tec_state(module);
    PyObject *old_t = s->tensor_type, *old_p = s->parameter_type;
    s->tensor_type = Py_NewRef(args[0]);
    s->parameter_type = Py_NewRef(args[1]);
    Py_XDECREF(old_t);
    Py_XDECREF(old_p);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"_init", (PyCFunction)(void (*)(void))tec_init, METH_FASTCALL,
     "_init(tensor_type, parameter_type): tell the engine which types are torch.Tensor and nn.Parameter."},
    {NULL, NULL, 0, NULL},
};

static int tec_exec(PyObject *m)
{
    tec_module_state *s = tec_state(m);
    s->EngineError = PyErr_NewExceptionWithDoc("transformer_engine_c._C.EngineError",
        "A failure inside the transformer_engine_c engine.", PyExc_RuntimeError, NULL);
    if (!s->EngineError)
        return -1;
    PyObject *bases = PyTuple_Pack(2, s->EngineError, PyExc_TimeoutError);
    if (!bases)
        return -1;
    s->CommTimeoutError = PyErr_NewExceptionWithDoc("transformer_engine_c._C.CommTimeoutError",
        "A communicator wait on a peer ran past its timeout.", bases, NULL);
    Py_DECREF(bases);
    if (!s->CommTimeoutError)
        return -1;
    if (PyModule_AddObjectRef(m, "EngineError", s->EngineError) < 0 ||
        PyModule_AddObjectRef(m, "CommTimeoutError", s->CommTimeoutError) < 0)
        return -1;
    if (PyModule_AddFunctions(m, module_methods) < 0 ||
        PyModule_AddFunctions(m, tec_ops_methods) < 0 ||
        PyModule_AddFunctions(m, tec_saving_methods) < 0 ||
        PyModule_AddFunctions(m, tec_ranges_methods) < 0 ||
        PyModule_AddFunctions(m, tec_nccl_methods) < 0 ||
        PyModule_AddFunctions(m, tec_fp8_methods) < 0)
        return -1;
    if (tec_comm_exec(m) < 0 || tec_saving_exec(m) < 0)
        return -1;
    return 0;
}

static int tec_traverse(PyObject *m, visitproc visit, void *arg)
{
    tec_module_state *s = tec_state(m);
    Py_VISIT(s->EngineError);
    Py_VISIT(s->CommTimeoutError);
    Py_VISIT(s->tensor_type);
    Py_VISIT(s->parameter_type);
    int r = tec_comm_traverse(s, visit, arg);
    return r ? r : tec_saving_traverse(s, visit, arg);
}

static int tec_clear(PyObject *m)
{
    tec_module_state *s = tec_state(m);
    Py_CLEAR(s->EngineError);
    Py_CLEAR(s->CommTimeoutError);
    Py_CLEAR(s->tensor_type);
    Py_CLEAR(s->parameter_type);
    tec_comm_clear(s);
    tec_saving_clear(s);
    return 0;
}

static void tec_free(void *m) { tec_clear((PyObject *)m); }

static PyModuleDef_Slot tec_slots[] = {
    {Py_mod_exec, tec_exec},
    {0, NULL},
};

static struct PyModuleDef tec_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "transformer_engine_c._C",
    .m_doc = "The C engine of transformer_engine_c (positional, unchecked-by-design entry points; "
             "use the Python package).",
    .m_size = sizeof(tec_module_state),
    .m_slots = tec_slots,
    .m_traverse = tec_traverse,
    .m_clear = tec_clear,
    .m_free = tec_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&tec_module); }
