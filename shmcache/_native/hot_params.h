/* shmcache/_native/hot_params.h: the pool as the core of shmcache._hot sees
 * it (HotCore: the mapping and the offsets of every field the core touches),
 * the accessors over it, and hot_open()/hot_set_chunks(), which check those
 * offsets against the mapping. Included by the other hot_*.h headers and by
 * hot.cpp, the binding.
 *
 * The hot_*.h headers are the core: plain C/C++ over pointers and integers,
 * no Python (each compiles on its own, tests/test_native_headers.py). Their
 * operations return codes, and write their results to the caller's
 * buffers: HOT_SLOW (-1) means "nothing changed, take the slow path" (the
 * binding returns None and the Python path runs), HOT_NOMEM (-2) that a
 * scratch buffer could not be allocated (the binding raises MemoryError);
 * the mutex calls return errno values.
 *
 * HotCore is filled by the binding from a writable buffer over the pool's
 * mapping and the parameters (a tuple of ints, layout.HOT_PARAMS in its
 * order, indexed by hot_params_gen.h's P_ enum): the offsets of the mutex,
 * the counters and every field the fused ops touch, the record sizes and
 * the counts; hot_set_chunks() adds the chunk count, which turns the fused
 * ops on.
 */
#ifndef SHMCACHE_HOT_PARAMS_H
#define SHMCACHE_HOT_PARAMS_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

/* What the core's operations return besides their results. */
#define HOT_SLOW (-1)       /* nothing changed: the slow path runs */
#define HOT_NOMEM (-2)      /* nothing changed: no memory for a scratch buffer */
#define HOT_REFUSED (-3)    /* nothing changed: the caller refused the result */
#define HOT_BUSY (-4)       /* nothing changed: the lock stayed busy through the spin */

/* The parameters Hot() takes (a tuple of ints) are the rows of layout.py's
 * HOT_PARAMS, in its order: hot_params_gen.h, generated from that table,
 * names their indices (P_<NAME>) and their count (P_COUNT). */
#include "hot_params_gen.h"

/* The chunk area (P_REFS_OFF, P_CHUNK_RECORD_BYTES bytes a chunk) is seen
 * as int32 words: chunk c is words [c*CW, c*CW + CW), word 0 its link, then
 * CI block ids. A slot's loose list: P_S_HEAD is its first chunk, the
 * partly filled one with ((count - 1) % CI) + 1 ids; the chunks it links to
 * are full (see refs.py). A table's list runs the other way: P_T_HEAD its first,
 * full chunk, P_T_TAIL the partly filled last one. The process-local map
 * holds, for each block, the words of its loose ids. */
#define CI 15
#define CW 16

/* Invariant: base is the mapping's first byte, len its size, and mutex and
 * c point into it; every offset in p that hot_open checks lies inside it.
 * nchunks is 0 (the fused ops off) until hot_set_chunks() checked that the
 * chunks fit the mapping; gen_off and c_tokens are -1 until then. */
typedef struct {
    char *base;
    int64_t len;
    pthread_mutex_t *mutex;
    int64_t *c;
    int64_t p[P_COUNT];
    double created_at;
    int64_t nchunks;        /* chunk ids the fused ops accept: [0, nchunks) */
    int64_t gen_off;        /* byte offset of a block record's generation (-1: off) */
    int64_t c_tokens;       /* counter index of the seed's total_tokens_cached (-1: off) */
    int64_t turn;           /* the lock holder's turn (hot_enter.h's take_turn), -1: none */
    int64_t turn_wait_ns;   /* how long the last take_turn waited for its turn */
    int log_holds;          /* time the fused ops' holds (tools/bench/scale --steps) */
    int64_t hold_start;     /* when the current hold began (log_holds) */
    int64_t holds, held_ns; /* the holds timed, and their total */
    /* log_holds == 2 also traces each hold (tools/bench/scale --trace; see
     * hot_mutex.h's trace_hold) into a buffer of trace_cap words the
     * binding owns */
    int64_t *trace;
    int64_t trace_n, trace_cap;
    int64_t asked, turned;  /* when the current fused op asked for the lock, got its turn */
    int64_t claimed;        /* the table whose claim the current fused op took (-1: none) */
} HotCore;

/* The first byte of block record b, slot record s, table record t. */
#define BLOCK_REC(h, b) \
    ((h)->base + (h)->p[P_BLOCKS_OFF] + (int64_t)(b) * (h)->p[P_BLOCK_RECORD_BYTES])
#define SLOT_REC(h, s) \
    ((h)->base + (h)->p[P_SLOTS_OFF] + (int64_t)(s) * (h)->p[P_SLOT_RECORD_BYTES])
#define TABLE_REC(h, t) \
    ((h)->base + (h)->p[P_TABLES_OFF] + (int64_t)(t) * (h)->p[P_TABLE_RECORD_BYTES])

