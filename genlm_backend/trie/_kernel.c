/* The compiled CPU reduction of ParallelTokenCharacterTrie (an optional extension; the
 * plan is built in _compiled.py, which documents it).
 *
 * One pass per row of a [B, V] weight matrix, straight into the [B, num_nodes] output
 * row: the leaves (the last V entries) are a copy of the weights; then, level by level
 * from the deepest, every internal node of the level copies its first source (a leaf or a
 * child), and the level's extra edges combine the other sources into their nodes. Each
 * source lies in a deeper level or is a leaf, so it is final when it is read. The loops
 * have no data-dependent branches; a node's sum is accumulated in the output dtype.
 * Maxima need no neutral value, so -inf and all-negative inputs are exact; NaN never
 * gets here (the Python side rejects it first).
 *
 * Rows are shared out between `num_threads` POSIX threads, the calling thread included,
 * one row at a time, and the GIL is released while they run. A Plan is immutable, so concurrent calls are safe.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(_WIN32) && !defined(__STDC_NO_ATOMICS__)
#include <pthread.h>
#include <stdatomic.h>
#define HAVE_PTHREADS 1
#endif

#define MAX_THREADS 64

typedef struct {
    PyObject_HEAD
    Py_ssize_t num_internal;
    Py_ssize_t num_items;
    Py_ssize_t num_levels;
    Py_ssize_t num_extra;
    int32_t *level_start; /* [num_levels + 1] internal ids of each level */
    int32_t *first_src;   /* [num_internal] the first value each node copies */
    int32_t *extra_start; /* [num_levels + 1] the extra edges into each level */
    int32_t *extra_dst;   /* [num_extra] */
    int32_t *extra_src;   /* [num_extra] */
} PlanObject;

/* ---- the reduction ---------------------------------------------------------------- */

/* One row: `out` = [internal nodes | leaves]; every source index points into `out`. */
#define DEFINE_ROW(NAME, T, COMBINE)                                                       \
    static void NAME(const PlanObject *p, const T *w, T *out)                              \
    {                                                                                      \
        const int32_t *first = p->first_src, *dst = p->extra_dst, *src = p->extra_src;     \
        memcpy(out + p->num_internal, w, (size_t)p->num_items * sizeof(T));                \
        for (Py_ssize_t level = p->num_levels - 1; level >= 0; level--) {                  \
            const int32_t stop = p->level_start[level + 1];                                \
            for (int32_t n = p->level_start[level]; n < stop; n++) out[n] = out[first[n]]; \
            const int32_t e_stop = p->extra_start[level + 1];                              \
            for (int32_t e = p->extra_start[level]; e < e_stop; e++) {                     \
                const int32_t d = dst[e], s = src[e];                                      \
                COMBINE;                                                                   \
            }                                                                              \
        }                                                                                  \
    }

DEFINE_ROW(sum_f32, float, out[d] += out[s])
DEFINE_ROW(sum_f64, double, out[d] += out[s])
DEFINE_ROW(max_f32, float, out[d] = out[s] > out[d] ? out[s] : out[d])
DEFINE_ROW(max_f64, double, out[d] = out[s] > out[d] ? out[s] : out[d])

typedef struct {
    const PlanObject *plan;
    int is_max, is_double;
    const char *weights;
    char *out;
    Py_ssize_t num_rows, weights_stride, out_stride; /* strides in bytes */
#ifdef HAVE_PTHREADS
    atomic_llong next_row; /* the next row nobody has taken */
#endif
} Job;

static void run_row(const Job *job, Py_ssize_t r)
{
    const void *w = job->weights + r * job->weights_stride;
    void *out = job->out + r * job->out_stride;
    if (job->is_double) {
        (job->is_max ? max_f64 : sum_f64)(job->plan, w, out);
    } else {
        (job->is_max ? max_f32 : sum_f32)(job->plan, w, out);
    }
}

#ifdef HAVE_PTHREADS
/* Threads take rows one at a time, so one that shares its core with other work does
 * fewer rows instead of holding up the call. */
static void *take_rows(void *arg)
{
    Job *job = arg;
    for (;;) {
        long long r = atomic_fetch_add(&job->next_row, 1);
        if (r >= job->num_rows) return NULL;
        run_row(job, (Py_ssize_t)r);
    }
}

/* `num_threads` threads, the calling one included; if a thread cannot be started, the
 * others do its share. */
static void run_rows(Job *job, int num_threads)
{
    pthread_t threads[MAX_THREADS];
    int num_started = 0;
    if (num_threads > job->num_rows) num_threads = (int)job->num_rows;
    atomic_init(&job->next_row, 0);
    for (int t = 1; t < num_threads; t++) {
        if (pthread_create(&threads[num_started], NULL, take_rows, job) == 0) num_started++;
    }
    take_rows(job);
    for (int t = 0; t < num_started; t++) pthread_join(threads[t], NULL);
}
#else
static void run_rows(Job *job, int num_threads)
{
    (void)num_threads;
    for (Py_ssize_t r = 0; r < job->num_rows; r++) run_row(job, r);
}
#endif

