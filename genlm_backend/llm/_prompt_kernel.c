/* The prompt checker's per-request passes over a prompt, in C (an optional extension; the
 * checker in prompts.py falls back to Python without it, and checks this module against
 * the built-in hash at import).
 *
 * A sampler sends every step a prompt that extends the one it sent before by a token. The
 * checker finds that earlier request by the hash of the prompt without its last id, then
 * confirms that the prompt really extends it and builds the new request's token tuple on
 * the earlier (checked) one. In Python that is four passes over the prompt (a tuple, its
 * hash, a copy, a comparison) plus big-int arithmetic; here it is two: `hashes` and
 * `extend`.
 *
 * Both accept a list or a tuple. Items are compared and hashed by Python's own rules, so
 * the results equal those of the Python route (an id of 4.0 hashes and compares as 4).
 * While the items are exact ints no Python code runs, and their array is read directly.
 * Hashing or comparing any other item can run Python code that changes a list under us:
 * from the first such item on, each item is held by a new reference while it is used and
 * the length is checked at every step, so such a change gives that caller None or an
 * error, never a crash.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* CPython's tuple hash (xxHash-based; CPython 3.8 on, 64-bit hashes): acc starts at P5;
 * per item acc = rotl31(acc + hash(item) * P2) * P1; then the length is mixed in. */
#define PRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define PRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define PRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define LEN_MIX (PRIME_5 ^ (Py_uhash_t)3527539UL)
#define MINUS_ONE_STANDIN 1546275796
#define HASH_MODULUS ((long long)(((Py_uhash_t)1 << 61) - 1)) /* ints hash modulo this */

static Py_hash_t finish_hash(Py_uhash_t acc, Py_ssize_t length)
{
    acc += (Py_uhash_t)length ^ LEN_MIX;
    if (acc == (Py_uhash_t)-1)
        return MINUS_ONE_STANDIN;
    return (Py_hash_t)acc;
}

/* The items of a list or tuple (*items: NULL for an empty list); -1 with TypeError set for
 * anything else. The array is valid only until Python code runs: that is, while every item
 * read from it is an exact int. */
static int items_of(PyObject *seq, PyObject ***items, Py_ssize_t *length)
{
    if (PyList_CheckExact(seq)) {
        *length = PyList_GET_SIZE(seq);
        *items = ((PyListObject *)seq)->ob_item;
        return 0;
    }
    if (PyTuple_CheckExact(seq)) {
        *length = PyTuple_GET_SIZE(seq);
        *items = ((PyTupleObject *)seq)->ob_item;
        return 0;
    }
    PyErr_SetString(PyExc_TypeError, "expected a list or a tuple");
    return -1;
}

/* hash(item) of an exact int whose magnitude is below 2**61 - 1 (every token id): the int
 * itself, -1 mapped to -2. Sets *ok to 0 for any other item. Runs no Python code. */
static Py_uhash_t small_int_hash(PyObject *item, int *ok)
{
    if (PyLong_CheckExact(item)) {
        int overflow;
        long value = PyLong_AsLongAndOverflow(item, &overflow);
        if (!overflow && value < HASH_MODULUS && value > -HASH_MODULUS)
            return (Py_uhash_t)(value == -1 ? -2 : value);
    }
    *ok = 0;
    return 0;
}

#define XXROUND(acc, lane) ((acc) += (lane) * PRIME_2, (acc) = ((acc) << 31) | ((acc) >> 33), (acc) *= PRIME_1)

/* `hashes` for lists holding items other than small ints: each item is held while its hash
 * (which may run Python code, and change the list) is taken, and the length read anew. */
static PyObject *hashes_generic(PyObject *seq, Py_ssize_t length)
{
    Py_uhash_t acc = PRIME_5, prefix_acc = PRIME_5;
    for (Py_ssize_t i = 0; i < length; i++) {
        PyObject **items = NULL;
        Py_ssize_t now = 0;
        if (items_of(seq, &items, &now) < 0)
            return NULL;
        if (now != length) {
            PyErr_SetString(PyExc_RuntimeError, "the list changed size while it was hashed");
            return NULL;
        }
        PyObject *item = items[i];
        Py_INCREF(item);
        Py_uhash_t lane = (Py_uhash_t)PyObject_Hash(item);
        Py_DECREF(item);
        if (lane == (Py_uhash_t)-1 && PyErr_Occurred())
            return NULL;
        prefix_acc = acc;
        XXROUND(acc, lane);
    }
    if (Py_SIZE(seq) != length) {
        PyErr_SetString(PyExc_RuntimeError, "the list changed size while it was hashed");
        return NULL;
    }
    return Py_BuildValue("(nn)", finish_hash(acc, length), finish_hash(prefix_acc, length - 1));
}

