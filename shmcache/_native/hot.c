/* shmcache._hot: the pool mutex, the two operations a scheduler calls on
 * every step (allocate blocks, free a batch of them), and the table calls
 * of a request's life (take a cached prefix into a table, append, delete),
 * in C.
 *
 * The mutex itself (a process-shared robust pthread mutex in the pool
 * header), the Hot object's layout and how a fused op takes the lock are in
 * hot_mutex.h.
 *
 * alloc() and free() do exactly what shmcache/fastpath.py does (which stays
 * as the reference, and the path taken where this module is not loaded),
 * plus taking and leaving the lock, in one call: in Python a call costs as
 * much as the work. They only ever *try* the lock: holding the GIL while
 * waiting for a lock that another thread of this process holds would
 * deadlock, so when the lock is busy, the pool dirty, the manager's view
 * stale or anything unusual they return None having changed nothing, and
 * the caller takes the slow path.
 *
 * NOTE: crash consistency is the Python code's: the dirty mark is set (with a
 * fence) before the first shared write and cleared after the last, so a
 * holder killed in between leaves a pool that the next holder repairs.
 *
 * Every index read from shared memory (free-list links, the free chunk list
 * head and links, the slot's list head and its chunk links, the words of
 * the local map) is checked against its structure's size before it is
 * used. One out of range means a corrupt pool: the op gives up (before its
 * first write when the check can be made then, else
 * leaving the pool dirty, as a crash would) and returns None, and the Python
 * path, which finds the pool dirty or meets the same index, repairs or
 * raises CorruptPoolError. No index is followed outside the segment.
 *
 * table_new(), table_take(), table_append(), table_drop() and
 * find_chain() are different: they run
 * inside a lock hold the Python caller took (see "table ops, lock held"),
 * do what the Python path of acquire_computed_blocks(table=),
 * prepare_append and delete_block_table does after its lookups, and check
 * everything before their first write, so None always means nothing
 * changed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "hot_mutex.h"

/* The Hot object, with what the fused ops need beyond hot_mutex.h's
 * parameters (set_chunks): how many reference chunks there are, where a
 * block record keeps its generation, and the seed's token counter.
 *
 * The chunk area (P_REFS_OFF, P_REF_SIZE bytes a chunk) is seen as int32
 * words: chunk c is words [c*CW, c*CW + CW), word 0 its link, then CI block
 * ids. A slot's loose list: P_S_HEAD is its first chunk, the partly filled
 * one with ((count - 1) % CI) + 1 ids; the chunks it links to are full
 * (see refs.py). The process-local map holds, for each block, the words of
 * its loose ids. */
#define CI 15
#define CW 16

typedef struct {
    Hot h;
    Py_ssize_t nchunks;     /* chunk ids the fused ops accept: [0, nchunks) */
    Py_ssize_t gen_off;     /* byte offset of a block record's generation (-1: off) */
    Py_ssize_t c_tokens;    /* counter index of the seed's total_tokens_cached (-1: off) */
} HotX;

#define NCHUNKS(h) (((HotX *)(h))->nchunks)
#define IS_BLOCK(h, b) ((b) >= 1 && (b) < (h)->p[P_MAX_BLOCKS])
#define IS_CHUNK(h, c) ((c) >= 0 && (c) < NCHUNKS(h))
#define W(h, g) (((int32_t *)((h)->base + (h)->p[P_REFS_OFF]))[g])
#define GEN(h, b) (*(uint32_t *)((h)->base + (h)->p[P_BLOCKS_OFF] + \
                                  (int64_t)(b) * (h)->p[P_BLOCK_SIZE] + ((HotX *)(h))->gen_off))
#define NCH_FOR(n) (((n) + CI - 1) / CI)

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

/* Record, in the process-local map, that this slot now holds bs[i] at
 * word rs[i]; returns the list of block ids, or NULL (MemoryError). */
static PyObject *
local_map_add(PyObject *loose, const int32_t *bs, const int64_t *rs, Py_ssize_t n)
{
    PyObject *ids = PyList_New(n);
    if (!ids)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *bo = PyLong_FromLong(bs[i]), *ro = PyLong_FromLongLong(rs[i]), *lst;
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
 * evicts their cache entries), and the chunks the slot's loose list grows
 * by free (otherwise None: the slow path reports it).
 * NOTE: the shared update is pure C and cannot fail; the process-local map
 * is updated after the lock is released (only this thread can see it: we
 * hold the GIL, and the GC is off so that no finalizer runs in between).
 * Should that fail (MemoryError only), the caller rebuilds the map from
 * the slot's list, which is the truth. */
