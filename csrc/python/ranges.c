/* ranges.c - byte-range overlap test behind tec.debug.check_saved_tensors:
 * is [start, end) inside any of a sorted set of disjoint address ranges?
 * tests/test_debug_checker.py exercises it (directly and through the checker). */
#include "module.h"

/* Read element i of a flat range table as an address. */
static int range_item(PyObject *table, Py_ssize_t i, unsigned long long *out)
{
    PyObject *v = PyTuple_GetItem(table, i);
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "find_overlap(): range bound %zd must be an int", i);
        return 0;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *out = x;
    return 1;
}

/* Index of the first pair (s_i, e_i) of `table` with s_i < end and
 * start < e_i, -1 if none, -2 with an exception set. The pairs are sorted
 * and disjoint (touching allowed), so the ends are sorted too: binary search
 * for the first end past `start`, then one compare. O(log n) item reads. */
static Py_ssize_t find_overlap_impl(unsigned long long start, unsigned long long end, PyObject *table)
{
    Py_ssize_t n = PyTuple_Size(table) / 2;
    if (start >= end || n == 0)
        return -1;
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        unsigned long long e;
        if (!range_item(table, 2 * mid + 1, &e))
            return -2;
        if (e > start)
            hi = mid;
        else
            lo = mid + 1;
    }
    if (lo == n)
        return -1;
    unsigned long long s;
    if (!range_item(table, 2 * lo, &s))
        return -2;
    return s < end ? lo : -1;
}

/* find_overlap(start, end, ranges) -> int
 * ranges: flat tuple (s0, e0, s1, e1, ...) of sorted, disjoint, end-exclusive
 * address ranges (tec.debug builds it). Returns the index of the first range
 * that [start, end) overlaps, or -1. An empty query never overlaps. */
static PyObject *py_find_overlap(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (!tec_arg_count("find_overlap", nargs, 3))
        return NULL;
    unsigned long long start = PyLong_AsUnsignedLongLong(args[0]);
    if (start == (unsigned long long)-1 && PyErr_Occurred())
        return PyErr_Format(PyExc_TypeError, "find_overlap(): argument 0 must be a non-negative int");
    unsigned long long end = PyLong_AsUnsignedLongLong(args[1]);
    if (end == (unsigned long long)-1 && PyErr_Occurred())
        return PyErr_Format(PyExc_TypeError, "find_overlap(): argument 1 must be a non-negative int");
    PyObject *table = args[2];
    if (!PyTuple_Check(table)) {
        PyObject *tn = tec_type_name(table);
        if (tn)
            PyErr_Format(PyExc_TypeError, "find_overlap(): argument 2 must be a tuple, not %U", tn);
        Py_XDECREF(tn);
        return NULL;
    }
    if (PyTuple_Size(table) % 2)
        return PyErr_Format(PyExc_ValueError, "find_overlap(): argument 2 must hold (start, end) pairs, "
                            "got %zd bounds", PyTuple_Size(table));
    Py_ssize_t i = find_overlap_impl(start, end, table);
    if (i == -2)
        return NULL;
    return PyLong_FromSsize_t(i);
}

PyMethodDef tec_ranges_methods[] = {
    {"find_overlap", (PyCFunction)(void (*)(void))py_find_overlap, METH_FASTCALL,
     "find_overlap(start, end, ranges) -> int: index of the first of the sorted, disjoint "
     "(start, end) pairs in the flat tuple `ranges` that [start, end) overlaps, or -1."},
    {NULL, NULL, 0, NULL},
};
