/* shmcache._hot: the pool mutex and the two operations a scheduler calls on
 * every step (allocate blocks, free a batch of them), in C.
 *
 * The mutex itself (a process-shared robust pthread mutex in the pool
 * header), the Hot object's layout and how a fused op takes the lock are in
 * _hot_mutex.h.
 *
 * alloc() and free() do exactly what shmcache/fastpath.py does (which stays
 * as the fallback where this module is not built), plus taking and leaving
 * the lock, in one call: in Python a call costs as much as the work. They
 * only ever *try* the lock: holding the GIL while waiting for a lock that
 * another thread of this process holds would deadlock, so when the lock is
 * busy, the pool dirty, the manager's view stale or anything unusual they
 * return None having changed nothing, and the caller takes the slow path.
 *
 * NOTE: crash consistency is the Python code's: the dirty mark is set (with a
 * fence) before the first shared write and cleared after the last, so a
 * holder killed in between leaves a pool that the next holder repairs.
 *
 * Every index read from shared memory (free-list links, the free-record list
 * head and links, the slot's list head) is checked against its structure's
 * size before it is used. One out of range means a corrupt pool: the op
 * gives up (before its first write when the check can be made then, else
 * leaving the pool dirty, as a crash would) and returns None, and the Python
 * path, which finds the pool dirty or meets the same index, repairs or
 * raises CorruptPoolError. No index is followed outside the segment.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_hot_mutex.h"

/* The Hot object, with what the fused ops need beyond _hot_mutex.h's
 * parameters: how many reference records there are. */
typedef struct {
    Hot h;
    Py_ssize_t max_refs;    /* record ids the fused ops accept: [0, max_refs) */
} HotX;

#define MAX_REFS(h) (((HotX *)(h))->max_refs)
#define IS_BLOCK(h, b) ((b) >= 1 && (b) < (h)->p[P_MAX_BLOCKS])
#define IS_REC(h, r) ((r) >= 0 && (r) < MAX_REFS(h))

/* The most records that fit between the records' offset and the end of the
 * mapping (0 when the fused ops are off). */