static PyObject *
Hot_alloc(Hot *h, PyObject *args)
{
    Py_ssize_t n, i;
    int slot, gc;
    long long epoch;
    PyObject *loose, *ids;
    int32_t stack_b[64], stack_c[8], *bs = stack_b, *cs = stack_c;
    int64_t stack_g[64], *gs = stack_g;

    if (!PyArg_ParseTuple(args, "niLO!", &n, &slot, &epoch, &PyDict_Type, &loose))
        return NULL;
    if (!hot_ready(h))
        return NULL;
    /* (more than the pool has: the slow path raises, before any allocation) */
    if (n <= 0 || n >= h->p[P_MAX_BLOCKS] || slot < 0 || slot >= h->p[P_MAX_SLOTS] ||
        NCHUNKS(h) <= 0)
        Py_RETURN_NONE;
    if (n > 64) {
        bs = PyMem_Malloc(n * sizeof(int32_t));
        gs = PyMem_Malloc(n * sizeof(int64_t));
        cs = PyMem_Malloc((n / CI + 2) * sizeof(int32_t));
        if (!bs || !gs || !cs) {
            PyMem_Free(bs);
            PyMem_Free(gs);
            PyMem_Free(cs);
            return PyErr_NoMemory();
        }
    }
    if (enter(h, epoch, slot) < 0)
        goto busy;
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS];
        const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
        int32_t b = NEXT(h, HEAD), k = (int32_t)C(h, P_C_FREE_REF);
        int32_t cnt = SF(h, slot, P_S_COUNT), head = SF(h, slot, P_S_HEAD);
        Py_ssize_t need, ci = 0;
        struct timespec ts;
        float now;
        if (cnt < 0 || cnt > NCHUNKS(h) * CI) {
            leave(h, 0);
            goto busy;
        }
        need = NCH_FOR(cnt + n) - NCH_FOR(cnt);
        if (C(h, P_C_NUM_FREE) < n || C(h, P_C_FREE_REFS) < need ||
            (cnt % CI && !IS_CHUNK(h, head))) {
            leave(h, 0);
            goto busy;
        }
        /* read-only walk first: nothing changes unless all of it works (and
         * every id read is in range: else the slow path meets the same one) */
        for (i = 0; i < n; i++) {
            if (!IS_BLOCK(h, b) || (FLAGS(h, b) & CACHED)) {
                leave(h, 0);
                goto busy;
            }
            bs[i] = b;
            b = NEXT(h, b);
        }
        for (i = 0; i < need; i++) {
            if (!IS_CHUNK(h, k) || W(h, (int64_t)k * CW + 1) != -1) {
                leave(h, 0);
                goto busy;
            }
            cs[i] = k;
            k = W(h, (int64_t)k * CW);
        }
        /* b, k: the first ones not taken, the new heads */
        if (!(IS_BLOCK(h, b) || b == HEAD + 1) || !(IS_CHUNK(h, k) || k == -1)) {
            leave(h, 0);
            goto busy;
        }
        clock_gettime(CLOCK_REALTIME, &ts);
        now = (float)((double)ts.tv_sec + ts.tv_nsec * 1e-9 - h->created_at);
        begin_update(h);
        for (i = 0; i < n; i++) {
            int32_t bb = bs[i], off = cnt % CI;
            int64_t g;
            PREV(h, bb) = -1;
            NEXT(h, bb) = -1;
            REF(h, bb) = 1;
            TOK(h, bb) = 0;
            LAST(h, bb) = now;
            GEN(h, bb) += 1;
            if (off == 0) {
                int32_t c = cs[ci++];
                W(h, (int64_t)c * CW) = cnt ? head : -1;
                g = (int64_t)c * CW + 1;
                W(h, g) = bb;
                head = c;
                SF(h, slot, P_S_HEAD) = c;
            }
            else {
                g = (int64_t)head * CW + 1 + off;
                W(h, g) = bb;
            }
            cnt++;
            SF(h, slot, P_S_COUNT) = cnt;   /* commit: the slot holds bb */
            gs[i] = g;
        }
        NEXT(h, HEAD) = b;                  /* b, k: the first ones not taken */
        PREV(h, b) = HEAD;
        C(h, P_C_FREE_REF) = k;
        C(h, P_C_FREE_REFS) -= need;
        C(h, P_C_NUM_FREE) -= n;
        leave(h, 1);
    }
    gc = PyGC_Disable();
    ids = local_map_add(loose, bs, gs, n);
    if (gc)
        PyGC_Enable();
    if (!ids) {
        PyErr_Clear();
        PyErr_SetString(PyExc_MemoryError, "loose-reference map must be resynced");
    }
    if (bs != stack_b) {
        PyMem_Free(bs);
        PyMem_Free(gs);
        PyMem_Free(cs);
    }
    return ids;
