/* shmcache/_native/hot_localmap.h: the process-local map of a slot's loose
 * references, as alloc() and free() (hot_loose.h) read and extend it.
 *
 * The map is a dict owned by the manager (refs.py): block id -> list of the
 * chunk-area words (ints) where this slot's loose list names that block,
 * one per reference held. It is this process's alone, so it is read and
 * written without the pool lock (with the GIL held); the slot's list in
 * shared memory is the truth, and a caller that gets MemoryError from a
 * fused op rebuilds the map from it.
 */
#ifndef SHMCACHE_HOT_LOCALMAP_H
#define SHMCACHE_HOT_LOCALMAP_H

#include "hot_params.h"    /* first: it includes Python.h */

#include <stdint.h>

/* Record, in the process-local map, that this slot now holds bs[i] at
 * word rs[i]; returns the list of block ids, or NULL (MemoryError). */
static HOT_UNUSED PyObject *
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

/* Whether the map holds each id of sorted (n ids, ascending) at least as
 * many times as it is listed: 1 yes, 0 no, -1 an error is set. */
static HOT_UNUSED int
local_map_holds(PyObject *loose, const int32_t *sorted, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t j = i;
        PyObject *key, *lst;
        while (j < n && sorted[j] == sorted[i])
            j++;
        key = PyLong_FromLong(sorted[i]);
        if (!key)
            return -1;
        lst = PyDict_GetItemWithError(loose, key);
        Py_DECREF(key);
        if (!lst && PyErr_Occurred())
            return -1;
        if (!lst || !PyList_CheckExact(lst) || PyList_GET_SIZE(lst) < j - i)
            return 0;
        i = j;
    }
    return 1;
}

#endif