#define BF(h, b, f, T) (*(T *)(BLOCK_REC(h, b) + (h)->p[f]))
#define REF(h, b) BF(h, b, P_B_REF, int32_t)
#define PREV(h, b) BF(h, b, P_B_PREV, int32_t)
#define NEXT(h, b) BF(h, b, P_B_NEXT, int32_t)
#define FLAGS(h, b) BF(h, b, P_B_FLAGS, uint16_t)
#define TOK(h, b) BF(h, b, P_B_TOK, uint16_t)
#define LAST(h, b) BF(h, b, P_B_LAST, float)
#define TF(h, t, f) (*(int32_t *)(TABLE_REC(h, t) + (h)->p[f]))
#define SF(h, s, f) (*(int32_t *)(SLOT_REC(h, s) + (h)->p[f]))
#define C(h, i) ((h)->c[(h)->p[i]])

#define NCHUNKS(h) ((h)->nchunks)
#define IS_BLOCK(h, b) ((b) >= 1 && (b) < (h)->p[P_MAX_BLOCKS])
#define IS_CHUNK(h, c) ((c) >= 0 && (c) < NCHUNKS(h))
#define W(h, g) (((int32_t *)((h)->base + (h)->p[P_REFS_OFF]))[g])
#define GEN(h, b) (*(uint32_t *)(BLOCK_REC(h, b) + (h)->gen_off))
#define NCH_FOR(n) (((n) + CI - 1) / CI)

/* The marks a block's prev carries while slot s holds it as a loose
 * reference (layout.py): allocated loose (held), or in s's reserve (stash). */
#define STASH_MARK(s) (-2 - (int32_t)(s))
#define HELD_MARK(h, s) (-2 - (int32_t)(h)->p[P_MAX_SLOTS] - (int32_t)(s))

/* Put block b, whose last reference is gone, on the free list (lock held,
 * b unlinked): a cached block at the back, evicted last; an uncached one at
 * the front, reused first (freelist.py's push_back / push_front). */
static inline void
free_list_put(HotCore *h, int32_t b, int cached)
{
    const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS], TAIL = HEAD + 1;
    if (cached) {
        int32_t lb = PREV(h, TAIL);
        NEXT(h, lb) = b;
        PREV(h, b) = lb;
        NEXT(h, b) = TAIL;
        PREV(h, TAIL) = b;
    }
    else {
        int32_t first = NEXT(h, HEAD);
        PREV(h, first) = b;
        NEXT(h, b) = first;
        PREV(h, b) = HEAD;
        NEXT(h, HEAD) = b;
    }
}

/* Write id at position pos of table t's list, whose last chunk is *tail
 * (-1: none yet), taking the next chunk of cs (*ci) from the free chunk
 * list's front when pos starts a new one (refs.table_extend's steps; lock
 * held, the chunks checked by the caller). */
static inline void
chain_put(HotCore *h, int64_t t, int64_t pos, int32_t id, int32_t *tail, const int32_t *cs,
          int64_t *ci)
{
    int64_t off = pos % CI;
    if (off == 0) {
        int32_t c = cs[(*ci)++];
        C(h, P_C_FREE_REF) = W(h, (int64_t)c * CW);
        C(h, P_C_FREE_REFS) -= 1;
        W(h, (int64_t)c * CW) = -1;
        if (*tail >= 0)
            W(h, (int64_t)*tail * CW) = c;
        else
            TF(h, t, P_T_HEAD) = c;
        *tail = c;
        TF(h, t, P_T_TAIL) = c;
    }
    W(h, (int64_t)*tail * CW + 1 + off) = id;
}

/* View the mapping (buf, len bytes, writable) through the P_COUNT offsets
 * of params: NULL, or why not (the binding raises ValueError with it; h is
 * then not to be used). The fused ops stay off until hot_set_chunks(). */
