/* saving.c - prepare_for_saving / restore_from_saved: what a layer hands to
 * ctx.save_for_backward, and how its backward gets the original objects back
 * whatever saved-tensor hooks unpacked. tests/test_saving.py exercises it;
 * `python -m transformer_engine_c.bench_saving` times it.
 *
 * prepare_for_saving(*objs) -> (tensors_to_save: tuple, objects: SavedObjects)
 *   None, torch.Tensor        -> saved as is                    (kind PLAIN)
 *   tensor subclass with a true `is_distributed_weight`
 *                             -> saved as is AND kept by reference (kind REF);
 *                                restore returns the original object
 *   object whose type defines prepare_for_saving()
 *                             -> delegated (kind DELEGATE): it returns
 *                                (tensors, state); `tensors` are saved in its
 *                                place; restore calls
 *                                state.restore_from_saved(list_of_those_tensors)
 *                                and returns its result, or `state` if that
 *                                result is None
 *   other tensor subclasses   -> saved as is (PLAIN)
 * restore_from_saved(objects, saved_tensors) -> list, one item per prepared
 *   object; `objects` is consumed (its references dropped) and cannot be
 *   restored again.
 *
 * Hot path: None and exact torch.Tensor cost a pointer compare each; the
 * marker is read only for tensor subclasses (nn.Parameter included), with an
 * interned name and no AttributeError on a miss. */
#include "module.h"

#include <string.h>

#if PY_VERSION_HEX >= 0x030D0000
#define TEC_LOOKUP_ATTR(o, name, res) PyObject_GetOptionalAttr((o), (name), (res))
#else
#define TEC_LOOKUP_ATTR(o, name, res) _PyObject_LookupAttr((o), (name), (res))
#endif

enum { SAVED_PLAIN = 0, SAVED_REF = 1, SAVED_DELEGATE = 2 };

typedef struct {
    PyObject *obj;    /* REF: the original tensor; DELEGATE: the state; PLAIN: NULL */
    Py_ssize_t count; /* saved tensors this entry takes: 1, or k for DELEGATE */
    int kind;
} saved_entry;

/* The objects container: one entry per prepared object (ob_size of them). */
typedef struct {
    PyObject_VAR_HEAD
    Py_ssize_t n_saved;   /* length of tensors_to_save */
    Py_ssize_t n_special; /* entries that are not PLAIN */
    int consumed;
    saved_entry e[];
} SavedObjects;

/* ---- the SavedObjects type ------------------------------------------------ */

static int so_traverse(PyObject *self, visitproc visit, void *arg)
{
    SavedObjects *so = (SavedObjects *)self;
    Py_VISIT(Py_TYPE(self));
    for (Py_ssize_t i = 0; i < Py_SIZE(so); i++)
        Py_VISIT(so->e[i].obj);
    return 0;
}

static int so_clear(PyObject *self)
{
    SavedObjects *so = (SavedObjects *)self;
    for (Py_ssize_t i = 0; i < Py_SIZE(so); i++)
        Py_CLEAR(so->e[i].obj);
    return 0;
}

static void so_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    so_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static Py_ssize_t so_length(PyObject *self) { return Py_SIZE(self); }

static PyObject *so_repr(PyObject *self)
{
    SavedObjects *so = (SavedObjects *)self;
    return PyUnicode_FromFormat("<SavedObjects: %zd objects, %zd saved tensors, %zd kept by reference "
                                "or delegated%s>", Py_SIZE(so), so->n_saved, so->n_special,
                                so->consumed ? ", consumed" : "");
}

static PyObject *so_get_consumed(PyObject *self, void *closure)
{
    return PyBool_FromLong(((SavedObjects *)self)->consumed);
}

static PyObject *so_get_n_saved(PyObject *self, void *closure)
{
    return PyLong_FromSsize_t(((SavedObjects *)self)->n_saved);
}

