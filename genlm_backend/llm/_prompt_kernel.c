/* The prompt checker's per-request passes over a prompt, and its whole extension step, in C
 * (an optional extension; the checker in prompts.py falls back to Python without it, and
 * checks this module against the built-in hash at import).
 *
 * A sampler sends every step a prompt that extends the one it sent before by a token. The
 * checker finds that earlier request by the hash of the prompt without its last id, then
 * confirms that the prompt really extends it and builds the new request's token tuple on
 * the earlier (checked) one. In Python that is four passes over the prompt (a tuple, its
 * hash, a copy, a comparison) plus big-int arithmetic; here it is two: `hashes` and
 * `extend`. `extension` is the checker's whole step (PromptChecker._extension: the parent
 * looked up in the three generations of remembered requests, the new request made and
 * remembered) in one call, on the checker's own dicts.
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
    int all_ints = PyLong_CheckExact(items[n]);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *theirs = items[i];
        all_ints &= PyLong_CheckExact(mine[i]);
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
    /* A tuple of ints can be in no reference cycle. The collector would untrack it at its
     * first pass, after visiting every item; untracked now, no pass visits it. */
    if (all_ints)
        PyObject_GC_UnTrack(out);
    return out;
}

/* ---- the checker's whole extension step (PromptChecker._extension) ------------------- */

static PyObject *s_new, *s_old, *s_older, *s_min_remember, *s_remember, *s_token_ids, *s_lora_name,
    *s_parent;

static int intern_names(void)
{
#define NAME(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1
    NAME(s_new, "_new"); NAME(s_old, "_old"); NAME(s_older, "_older"); NAME(s_min_remember, "min_remember");
    NAME(s_remember, "remember"); NAME(s_token_ids, "token_ids"); NAME(s_lora_name, "lora_name");
    NAME(s_parent, "parent");
#undef NAME
    return 0;
}

/* prompts._key: a request's hash from its prompt's hash and its adapter (new reference). */
static PyObject *request_key(Py_hash_t ids_hash, PyObject *lora_name)
{
    PyObject *boxed = PyLong_FromSsize_t(ids_hash);
    if (boxed == NULL || lora_name == Py_None)
        return boxed;
    PyObject *pair = PyTuple_Pack(2, boxed, lora_name);
    Py_DECREF(boxed);
    if (pair == NULL)
        return NULL;
    Py_hash_t key = PyObject_Hash(pair);
    Py_DECREF(pair);
    return key == -1 && PyErr_Occurred() ? NULL : PyLong_FromSsize_t(key);
}

/* checker.<name> as a dict (new reference), or NULL with TypeError. */
static PyObject *table(PyObject *checker, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(checker, name);
    if (value != NULL && !PyDict_CheckExact(value)) {
        Py_DECREF(value);
        PyErr_SetString(PyExc_TypeError, "the checker's generations are dicts");
        return NULL;
    }
    return value;
}

/* The remembered request of `key` in the three generations, newest first (borrowed; NULL
 * with no error when there is none). *in_new: found in the newest one. */
static PyObject *remembered(PyObject *new, PyObject *old, PyObject *older, PyObject *key, int *in_new)
{
    PyObject *found = PyDict_GetItemWithError(new, key);
    *in_new = found != NULL;
    if (found == NULL && !PyErr_Occurred())
        found = PyDict_GetItemWithError(old, key);
    if (found == NULL && !PyErr_Occurred())
        found = PyDict_GetItemWithError(older, key);
    return found;
}

/* checker._new, _old, _older = new_new, new_old, new_older. */
static int rotate(PyObject *checker, PyObject *new_older, PyObject *new_old, PyObject *new_new)
{
    return PyObject_SetAttr(checker, s_older, new_older) < 0 || PyObject_SetAttr(checker, s_old, new_old) < 0
        || PyObject_SetAttr(checker, s_new, new_new) < 0 ? -1 : 0;
}

