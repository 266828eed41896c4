/* saving.c - prepare_for_saving / restore_from_saved: what a layer hands to
 * ctx.save_for_backward, and how its backward gets the original objects back
 * whatever saved-tensor hooks unpacked. tests/test_saving.py exercises it;
 * `python -m transformer_engine_c.bench_saving` times it.
 *
 * prepare_for_saving(*objs) -> (tensors_to_save: tuple, objects: SavedObjects)
 *   None, torch.Tensor, torch.nn.Parameter (exact types)
 *                             -> saved as is                    (kind PLAIN)
 *   tensor subclass with a true `is_distributed_weight`
 *                             -> saved as is AND kept by reference (kind REF);
 *                                restore returns the original object
 *   object whose type defines prepare_for_saving()
 *                             -> delegated (kind DELEGATE): it returns
 *                                (tensors, state); `tensors` are saved in its
 *                                place; restore calls
 *                                state.restore_from_saved(list_of_those_tensors)
 *                                and returns its result, or `state` if that
 *                                result is None or an empty list / tuple
 *                                (TE's restore_from_saved returns the saved
 *                                tensors it did not take)
 *   other tensor subclasses   -> saved as is (PLAIN)
 * restore_from_saved(objects, saved_tensors) -> list, one item per prepared
 *   object; `objects` is consumed (its references dropped) and cannot be
 *   restored again.
 *
 * Hot path: None, exact torch.Tensor and exact nn.Parameter cost a pointer
 * compare each (an exact Parameter is never a distributed weight: the layers'
 * own test, module/_weights.py, says the same). The marker and the delegation
 * method are looked up only for other tensor subclasses and other objects,
 * by interned name. Unless an object delegates, the tensors to save are the
 * call's argument tuple itself (METH_VARARGS: no copy). On the limited API a miss raises (and clears) an
 * AttributeError: a DistributedWeight finds its marker, so only foreign
 * subclasses pay for that. */
#include "module.h"

#include <string.h>

/* getattr(o, name) -> 1 with *res set, 0 if o has no such attribute (the
 * AttributeError cleared), -1 on any other error. */
static int lookup_attr(PyObject *o, PyObject *name, PyObject **res)
{
    *res = PyObject_GetAttr(o, name);
    if (*res)
        return 1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
    PyErr_Clear();
    return 0;
}

/* Whether o's class defines `name` (a method found on the type, as Python
 * finds special methods): 1, 0, or -1 with an exception. */
static int type_has(PyObject *o, PyObject *name)
{
    PyObject *v;
    int r = lookup_attr((PyObject *)Py_TYPE(o), name, &v);
    Py_XDECREF(v);
    return r;
}

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
    Py_ssize_t n_delegate; /* of those, DELEGATE entries */
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
    PyObject_GC_Del(self);
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

/* The tensors to save, built lazily: while every object is saved as itself
 * the result is the argument tuple itself (no copy); the first delegating
 * object makes a tuple of its own. */
typedef struct {
    PyObject *args;  /* the call's argument tuple (borrowed) */
    PyObject *tup;   /* NULL: identical to args so far */
    Py_ssize_t pos;  /* items emitted */
} saved_out;

/* Save o itself at the next position. */
static void emit(saved_out *ob, PyObject *o)
{
    if (ob->tup)
        PyTuple_SetItem(ob->tup, ob->pos, Py_NewRef(o));
    ob->pos++;
}

/* Give the result `size` slots, keeping the ob->pos items emitted so far. */
static int regrow(saved_out *ob, Py_ssize_t size)
{
    PyObject *t = PyTuple_New(size), *from = ob->tup ? ob->tup : ob->args;
    if (!t)
        return -1;
    for (Py_ssize_t j = 0; j < ob->pos && j < size; j++)
        PyTuple_SetItem(t, j, Py_NewRef(PyTuple_GetItem(from, j)));
    Py_XDECREF(ob->tup);
    ob->tup = t;
    return 0;
}

/* TypeError "prepare_for_saving: argument i (TYPE OF o): MSG", MSG being
 * `fmt` formatted with the name of `what`'s type (%U) and `j` (%zd). */
static void delegate_error(Py_ssize_t i, PyObject *o, const char *fmt, PyObject *what, Py_ssize_t j)
{
    PyObject *tn = tec_type_name(o), *wn = tec_type_name(what);
    PyObject *msg = tn && wn ? PyUnicode_FromFormat(fmt, wn, j) : NULL;
    if (msg)
        PyErr_Format(PyExc_TypeError, "prepare_for_saving: argument %zd (%U): %U", i, tn, msg);
    Py_XDECREF(msg);
    Py_XDECREF(tn);
    Py_XDECREF(wn);
}

/* Delegate to o.prepare_for_saving(): append its k tensors to the result
 * (k - 1 more slots) and record (state, k) in entry `e`. */