static Py_ssize_t
refs_room(Hot *h)
{
    if (h->p[P_MAX_SLOTS] <= 0 || h->p[P_REF_SIZE] <= 0 || h->p[P_REFS_OFF] <= 0 ||
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
    self->base = (char *)self->view.buf;
    self->mutex = (pthread_mutex_t *)(self->base + self->p[P_MUTEX_OFF]);
    self->c = (int64_t *)(self->base + self->p[P_COUNTERS_OFF]);
    self->created_at = created_at;
    MAX_REFS(self) = refs_room(self);   /* until set_max_refs() says exactly */
    return 0;
}

/* set_max_refs(n): the pool's record count (at most what fits the mapping). */
static PyObject *
Hot_set_max_refs(Hot *self, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (!hot_ready(self))
        return NULL;
    if (n < 0 || n > refs_room(self)) {
        PyErr_Format(PyExc_ValueError, "max_refs %zd does not fit the mapping (room for %zd)",
                     n, refs_room(self));
        return NULL;
    }
    MAX_REFS(self) = n;
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

/* Record, in the process-local map, that this slot now holds bs[i] through
 * record rs[i]; returns the list of block ids, or NULL (MemoryError). */
static PyObject *
local_map_add(PyObject *loose, const int32_t *bs, const int32_t *rs, Py_ssize_t n)
{
    PyObject *ids = PyList_New(n);
    if (!ids)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *bo = PyLong_FromLong(bs[i]), *ro = PyLong_FromLong(rs[i]), *lst;
        int err = -1;
        if (bo && ro) {
            lst = PyDict_GetItemWithError(loose, bo);
            if (lst && PyList_CheckExact(lst))
                err = PyList_Append(lst, ro);
            else if (!lst && !PyErr_Occurred()) {
                PyObject *nl = PyList_New(1);
                if (nl) {
                    Py_INCREF(ro);
                    PyList_SET_ITEM(nl, 0, ro);
                    err = PyDict_SetItem(loose, bo, nl);
                    Py_DECREF(nl);
                }
            }
        }
        Py_XDECREF(ro);
        if (err) {
            Py_XDECREF(bo);
            Py_DECREF(ids);
            return NULL;
        }
        PyList_SET_ITEM(ids, i, bo);   /* steals bo */
    }
    return ids;
}

/* alloc(n, slot, epoch, loose) -> list of n block ids, or None.
 * The first n free blocks must be uncached (otherwise None: the slow path
 * evicts their cache entries), and n reference records free.
 * NOTE: the shared update is pure C and cannot fail; the process-local map
 * is updated after the lock is released (only this thread can see it: we
 * hold the GIL, and the GC is off so that no finalizer runs in between).
 * Should that fail (MemoryError only), the caller rebuilds the map from
 * the slot's records, which are the truth. */
static PyObject *
Hot_alloc(Hot *h, PyObject *args)
{
    Py_ssize_t n, i;
    int slot, gc;
    long long epoch;
    PyObject *loose, *ids;
    int32_t stack_b[64], stack_r[64], *bs = stack_b, *rs = stack_r;

    if (!PyArg_ParseTuple(args, "niLO!", &n, &slot, &epoch, &PyDict_Type, &loose))
        return NULL;
    if (!hot_ready(h))
        return NULL;
    /* (more than the pool has: the slow path raises, before any allocation) */
    if (n <= 0 || n >= h->p[P_MAX_BLOCKS] || slot < 0 || slot >= h->p[P_MAX_SLOTS])
        Py_RETURN_NONE;
    if (n > 64) {
        bs = PyMem_Malloc(n * sizeof(int32_t));
        rs = PyMem_Malloc(n * sizeof(int32_t));
        if (!bs || !rs) {
            PyMem_Free(bs);
            PyMem_Free(rs);
            return PyErr_NoMemory();
        }
    }
    if (enter(h, epoch, slot) < 0)
        goto busy;
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS];
        const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
        int32_t b = NEXT(h, HEAD), r = (int32_t)C(h, P_C_FREE_REF), shead;
        struct timespec ts;
        float now;
        if (C(h, P_C_NUM_FREE) < n || C(h, P_C_FREE_REFS) < n) {
            leave(h, 0);
            goto busy;
        }
        /* read-only walk first: nothing changes unless all of it works (and
         * every id read is in range: else the slow path meets the same one) */
        for (i = 0; i < n; i++) {
            if (!IS_BLOCK(h, b) || (FLAGS(h, b) & CACHED) || !IS_REC(h, r)) {
                leave(h, 0);
                goto busy;
            }
            bs[i] = b;
            rs[i] = r;
            b = NEXT(h, b);
            r = RNEXT(h, r);
        }
        /* b, r: the first ones not taken, the new heads */
        if (!(IS_BLOCK(h, b) || b == HEAD + 1) || !(IS_REC(h, r) || r == -1)) {
            leave(h, 0);
            goto busy;
        }
        clock_gettime(CLOCK_REALTIME, &ts);
        now = (float)((double)ts.tv_sec + ts.tv_nsec * 1e-9 - h->created_at);
        begin_update(h);
        shead = SF(h, slot, P_S_HEAD);
        for (i = 0; i < n; i++) {
            int32_t bb = bs[i], rr = rs[i];
            PREV(h, bb) = -1;
            NEXT(h, bb) = -1;
            REF(h, bb) = 1;
            TOK(h, bb) = 0;
            LAST(h, bb) = now;
            RBLOCK(h, rr) = bb;
            RNEXT(h, rr) = shead;
            shead = rr;
            SF(h, slot, P_S_HEAD) = rr;     /* commit: the slot holds bb */
        }
        NEXT(h, HEAD) = b;                  /* b, r: the first ones not taken */
        PREV(h, b) = HEAD;
        C(h, P_C_FREE_REF) = r;
        C(h, P_C_FREE_REFS) -= n;
        C(h, P_C_NUM_FREE) -= n;
        SF(h, slot, P_S_COUNT) += (int32_t)n;
        leave(h, 1);
    }
    gc = PyGC_Disable();
    ids = local_map_add(loose, bs, rs, n);
    if (gc)
        PyGC_Enable();
    if (!ids) {
        PyErr_Clear();
        PyErr_SetString(PyExc_MemoryError, "loose-reference map must be resynced");
    }
    if (bs != stack_b) {
        PyMem_Free(bs);
        PyMem_Free(rs);
    }
    return ids;
busy:
    if (bs != stack_b) {
        PyMem_Free(bs);
        PyMem_Free(rs);
    }
    Py_RETURN_NONE;
}