/* ---- buffers ------------------------------------------------------------------------ */

/* The element type of a native-order buffer format ("f", "<f", "=i", ...), or 0. */
static char format_code(const Py_buffer *view)
{
    const char *f = view->format ? view->format : "B";
    if (f[0] == '@' || f[0] == '=') f++;
#if PY_LITTLE_ENDIAN
    else if (f[0] == '<') f++;
#else
    else if (f[0] == '>' || f[0] == '!') f++;
#endif
    return f[0] != '\0' && f[1] == '\0' ? f[0] : 0;
}

/* A copy of a 1-D int32 buffer, or NULL with an exception set. */
static int32_t *copy_int32(PyObject *obj, const char *name, Py_ssize_t *length)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    int32_t *data = NULL;
    char code = format_code(&view);
    if (view.ndim != 1 || view.itemsize != 4 || (code != 'i' && code != 'l')) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D int32 buffer", name);
    } else {
        *length = view.shape[0];
        data = PyMem_Malloc(view.len > 0 ? (size_t)view.len : 1);
        if (data == NULL) {
            PyErr_NoMemory();
        } else {
            memcpy(data, view.buf, (size_t)view.len);
        }
    }
    PyBuffer_Release(&view);
    return data;
}

/* ---- Plan --------------------------------------------------------------------------- */

static void Plan_dealloc(PlanObject *self)
{
    PyMem_Free(self->level_start);
    PyMem_Free(self->first_src);
    PyMem_Free(self->extra_start);
    PyMem_Free(self->extra_dst);
    PyMem_Free(self->extra_src);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Every value is read after it is final and every index stays in bounds: levels tile the
 * internal ids, and every edge into a level comes from a later level or a leaf. */
static int check_plan(const PlanObject *p)
{
    const Py_ssize_t num_nodes = p->num_internal + p->num_items;
    if (p->num_levels < 1 || p->level_start[0] != 0 || p->extra_start[0] != 0 ||
        p->level_start[p->num_levels] != p->num_internal ||
        p->extra_start[p->num_levels] != p->num_extra || num_nodes > INT32_MAX) {
        goto bad;
    }
    for (Py_ssize_t level = 0; level < p->num_levels; level++) {
        const int32_t lo = p->level_start[level], hi = p->level_start[level + 1];
        const int32_t e_lo = p->extra_start[level], e_hi = p->extra_start[level + 1];
        if (hi < lo || e_hi < e_lo) goto bad;
        for (int32_t n = lo; n < hi; n++) {
            if (p->first_src[n] < hi || p->first_src[n] >= num_nodes) goto bad;
        }
        for (int32_t e = e_lo; e < e_hi; e++) {
            if (p->extra_dst[e] < lo || p->extra_dst[e] >= hi || p->extra_src[e] < hi ||
                p->extra_src[e] >= num_nodes) {
                goto bad;
            }
        }
    }
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "the arrays do not describe a bottom-up plan");
    return -1;
}

static PyObject *Plan_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"num_items",   "level_start", "first_src",
                               "extra_start", "extra_dst",   "extra_src", NULL};
    Py_ssize_t num_items;
    PyObject *objs[5];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nOOOOO:Plan", keywords, &num_items,
                                     &objs[0], &objs[1], &objs[2], &objs[3], &objs[4])) {
        return NULL;
    }
    PlanObject *self = (PlanObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_ssize_t len[5];
    int32_t **arrays[5] = {&self->level_start, &self->first_src, &self->extra_start,
                           &self->extra_dst, &self->extra_src};
    for (int i = 0; i < 5; i++) {
        *arrays[i] = copy_int32(objs[i], keywords[i + 1], &len[i]);
        if (*arrays[i] == NULL) goto fail;
    }
    self->num_items = num_items;
    self->num_levels = len[0] - 1;
    self->num_internal = len[1];
    self->num_extra = len[3];
    if (num_items < 1 || len[0] < 2 || len[2] != len[0] || len[4] != len[3]) {
        PyErr_SetString(PyExc_ValueError, "the arrays of a plan have inconsistent lengths");
        goto fail;
    }
    if (check_plan(self) < 0) goto fail;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

/* A C-contiguous [rows, cols] float32/float64 buffer; returns its code ('f'/'d') or 0. */
static char get_matrix(PyObject *obj, Py_buffer *view, int flags, const char *name,
                       Py_ssize_t cols)
{
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return 0;
    char code = format_code(view);
    int ok_type = (code == 'f' && view->itemsize == 4) || (code == 'd' && view->itemsize == 8);
    if (!ok_type || view->ndim != 2 || view->shape[1] != cols) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous float32/float64 matrix "
                     "with %zd columns", name, cols);
        PyBuffer_Release(view);
        return 0;
    }
    return code;
}