static int prepare_delegate(tec_module_state *s, PyTypeObject *tt, saved_entry *e, Py_ssize_t i,
                            PyObject *o, saved_out *ob)
{
    PyObject *r = PyObject_CallMethodObjArgs(o, s->str_prepare_for_saving, NULL);
    if (!r)
        return -1;
    int rc = -1;
    PyObject *ts = NULL;
    if (!PyTuple_Check(r) || PyTuple_Size(r) != 2) {
        delegate_error(i, o, "its prepare_for_saving() must return a pair (tensors, state), got %U", r, 0);
        goto done;
    }
    PyObject *state = PyTuple_GetItem(r, 1);
    PyObject *probe;
    int has = lookup_attr(state, s->str_restore_from_saved, &probe);
    Py_XDECREF(probe);
    if (has < 0)
        goto done;
    if (!has) {
        delegate_error(i, o, "the state its prepare_for_saving() returned (%U) has no restore_from_saved()",
                       state, 0);
        goto done;
    }
    PyObject *t0 = PyTuple_GetItem(r, 0);
    if (!PyList_Check(t0) && !PyTuple_Check(t0)) {
        delegate_error(i, o, "its prepare_for_saving() must return a list or tuple of tensors first, got %U",
                       t0, 0);
        goto done;
    }
    ts = PySequence_Tuple(t0);
    if (!ts)
        goto done;
    Py_ssize_t k = PyTuple_Size(ts);
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *t = PyTuple_GetItem(ts, j);
        if (t != Py_None && !PyObject_TypeCheck(t, tt)) {
            delegate_error(i, o, "its prepare_for_saving() returned %U at position %zd; expected "
                           "torch.Tensor or None", t, j);
            goto done;
        }
    }
    Py_ssize_t size = ob->tup ? PyTuple_Size(ob->tup) : PyTuple_Size(ob->args);
    if ((!ob->tup || k != 1) && regrow(ob, size + k - 1) < 0)
        goto done;
    for (Py_ssize_t j = 0; j < k; j++)
        emit(ob, PyTuple_GetItem(ts, j));
    e->obj = Py_NewRef(state);
    e->count = k;
    e->kind = SAVED_DELEGATE;
    rc = 0;
done:
    Py_XDECREF(ts);
    Py_DECREF(r);
    return rc;
}

/* Everything that is neither None nor an exact torch.Tensor / nn.Parameter. */
static int prepare_other(tec_module_state *s, PyTypeObject *tt, SavedObjects *so, Py_ssize_t i,
                         PyObject *o, saved_out *ob)
{
    saved_entry *e = &so->e[i];
    int is_tensor = PyObject_TypeCheck(o, tt);
    if (is_tensor) {
        PyObject *v;
        int r = lookup_attr(o, s->str_is_distributed_weight, &v);
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
                emit(ob, o);
                return 0;
            }
        }
    }
    int has = type_has(o, s->str_prepare_for_saving);
    if (has < 0)
        return -1;
    if (has) {
        if (prepare_delegate(s, tt, e, i, o, ob) < 0)
            return -1;
        so->n_special++;
        so->n_delegate++;
        return 0;
    }
    if (!is_tensor) {
        PyObject *tn = tec_type_name(o);
        if (tn)
            PyErr_Format(PyExc_TypeError, "prepare_for_saving: argument %zd is %U; expected a torch.Tensor, "
                         "None, or an object with prepare_for_saving() and restore_from_saved() methods", i, tn);
        Py_XDECREF(tn);
        return -1;
    }
    emit(ob, o);
    return 0;
}

static PyObject *py_prepare_for_saving(PyObject *m, PyObject *args)
{
    tec_module_state *s = tec_state(m);
    PyTypeObject *tt = (PyTypeObject *)s->tensor_type, *pt = (PyTypeObject *)s->parameter_type;
    if (!tt)
        return PyErr_Format(PyExc_RuntimeError, "prepare_for_saving: _C._init(torch.Tensor) was not called");
    const Py_ssize_t nargs = PyTuple_Size(args);
    SavedObjects *so = PyObject_GC_NewVar(SavedObjects, (PyTypeObject *)s->SavedObjects_type, nargs);
    if (!so)
        return NULL;
    memset(so->e, 0, (size_t)nargs * sizeof(saved_entry));
    so->n_saved = 0;
    so->n_special = 0;
    so->n_delegate = 0;
    so->consumed = 0;
    saved_out ob = {.args = args, .tup = NULL, .pos = 0};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *o = PyTuple_GetItem(args, i);
        so->e[i].count = 1;
        if (o == Py_None || Py_TYPE(o) == tt || Py_TYPE(o) == pt) {
            emit(&ob, o);
            continue;
        }
        if (prepare_other(s, tt, so, i, o, &ob) < 0)
            goto fail;
    }
    so->n_saved = ob.pos;
    if (so->n_special)
        PyObject_GC_Track(so); /* only a container that holds references can be in a cycle */
    PyObject *out = ob.tup ? ob.tup : Py_NewRef(args);
    ob.tup = NULL;
    PyObject *res = PyTuple_New(2);
    if (!res) {
        Py_DECREF(out);
        goto fail;
    }
    PyTuple_SetItem(res, 0, out);
    PyTuple_SetItem(res, 1, (PyObject *)so);
    return res;