busy:
    if (bs != stack_b) {
        PyMem_Free(bs);
        PyMem_Free(gs);
        PyMem_Free(cs);
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
    if (slot < 0 || slot >= h->p[P_MAX_SLOTS] || NCHUNKS(h) <= 0)
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
        const int64_t NW = (int64_t)NCHUNKS(h) * CW;
        const Py_ssize_t CT = ((HotX *)h)->c_tokens;
        int corrupt = 0, nomem = 0;
        begin_update(h);
        for (i = 0; i < n; i++) {
            int32_t b = bs[i], hd = SF(h, slot, P_S_HEAD), cnt = SF(h, slot, P_S_COUNT);
            int32_t bl = 0, x, nb, nh = -1;
            int64_t last;
            PyObject *bo = PySequence_Fast_GET_ITEM(fast, i), *recs, *go, *lst = NULL;
            Py_ssize_t k, m, q = 0;
            long g;
            int cached = (FLAGS(h, b) & CACHED) != 0, empty;
            /* checks first: every index read from shared memory in range,
             * and the map agreeing with the slot's list; then the change */
            recs = PyDict_GetItem(loose, bo);   /* held: checked above */
            k = PyList_GET_SIZE(recs);
            go = PyList_GET_ITEM(recs, k - 1);
            g = PyLong_AsLong(go);
            if (cnt < 1 || !IS_CHUNK(h, hd) || g < 0 || g >= NW || g % CW == 0 || W(h, g) != b) {
                PyErr_Clear();
                corrupt = 1;
                break;
            }
            last = (int64_t)hd * CW + 1 + (cnt - 1) % CI;
            if (g != last) {
                PyObject *blo;
                bl = W(h, last);
                blo = PyLong_FromLong(bl);
                if (!blo) {
                    nomem = 1;
                    break;
                }
                lst = PyDict_GetItem(loose, blo);
                Py_DECREF(blo);
                if (!lst || !PyList_CheckExact(lst)) {
                    corrupt = 1;
                    break;
                }
                m = lst == recs ? k - 1 : PyList_GET_SIZE(lst);
                for (q = 0; q < m; q++)
                    if (PyLong_AsLong(PyList_GET_ITEM(lst, q)) == last)
                        break;
                PyErr_Clear();      /* (the map holds ints: never set) */
                if (q == m) {
                    corrupt = 1;
                    break;
                }
            }
            empty = (cnt - 1) % CI == 0;
            if (empty) {
                nh = W(h, (int64_t)hd * CW);
                if (cnt == 1 ? nh != -1 : !IS_CHUNK(h, nh)) {
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
            Py_SET_SIZE(recs, k - 1);           /* we own go now */
            if (g != last) {
                /* move the newest id into g, then drop the newest: O(1)
                 * removal (g's int object now names the moved id's word) */
                PyObject *old = PyList_GET_ITEM(lst, q);
                W(h, g) = bl;
                PyList_SET_ITEM(lst, q, go);    /* steals go */
                Py_DECREF(old);
            }
            else
                Py_DECREF(go);
            if (k == 1)
                PyDict_DelItem(loose, bo);
            SF(h, slot, P_S_COUNT) = cnt - 1;   /* commit: b's reference is gone */
            if (empty) {                        /* the first chunk is empty: free it */
                SF(h, slot, P_S_HEAD) = nh;
                W(h, (int64_t)hd * CW + 1) = -1;
                W(h, (int64_t)hd * CW) = (int32_t)C(h, P_C_FREE_REF);
                C(h, P_C_FREE_REF) = hd;
                C(h, P_C_FREE_REFS) += 1;
            }
            REF(h, b) = x;
            if (x == 0) {
                freed++;
                h->c[CT] -= TOK(h, b);          /* as the seed's free_block */
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
        C(h, P_C_NUM_FREE) += freed;
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

/* ------------------------------------------------ table ops, lock held */

/* The table ops below run inside a lock hold the caller (PoolLock) took:
 * the pool is marked dirty for the whole hold, so a holder killed at any
 * instruction leaves a pool the next holder repairs, and the caller has
 * synced its view. They check first (every index read from shared memory
 * in range) and return None having changed nothing when anything is off;
 * the Python path then raises, or repairs, exactly as it would have. Once
 * the checks pass the writes cannot fail. */

/* Whether this thread holds the pool mutex (the lock word names it: glibc
 * keeps the word first in pthread_mutex_t on Linux, see owner_vanished). */
static int
held_here(Hot *h)
{
    uint32_t w = __atomic_load_n((uint32_t *)h->mutex, __ATOMIC_RELAXED);
    return (w & W_TID_MASK) == (uint32_t)syscall(SYS_gettid);
}

static int
table_ops_on(Hot *h, Py_ssize_t t)
{
    return NCHUNKS(h) > 0 && ((HotX *)h)->c_tokens >= 0 && h->p[P_MAX_TABLES] > 0 &&
           t >= 0 && t < h->p[P_MAX_TABLES] && TF(h, t, P_T_STATE) == 1 && held_here(h);
}

/* Block ids (ints in [1, max_blocks)) of a sequence, into bs (n of them). */
static int
read_ids(Hot *h, PyObject *fast, int32_t *bs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
        long v;
        if (!PyLong_CheckExact(o))
            return 0;
        v = PyLong_AsLong(o);
        if (v < 1 || v >= h->p[P_MAX_BLOCKS]) {
            PyErr_Clear();
            return 0;
        }
        bs[i] = (int32_t)v;
    }
    return 1;
}

/* table_drop(t) -> references released, or None (nothing changed).
 * Live table t's list emptied and its references released last block
 * first, as tables.delete_block_table does with refs.pop_table and
 * reclaim.release_block; the table's state and the table counter too
 * (refs.unlink_table), but not the request-id index: the caller removes
 * the entry in the same hold. Checked first: the chain (each chunk in
 * range, the last linking to -1, so no cycle), every id a block, every
 * block's ref_count at least the ids naming it, and the free list's ends. */
static PyObject *
Hot_table_drop(Hot *h, PyObject *args)
{
    Py_ssize_t t, i, k, len;
    int32_t stack_b[256], stack_c[32], *bs = stack_b, *cs = stack_c, *sorted = NULL;
    PyObject *result = Py_None;

    if (!PyArg_ParseTuple(args, "n", &t))
        return NULL;
    if (!hot_ready(h))
        return NULL;
    if (!table_ops_on(h, t))
        Py_RETURN_NONE;
    len = TF(h, t, P_T_LEN);
    k = NCH_FOR(len);
    if (len < 0 || k > NCHUNKS(h))
        Py_RETURN_NONE;
    if (len > 128) {
        bs = PyMem_Malloc(2 * len * sizeof(int32_t));
        cs = PyMem_Malloc((k + 1) * sizeof(int32_t));
        if (!bs || !cs) {
            PyMem_Free(bs);
            PyMem_Free(cs);
            return PyErr_NoMemory();
        }
    }
    sorted = bs + len;
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS], TAIL = HEAD + 1;
        const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
        const Py_ssize_t CT = ((HotX *)h)->c_tokens;
        int32_t c = TF(h, t, P_T_HEAD), nf, lt;
        for (i = 0; i < k; i++) {
            if (!IS_CHUNK(h, c))
                goto done;
            cs[i] = c;
            c = W(h, (int64_t)c * CW);
        }
        if (k && c != -1)
            goto done;
        for (i = 0; i < len; i++) {
            int32_t b = W(h, (int64_t)cs[i / CI] * CW + 1 + i % CI);
            if (!IS_BLOCK(h, b))
                goto done;
            bs[i] = sorted[i] = b;
        }
        if (len > 1)
            qsort(sorted, len, sizeof(int32_t), cmp_i32);
        for (i = 0; i < len;) {
            Py_ssize_t j = i;
            while (j < len && sorted[j] == sorted[i])
                j++;
            if (REF(h, sorted[i]) < j - i)
                goto done;
            i = j;
        }
        nf = NEXT(h, HEAD);
        lt = PREV(h, TAIL);
        if (!(IS_BLOCK(h, nf) || nf == TAIL) || !(IS_BLOCK(h, lt) || lt == HEAD))
            goto done;
        /* the writes, in refs.unlink_table's, pop_table's and release_block's order */
        TF(h, t, P_T_STATE) = 0;                /* commit: the table is gone */
        C(h, P_C_NUM_TABLES) -= 1;
        TF(h, t, P_T_LEN) = 0;                  /* commit: its list is empty */
        TF(h, t, P_T_HEAD) = -1;
        TF(h, t, P_T_TAIL) = -1;
        for (i = 0; i < k; i++) {
            c = cs[i];
            W(h, (int64_t)c * CW + 1) = -1;
            W(h, (int64_t)c * CW) = (int32_t)C(h, P_C_FREE_REF);
            C(h, P_C_FREE_REF) = c;
            C(h, P_C_FREE_REFS) += 1;
        }
        for (i = len - 1; i >= 0; i--) {
            int32_t b = bs[i], x = REF(h, b) - 1;
            REF(h, b) = x;
            if (x)
                continue;
            h->c[CT] -= TOK(h, b);              /* as the seed's free_block */
            if (FLAGS(h, b) & CACHED) {         /* to the back: evicted last */
                int32_t lb = PREV(h, TAIL);
                NEXT(h, lb) = b;
                PREV(h, b) = lb;
                NEXT(h, b) = TAIL;
                PREV(h, TAIL) = b;
            }
            else {                              /* to the front: reused first */
                int32_t first = NEXT(h, HEAD);
                PREV(h, first) = b;
                NEXT(h, b) = first;
                PREV(h, b) = HEAD;
                NEXT(h, HEAD) = b;
            }
            C(h, P_C_NUM_FREE) += 1;
        }
        result = PyLong_FromSsize_t(len);
    }
done:
    if (bs != stack_b) {
        PyMem_Free(bs);
        PyMem_Free(cs);
    }
    if (result == Py_None)
        Py_INCREF(result);
    return result;
}

/* table_take(t, ids, now, tokens) -> len(ids), or None (nothing changed).
 * The table branch of prefix.acquire_computed_blocks after its lookup: a
 * reference on each block of ids (taking a free one out of the free list),
 * its last access set to now, the ids appended to live table t's list
 * (refs.table_extend: new chunks from the free chunk list, the length the
 * commit point), and tokens added to the table's and the pool's token
 * counts. Checked first: the ids, the table's tail, enough free chunks
 * (each one free, its link in range), and the free-list links of every
 * free block in ids. */
static PyObject *
Hot_table_take(Hot *h, PyObject *args)
{
    Py_ssize_t t, n, i, len, need, tokens;
    double now;
    PyObject *seq, *fast, *result = Py_None;
    int32_t stack_b[256], stack_c[32], *bs = stack_b, *cs = stack_c;

    if (!PyArg_ParseTuple(args, "nOdn", &t, &seq, &now, &tokens))
        return NULL;
    if (!hot_ready(h))
        return NULL;
    if (!table_ops_on(h, t))
        Py_RETURN_NONE;
    fast = PySequence_Fast(seq, "ids must be a sequence");
    if (!fast)
        return NULL;
    n = PySequence_Fast_GET_SIZE(fast);
    len = TF(h, t, P_T_LEN);
    if (n <= 0 || n >= h->p[P_MAX_BLOCKS] || len < 0 || len > NCHUNKS(h) * CI) {
        Py_DECREF(fast);
        Py_RETURN_NONE;
    }
    need = NCH_FOR(len + n) - NCH_FOR(len);
    if (n > 256 || need > 32) {
        bs = PyMem_Malloc(n * sizeof(int32_t));
        cs = PyMem_Malloc((need + 1) * sizeof(int32_t));
        if (!bs || !cs) {
            PyMem_Free(bs);
            PyMem_Free(cs);
            Py_DECREF(fast);
            return PyErr_NoMemory();
        }
    }
    if (!read_ids(h, fast, bs, n))
        goto done;
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS], TAIL = HEAD + 1;
        const Py_ssize_t CT = ((HotX *)h)->c_tokens;
        int32_t tail = TF(h, t, P_T_TAIL), k = (int32_t)C(h, P_C_FREE_REF);
        Py_ssize_t free = C(h, P_C_FREE_REFS), ci = 0, pos;
        if ((len && !IS_CHUNK(h, tail)) || free < need || free > NCHUNKS(h))
            goto done;
        for (i = 0; i < need; i++) {
            if (!IS_CHUNK(h, k) || W(h, (int64_t)k * CW + 1) != -1)
                goto done;
            cs[i] = k;
            k = W(h, (int64_t)k * CW);
        }
        if (!(IS_CHUNK(h, k) || k == -1))
            goto done;
        for (i = 0; i < n; i++) {
            int32_t b = bs[i], pr, nx;
            if (REF(h, b) != 0)
                continue;
            pr = PREV(h, b);
            nx = NEXT(h, b);
            if (!(IS_BLOCK(h, pr) || pr == HEAD) || !(IS_BLOCK(h, nx) || nx == TAIL))
                goto done;
        }
        /* the writes, in acquire_computed_blocks's order: the references
         * counted first (repair recomputes them from the lists), then the
         * list, its length last */
        for (i = 0; i < n; i++) {
            int32_t b = bs[i];
            if (REF(h, b) == 0) {
                int32_t pr = PREV(h, b), nx = NEXT(h, b);
                NEXT(h, pr) = nx;
                PREV(h, nx) = pr;
                PREV(h, b) = -1;
                NEXT(h, b) = -1;
                C(h, P_C_NUM_FREE) -= 1;
            }
            REF(h, b) += 1;
            LAST(h, b) = (float)now;
        }
        tail = len ? tail : -1;
        for (pos = len, i = 0; i < n; i++, pos++) {
            Py_ssize_t off = pos % CI;
            if (off == 0) {
                int32_t c = cs[ci++];
                C(h, P_C_FREE_REF) = W(h, (int64_t)c * CW);
                C(h, P_C_FREE_REFS) -= 1;
                W(h, (int64_t)c * CW) = -1;
                if (tail >= 0)
                    W(h, (int64_t)tail * CW) = c;
                else
                    TF(h, t, P_T_HEAD) = c;
                tail = c;
                TF(h, t, P_T_TAIL) = c;
            }
            W(h, (int64_t)tail * CW + 1 + off) = bs[i];
        }
        TF(h, t, P_T_LEN) = (int32_t)pos;        /* commit: the table holds them */
        TF(h, t, P_T_TOK) += (int32_t)tokens;
        h->c[CT] += tokens;
        result = PyLong_FromSsize_t(n);
    }
done:
    Py_DECREF(fast);
    if (bs != stack_b) {
        PyMem_Free(bs);
        PyMem_Free(cs);
    }
    if (result == Py_None)
        Py_INCREF(result);
    return result;
}