static PyGetSetDef so_getset[] = {
    {"consumed", so_get_consumed, NULL, "True once restore_from_saved has used these objects.", NULL},
    {"n_saved", so_get_n_saved, NULL, "How many saved tensors restore_from_saved takes.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot so_slots[] = {
    {Py_tp_doc, "What prepare_for_saving keeps beside the saved tensors; pass it to "
                "restore_from_saved once."},
    {Py_tp_traverse, so_traverse},
    {Py_tp_clear, so_clear},
    {Py_tp_dealloc, so_dealloc},
    {Py_tp_repr, so_repr},
    {Py_tp_getset, so_getset},
    {Py_sq_length, so_length},
    {0, NULL},
};

static PyType_Spec so_spec = {
    .name = "transformer_engine_c._C.SavedObjects",
    .basicsize = (int)offsetof(SavedObjects, e),
    .itemsize = (int)sizeof(saved_entry),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = so_slots,
};

/* ---- prepare_for_saving ---------------------------------------------------- */

static int truthy(PyObject *v) { return v == Py_True ? 1 : v == Py_False ? 0 : PyObject_IsTrue(v); }

/* Delegate to o.prepare_for_saving(): append its tensors to *out at *pos
 * (growing *out by k - 1) and record (state, k) in entry `e`. */
static int prepare_delegate(tec_module_state *s, PyTypeObject *tt, saved_entry *e, Py_ssize_t i,
                            PyObject *o, PyObject **out, Py_ssize_t *pos)
{
    const char *tn = Py_TYPE(o)->tp_name;
    PyObject *r = PyObject_CallMethodNoArgs(o, s->str_prepare_for_saving);
    if (!r)
        return -1;
    int rc = -1;
    PyObject *ts = NULL, *probe = NULL;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
        PyErr_Format(PyExc_TypeError, "prepare_for_saving: argument %zd (%.200s): its prepare_for_saving() "
                     "must return a pair (tensors, state), got %.200s", i, tn, Py_TYPE(r)->tp_name);
        goto done;
    }
    PyObject *state = PyTuple_GET_ITEM(r, 1);
    int has = TEC_LOOKUP_ATTR(state, s->str_restore_from_saved, &probe);
    if (has < 0)
        goto done;
    if (!has) {
        PyErr_Format(PyExc_TypeError, "prepare_for_saving: argument %zd (%.200s): the state its "
                     "prepare_for_saving() returned (%.200s) has no restore_from_saved()",
                     i, tn, Py_TYPE(state)->tp_name);
        goto done;
    }
    PyObject *t0 = PyTuple_GET_ITEM(r, 0);
    if (!PyList_Check(t0) && !PyTuple_Check(t0)) {
        PyErr_Format(PyExc_TypeError, "prepare_for_saving: argument %zd (%.200s): its prepare_for_saving() "
                     "must return a list or tuple of tensors first, got %.200s", i, tn, Py_TYPE(t0)->tp_name);
        goto done;
    }
    ts = PySequence_Tuple(t0);
    if (!ts)
        goto done;
    Py_ssize_t k = PyTuple_GET_SIZE(ts);
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *t = PyTuple_GET_ITEM(ts, j);
        if (t != Py_None && !PyObject_TypeCheck(t, tt)) {
            PyErr_Format(PyExc_TypeError, "prepare_for_saving: argument %zd (%.200s): its prepare_for_saving() "
                         "returned %.200s at position %zd; expected torch.Tensor or None",
                         i, tn, Py_TYPE(t)->tp_name, j);
            goto done;
        }
    }
    if (k != 1 && _PyTuple_Resize(out, PyTuple_GET_SIZE(*out) + k - 1) < 0)
        goto done;
    for (Py_ssize_t j = 0; j < k; j++)
        PyTuple_SET_ITEM(*out, (*pos)++, Py_NewRef(PyTuple_GET_ITEM(ts, j)));
    e->obj = Py_NewRef(state);
    e->count = k;
    e->kind = SAVED_DELEGATE;
    rc = 0;
done:
    Py_XDECREF(probe);
    Py_XDECREF(ts);
    Py_DECREF(r);
    return rc;
}