fail:
    Py_XDECREF(ob.tup);
    Py_DECREF(so);
    return NULL;
}

/* ---- restore_from_saved ---------------------------------------------------- */

static PyObject *restore_special(tec_module_state *s, SavedObjects *so, PyObject *items)
{
    Py_ssize_t n = Py_SIZE(so), pos = 0;
    PyObject *res = PyList_New(n);
    if (!res)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        saved_entry *e = &so->e[i];
        PyObject *item;
        if (e->kind == SAVED_PLAIN) {
            item = Py_NewRef(PyTuple_GetItem(items, pos));
        } else if (e->kind == SAVED_REF) {
            item = e->obj; /* move the container's reference into the result */
            e->obj = NULL;
        } else {
            PyObject *lst = PyList_New(e->count);
            if (!lst)
                goto fail;
            for (Py_ssize_t j = 0; j < e->count; j++)
                PyList_SetItem(lst, j, Py_NewRef(PyTuple_GetItem(items, pos + j)));
            PyObject *r = PyObject_CallMethodObjArgs(e->obj, s->str_restore_from_saved, lst, NULL);
            Py_DECREF(lst);
            if (!r)
                goto fail;
            /* None, or TE's convention: the saved tensors it did not take
             * (none here: it was handed exactly its own). */
            if (r == Py_None || ((PyList_Check(r) || PyTuple_Check(r)) && PySequence_Size(r) == 0)) {
                Py_DECREF(r);
                item = e->obj;
                e->obj = NULL;
            } else {
                item = r;
                Py_CLEAR(e->obj);
            }
        }
        pos += e->count;
        PyList_SetItem(res, i, item);
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
    if (Py_TYPE(objs) != (PyTypeObject *)s->SavedObjects_type) {
        PyObject *tn = tec_type_name(objs);
        if (tn)
            PyErr_Format(PyExc_TypeError, "restore_from_saved: argument 0 must be the objects returned by "
                         "prepare_for_saving (SavedObjects), got %U", tn);
        Py_XDECREF(tn);
        return NULL;
    }
    SavedObjects *so = (SavedObjects *)objs;
    if (so->consumed)
        return PyErr_Format(PyExc_ValueError, "restore_from_saved: these objects were already restored; "
                            "each prepare_for_saving result can be restored once");
    PyObject *tup;
    if (PyTuple_Check(saved))
        tup = Py_NewRef(saved);
    else if (PyList_Check(saved))
        tup = PyList_AsTuple(saved); /* delegates run Python code: do not index a list they could change */
    else {
        PyObject *tn = tec_type_name(saved);
        if (tn)
            PyErr_Format(PyExc_TypeError, "restore_from_saved: argument 1 must be the saved tensors (a tuple "
                         "or list, e.g. ctx.saved_tensors), got %U", tn);
        Py_XDECREF(tn);
        return NULL;
    }
    if (!tup)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = PyTuple_Size(tup);
    if (n != so->n_saved) {
        PyErr_Format(PyExc_ValueError, "restore_from_saved: expected %zd saved tensors (prepare_for_saving of %zd "
                     "objects), got %zd", so->n_saved, Py_SIZE(so), n);
        goto done;
    }
    so->consumed = 1;
    if (so->n_delegate) {
        res = restore_special(s, so, tup);
    } else if ((res = PySequence_List(tup)) && so->n_special) {
        /* only kept references: one saved tensor per object, so positions
         * match; put the original objects in place of what was unpacked */
        for (Py_ssize_t i = 0; i < n; i++) {
            saved_entry *e = &so->e[i];
            if (e->kind == SAVED_REF) {
                PyList_SetItem(res, i, e->obj); /* moves the container's reference */
                e->obj = NULL;
            }
        }
    }
done:
    Py_DECREF(tup);
    return res;
}

PyMethodDef tec_saving_methods[] = {
    {"prepare_for_saving", (PyCFunction)(void (*)(void))py_prepare_for_saving, METH_VARARGS,
     "prepare_for_saving(*tensors) -> (tensors_to_save, objects)."},
    {"restore_from_saved", (PyCFunction)(void (*)(void))py_restore_from_saved, METH_FASTCALL,
     "restore_from_saved(objects, saved_tensors) -> list."},
    {NULL, NULL, 0, NULL},
};

int tec_saving_exec(PyObject *module)
{
    tec_module_state *s = tec_state(module);
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
