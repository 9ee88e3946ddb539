/* The hot paths of free-running sessions (vllm_freerun.py), in C: an optional extension.
 *
 * With lockstep sampling on free sessions, every particle-step runs `take` on the event loop
 * (its row, or a future of it) and, on the engine thread, one pass of `tokens` pairs the
 * step's sampled tokens with their rows and hands those to the waiting requests; `resolve`
 * then wakes the waiting callers on the loop. In Python these are a dozen frames a
 * particle-step, on the one GIL that vLLM's own scheduling needs too. Here they are the
 * same steps on the same Python objects (the sessions' dataclass fields, their deques, the
 * pool's lock and counters), in the same order, with the same results: vllm_freerun.py
 * keeps the Python versions, which run where this module was not built, and the tests run
 * both.
 *
 * Rare branches (a token without its row, a session to close) call the pool's own Python
 * methods. Every call into Python code may switch threads; the pool's lock is held as in
 * Python, so the engine thread and the event loop still see each session consistently.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_parent, *s_kept, *s_closed, *s_key, *s_waiting, *s_enabled, *s_drawn, *s_token_ids,
    *s_ready, *s_captured, *s_rows_left, *s_steps, *s_last_used, *s_batch, *s_num_extended, *s_num_direct,
    *s_lock, *s_acquire, *s_release, *s_popleft, *s_append, *s_draw, *s_version, *s_create_future,
    *s_by_tag, *s_outbox, *s_set, *s_close, *s_fail, *s_send, *s_max_ahead, *s_num_ahead_stops, *s_done,
    *s_set_result, *s_set_exception;

static PyObject *get_running_loop; /* asyncio.get_running_loop */

static int intern_names(void)
{
#define NAME(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1
    NAME(s_parent, "parent"); NAME(s_kept, "kept"); NAME(s_closed, "closed"); NAME(s_key, "key");
    NAME(s_waiting, "waiting"); NAME(s_enabled, "enabled"); NAME(s_drawn, "drawn");
    NAME(s_token_ids, "token_ids"); NAME(s_ready, "ready"); NAME(s_captured, "captured");
    NAME(s_rows_left, "rows_left"); NAME(s_steps, "steps"); NAME(s_last_used, "last_used");
    NAME(s_batch, "_batch"); NAME(s_num_extended, "num_extended"); NAME(s_num_direct, "num_direct");
    NAME(s_lock, "_lock"); NAME(s_acquire, "acquire"); NAME(s_release, "release");
    NAME(s_popleft, "popleft"); NAME(s_append, "append"); NAME(s_draw, "_genlm_draw");
    NAME(s_version, "_version"); NAME(s_create_future, "create_future"); NAME(s_by_tag, "_by_tag");
    NAME(s_outbox, "_outbox"); NAME(s_set, "set"); NAME(s_close, "close"); NAME(s_fail, "_fail");
    NAME(s_send, "_send"); NAME(s_max_ahead, "max_ahead"); NAME(s_num_ahead_stops, "num_ahead_stops");
    NAME(s_done, "done"); NAME(s_set_result, "set_result"); NAME(s_set_exception, "set_exception");
#undef NAME
    return 0;
}

/* ---- small helpers ------------------------------------------------------------------- */

