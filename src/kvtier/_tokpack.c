/* kvtier._tokpack: token ids to little-endian uint32 bytes, in C.
 *
 * The same function as _tokpack.py (which documents it): a list's or a
 * tuple's items are read in place, without a slice or per-item reference
 * counting; any other sequence is sliced and converted item by item. Ids are
 * accepted and refused exactly as array("I", ...) does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static int
token_value(PyObject *v, uint32_t *out)
{
    unsigned long x;
    if (PyLong_Check(v)) {
        x = PyLong_AsUnsignedLong(v);
    }
    else {
        PyObject *index = PyNumber_Index(v);
        if (index == NULL) {
            return -1;
        }
        x = PyLong_AsUnsignedLong(index);
        Py_DECREF(index);
    }
    if (x == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (x > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, "unsigned int is greater than maximum");
        return -1;
    }
    *out = (uint32_t)x;
    return 0;
}

/* How far ahead fill() prefetches: each id is a separate int object, and
 * reading them one by one waits on memory for every one. */
#define PREFETCH_AHEAD 16
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)(p))
#endif

/* A small non-negative exact int's value, read in place (no call). */
static inline int
small_token(PyObject *v, uint32_t *out)
{
    if (!PyLong_CheckExact(v)) {
        return 0;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        return 0;
    }
    Py_ssize_t x = PyUnstable_Long_CompactValue((PyLongObject *)v);
    if (x < 0 || x > 0xFFFFFFFF) {
        return 0;
    }
    *out = (uint32_t)x;
    return 1;
#else
    Py_ssize_t size = Py_SIZE(v);
    if (size == 0) {
        *out = 0;
        return 1;
    }
    if (size == 1) {
        *out = (uint32_t)((PyLongObject *)v)->ob_digit[0];
        return 1;
    }
    return 0;
#endif
}

/* Writes items[0:n] to dst. Returns 1 when done, -1 on an error (set), and,
 * with ints_only, 0 at the first item that is not an int (whose __index__
 * could run Python code that changes the sequence under the loop). */
static int
fill(unsigned char *dst, PyObject **items, Py_ssize_t n, int ints_only)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t x;
        if (i + PREFETCH_AHEAD < n) {
            PREFETCH(items[i + PREFETCH_AHEAD]);
        }
        if (small_token(items[i], &x)) {
            dst[0] = (unsigned char)x;
            dst[1] = (unsigned char)(x >> 8);
            dst[2] = (unsigned char)(x >> 16);
            dst[3] = (unsigned char)(x >> 24);
            dst += 4;
            continue;
        }
        if (ints_only && !PyLong_Check(items[i])) {
            return 0;
        }
        if (token_value(items[i], &x) < 0) {
            return -1;
        }
        /* Little-endian whatever the host: one store on x86 and ARM. */
        dst[0] = (unsigned char)x;
        dst[1] = (unsigned char)(x >> 8);
        dst[2] = (unsigned char)(x >> 16);
        dst[3] = (unsigned char)(x >> 24);
        dst += 4;
    }
    return 1;
}

static PyObject *
pack_u32(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "pack_u32 takes (token_ids, start, stop)");
        return NULL;
    }
    Py_ssize_t start = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t stop = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (stop == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *seq = args[0];
    PyObject *out;
    if (PyList_Check(seq) || PyTuple_Check(seq)) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
        if (start < 0 || stop < start || stop > len) {
            PyErr_SetString(PyExc_IndexError, "pack_u32 needs 0 <= start <= stop <= len");
            return NULL;
        }
        out = PyBytes_FromStringAndSize(NULL, (stop - start) * 4);
        if (out == NULL) {
            return NULL;
        }
        int done = fill((unsigned char *)PyBytes_AS_STRING(out),
                        PySequence_Fast_ITEMS(seq) + start, stop - start, 1);
        if (done == 1) {
            return out;
        }
        Py_DECREF(out);
        if (done < 0) {
            return NULL;
        }
    }
    /* Any other sequence, or items that are not ints: a copy of the slice. */
    PyObject *part = PySequence_GetSlice(seq, start, stop);
    if (part == NULL) {
        return NULL;
    }
    PyObject *items = PySequence_List(part);
    Py_DECREF(part);
    if (items == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out != NULL &&
        fill((unsigned char *)PyBytes_AS_STRING(out), PySequence_Fast_ITEMS(items), n, 0) < 0) {
        Py_CLEAR(out);
    }
    Py_DECREF(items);
    return out;
}

static PyMethodDef methods[] = {
    {"pack_u32", (PyCFunction)(void (*)(void))pack_u32, METH_FASTCALL,
     "pack_u32(token_ids, start, stop) -> token_ids[start:stop] as little-endian uint32 bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier._tokpack",
    .m_doc = "Token ids to little-endian uint32 bytes (C form of _tokpack.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__tokpack(void)
{
    return PyModule_Create(&module);
}