PyDoc_STRVAR(hashes_doc,
"hashes(ids) -> (hash(tuple(ids)), hash(tuple(ids[:-1])))\n\n"
"One pass over a list or tuple of at least one hashable item.");

static PyObject *hashes(PyObject *self, PyObject *seq)
{
    PyObject **items = NULL;
    Py_ssize_t length = 0;
    if (items_of(seq, &items, &length) < 0)
        return NULL;
    if (length < 1) {
        PyErr_SetString(PyExc_ValueError, "expected at least one item");
        return NULL;
    }
    Py_uhash_t acc = PRIME_5, prefix_acc = PRIME_5;
    int ok = 1;
    for (Py_ssize_t i = 0; i < length; i++) {
        Py_uhash_t lane = small_int_hash(items[i], &ok);
        if (!ok)
            return hashes_generic(seq, length);
        prefix_acc = acc;
        XXROUND(acc, lane);
    }
    return Py_BuildValue("(nn)", finish_hash(acc, length), finish_hash(prefix_acc, length - 1));
}

/* `extend` from item `start` on, for items other than ints: each item is held while it is
 * compared (which may run Python code, and change the list), and the length read anew. */
static PyObject *extend_generic(PyObject *parent, PyObject *seq, PyObject *out, Py_ssize_t start)
{
    Py_ssize_t n = PyTuple_GET_SIZE(parent);
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject **items = NULL;
        Py_ssize_t length = 0;
        if (items_of(seq, &items, &length) < 0 || length != n + 1) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        PyObject *mine = PyTuple_GET_ITEM(parent, i), *theirs = items[i];
        Py_INCREF(theirs);
        int equal = theirs == mine ? 1 : PyObject_RichCompareBool(theirs, mine, Py_EQ);
        Py_DECREF(theirs);
        if (equal != 1) {
            Py_DECREF(out);
            if (equal < 0)
                return NULL;
            Py_RETURN_NONE;
        }
        Py_INCREF(mine);
        PyTuple_SET_ITEM(out, i, mine);
    }
    PyObject **items = NULL;
    Py_ssize_t length = 0;
    if (items_of(seq, &items, &length) < 0 || length != n + 1) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    Py_INCREF(items[n]);
    PyTuple_SET_ITEM(out, n, items[n]);
    return out;
}

PyDoc_STRVAR(extend_doc,
"extend(parent, ids) -> parent + (ids[-1],), or None\n\n"
"The tuple of `parent`'s items followed by the last item of `ids` (a list or tuple) when\n"
"`ids` is one item longer than the tuple `parent` and equal to it item by item (==) up\n"
"to that last item; None otherwise.");

static PyObject *extend(PyObject *self, PyObject *args)
{
    PyObject *parent, *seq;
    if (!PyArg_ParseTuple(args, "O!O:extend", &PyTuple_Type, &parent, &seq))
        return NULL;
    PyObject **items = NULL;
    Py_ssize_t length = 0;
    if (items_of(seq, &items, &length) < 0)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(parent);
    if (length != n + 1)
        Py_RETURN_NONE;
    PyObject *out = PyTuple_New(n + 1);
    if (out == NULL)
        return NULL;
    /* PyTuple_New ran no Python code: `items` is still the list's array. */
    PyObject **mine = ((PyTupleObject *)parent)->ob_item;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *theirs = items[i];
        if (theirs != mine[i]) {
            if (!PyLong_CheckExact(theirs) || !PyLong_CheckExact(mine[i]))
                return extend_generic(parent, seq, out, i);
            /* two ints: compared without running Python code */
            if (PyObject_RichCompareBool(theirs, mine[i], Py_EQ) != 1) {
                Py_DECREF(out);
                Py_RETURN_NONE;
            }
        }
        Py_INCREF(mine[i]);
        PyTuple_SET_ITEM(out, i, mine[i]);
    }
    Py_INCREF(items[n]);
    PyTuple_SET_ITEM(out, n, items[n]);
    return out;
}

static PyMethodDef methods[] = {
    {"hashes", hashes, METH_O, hashes_doc},
    {"extend", extend, METH_VARARGS, extend_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prompt_kernel",
    "The prompt checker's passes over a prompt (see prompts.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__prompt_kernel(void)
{
    return PyModule_Create(&module);
}