/* Everything that is neither None nor an exact torch.Tensor. */
static int prepare_other(tec_module_state *s, PyTypeObject *tt, SavedObjects *so, Py_ssize_t i,
                         PyObject *o, PyObject **out, Py_ssize_t *pos)
{
    saved_entry *e = &so->e[i];
    int is_tensor = PyObject_TypeCheck(o, tt);
    if (is_tensor && s->saving_keep_refs) {
        PyObject *v;
        int r = TEC_LOOKUP_ATTR(o, s->str_is_distributed_weight, &v);
        if (r < 0)
            return -1;
        if (r > 0) {
            int t = truthy(v);
            Py_DECREF(v);
            if (t < 0)
                return -1;
            if (t) {
                e->obj = Py_NewRef(o);
                e->kind = SAVED_REF;
                so->n_special++;
                PyTuple_SET_ITEM(*out, (*pos)++, Py_NewRef(o));
                return 0;
            }
        }
    }
    if (_PyType_Lookup(Py_TYPE(o), s->str_prepare_for_saving)) {
        if (prepare_delegate(s, tt, e, i, o, out, pos) < 0)
            return -1;
        so->n_special++;
        return 0;
    }
    if (!is_tensor) {
        PyErr_Format(PyExc_TypeError, "prepare_for_saving: argument %zd is %.200s; expected a torch.Tensor, "
                     "None, or an object with prepare_for_saving() and restore_from_saved() methods",
                     i, Py_TYPE(o)->tp_name);
        return -1;
    }
    PyTuple_SET_ITEM(*out, (*pos)++, Py_NewRef(o));
    return 0;
}

static PyObject *py_prepare_for_saving(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    tec_module_state *s = tec_state(m);
    PyTypeObject *tt = (PyTypeObject *)s->tensor_type;
    if (!tt)
        return PyErr_Format(PyExc_RuntimeError, "prepare_for_saving: _C._init(torch.Tensor) was not called");
    SavedObjects *so = PyObject_GC_NewVar(SavedObjects, (PyTypeObject *)s->SavedObjects_type, nargs);
    if (!so)
        return NULL;
    memset(so->e, 0, (size_t)nargs * sizeof(saved_entry));
    so->n_saved = 0;
    so->n_special = 0;
    so->consumed = 0;
    PyObject *out = PyTuple_New(nargs);
    if (!out)
        goto fail;
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *o = args[i];
        so->e[i].count = 1;
        if (o == Py_None || Py_TYPE(o) == tt) {
            PyTuple_SET_ITEM(out, pos++, Py_NewRef(o));
            continue;
        }
        if (prepare_other(s, tt, so, i, o, &out, &pos) < 0)
            goto fail;
    }
    so->n_saved = pos;
    if (so->n_special)
        PyObject_GC_Track(so); /* only a container that holds references can be in a cycle */
    PyObject *res = PyTuple_New(2);
    if (!res)
        goto fail;
    PyTuple_SET_ITEM(res, 0, out);
    PyTuple_SET_ITEM(res, 1, (PyObject *)so);
    return res;
fail:
    Py_XDECREF(out);
    Py_DECREF(so);
    return NULL;
}

/* ---- restore_from_saved ---------------------------------------------------- */

static PyObject *restore_special(tec_module_state *s, SavedObjects *so, PyObject *const *items)
{
    Py_ssize_t n = Py_SIZE(so), pos = 0;
    PyObject *res = PyList_New(n);
    if (!res)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        saved_entry *e = &so->e[i];
        PyObject *item;
        if (e->kind == SAVED_PLAIN) {
            item = Py_NewRef(items[pos]);
        } else if (e->kind == SAVED_REF) {
            item = e->obj; /* move the container's reference into the result */
            e->obj = NULL;
        } else {
            PyObject *lst = PyList_New(e->count);
            if (!lst)
                goto fail;
            for (Py_ssize_t j = 0; j < e->count; j++)
                PyList_SET_ITEM(lst, j, Py_NewRef(items[pos + j]));
            PyObject *r = PyObject_CallMethodOneArg(e->obj, s->str_restore_from_saved, lst);
            Py_DECREF(lst);
            if (!r)
                goto fail;
            if (r == Py_None) {
                Py_DECREF(r);
                item = e->obj;
                e->obj = NULL;
            } else {
                item = r;
                Py_CLEAR(e->obj);
            }
        }
        pos += e->count;
        PyList_SET_ITEM(res, i, item);
    }
    return res;
fail:
    Py_DECREF(res);
    return NULL;
}

