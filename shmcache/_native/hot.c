/* shmcache._hot: the pool mutex, the two operations a scheduler calls on
 * every step (allocate blocks, free a batch of them), and the table calls
 * of a request's life (take a cached prefix into a table, append, delete),
 * in C.
 *
 * This file is the module: the Hot object (its creation, set_chunks, its
 * release), the method table and the type. It is the one translation unit;
 * the rest is in headers it includes, one role each:
 *   hot_params.h    the Hot object's layout and the pool fields it reaches;
 *   hot_mutex.h     the robust pool mutex, and how a fused op takes it;
 *   hot_localmap.h  the process-local map of a slot's loose references
 *                   (loosemap.py's int32 array, shared with numpy);
 *   hot_loose.h     alloc() and free(): fused, they take the lock themselves
 *                   and only ever try it (None: the slow path runs);
 *   hot_tables.h    table_new(), table_drop(), and the checks of the table
 *                   ops, which run inside a lock hold the Python caller took;
 *   hot_append.h    table_take(), table_append(): a table's list grows;
 *   hot_index.h     find_chain(): the prefix lookup, in the same lock hold.
 * The Python paths stay the reference (fastpath.py, tables.py, prefix.py,
 * index.py): each C path does what its Python path does (a table op, what
 * it does after its lookups), and None means the Python path runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "hot_params.h"
#include "hot_mutex.h"
#include "hot_loose.h"
#include "hot_tables.h"
#include "hot_append.h"
#include "hot_index.h"

#include <pthread.h>
#include <stdint.h>

/* The most chunks that fit between the chunks' offset and the end of the
 * mapping (0 when the fused ops are off, or the record size is not a
 * chunk's). */
static Py_ssize_t
chunks_room(Hot *h)
{
    if (h->p[P_MAX_SLOTS] <= 0 || h->p[P_REF_SIZE] != CW * 4 || h->p[P_REFS_OFF] <= 0 ||
        h->p[P_REFS_OFF] >= h->view.len)
        return 0;
    return (h->view.len - h->p[P_REFS_OFF]) / h->p[P_REF_SIZE];
}

static int
Hot_init(Hot *self, PyObject *args, PyObject *kw)
{
    PyObject *buf, *params;
    double created_at = 0.0;
    if (!PyArg_ParseTuple(args, "OO!|d", &buf, &PyTuple_Type, &params, &created_at))
        return -1;
    if (PyTuple_GET_SIZE(params) != P_COUNT) {
        PyErr_Format(PyExc_ValueError, "Hot() takes %d parameters, got %zd",
                     (int)P_COUNT, PyTuple_GET_SIZE(params));
        return -1;
    }
    for (int i = 0; i < P_COUNT; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(params, i));
        if (v == -1 && PyErr_Occurred())
            return -1;
        self->p[i] = v;
    }
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0)
        return -1;
    self->has_view = 1;
    /* the counters (64 int64) are written when a dead holder is found */
    if (self->view.len < self->p[P_MUTEX_OFF] + (Py_ssize_t)sizeof(pthread_mutex_t) ||
        self->view.len < self->p[P_COUNTERS_OFF] + 64 * 8) {
        PyErr_SetString(PyExc_ValueError, "buffer too small for the pool mutex and counters");
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        return -1;
    }
    /* the fused ops index blocks (with the two sentinels) and slots: those
     * arrays must lie inside the mapping */
    if (self->p[P_MAX_SLOTS] > 0 &&
        (self->p[P_MAX_BLOCKS] < 1 || self->p[P_BLOCKS_OFF] < 0 || self->p[P_SLOTS_OFF] < 0 ||
         self->p[P_BLOCKS_OFF] + (self->p[P_MAX_BLOCKS] + 2) * self->p[P_BLOCK_SIZE] > self->view.len ||
         self->p[P_SLOTS_OFF] + self->p[P_MAX_SLOTS] * self->p[P_SLOT_SIZE] > self->view.len)) {
        PyErr_SetString(PyExc_ValueError, "buffer too small for the pool's blocks and slots");
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        return -1;
    }
    /* find_chain indexes the prefix index (a power of two of int32 slots) */
    if (self->p[P_HASH_CAP] > 0 &&
        ((self->p[P_HASH_CAP] & (self->p[P_HASH_CAP] - 1)) || self->p[P_HASH_OFF] < 0 ||
         self->p[P_B_HASH] < 0 || self->p[P_B_HASH] + 16 > self->p[P_BLOCK_SIZE] ||
         self->p[P_HASH_OFF] + self->p[P_HASH_CAP] * 4 > self->view.len)) {
        PyErr_SetString(PyExc_ValueError, "buffer too small for the pool's prefix index");
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        return -1;
    }
    /* the table ops index table records, and the request-id index (a power
     * of two of int32 slots) */
    if (self->p[P_MAX_TABLES] > 0 &&
        (self->p[P_TABLES_OFF] < 0 || self->p[P_TABLE_SIZE] < 4 ||
         self->p[P_TABLES_OFF] + self->p[P_MAX_TABLES] * self->p[P_TABLE_SIZE] > self->view.len ||
         self->p[P_TINDEX_CAP] <= 0 || (self->p[P_TINDEX_CAP] & (self->p[P_TINDEX_CAP] - 1)) ||
         self->p[P_TINDEX_OFF] < 0 ||
         self->p[P_TINDEX_OFF] + self->p[P_TINDEX_CAP] * 4 > self->view.len ||
         self->p[P_RID_BYTES] <= 0 || self->p[P_T_RID] < 0 ||
         self->p[P_T_RID] + self->p[P_RID_BYTES] > self->p[P_TABLE_SIZE] ||
         self->p[P_T_RHASH] < 0 || self->p[P_T_RHASH] + 8 > self->p[P_TABLE_SIZE])) {
        PyErr_SetString(PyExc_ValueError, "buffer too small for the pool's tables");
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        return -1;
    }
    self->base = (char *)self->view.buf;
    self->mutex = (pthread_mutex_t *)(self->base + self->p[P_MUTEX_OFF]);
    self->c = (int64_t *)(self->base + self->p[P_COUNTERS_OFF]);
    self->created_at = created_at;
    /* the fused ops stay off until set_chunks() says what they need */
    NCHUNKS(self) = 0;
    ((HotX *)self)->gen_off = -1;
    ((HotX *)self)->c_tokens = -1;
    return 0;
}

