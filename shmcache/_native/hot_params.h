/* shmcache/_native/hot_params.h: the Hot object's layout, and how the C paths
 * of shmcache._hot reach the pool's fields through it. Included by the other
 * hot_*.h headers (and so by hot.c, their one translation unit); it includes
 * Python.h itself, first, so that it also compiles on its own.
 *
 * Hot is the Python object: a writable buffer over the pool's mapping and
 * the offsets (a tuple of ints, in the order of the P_ enum) of the mutex,
 * the counters and every field the fused ops touch (see layout.py). HotX
 * adds what set_chunks() gives (hot.c).
 *
 * Every function of these headers is static: they form one translation
 * unit. HOT_UNUSED marks them so that a header compiled on its own (where
 * nothing calls them) raises no -Wunused-function warning.
 */
#ifndef SHMCACHE_HOT_PARAMS_H
#define SHMCACHE_HOT_PARAMS_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>     /* before any system header, as Python requires */

#include <pthread.h>
#include <stdint.h>

#define HOT_UNUSED __attribute__((unused))

/* The parameters Hot() takes, in this order (a tuple of ints). */
enum {
    P_MUTEX_OFF, P_COUNTERS_OFF,
    P_BLOCKS_OFF, P_BLOCK_SIZE, P_B_REF, P_B_PREV, P_B_NEXT, P_B_FLAGS, P_B_TOK, P_B_LAST,
    P_REFS_OFF, P_REF_SIZE, P_R_BLOCK, P_R_NEXT,
    P_SLOTS_OFF, P_SLOT_SIZE, P_S_HEAD, P_S_COUNT,
    P_MAX_BLOCKS, P_MAX_SLOTS, P_FLAG_CACHED,
    P_C_DIRTY, P_C_NUM_FREE, P_C_FREE_REF, P_C_FREE_REFS, P_C_OPS, P_C_EPOCH, P_C_HOLDER,
    P_TABLES_OFF, P_TABLE_SIZE, P_T_STATE, P_T_HEAD, P_T_TAIL, P_T_LEN, P_T_TOK,
    P_MAX_TABLES, P_C_NUM_TABLES, P_HASH_OFF, P_HASH_CAP, P_B_HASH,
    P_TINDEX_OFF, P_TINDEX_CAP, P_T_RID, P_RID_BYTES, P_T_RHASH, P_T_OWNER,
    P_COUNT
};

/* Invariant: while has_view, base is the mapping's first byte and mutex and
 * c point into it; every offset in p that Hot_init checks lies inside it. */
typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    char *base;
    pthread_mutex_t *mutex;
    int64_t *c;
    Py_ssize_t p[P_COUNT];
    double created_at;
} Hot;

#define BF(h, b, f, T) (*(T *)((h)->base + (h)->p[P_BLOCKS_OFF] + (int64_t)(b) * (h)->p[P_BLOCK_SIZE] + (h)->p[f]))
#define REF(h, b) BF(h, b, P_B_REF, int32_t)
#define PREV(h, b) BF(h, b, P_B_PREV, int32_t)
#define NEXT(h, b) BF(h, b, P_B_NEXT, int32_t)
#define FLAGS(h, b) BF(h, b, P_B_FLAGS, uint16_t)
#define TOK(h, b) BF(h, b, P_B_TOK, uint16_t)
#define LAST(h, b) BF(h, b, P_B_LAST, float)
#define RF(h, r, f) (*(int32_t *)((h)->base + (h)->p[P_REFS_OFF] + (int64_t)(r) * (h)->p[P_REF_SIZE] + (h)->p[f]))
#define RBLOCK(h, r) RF(h, r, P_R_BLOCK)
#define RNEXT(h, r) RF(h, r, P_R_NEXT)
#define TF(h, t, f) (*(int32_t *)((h)->base + (h)->p[P_TABLES_OFF] + (int64_t)(t) * (h)->p[P_TABLE_SIZE] + (h)->p[f]))
#define SF(h, s, f) (*(int32_t *)((h)->base + (h)->p[P_SLOTS_OFF] + (int64_t)(s) * (h)->p[P_SLOT_SIZE] + (h)->p[f]))
#define C(h, i) ((h)->c[(h)->p[i]])

/* The Hot object, with what the fused ops need beyond the parameters
 * (set_chunks): how many reference chunks there are, where a block record
 * keeps its generation, and the seed's token counter.
 *
 * The chunk area (P_REFS_OFF, P_REF_SIZE bytes a chunk) is seen as int32
 * words: chunk c is words [c*CW, c*CW + CW), word 0 its link, then CI block
 * ids. A slot's loose list: P_S_HEAD is its first chunk, the partly filled
 * one with ((count - 1) % CI) + 1 ids; the chunks it links to are full
 * (see refs.py). A table's list runs the other way: P_T_HEAD its first,
 * full chunk, P_T_TAIL the partly filled last one. The process-local map
 * holds, for each block, the words of its loose ids.
 *
 * Invariant: nchunks is 0 (the fused ops off) until set_chunks() checked
 * that the chunks fit the mapping; gen_off and c_tokens are -1 until then. */
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

static HOT_UNUSED int
hot_ready(Hot *h)
{
    if (!h->has_view) {
        PyErr_SetString(PyExc_ValueError, "pool mapping already released");
        return 0;
    }
    return 1;
}

/* qsort order of block ids (free and table_drop count repeated ids). */
static HOT_UNUSED int
cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

#endif
