/* shmcache/_native/hot_loose.h: the two operations a scheduler calls on
 * every step, in C: alloc() (allocate blocks as loose references of the
 * caller's slot) and free() (release a batch of them). Included by hot.c.
 *
 * They do exactly what shmcache/fastpath.py does (which stays as the
 * reference, and the path taken where this module is not loaded), plus
 * taking and leaving the lock (hot_mutex.h), in one call: in Python a call
 * costs as much as the work. They only ever *try* the lock: holding the GIL
 * while waiting for a lock that another thread of this process holds would
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
 */
#ifndef SHMCACHE_HOT_LOOSE_H
#define SHMCACHE_HOT_LOOSE_H

#include "hot_mutex.h"     /* first: it includes Python.h */
#include "hot_localmap.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* alloc(n, slot, epoch, loose) -> list of n block ids, or None.
 * loose is the manager's LooseMap array (hot_localmap.h).
 * The first n free blocks must be uncached (otherwise None: the slow path
 * evicts their cache entries), and the chunks the slot's loose list grows
 * by free (otherwise None: the slow path reports it).
 * NOTE: the shared update is pure C and cannot fail, and neither can the
 * process-local map's, done after the lock is released (only this thread
 * can see the map: we hold the GIL). Only building the returned list can
 * (MemoryError); the caller then rebuilds the map from the slot's list. */
static HOT_UNUSED PyObject *
Hot_alloc(Hot *h, PyObject *args)
{
    Py_ssize_t n, i;
    int slot;
    long long epoch;
    Py_buffer lv;
    LMap lm;
    PyObject *ids = NULL;
    int32_t stack_b[64], stack_c[8], *bs = stack_b, *cs = stack_c;
    int64_t stack_g[64], *gs = stack_g;

    if (!PyArg_ParseTuple(args, "niLw*", &n, &slot, &epoch, &lv))
        return NULL;
    if (!hot_ready(h)) {
        PyBuffer_Release(&lv);
        return NULL;
    }
    /* (more than the pool has: the slow path raises, before any allocation) */
    if (n <= 0 || n >= h->p[P_MAX_BLOCKS] || slot < 0 || slot >= h->p[P_MAX_SLOTS] ||
        NCHUNKS(h) <= 0) {
        PyBuffer_Release(&lv);
        Py_RETURN_NONE;
    }
    if (lm_open(h, &lv, &lm) < 0) {
        PyBuffer_Release(&lv);
        return NULL;
    }
    if (n > 64) {
        bs = PyMem_Malloc(n * sizeof(int32_t));
        gs = PyMem_Malloc(n * sizeof(int64_t));
        cs = PyMem_Malloc((n / CI + 2) * sizeof(int32_t));
        if (!bs || !gs || !cs) {
            PyMem_Free(bs);
            PyMem_Free(gs);
            PyMem_Free(cs);
            PyBuffer_Release(&lv);
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
    for (i = 0; i < n; i++)
        lm_push(&lm, bs[i], gs[i]);
    ids = PyList_New(n);
    for (i = 0; ids && i < n; i++) {
        PyObject *bo = PyLong_FromLong(bs[i]);
        if (!bo)
            Py_CLEAR(ids);
        else
            PyList_SET_ITEM(ids, i, bo);
    }
    if (!ids) {
        PyErr_Clear();
        PyErr_SetString(PyExc_MemoryError, "loose-reference map must be resynced");
    }
    goto done;
busy:
    ids = Py_None;
    Py_INCREF(ids);
done:
    if (bs != stack_b) {
        PyMem_Free(bs);
        PyMem_Free(gs);
        PyMem_Free(cs);
    }
    PyBuffer_Release(&lv);
    return ids;
}

/* free(ids, slot, epoch, loose) -> number of blocks that became free, or
 * None (nothing changed) when an id is not an int in [1, max_blocks), is
 * not held loose by this slot as many times as listed, or the lock is busy:
 * the slow path then raises the precise error or waits. */
static HOT_UNUSED PyObject *
Hot_free(Hot *h, PyObject *args)
{
    PyObject *seq, *fast = NULL, *result = NULL;
    Py_buffer lv;
    LMap lm;
    int slot;
    long long epoch;
    int32_t stack_b[64], stack_s[64], *bs = stack_b, *sorted = stack_s;
    Py_ssize_t n, i, freed = 0;
    int ok = 1;

    if (!PyArg_ParseTuple(args, "OiLw*", &seq, &slot, &epoch, &lv))
        return NULL;
    if (!hot_ready(h))
        goto fail;
    if (slot < 0 || slot >= h->p[P_MAX_SLOTS] || NCHUNKS(h) <= 0)
        goto busy;
    if (lm_open(h, &lv, &lm) < 0)
        goto fail;
    fast = PySequence_Fast(seq, "ids must be a sequence");
    if (!fast)
        goto fail;
    n = PySequence_Fast_GET_SIZE(fast);
    if (n == 0) {
        result = PyLong_FromLong(0);
        goto done;
    }
    if (n > 64) {
        bs = PyMem_Malloc(n * sizeof(int32_t));
        sorted = PyMem_Malloc(n * sizeof(int32_t));
        if (!bs || !sorted) {
            PyErr_NoMemory();
            goto fail;
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
    memcpy(sorted, bs, n * sizeof(int32_t));
    if (n > 1)
        qsort(sorted, n, sizeof(int32_t), cmp_i32);
    if (!lm_holds(&lm, sorted, n) || enter(h, epoch, slot) < 0)
        goto busy;
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS], TAIL = HEAD + 1;
        const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
        const int64_t NW = (int64_t)NCHUNKS(h) * CW;
        const Py_ssize_t CT = ((HotX *)h)->c_tokens;
        int corrupt = 0;
        begin_update(h);
        for (i = 0; i < n; i++) {
            int32_t b = bs[i], hd = SF(h, slot, P_S_HEAD), cnt = SF(h, slot, P_S_COUNT);
            int32_t bl = 0, x, nb, nh = -1;
            int64_t last, g;
            int cached = (FLAGS(h, b) & CACHED) != 0, empty;
            /* checks first: every index read from shared memory in range,
             * and the map agreeing with the slot's list; then the change
             * (the count was checked above, and only this loop lowers it) */
            g = lm_top(&lm, b);
            if (cnt < 1 || !IS_CHUNK(h, hd) || g < 0 || g >= NW || g % CW == 0 || W(h, g) != b) {
                corrupt = 1;
                break;
            }
            last = (int64_t)hd * CW + 1 + (cnt - 1) % CI;
            if (g != last) {
                bl = W(h, last);
                if (!lm_has_word(&lm, bl, last)) {
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
            lm_pop(&lm, b);
            if (g != last) {
                /* move the newest id into g, then drop the newest: O(1) removal */
                W(h, g) = bl;
                lm_move(&lm, bl, last, g);
            }
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
    }
    result = PyLong_FromSsize_t(freed);
    goto done;
busy:
    result = Py_None;
    Py_INCREF(result);
fail:
done:
    Py_XDECREF(fast);
    if (sorted != stack_s)
        PyMem_Free(sorted);
    if (bs != stack_b)
        PyMem_Free(bs);
    PyBuffer_Release(&lv);
    return result;
}

#endif