/* table_append(t, n, bs, now) -> the ids of the blocks the n new tokens land
 * in, or None (nothing changed).
 * tables.prepare_append's common case, with no copy-on-write: the blocks
 * still needed popped from the free list's front (uncached ones only: the
 * Python path evicts), appended to live table t's list, and the tokens
 * counted in the blocks they land in, the table and the pool. None when a
 * block the tokens land in is shared or published, free blocks or chunks
 * are short (the Python path reclaims or raises), or any index read is out
 * of range. Checked first: the tail, or when the tokens land in a chunk
 * before it the whole chain (each chunk in range, the last one the tail,
 * linking to -1); the ids the tokens land in; the free blocks and chunks
 * taken. */
static PyObject *
Hot_table_append(Hot *h, PyObject *args)
{
    Py_ssize_t t, n, bs, len, tok, first, needed, end, last, k, lo, need, nnew, i;
    double now;
    int32_t stack_c[64], stack_n[64], *cs = stack_c, *nbs = stack_n;
    PyObject *result = Py_None;

    if (!PyArg_ParseTuple(args, "nnnd", &t, &n, &bs, &now))
        return NULL;
    if (!hot_ready(h))
        return NULL;
    if (n <= 0 || bs <= 0 || bs > 65535 || !table_ops_on(h, t))
        Py_RETURN_NONE;
    len = TF(h, t, P_T_LEN);
    tok = TF(h, t, P_T_TOK);
    if (len < 0 || len > NCHUNKS(h) * CI || tok < 0 || n > INT32_MAX - tok)
        Py_RETURN_NONE;
    first = tok / bs;
    needed = (tok + n + bs - 1) / bs;
    last = needed - 1;
    end = len < needed ? len : needed;
    nnew = needed > len ? needed - len : 0;
    k = NCH_FOR(len);
    need = NCH_FOR(len + nnew) - k;
    if (nnew >= h->p[P_MAX_BLOCKS] || need > NCHUNKS(h))
        Py_RETURN_NONE;
    /* the chunks kept: from the one the first token lands in (or the tail)
     * on, at cs[j - lo]; then the new ones */
    lo = k ? (first / CI < k - 1 ? first / CI : k - 1) : 0;
    if (k - lo + need > 64 || nnew > 64) {
        cs = PyMem_Malloc((k - lo + need + 1) * sizeof(int32_t));
        nbs = PyMem_Malloc((nnew + 1) * sizeof(int32_t));
        if (!cs || !nbs) {
            PyMem_Free(cs);
            PyMem_Free(nbs);
            return PyErr_NoMemory();
        }
    }
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS], TAIL = HEAD + 1;
        const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
        const Py_ssize_t CT = ((HotX *)h)->c_tokens;
        int32_t c = TF(h, t, P_T_HEAD), b, tail;
        Py_ssize_t free = C(h, P_C_FREE_REFS), nfree = C(h, P_C_NUM_FREE), ci, pos;
        PyObject *ids;
        if (k && lo == k - 1) {
            /* the usual case: only the tail is read (as refs.table_word
             * reads it), so the cost does not grow with the table */
            c = TF(h, t, P_T_TAIL);
            if (!IS_CHUNK(h, c))
                goto done;
            cs[0] = c;
        }
        else {
            for (i = 0; i < k; i++) {
                if (!IS_CHUNK(h, c))
                    goto done;
                if (i >= lo)
                    cs[i - lo] = c;
                c = W(h, (int64_t)c * CW);
            }
            if (k && (c != -1 || cs[k - 1 - lo] != TF(h, t, P_T_TAIL)))
                goto done;
        }
        /* the blocks written into: private and unpublished, or the Python
         * path copies them first */
        for (i = first; i < end; i++) {
            b = W(h, (int64_t)cs[i / CI - lo] * CW + 1 + i % CI);
            if (!IS_BLOCK(h, b) || REF(h, b) > 1 || (FLAGS(h, b) & CACHED))
                goto done;
        }
        if (nfree < nnew || nfree >= h->p[P_MAX_BLOCKS] || free < need || free > NCHUNKS(h))
            goto done;
        b = NEXT(h, HEAD);
        for (i = 0; i < nnew; i++) {
            if (!IS_BLOCK(h, b) || (FLAGS(h, b) & CACHED))
                goto done;
            nbs[i] = b;
            b = NEXT(h, b);
        }
        if (!(IS_BLOCK(h, b) || b == TAIL))
            goto done;
        c = (int32_t)C(h, P_C_FREE_REF);
        for (i = 0; i < need; i++) {
            if (!IS_CHUNK(h, c) || W(h, (int64_t)c * CW + 1) != -1)
                goto done;
            cs[k - lo + i] = c;
            c = W(h, (int64_t)c * CW);
        }
        if (!(IS_CHUNK(h, c) || c == -1))
            goto done;
        /* the result, before anything changes (a MemoryError changes nothing) */
        ids = PyList_New(last - first + 1);
        for (i = first; ids && i <= last; i++) {
            PyObject *o = PyLong_FromLong(i < len ? W(h, (int64_t)cs[i / CI - lo] * CW + 1 + i % CI)
                                                  : nbs[i - len]);
            if (!o)
                Py_CLEAR(ids);
            else
                PyList_SET_ITEM(ids, i - first, o);
        }
        if (!ids) {
            result = NULL;
            goto done;
        }
        /* the writes, in prepare_append's order: the new blocks taken
         * (core._pop_free), appended (refs.table_extend: the length is the
         * commit point), then the token counts */
        for (i = 0; i < nnew; i++) {
            int32_t bb = nbs[i];
            PREV(h, bb) = -1;
            NEXT(h, bb) = -1;
            REF(h, bb) = 1;
            TOK(h, bb) = 0;
            LAST(h, bb) = (float)now;
            GEN(h, bb) += 1;
        }
        NEXT(h, HEAD) = b;
        PREV(h, b) = HEAD;
        C(h, P_C_NUM_FREE) -= nnew;
        tail = len ? TF(h, t, P_T_TAIL) : -1;
        for (ci = k - lo, pos = len, i = 0; i < nnew; i++, pos++) {
            Py_ssize_t off = pos % CI;
            if (off == 0) {
                c = cs[ci++];
                C(h, P_C_FREE_REF) = W(h, (int64_t)c * CW);
                C(h, P_C_FREE_REFS) -= 1;
                W(h, (int64_t)c * CW) = -1;
                if (tail >= 0)
                    W(h, (int64_t)tail * CW) = c;
                else
                    TF(h, t, P_T_HEAD) = c;
                tail = c;
                TF(h, t, P_T_TAIL) = c;
            }
            W(h, (int64_t)tail * CW + 1 + off) = nbs[i];
        }
        if (nnew)
            TF(h, t, P_T_LEN) = (int32_t)pos;    /* commit: the table holds them */
        for (i = first; i <= last; i++) {
            Py_ssize_t left = tok + n - i * bs;
            b = i < len ? W(h, (int64_t)cs[i / CI - lo] * CW + 1 + i % CI) : nbs[i - len];
            TOK(h, b) = (uint16_t)(left < bs ? left : bs);
        }
        TF(h, t, P_T_TOK) = (int32_t)(tok + n);
        h->c[CT] += n;
        result = ids;
    }