static int get_ssize(PyObject *obj, PyObject *name, Py_ssize_t *out)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    *out = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The body of `extension`, with the generations read (new references the caller drops). */
static PyObject *extension_in(PyObject *checker, PyObject *seq, PyObject *last, PyObject *lora_name,
                              PyObject *request_type, PyObject *new, PyObject *old, PyObject *older)
{
    PyObject *hashes_of = hashes(NULL, seq);
    if (hashes_of == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError))
            return NULL;
        PyErr_Clear(); /* an unhashable id: the full check says what is wrong */
        Py_RETURN_NONE;
    }
    Py_hash_t ids_hash = PyLong_AsSsize_t(PyTuple_GET_ITEM(hashes_of, 0));
    Py_hash_t prefix_hash = PyLong_AsSsize_t(PyTuple_GET_ITEM(hashes_of, 1));
    Py_DECREF(hashes_of);
    PyObject *prefix_key = request_key(prefix_hash, lora_name);
    if (prefix_key == NULL)
        return NULL;
    int in_new;
    PyObject *parent = remembered(new, old, older, prefix_key, &in_new);
    Py_DECREF(prefix_key);
    if (parent == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    Py_INCREF(parent);
    PyObject *result = NULL, *checked = NULL, *key = NULL, *request = NULL;
    if (in_new) { /* _parent: a sampler's next step began once the newest generation is full enough */
        Py_ssize_t min_remember;
        if (get_ssize(checker, s_min_remember, &min_remember) < 0)
            goto done;
        if (PyDict_GET_SIZE(new) >= min_remember && PyDict_GET_SIZE(new) >= PyDict_GET_SIZE(old)) {
            PyObject *fresh = PyDict_New();
            int rc = fresh == NULL ? -1 : rotate(checker, old, new, fresh);
            if (rc == 0) { /* the generations this call works on from here */
                Py_SETREF(older, Py_NewRef(old));
                Py_SETREF(old, Py_NewRef(new));
                Py_SETREF(new, Py_NewRef(fresh));
            }
            Py_XDECREF(fresh);
            if (rc < 0)
                goto done;
        }
    }
    PyObject *parent_lora = PyObject_GetAttr(parent, s_lora_name);
    if (parent_lora == NULL)
        goto done;
    int same = parent_lora == lora_name ? 1 : PyObject_RichCompareBool(parent_lora, lora_name, Py_EQ);
    Py_DECREF(parent_lora);
    if (same != 1) {
        result = same < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    PyObject *parent_ids = PyObject_GetAttr(parent, s_token_ids);
    if (parent_ids == NULL)
        goto done;
    if (!PyTuple_CheckExact(parent_ids)) {
        Py_DECREF(parent_ids);
        PyErr_SetString(PyExc_TypeError, "a request's token_ids is a tuple");
        goto done;
    }
    PyObject *args = PyTuple_Pack(2, parent_ids, seq);
    Py_DECREF(parent_ids);
    checked = args == NULL ? NULL : extend(NULL, args);
    Py_XDECREF(args);
    if (checked == NULL)
        goto done;
    if (checked == Py_None || PyTuple_GET_ITEM(checked, PyTuple_GET_SIZE(checked) - 1) != last) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    /* planned long ago: no chains of requests kept alive */
    if (PyObject_SetAttr(parent, s_parent, Py_None) < 0 || (key = request_key(ids_hash, lora_name)) == NULL)
        goto done;
    PyObject *call_args[4] = {checked, lora_name, parent, key};
    request = PyObject_Vectorcall(request_type, call_args, 4, NULL);
    if (request == NULL)
        goto done;
    /* _remember */
    PyObject *known = remembered(new, old, older, key, &in_new);
    if (known == NULL && PyErr_Occurred())
        goto done;
    if (known != NULL) {
        Py_INCREF(known);
        int equal = PyObject_RichCompareBool(known, request, Py_EQ);
        if (equal < 0) {
            Py_DECREF(known);
            goto done;
        }
        if (equal)
            Py_SETREF(request, known);
        else
            Py_DECREF(known);
    }
    if (PyDict_SetItem(new, key, request) < 0)
        goto done;
    Py_ssize_t remember;
    if (get_ssize(checker, s_remember, &remember) < 0)
        goto done;
    if (PyDict_GET_SIZE(new) >= remember) {
        PyObject *fresh = PyDict_New();
        int rc = fresh == NULL ? -1 : rotate(checker, old, new, fresh);
        Py_XDECREF(fresh);
        if (rc < 0)
            goto done;
    }
    result = Py_NewRef(request);
done:
    Py_XDECREF(request);
    Py_XDECREF(key);
    Py_XDECREF(checked);
    Py_DECREF(parent);
    Py_DECREF(new);
    Py_DECREF(old);
    Py_DECREF(older);
    return result;
}

PyDoc_STRVAR(extension_doc,
"extension(checker, ids, last, lora_name, request_type) -> request or None\n\n"
"PromptChecker._extension in one call: the request of `ids` (a list or tuple whose last\n"
"item is the checked int `last`) built on the remembered request of all but its last id,\n"
"remembered in turn; None when there is none.");

static PyObject *extension(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "extension(checker, ids, last, lora_name, request_type)");
        return NULL;
    }
    PyObject *checker = args[0];
    PyObject *new = table(checker, s_new);
    PyObject *old = new == NULL ? NULL : table(checker, s_old);
    PyObject *older = old == NULL ? NULL : table(checker, s_older);
    if (older == NULL) {
        Py_XDECREF(new);
        Py_XDECREF(old);
        return NULL;
    }
    return extension_in(checker, args[1], args[2], args[3], args[4], new, old, older);
}

static PyMethodDef methods[] = {
    {"hashes", hashes, METH_O, hashes_doc},
    {"extend", extend, METH_VARARGS, extend_doc},
    {"extension", (PyCFunction)(void (*)(void))extension, METH_FASTCALL, extension_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prompt_kernel",
    "The prompt checker's passes over a prompt (see prompts.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__prompt_kernel(void)
{
    if (intern_names() < 0)
        return NULL;
    return PyModule_Create(&module);
}
