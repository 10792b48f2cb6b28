/* shmcache/_native/hot_append.h: the table ops that grow a live table's
 * list, in C: table_take() (a cached prefix taken into the table, the
 * table branch of prefix.acquire_computed_blocks) and table_append()
 * (tables.prepare_append without copy-on-write). Included by hot.c.
 *
 * Both run inside the caller's lock hold and check everything before their
 * first write, as hot_tables.h says; both take new chunks for the list from
 * the free chunk list's front, as refs.table_extend does.
 */
#ifndef SHMCACHE_HOT_APPEND_H
#define SHMCACHE_HOT_APPEND_H

#include "hot_tables.h"    /* first: it includes Python.h */

#include <stdint.h>

/* Block ids (ints in [1, max_blocks)) of a sequence, into bs (n of them). */
static HOT_UNUSED int
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

/* table_take(t, ids, now, tokens) -> len(ids), or None (nothing changed).
 * The table branch of prefix.acquire_computed_blocks after its lookup: a
 * reference on each block of ids (taking a free one out of the free list),
 * its last access set to now, the ids appended to live table t's list
 * (refs.table_extend: new chunks from the free chunk list, the length the
 * commit point), and tokens added to the table's and the pool's token
 * counts. Checked first: the ids, the table's tail, enough free chunks
 * (each one free, its link in range), and the free-list links of every
 * free block in ids. */
static HOT_UNUSED PyObject *
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
static HOT_UNUSED PyObject *
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

#endif