/* obj.name as a C long (-1 with an error set on failure). */
static int get_long(PyObject *obj, PyObject *name, long *out)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    *out = PyLong_AsLong(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_long(PyObject *obj, PyObject *name, long value)
{
    PyObject *boxed = PyLong_FromLong(value);
    if (boxed == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, boxed);
    Py_DECREF(boxed);
    return rc;
}

static int add_long(PyObject *obj, PyObject *name, long delta)
{
    long value;
    if (get_long(obj, name, &value) < 0)
        return -1;
    return set_long(obj, name, value + delta);
}

/* 1 when obj.name is truthy, 0 when not, -1 on error. */
static int get_truth(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* 1 when obj.name is None, 0 when not, -1 on error. */
static int get_is_none(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int none = value == Py_None;
    Py_DECREF(value);
    return none;
}

/* len(obj.name), or -1 on error. */
static Py_ssize_t get_len(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    Py_ssize_t length = PyObject_Size(value);
    Py_DECREF(value);
    return length;
}

static PyObject *call_method0(PyObject *obj, PyObject *name)
{
    return PyObject_CallMethodNoArgs(obj, name);
}

static PyObject *call_method1(PyObject *obj, PyObject *name, PyObject *arg)
{
    return PyObject_CallMethodOneArg(obj, name, arg);
}

static int call_method_discard(PyObject *result)
{
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

/* The pool's lock, acquired (a new reference), or NULL with an error set. */
static PyObject *lock_pool(PyObject *sessions)
{
    PyObject *lock = PyObject_GetAttr(sessions, s_lock);
    if (lock == NULL)
        return NULL;
    if (call_method_discard(call_method0(lock, s_acquire)) < 0) {
        Py_DECREF(lock);
        return NULL;
    }
    return lock;
}

/* Releases the lock, keeping any error already set; returns -1 when one is set after. */
static int unlock_pool(PyObject *lock)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *result = call_method0(lock, s_release);
    Py_DECREF(lock);
    if (type != NULL) {
        Py_XDECREF(result);
        PyErr_Restore(type, value, traceback); /* the first error wins */
        return -1;
    }
    return call_method_discard(result);
}

/* ---- the steps ----------------------------------------------------------------------- */

/* FreeSessions._next_row: the session's next ready row (a new reference), with the engine's
 * draw from it offered to the sampler (sampling.offer_draw); the session and the request
 * that takes the row are linked. */
static PyObject *next_row(PyObject *session, PyObject *request)
{
    PyObject *ready = PyObject_GetAttr(session, s_ready);
    if (ready == NULL)
        return NULL;
    PyObject *pair = call_method0(ready, s_popleft);
    Py_DECREF(ready);
    if (pair == NULL)
        return NULL;
    if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
        Py_DECREF(pair);
        PyErr_SetString(PyExc_TypeError, "a ready row is a (row, token) pair");
        return NULL;
    }
    PyObject *row = PyTuple_GET_ITEM(pair, 0), *token = PyTuple_GET_ITEM(pair, 1);
    Py_INCREF(row);
    PyObject *version = PyObject_GetAttr(row, s_version);
    PyObject *offered = version == NULL ? NULL : PyTuple_Pack(2, token, version);
    Py_XDECREF(version);
    int failed = offered == NULL || PyObject_SetAttr(row, s_draw, offered) < 0
        || PyObject_SetAttr(session, s_drawn, token) < 0 || PyObject_SetAttr(request, s_kept, session) < 0;
    Py_XDECREF(offered);
    Py_DECREF(pair);
    if (failed) {
        Py_DECREF(row);
        return NULL;
    }
    return row;
}

/* FreeSessions._give: into its batch's slot, or into the outbox for a future. */
static int give(PyObject *sessions, PyObject *waiting, PyObject *result)
{
    PyObject *batch = PyTuple_GET_ITEM(waiting, 0), *slot = PyTuple_GET_ITEM(waiting, 1);
    if (batch == Py_None) {
        PyObject *outbox = PyObject_GetAttr(sessions, s_outbox);
        if (outbox == NULL)
            return -1;
        PyObject *item = PyTuple_Pack(2, slot, result);
        int rc = item == NULL ? -1 : PyList_Append(outbox, item);
        Py_XDECREF(item);
        Py_DECREF(outbox);
        return rc;
    }
    return call_method_discard(PyObject_CallMethodObjArgs(batch, s_set, slot, result, NULL));
}

/* 1 when the session's engine request has ended and nothing of it is left to hand out. */
static int used_up(PyObject *session)
{
    long rows_left;
    if (get_long(session, s_rows_left, &rows_left) < 0)
        return -1;
    if (rows_left > 0)
        return 0;
    Py_ssize_t ready = get_len(session, s_ready);
    return ready < 0 ? -1 : ready == 0;
}

/* FreeSessions._serve. */
static int serve(PyObject *sessions, PyObject *session)
{
    PyObject *waiting = PyObject_GetAttr(session, s_waiting);
    if (waiting == NULL)
        return -1;
    Py_ssize_t ready = waiting == Py_None ? 0 : get_len(session, s_ready);
    if (ready <= 0) {
        Py_DECREF(waiting);
        return (int)ready;
    }
    if (!PyTuple_CheckExact(waiting) || PyTuple_GET_SIZE(waiting) != 4) {
        Py_DECREF(waiting);
        PyErr_SetString(PyExc_TypeError, "a waiting request is a (batch, slot, request, step) tuple");
        return -1;
    }
    PyObject *row = NULL;
    int rc = -1;
    if (PyObject_SetAttr(session, s_waiting, Py_None) < 0)
        goto done;
    row = next_row(session, PyTuple_GET_ITEM(waiting, 2));
    if (row == NULL || give(sessions, waiting, row) < 0)
        goto done;
    int ended = used_up(session);
    if (ended < 0 || (ended && call_method_discard(call_method1(sessions, s_close, session)) < 0))
        goto done;
    rc = 0;
done:
    Py_XDECREF(row);
    Py_DECREF(waiting);
    return rc;
}

PyDoc_STRVAR(take_doc,
"take(session_type, sessions, request) -> row, future or None\n\n"
"FreeSessions.take: on the event loop, the next row of the session that `request` extends\n"
"by its draw, or a future of it; None for any other request.");

static PyObject *take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "take(session_type, sessions, request)");
        return NULL;
    }
    PyObject *session_type = args[0], *sessions = args[1], *request = args[2];
    PyObject *parent = PyObject_GetAttr(request, s_parent);
    if (parent == NULL)
        return NULL;
    if (parent == Py_None) {
        Py_DECREF(parent);
        Py_RETURN_NONE;
    }
    PyObject *session = PyObject_GetAttr(parent, s_kept);
    if (session == NULL || (PyObject *)Py_TYPE(session) != session_type) {
        Py_DECREF(parent);
        Py_XDECREF(session);
        if (session == NULL)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *taken = NULL, *key = NULL, *drawn = NULL, *token_ids = NULL;
    PyObject *lock = lock_pool(sessions);
    if (lock == NULL)
        goto fail;
    int closed = get_truth(session, s_closed);
    if (closed < 0)
        goto unlock;
    if ((key = PyObject_GetAttr(session, s_key)) == NULL)
        goto unlock;
    int waiting_none = closed || key != parent ? 0 : get_is_none(session, s_waiting);
    if (waiting_none < 0)
        goto unlock;
    int enabled = waiting_none ? get_truth(sessions, s_enabled) : 0;
    if (enabled <= 0)
        goto unlock; /* (or an error) */
    if ((drawn = PyObject_GetAttr(session, s_drawn)) == NULL)
        goto unlock;
    if ((token_ids = PyObject_GetAttr(request, s_token_ids)) == NULL)
        goto unlock;
    if (!PyTuple_CheckExact(token_ids) || PyTuple_GET_SIZE(token_ids) == 0) {
        PyErr_SetString(PyExc_TypeError, "a request's token_ids is a non-empty tuple");
        goto unlock;
    }
    int differs = PyObject_RichCompareBool(drawn, PyTuple_GET_ITEM(token_ids, PyTuple_GET_SIZE(token_ids) - 1), Py_NE);
    if (differs != 0)
        goto unlock; /* (or an error) */
    Py_ssize_t ready = get_len(session, s_ready);
    if (ready < 0)
        goto unlock;
    if (ready > 0) {
        if ((taken = next_row(session, request)) == NULL)
            goto unlock;
    } else {
        long rows_left;
        if (get_long(session, s_rows_left, &rows_left) < 0 || rows_left <= 0)
            goto unlock; /* its engine request ended: a batch opens a new session */
        PyObject *loop = PyObject_CallNoArgs(get_running_loop);
        if (loop == NULL)
            goto unlock;
        taken = call_method0(loop, s_create_future);
        Py_DECREF(loop);
        PyObject *steps = taken == NULL ? NULL : PyObject_GetAttr(sessions, s_steps);
        PyObject *waiting = steps == NULL ? NULL : PyTuple_Pack(4, Py_None, taken, request, steps);
        Py_XDECREF(steps);
        int rc = waiting == NULL ? -1 : PyObject_SetAttr(session, s_waiting, waiting);
        Py_XDECREF(waiting);
        if (rc < 0) {
            Py_CLEAR(taken);
            goto unlock;
        }
    }
    PyObject *batch = PyObject_GetAttr(sessions, s_batch);
    int rc = batch == NULL ? -1 : PyObject_SetAttr(session, s_key, request);
    rc = rc < 0 ? -1 : PyObject_SetAttr(session, s_last_used, batch);
    Py_XDECREF(batch);
    if (rc < 0 || add_long(sessions, s_num_extended, 1) < 0 || add_long(sessions, s_num_direct, 1) < 0)
        Py_CLEAR(taken);
unlock:
    if (unlock_pool(lock) < 0)
        Py_CLEAR(taken);
fail:
    Py_XDECREF(token_ids);
    Py_XDECREF(drawn);
    Py_XDECREF(key);
    Py_DECREF(session);
    Py_DECREF(parent);
    if (taken == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return taken;
}

/* One (tag, tokens) pair of `tokens`, under the lock. */
static int tokens_of(PyObject *sessions, PyObject *session, PyObject *tokens, long max_ahead)
{
    PyObject *captured = PyObject_GetAttr(session, s_captured);
    PyObject *ready = captured == NULL ? NULL : PyObject_GetAttr(session, s_ready);
    PyObject *seq = ready == NULL ? NULL : PySequence_Fast(tokens, "tokens must be a sequence");
    long rows_left;
    int rc = -1;
    if (seq == NULL || get_long(session, s_rows_left, &rows_left) < 0)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t left = PyObject_Size(captured);
        if (left < 0)
            goto done;
        if (left == 0) { /* a token without its row: never seen; not trusted */
            if (set_long(session, s_rows_left, rows_left) < 0)
                goto done;
            PyObject *error = PyObject_CallFunction(PyExc_RuntimeError, "s",
                                                    "a free session's token came without its row");
            if (error == NULL)
                goto done;
            PyObject *result = PyObject_CallMethodObjArgs(sessions, s_fail, session, error, NULL);
            Py_DECREF(error);
            if (call_method_discard(result) < 0)
                goto done;
            break;
        }
        PyObject *row = call_method0(captured, s_popleft);
        PyObject *token = row == NULL ? NULL : PyNumber_Long(PySequence_Fast_GET_ITEM(seq, i));
        PyObject *pair = token == NULL ? NULL : PyTuple_Pack(2, row, token);
        Py_XDECREF(row);
        Py_XDECREF(token);
        if (pair == NULL || call_method_discard(call_method1(ready, s_append, pair)) < 0) {
            Py_XDECREF(pair);
            goto done;
        }
        Py_DECREF(pair);
        rows_left -= 1;
        if (i == n - 1 && set_long(session, s_rows_left, rows_left) < 0)
            goto done;
    }
    int closed = get_truth(session, s_closed);
    if (closed != 0) {
        rc = closed < 0 ? -1 : 0;
        goto done;
    }
    int none = get_is_none(session, s_waiting);
    if (none < 0 || (!none && serve(sessions, session) < 0))
        goto done;
    int ended = used_up(session);
    if (ended < 0)
        goto done;
    if (ended) {
        if (call_method_discard(call_method1(sessions, s_close, session)) < 0)
            goto done;
    } else {
        Py_ssize_t waiting_rows = PyObject_Size(ready);
        if (waiting_rows < 0)
            goto done;
        if (waiting_rows >= max_ahead) {
            if (add_long(sessions, s_num_ahead_stops, 1) < 0
                || call_method_discard(call_method1(sessions, s_close, session)) < 0)
                goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(seq);
    Py_XDECREF(ready);
    Py_XDECREF(captured);
    return rc;
}

PyDoc_STRVAR(tokens_doc,
"tokens(sessions, found) -> None\n\n"
"FreeSessions.tokens: the tokens one engine step sampled, as (tag, tokens) pairs, each\n"
"paired with its session's captured row; rows go to their waiting requests.");

static PyObject *tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "tokens(sessions, found)");
        return NULL;
    }
    PyObject *sessions = args[0];
    PyObject *found = PySequence_Fast(args[1], "found must be a sequence");
    if (found == NULL)
        return NULL;
    PyObject *lock = lock_pool(sessions);
    if (lock == NULL) {
        Py_DECREF(found);
        return NULL;
    }
    PyObject *by_tag = PyObject_GetAttr(sessions, s_by_tag);
    long max_ahead;
    int rc = by_tag == NULL ? -1 : get_long(sessions, s_max_ahead, &max_ahead);
    if (rc == 0 && !PyDict_CheckExact(by_tag)) {
        PyErr_SetString(PyExc_TypeError, "the sessions by tag are a dict");
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < PySequence_Fast_GET_SIZE(found); i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(found, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "found holds (tag, tokens) pairs");
            rc = -1;
            break;
        }
        PyObject *session = PyDict_GetItemWithError(by_tag, PyTuple_GET_ITEM(pair, 0)); /* borrowed */
        if (session == NULL) {
            rc = PyErr_Occurred() ? -1 : 0;
            continue;
        }
        Py_INCREF(session); /* (closing it takes it out of the dict) */
        rc = tokens_of(sessions, session, PyTuple_GET_ITEM(pair, 1), max_ahead);
        Py_DECREF(session);
    }
    Py_XDECREF(by_tag);
    Py_DECREF(found);
    if (unlock_pool(lock) < 0 || rc < 0)
        return NULL;
    return call_method0(sessions, s_send);
}