done:
    if (cs != stack_c) {
        PyMem_Free(cs);
        PyMem_Free(nbs);
    }
    if (result == Py_None)
        Py_INCREF(result);
    return result;
}

/* find_chain(hashes) -> the blocks of the longest cached run of hashes
 * from the first, or None (a probe met an entry out of range or went all
 * the way round: the Python path, index.PrefixIndex.find_chain, meets the
 * same and raises). Reads only; the caller holds the lock and counts the
 * hits. Each hash is 16 bytes (else None); its first 8, little-endian, are
 * its home slot; an entry matches when its block record holds the hash. */
static PyObject *
Hot_find_chain(Hot *h, PyObject *args)
{
    PyObject *seq, *fast, *out;
    Py_ssize_t n, i;
    if (!PyArg_ParseTuple(args, "O", &seq))
        return NULL;
    if (!hot_ready(h))
        return NULL;
    if (h->p[P_HASH_CAP] <= 0 || h->p[P_MAX_SLOTS] <= 0)
        Py_RETURN_NONE;
    fast = PySequence_Fast(seq, "hashes must be a sequence");
    if (!fast)
        return NULL;
    out = PyList_New(0);
    if (!out) {
        Py_DECREF(fast);
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(fast);
    {
        const uint64_t mask = (uint64_t)h->p[P_HASH_CAP] - 1;
        const int32_t *slots = (const int32_t *)(h->base + h->p[P_HASH_OFF]);
        const char *hb = h->base + h->p[P_BLOCKS_OFF] + h->p[P_B_HASH];
        for (i = 0; i < n; i++) {
            PyObject *o = PySequence_Fast_GET_ITEM(fast, i), *bo;
            const char *key;
            uint64_t home, j, probes;
            int32_t e = -1;
            if (!PyBytes_CheckExact(o) || PyBytes_GET_SIZE(o) != 16)
                goto refuse;
            key = PyBytes_AS_STRING(o);
            for (home = 0, j = 8; j-- > 0;)     /* its first 8 bytes, little-endian */
                home = home << 8 | (uint8_t)key[j];
            for (j = home & mask, probes = 0; probes <= mask; probes++, j = (j + 1) & mask) {
                e = slots[j];
                if (e < 0)
                    break;
                if (!IS_BLOCK(h, e))
                    goto refuse;
                if (!memcmp(hb + (int64_t)e * h->p[P_BLOCK_SIZE], key, 16))
                    break;
            }
            if (probes > mask)
                goto refuse;
            if (e < 0)
                break;
            bo = PyLong_FromLong(e);
            if (!bo || PyList_Append(out, bo) < 0) {
                Py_XDECREF(bo);
                Py_DECREF(out);
                Py_DECREF(fast);
                return NULL;
            }
            Py_DECREF(bo);
        }
    }
    Py_DECREF(fast);
    return out;
refuse:
    Py_DECREF(out);
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

/* table_new(raw, h, slot) -> the new table, or None (nothing changed).
 * core._new_table after the request id's key (raw bytes, 64-bit hash h,
 * refs.rid_key) is known: no live table may have it (the request-id index
 * probed from h's home slot: an entry's record holds raw, NUL-padded), the
 * lowest free table is taken, its record written, the entry put in the
 * first empty slot of the probe (where the probe stopped), then the state
 * set (the commit) and the table counter bumped. None when the id is
 * taken, no table is free, or the probe meets an entry out of range or
 * goes all the way round: the Python path raises. The caller holds the
 * lock. */
static PyObject *
Hot_table_new(Hot *h, PyObject *args)
{
    const char *raw;
    Py_ssize_t n, t, i, probes, mask;
    unsigned long long hash;
    int slot;
    int32_t *slots;

    if (!PyArg_ParseTuple(args, "y#Ki", &raw, &n, &hash, &slot))
        return NULL;
    if (!hot_ready(h))
        return NULL;
    if (NCHUNKS(h) <= 0 || h->p[P_MAX_TABLES] <= 0 || n <= 0 || n > h->p[P_RID_BYTES] ||
        memchr(raw, 0, n) || !held_here(h))
        Py_RETURN_NONE;
    mask = h->p[P_TINDEX_CAP] - 1;
    slots = (int32_t *)(h->base + h->p[P_TINDEX_OFF]);
    for (i = (Py_ssize_t)(hash & (uint64_t)mask), probes = 0; probes <= mask;
         probes++, i = (i + 1) & mask) {
        int32_t e = slots[i];
        const char *rid;
        if (e < 0)
            break;
        if (e >= h->p[P_MAX_TABLES])
            Py_RETURN_NONE;
        rid = h->base + h->p[P_TABLES_OFF] + (int64_t)e * h->p[P_TABLE_SIZE] + h->p[P_T_RID];
        if (!memcmp(rid, raw, n) && (n == h->p[P_RID_BYTES] || rid[n] == 0))
            Py_RETURN_NONE;                 /* taken (trailing NULs are padding) */
    }
    if (probes > mask)
        Py_RETURN_NONE;
    for (t = 0; t < h->p[P_MAX_TABLES] && TF(h, t, P_T_STATE) != 0; t++)
        ;
    if (t == h->p[P_MAX_TABLES])
        Py_RETURN_NONE;
    {
        char *rec = h->base + h->p[P_TABLES_OFF] + (int64_t)t * h->p[P_TABLE_SIZE];
        memcpy(rec + h->p[P_T_RID], raw, n);
        memset(rec + h->p[P_T_RID] + n, 0, h->p[P_RID_BYTES] - n);
        memcpy(rec + h->p[P_T_RHASH], &hash, 8);
        TF(h, t, P_T_OWNER) = slot;
        TF(h, t, P_T_HEAD) = -1;
        TF(h, t, P_T_TAIL) = -1;
        TF(h, t, P_T_LEN) = 0;
        TF(h, t, P_T_TOK) = 0;
        slots[i] = (int32_t)t;
        TF(h, t, P_T_STATE) = 1;            /* commit */
        C(h, P_C_NUM_TABLES) += 1;
    }
    return PyLong_FromSsize_t(t);
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