static PyObject *py_restore_from_saved(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (!tec_arg_count("restore_from_saved", nargs, 2))
        return NULL;
    tec_module_state *s = tec_state(m);
    PyObject *objs = args[0], *saved = args[1];
    if (Py_TYPE(objs) != (PyTypeObject *)s->SavedObjects_type)
        return PyErr_Format(PyExc_TypeError, "restore_from_saved: argument 0 must be the objects returned by "
                            "prepare_for_saving (SavedObjects), got %.200s", Py_TYPE(objs)->tp_name);
    SavedObjects *so = (SavedObjects *)objs;
    if (so->consumed)
        return PyErr_Format(PyExc_ValueError, "restore_from_saved: these objects were already restored; "
                            "each prepare_for_saving result can be restored once");
    PyObject *tup;
    if (PyTuple_Check(saved))
        tup = Py_NewRef(saved);
    else if (PyList_Check(saved))
        tup = PyList_AsTuple(saved); /* delegates run Python code: do not index a list they could change */
    else
        return PyErr_Format(PyExc_TypeError, "restore_from_saved: argument 1 must be the saved tensors (a tuple "
                            "or list, e.g. ctx.saved_tensors), got %.200s", Py_TYPE(saved)->tp_name);
    if (!tup)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(tup);
    if (n != so->n_saved) {
        PyErr_Format(PyExc_ValueError, "restore_from_saved: expected %zd saved tensors (prepare_for_saving of %zd "
                     "objects), got %zd", so->n_saved, Py_SIZE(so), n);
        goto done;
    }
    so->consumed = 1;
    PyObject *const *items = &PyTuple_GET_ITEM(tup, 0);
    if (so->n_special) {
        res = restore_special(s, so, items);
    } else if ((res = PyList_New(n))) {
        for (Py_ssize_t i = 0; i < n; i++)
            PyList_SET_ITEM(res, i, Py_NewRef(items[i]));
    }
done:
    Py_DECREF(tup);
    return res;
}

/* _saving_keep_references(flag) -> previous flag. Private: a negative test
 * switches keep-by-reference off to show that the identity checks can fail. */
static PyObject *py_keep_references(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (!tec_arg_count("_saving_keep_references", nargs, 1))
        return NULL;
    int flag = PyObject_IsTrue(args[0]);
    if (flag < 0)
        return NULL;
    tec_module_state *s = tec_state(m);
    int old = s->saving_keep_refs;
    s->saving_keep_refs = flag;
    return PyBool_FromLong(old);
}

PyMethodDef tec_saving_methods[] = {
    {"prepare_for_saving", (PyCFunction)(void (*)(void))py_prepare_for_saving, METH_FASTCALL,
     "prepare_for_saving(*tensors) -> (tensors_to_save, objects)."},
    {"restore_from_saved", (PyCFunction)(void (*)(void))py_restore_from_saved, METH_FASTCALL,
     "restore_from_saved(objects, saved_tensors) -> list."},
    {"_saving_keep_references", (PyCFunction)(void (*)(void))py_keep_references, METH_FASTCALL,
     "_saving_keep_references(flag) -> previous flag (tests only)."},
    {NULL, NULL, 0, NULL},
};

int tec_saving_exec(PyObject *module)
{
    tec_module_state *s = tec_state(module);
    s->saving_keep_refs = 1;
    if (!(s->str_is_distributed_weight = PyUnicode_InternFromString("is_distributed_weight")) ||
        !(s->str_prepare_for_saving = PyUnicode_InternFromString("prepare_for_saving")) ||
        !(s->str_restore_from_saved = PyUnicode_InternFromString("restore_from_saved")))
        return -1;
    s->SavedObjects_type = PyType_FromModuleAndSpec(module, &so_spec, NULL);
    if (!s->SavedObjects_type)
        return -1;
    return PyModule_AddObjectRef(module, "SavedObjects", s->SavedObjects_type);
}

int tec_saving_traverse(tec_module_state *st, visitproc visit, void *arg)
{
    Py_VISIT(st->str_is_distributed_weight);
    Py_VISIT(st->str_prepare_for_saving);
    Py_VISIT(st->str_restore_from_saved);
    Py_VISIT(st->SavedObjects_type);
    return 0;
}

void tec_saving_clear(tec_module_state *st)
{
    Py_CLEAR(st->str_is_distributed_weight);
    Py_CLEAR(st->str_prepare_for_saving);
    Py_CLEAR(st->str_restore_from_saved);
    Py_CLEAR(st->SavedObjects_type);
}