static int
cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* free(ids, slot, epoch, loose) -> number of blocks that became free, or
 * None (nothing changed) when an id is not an int in [1, max_blocks), is
 * not held loose by this slot as many times as listed, or the lock is busy:
 * the slow path then raises the precise error or waits. */
static PyObject *
Hot_free(Hot *h, PyObject *args)
{
    PyObject *seq, *loose, *fast = NULL, *result = NULL;
    int slot;
    long long epoch;
    int32_t stack_b[64], stack_s[64], *bs = stack_b, *sorted = NULL;
    Py_ssize_t n, i, freed = 0;
    int ok = 1;

    if (!PyArg_ParseTuple(args, "OiLO!", &seq, &slot, &epoch, &PyDict_Type, &loose))
        return NULL;
    if (!hot_ready(h))
        return NULL;
    if (slot < 0 || slot >= h->p[P_MAX_SLOTS])
        Py_RETURN_NONE;
    fast = PySequence_Fast(seq, "ids must be a sequence");
    if (!fast)
        return NULL;
    n = PySequence_Fast_GET_SIZE(fast);
    if (n == 0) {
        Py_DECREF(fast);
        return PyLong_FromLong(0);
    }
    if (n > 64) {
        bs = PyMem_Malloc(n * sizeof(int32_t));
        if (!bs) {
            Py_DECREF(fast);
            return PyErr_NoMemory();
        }
    }
    for (i = 0; i < n && ok; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
        long v;
        if (!PyLong_CheckExact(o)) {
            ok = 0;
            break;
        }
        v = PyLong_AsLong(o);
        if (v < 1 || v >= h->p[P_MAX_BLOCKS]) {
            PyErr_Clear();
            ok = 0;
            break;
        }
        bs[i] = (int32_t)v;
    }
    if (!ok)
        goto busy;
    /* every id held loose as many times as listed (sorted copy for counts);
     * before the lock: the map is this process's, and the epoch check below
     * confirms that it is current */
    sorted = n > 64 ? PyMem_Malloc(n * sizeof(int32_t)) : stack_s;
    if (!sorted) {
        PyErr_NoMemory();
        goto fail;
    }
    memcpy(sorted, bs, n * sizeof(int32_t));
    if (n > 1)
        qsort(sorted, n, sizeof(int32_t), cmp_i32);
    for (i = 0; i < n && ok;) {
        Py_ssize_t j = i;
        PyObject *key, *lst;
        while (j < n && sorted[j] == sorted[i])
            j++;
        key = PyLong_FromLong(sorted[i]);
        if (!key)
            goto fail;
        lst = PyDict_GetItemWithError(loose, key);
        Py_DECREF(key);
        if (!lst && PyErr_Occurred())
            goto fail;
        if (!lst || !PyList_CheckExact(lst) || PyList_GET_SIZE(lst) < j - i)
            ok = 0;
        i = j;
    }
    if (!ok || enter(h, epoch, slot) < 0)
        goto busy;
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS], TAIL = HEAD + 1;
        const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
        int32_t fr = (int32_t)C(h, P_C_FREE_REF);
        int corrupt = 0, nomem = 0;
        begin_update(h);
        for (i = 0; i < n; i++) {
            int32_t b = bs[i], hd = SF(h, slot, P_S_HEAD), hb = 0, x, nb;
            PyObject *bo = PySequence_Fast_GET_ITEM(fast, i), *recs, *ro, *lst = NULL;
            Py_ssize_t k, m, q = 0;
            long r;
            int cached = (FLAGS(h, b) & CACHED) != 0;
            /* checks first: every index read from shared memory in range,
             * and the map agreeing with the slot's list; then the change */
            recs = PyDict_GetItem(loose, bo);   /* held: checked above */
            k = PyList_GET_SIZE(recs);
            ro = PyList_GET_ITEM(recs, k - 1);
            r = PyLong_AsLong(ro);
            if (!IS_REC(h, hd) || !IS_REC(h, r)) {
                PyErr_Clear();
                corrupt = 1;
                break;
            }
            if (r != hd) {
                PyObject *hbo;
                hb = RBLOCK(h, hd);
                hbo = PyLong_FromLong(hb);
                if (!hbo) {
                    nomem = 1;
                    break;
                }
                lst = PyDict_GetItem(loose, hbo);
                Py_DECREF(hbo);
                if (!lst || !PyList_CheckExact(lst)) {
                    corrupt = 1;
                    break;
                }
                m = lst == recs ? k - 1 : PyList_GET_SIZE(lst);
                for (q = 0; q < m; q++)
                    if (PyLong_AsLong(PyList_GET_ITEM(lst, q)) == hd)
                        break;
                PyErr_Clear();      /* (the map holds ints: never set) */
                if (q == m) {
                    corrupt = 1;
                    break;
                }
            }
            x = REF(h, b) - 1;
            if (x == 0) {
                nb = cached ? PREV(h, TAIL) : NEXT(h, HEAD);
                if (!IS_BLOCK(h, nb) && nb != (cached ? HEAD : TAIL)) {
                    corrupt = 1;
                    break;
                }
            }
            /* recs.pop(); if not recs: del loose[b]  (no allocation) */
            Py_SET_SIZE(recs, k - 1);           /* we own ro now */
            if (r != hd) {
                /* move the head's block into r, then pop the head: O(1)
                 * removal from a singly linked list */
                PyObject *old = PyList_GET_ITEM(lst, q);
                RBLOCK(h, r) = hb;
                PyList_SET_ITEM(lst, q, ro);    /* steals ro */
                Py_DECREF(old);
            }
            else
                Py_DECREF(ro);
            if (k == 1)
                PyDict_DelItem(loose, bo);
            SF(h, slot, P_S_HEAD) = RNEXT(h, hd);   /* commit: b's reference is gone */
            RBLOCK(h, hd) = -1;
            RNEXT(h, hd) = fr;
            fr = hd;
            REF(h, b) = x;
            if (x == 0) {
                freed++;
                if (cached) {                   /* to the back: evicted last */
                    int32_t lb = PREV(h, TAIL);
                    NEXT(h, lb) = b;
                    PREV(h, b) = lb;
                    NEXT(h, b) = TAIL;
                    PREV(h, TAIL) = b;
                }
                else {                          /* to the front: reused first */
                    int32_t first = NEXT(h, HEAD);
                    PREV(h, first) = b;
                    NEXT(h, b) = first;
                    PREV(h, b) = HEAD;
                    NEXT(h, HEAD) = b;
                }
            }
        }
        /* i references dropped (all n, unless stopped) */
        C(h, P_C_FREE_REF) = fr;
        C(h, P_C_FREE_REFS) += i;
        C(h, P_C_NUM_FREE) += freed;
        SF(h, slot, P_S_COUNT) -= (int32_t)i;
        if (corrupt) {
            /* left dirty: the slow path repairs, then does or refuses the rest */
            leave(h, 0);
            goto busy;
        }
        leave(h, 1);
        ok = !nomem;
    }
    result = ok ? PyLong_FromSsize_t(freed) : NULL;
    if (!ok) {
        PyErr_Clear();
        PyErr_SetString(PyExc_MemoryError, "loose-reference map must be resynced");
    }
    goto done;