PyDoc_STRVAR(resolve_doc,
"resolve(group) -> None\n\n"
"On the event loop: sets each (future, result) pair's future (an exception result as its\n"
"exception); a future done already (its caller was cancelled) is left alone.");

static PyObject *resolve(PyObject *self, PyObject *group)
{
    PyObject *items = PySequence_Fast(group, "group must be a sequence");
    if (items == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(items, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "group holds (future, result) pairs");
            goto fail;
        }
        PyObject *future = PyTuple_GET_ITEM(pair, 0), *result = PyTuple_GET_ITEM(pair, 1);
        PyObject *done = call_method0(future, s_done);
        if (done == NULL)
            goto fail;
        int is_done = PyObject_IsTrue(done);
        Py_DECREF(done);
        if (is_done < 0)
            goto fail;
        if (is_done)
            continue;
        PyObject *name = PyExceptionInstance_Check(result) ? s_set_exception : s_set_result;
        if (call_method_discard(call_method1(future, name, result)) < 0)
            goto fail;
    }
    Py_DECREF(items);
    Py_RETURN_NONE;
fail:
    Py_DECREF(items);
    return NULL;
}

static PyMethodDef methods[] = {
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL, take_doc},
    {"tokens", (PyCFunction)(void (*)(void))tokens, METH_FASTCALL, tokens_doc},
    {"resolve", resolve, METH_O, resolve_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_free_kernel",
    "The hot paths of free-running sessions (see vllm_freerun.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__free_kernel(void)
{
    if (intern_names() < 0)
        return NULL;
    PyObject *asyncio = PyImport_ImportModule("asyncio");
    if (asyncio == NULL)
        return NULL;
    get_running_loop = PyObject_GetAttrString(asyncio, "get_running_loop");
    Py_DECREF(asyncio);
    if (get_running_loop == NULL)
        return NULL;
    return PyModule_Create(&module);
}