/* Whether two buffers share a byte (C-contiguous: each spans buf .. buf + len). */
static int overlap(const Py_buffer *a, const Py_buffer *b)
{
    const uintptr_t a_lo = (uintptr_t)a->buf, b_lo = (uintptr_t)b->buf;
    return a->len > 0 && b->len > 0 && a_lo < b_lo + (uintptr_t)b->len &&
           b_lo < a_lo + (uintptr_t)a->len;
}

PyDoc_STRVAR(Plan_reduce_doc,
"reduce(op, weights, out, num_threads=1)\n--\n\n"
"Writes the trie sums (op='sum') or maxima (op='max') of every row of `weights`\n"
"([B, V], C-contiguous float32 or float64) into `out` ([B, num_internal + V], the\n"
"same dtype, memory of its own), with rows split between `num_threads` threads. The\n"
"GIL is released.");

static PyObject *Plan_reduce(PlanObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"op", "weights", "out", "num_threads", NULL};
    const char *op;
    PyObject *weights_obj, *out_obj;
    int num_threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOO|i:reduce", keywords, &op, &weights_obj,
                                     &out_obj, &num_threads)) {
        return NULL;
    }
    int is_max = strcmp(op, "max") == 0;
    if (!is_max && strcmp(op, "sum") != 0) {
        return PyErr_Format(PyExc_ValueError, "op must be 'sum' or 'max', got '%s'", op);
    }
    Py_buffer weights, out;
    char code = get_matrix(weights_obj, &weights, PyBUF_SIMPLE, "weights", self->num_items);
    if (!code) return NULL;
    char out_code = get_matrix(out_obj, &out, PyBUF_WRITABLE, "out",
                               self->num_internal + self->num_items);
    if (!out_code) {
        PyBuffer_Release(&weights);
        return NULL;
    }
    if (out_code != code || out.shape[0] != weights.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "out must have the dtype and the rows of weights");
    } else if (overlap(&weights, &out)) {
        /* each row's weights are copied into out, and threads write other rows */
        PyErr_SetString(PyExc_ValueError, "out must not overlap weights");
    } else {
        Job job = {.plan = self,
                   .is_max = is_max,
                   .is_double = code == 'd',
                   .weights = weights.buf,
                   .out = out.buf,
                   .num_rows = weights.shape[0],
                   .weights_stride = weights.shape[1] * weights.itemsize,
                   .out_stride = out.shape[1] * out.itemsize};
        if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
        Py_BEGIN_ALLOW_THREADS
        run_rows(&job, num_threads);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&weights);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Plan_methods[] = {
    {"reduce", (PyCFunction)(void (*)(void))Plan_reduce, METH_VARARGS | METH_KEYWORDS,
     Plan_reduce_doc},
    {NULL, NULL, 0, NULL},
};

static PyObject *Plan_num_nodes(PlanObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->num_internal + self->num_items);
}

static PyGetSetDef Plan_getset[] = {
    {"num_nodes", (getter)Plan_num_nodes, NULL, "internal nodes plus leaves", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Plan_doc,
"Plan(num_items, level_start, first_src, extra_start, extra_dst, extra_src)\n--\n\n"
"A bottom-up evaluation plan over node ids [internal nodes | num_items leaves], from\n"
"1-D int32 buffers (copied): level L holds the internal ids level_start[L] ..\n"
"level_start[L + 1]; node n first copies the value of node first_src[n], then each\n"
"edge e in extra_start[L] .. extra_start[L + 1] combines the value of extra_src[e]\n"
"into extra_dst[e]. Levels run from the last to the first. Raises ValueError unless\n"
"every source lies in a later level or is a leaf.");

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "genlm_backend.trie._kernel.Plan",
    .tp_basicsize = sizeof(PlanObject),
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Plan_doc,
    .tp_methods = Plan_methods,
    .tp_getset = Plan_getset,
    .tp_new = Plan_new,
};

/* ---- module ------------------------------------------------------------------------- */

static struct PyModuleDef kernel_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "genlm_backend.trie._kernel",
    .m_doc = "Compiled trie sums and maxima on the CPU (see _kernel.c).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__kernel(void)
{
    if (PyType_Ready(&PlanType) < 0) return NULL;
    PyObject *module = PyModule_Create(&kernel_module);
    if (module == NULL) return NULL;
    Py_INCREF(&PlanType);
    if (PyModule_AddObject(module, "Plan", (PyObject *)&PlanType) < 0) {
        Py_DECREF(&PlanType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