busy:
    result = Py_None;
    Py_INCREF(result);
fail:
done:
    Py_DECREF(fast);
    if (sorted != stack_s)
        PyMem_Free(sorted);
    if (bs != stack_b)
        PyMem_Free(bs);
    return result;
}

static PyMethodDef Hot_methods[] = {
    {"release", (PyCFunction)Hot_release, METH_NOARGS, "Release the buffer (before unmapping)."},
    {"set_max_refs", (PyCFunction)Hot_set_max_refs, METH_O, "set_max_refs(n): the pool's reference-record count."},
    {"init_mutex", (PyCFunction)Hot_init_mutex, METH_NOARGS, "Initialise the robust mutex (creator only)."},
    {"trylock", (PyCFunction)Hot_trylock, METH_NOARGS, "0 locked, 1 locked after the holder died, -1 busy."},
    {"lock", (PyCFunction)Hot_lock, METH_NOARGS, "Wait for the lock (GIL released); 1 if the holder died."},
    {"unlock", (PyCFunction)Hot_unlock, METH_NOARGS, "Release the lock."},
    {"lock_slices", (PyCFunction)Hot_lock_slices, METH_NOARGS, "Timed-lock slices this process let run out (a test hook)."},
    {"alloc", (PyCFunction)Hot_alloc, METH_VARARGS, "alloc(n, slot, epoch, loose) -> ids or None."},
    {"free", (PyCFunction)Hot_free, METH_VARARGS, "free(ids, slot, epoch, loose) -> freed or None."},
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
