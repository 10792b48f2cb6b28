/* shmcache/_native/hot_index.h: the prefix lookup, find_chain(), in C: the
 * read-only probe of the pool's prefix index behind prefix.py's lookups
 * (index.PrefixIndex.find_chain is the reference). Included by hot.c.
 *
 * Like the table ops (hot_tables.h) it runs inside a lock hold the caller
 * took, and returns None where the Python path would raise.
 */
#ifndef SHMCACHE_HOT_INDEX_H
#define SHMCACHE_HOT_INDEX_H

#include "hot_params.h"    /* first: it includes Python.h */

#include <stdint.h>
#include <string.h>

/* find_chain(hashes) -> the blocks of the longest cached run of hashes
 * from the first, or None (a probe met an entry out of range or went all
 * the way round: the Python path, index.PrefixIndex.find_chain, meets the
 * same and raises). Reads only; the caller holds the lock and counts the
 * hits. Each hash is 16 bytes (else None); its first 8, little-endian, are
 * its home slot; an entry matches when its block record holds the hash. */
static HOT_UNUSED PyObject *
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

#endif