static inline const char *
hot_open(HotCore *h, void *buf, int64_t len, const int64_t *params, double created_at)
{
    const int64_t *p = params;
    for (int i = 0; i < P_COUNT; i++)
        h->p[i] = p[i];
    /* the counters (64 int64) are written when a dead holder is found */
    if (len < p[P_MUTEX_OFF] + (int64_t)sizeof(pthread_mutex_t) ||
        len < p[P_COUNTERS_OFF] + 64 * 8)
        return "buffer too small for the pool mutex and counters";
    /* the fused ops index blocks (with the two sentinels) and slots: those
     * arrays must lie inside the mapping */
    if (p[P_MAX_SLOTS] > 0 &&
        (p[P_MAX_BLOCKS] < 1 || p[P_BLOCKS_OFF] < 0 || p[P_SLOTS_OFF] < 0 ||
         p[P_BLOCKS_OFF] + (p[P_MAX_BLOCKS] + 2) * p[P_BLOCK_RECORD_BYTES] > len ||
         p[P_SLOTS_OFF] + p[P_MAX_SLOTS] * p[P_SLOT_RECORD_BYTES] > len))
        return "buffer too small for the pool's blocks and slots";
    if (p[P_MAX_SLOTS] > 0 &&
        (p[P_S_RESERVED] < 0 || p[P_S_RESERVED] + 4 > p[P_SLOT_RECORD_BYTES]))
        return "a slot's reserve count lies outside its record";
    /* find_chain indexes the prefix index (a power of two of int32 slots) */
    if (p[P_HASH_CAP] > 0 &&
        ((p[P_HASH_CAP] & (p[P_HASH_CAP] - 1)) || p[P_HASH_OFF] < 0 ||
         p[P_B_HASH] < 0 || p[P_B_HASH] + 16 > p[P_BLOCK_RECORD_BYTES] ||
         p[P_HASH_OFF] + p[P_HASH_CAP] * 4 > len))
        return "buffer too small for the pool's prefix index";
    /* the table ops index table records, and the request-id index (a power
     * of two of int32 slots) */
    if (p[P_MAX_TABLES] > 0 &&
        (p[P_TABLES_OFF] < 0 || p[P_TABLE_RECORD_BYTES] < 4 ||
         p[P_TABLES_OFF] + p[P_MAX_TABLES] * p[P_TABLE_RECORD_BYTES] > len ||
         p[P_TINDEX_CAP] <= 0 || (p[P_TINDEX_CAP] & (p[P_TINDEX_CAP] - 1)) ||
         p[P_TINDEX_OFF] < 0 ||
         p[P_TINDEX_OFF] + p[P_TINDEX_CAP] * 4 > len ||
         p[P_RID_BYTES] <= 0 || p[P_T_RID] < 0 ||
         p[P_T_RID] + p[P_RID_BYTES] > p[P_TABLE_RECORD_BYTES] ||
         p[P_T_RHASH] < 0 || p[P_T_RHASH] + 8 > p[P_TABLE_RECORD_BYTES] ||
         p[P_T_CLAIM] < 0 || p[P_T_CLAIM] + 4 > p[P_TABLE_RECORD_BYTES]))
        return "buffer too small for the pool's tables";
    h->base = (char *)buf;
    h->len = len;
    h->mutex = (pthread_mutex_t *)(h->base + p[P_MUTEX_OFF]);
    h->c = (int64_t *)(h->base + p[P_COUNTERS_OFF]);
    h->created_at = created_at;
    /* the fused ops stay off until hot_set_chunks() says what they need */
    h->nchunks = 0;
    h->gen_off = -1;
    h->c_tokens = -1;
    h->turn = -1;
    h->turn_wait_ns = 0;
    h->log_holds = 0;
    h->hold_start = h->holds = h->held_ns = 0;
    h->trace = NULL;
    h->trace_n = h->trace_cap = h->asked = h->turned = 0;
    h->claimed = -1;
    return NULL;
}

/* The most chunks that fit between the chunks' offset and the end of the
 * mapping (0 when the fused ops are off, or the record size is not a
 * chunk's). */
static inline int64_t
hot_chunks_room(const HotCore *h)
{
    if (h->p[P_MAX_SLOTS] <= 0 || h->p[P_CHUNK_RECORD_BYTES] != CW * 4 ||
        h->p[P_REFS_OFF] <= 0 || h->p[P_REFS_OFF] >= h->len)
        return 0;
    return (h->len - h->p[P_REFS_OFF]) / h->p[P_CHUNK_RECORD_BYTES];
}

/* set_chunks(nchunks): the pool's chunk count (at most what fits the
 * mapping, hot_chunks_room); it turns the fused ops on, with a block
 * record's generation (P_B_GEN) and the counter of the seed's token count
 * (P_C_TOKENS). 0; -1 (nothing set) when the chunks do not fit, -2 for a
 * bad offset or counter. */
static inline int
hot_set_chunks(HotCore *h, int64_t n)
{
    const int64_t gen_off = h->p[P_B_GEN], c_tokens = h->p[P_C_TOKENS];
    if (n < 0 || n > hot_chunks_room(h))
        return -1;
    if (gen_off < 0 || gen_off + 4 > h->p[P_BLOCK_RECORD_BYTES] ||
        c_tokens < 0 || c_tokens >= 64)
        return -2;
    h->nchunks = n;
    h->gen_off = gen_off;
    h->c_tokens = c_tokens;
    return 0;
}

/* Whether v is a block id the fused ops accept: in [1, max_blocks). */
static inline int
hot_is_block(const HotCore *h, long long v)
{
    return IS_BLOCK(h, v);
}

/* qsort order of block ids (free and table_drop count repeated ids). */
static inline int
cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

#endif