/* set_chunks(nchunks, gen_off, c_tokens): the pool's chunk count (at most
 * what fits the mapping), a block record's generation offset and the
 * counter of the seed's token count. */
static PyObject *
Hot_set_chunks(Hot *self, PyObject *args)
{
    Py_ssize_t n, gen_off, c_tokens;
    if (!PyArg_ParseTuple(args, "nnn", &n, &gen_off, &c_tokens))
        return NULL;
    if (!hot_ready(self))
        return NULL;
    if (n < 0 || n > chunks_room(self)) {
        PyErr_Format(PyExc_ValueError, "%zd chunks do not fit the mapping (room for %zd)",
                     n, chunks_room(self));
        return NULL;
    }
    if (gen_off < 0 || gen_off + 4 > self->p[P_BLOCK_SIZE] || c_tokens < 0 || c_tokens >= 64) {
        PyErr_SetString(PyExc_ValueError, "bad generation offset or token counter");
        return NULL;
    }
    NCHUNKS(self) = n;
    ((HotX *)self)->gen_off = gen_off;
    ((HotX *)self)->c_tokens = c_tokens;
    Py_RETURN_NONE;
}

static void
Hot_dealloc(Hot *self)
{
    if (self->has_view)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Hot_release(Hot *self, PyObject *unused)
{
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    Py_RETURN_NONE;
}

static PyMethodDef Hot_methods[] = {
    {"release", (PyCFunction)Hot_release, METH_NOARGS, "Release the buffer (before unmapping)."},
    {"set_chunks", (PyCFunction)Hot_set_chunks, METH_VARARGS,
     "set_chunks(nchunks, gen_off, c_tokens): what the fused ops need beyond the parameters."},
    {"init_mutex", (PyCFunction)Hot_init_mutex, METH_NOARGS, "Initialise the robust mutex (creator only)."},
    {"trylock", (PyCFunction)Hot_trylock, METH_NOARGS, "0 locked, 1 locked after the holder died, -1 busy."},
    {"lock", (PyCFunction)Hot_lock, METH_NOARGS, "Wait for the lock (GIL released); 1 if the holder died."},
    {"unlock", (PyCFunction)Hot_unlock, METH_NOARGS, "Release the lock."},
    {"lock_slices", (PyCFunction)Hot_lock_slices, METH_NOARGS, "Timed-lock slices this process let run out (a test hook)."},
    {"alloc", (PyCFunction)Hot_alloc, METH_VARARGS, "alloc(n, slot, epoch, loose) -> ids or None."},
    {"free", (PyCFunction)Hot_free, METH_VARARGS, "free(ids, slot, epoch, loose) -> freed or None."},
    {"table_new", (PyCFunction)Hot_table_new, METH_VARARGS,
     "table_new(raw, hash, slot) -> table, or None (lock held by the caller)."},
    {"table_drop", (PyCFunction)Hot_table_drop, METH_VARARGS,
     "table_drop(t) -> references released, or None (lock held by the caller)."},
    {"table_take", (PyCFunction)Hot_table_take, METH_VARARGS,
     "table_take(t, ids, now, tokens) -> len(ids), or None (lock held by the caller)."},
    {"find_chain", (PyCFunction)Hot_find_chain, METH_VARARGS,
     "find_chain(hashes) -> blocks of the longest cached run, or None (lock held by the caller)."},
    {"table_append", (PyCFunction)Hot_table_append, METH_VARARGS,
     "table_append(t, n, bs, now) -> ids the tokens land in, or None (lock held by the caller)."},
    {NULL}
};

static PyTypeObject HotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmcache._hot.Hot",
    .tp_basicsize = sizeof(HotX),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hot(buffer, params, created_at): the pool mutex and fused operations.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Hot_init,
    .tp_dealloc = (destructor)Hot_dealloc,
    .tp_methods = Hot_methods,
};

static struct PyModuleDef hotmodule = {
    PyModuleDef_HEAD_INIT, "shmcache._hot",
    "The pool mutex and fused hot paths of shmcache, in C.", -1, NULL
};

PyMODINIT_FUNC
PyInit__hot(void)
{
    PyObject *m;
    if (PyType_Ready(&HotType) < 0)
        return NULL;
    m = PyModule_Create(&hotmodule);
    if (!m)
        return NULL;
    Py_INCREF(&HotType);
    if (PyModule_AddObject(m, "Hot", (PyObject *)&HotType) < 0) {
        Py_DECREF(&HotType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MUTEX_SIZE", (long)sizeof(pthread_mutex_t)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
