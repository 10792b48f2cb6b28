/* shmcache/_native/hot_tables.h: the table ops that create and delete a
 * block table, in C: table_new() (core._new_table after the request id's
 * key is known) and table_drop() (tables.delete_block_table's release), and
 * the checks every lock-held table op starts with. Included by hot.cpp,
 * and by hot_append.h (the ops that grow a table's list).
 *
 * The table ops, and find_chain() (hot_index.h), run inside a lock hold the
 * caller (PoolLock) took: the pool is marked dirty for the whole hold, so a
 * holder killed at any instruction leaves a pool the next holder repairs,
 * and the caller has synced its view. They check first (every index read
 * from shared memory in range) and return HOT_SLOW having changed nothing
 * when anything is off (the binding returns None); the Python path then
 * raises, or repairs, exactly as it would have. Once the checks pass the
 * writes cannot fail.
 */
#ifndef SHMCACHE_HOT_TABLES_H
#define SHMCACHE_HOT_TABLES_H

#include "hot_claim.h"
#include "hot_enter.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The fused ops are on, t is a live table, this thread holds the lock and
 * the hold has the table's claim (hot_claim.h). */
static inline int
hot_table_ops_on(const HotCore *h, int64_t t)
{
    return NCHUNKS(h) > 0 && h->c_tokens >= 0 && h->p[P_MAX_TABLES] > 0 &&
           t >= 0 && t < h->p[P_MAX_TABLES] && TF(h, t, P_T_STATE) == 1 &&
           TF(h, t, P_T_CLAIM) == -1 && held_here(h);
}

/* table_new(raw, hash, slot): the new table, or HOT_SLOW (nothing changed).
 * core._new_table after the request id's key (raw: n bytes, 64-bit hash,
 * refs.rid_key) is known: no live table may have it (the request-id index
 * probed from hash's home slot: an entry's record holds raw, NUL-padded),
 * the lowest free table is taken, its record written, the entry put in the
 * first empty slot of the probe (where the probe stopped), then the state
 * set (the commit) and the table counter bumped. HOT_SLOW when the id is
 * taken, no table is free, or the probe meets an entry out of range or
 * goes all the way round: the Python path raises. The caller holds the
 * lock. */
static inline int64_t
hot_table_new(HotCore *h, const char *raw, int64_t n, uint64_t hash, int slot)
{
    int64_t t, i, probes, mask;
    int32_t *slots;

    if (NCHUNKS(h) <= 0 || h->p[P_MAX_TABLES] <= 0 || n <= 0 || n > h->p[P_RID_BYTES] ||
        memchr(raw, 0, n) || !held_here(h))
        return HOT_SLOW;
    mask = h->p[P_TINDEX_CAP] - 1;
    slots = (int32_t *)(h->base + h->p[P_TINDEX_OFF]);
    for (i = (int64_t)(hash & (uint64_t)mask), probes = 0; probes <= mask;
         probes++, i = (i + 1) & mask) {
        int32_t e = slots[i];
        const char *rid;
        if (e < 0)
            break;
        if (e >= h->p[P_MAX_TABLES])
            return HOT_SLOW;
        rid = TABLE_REC(h, e) + h->p[P_T_RID];
        if (!memcmp(rid, raw, n) && (n == h->p[P_RID_BYTES] || rid[n] == 0))
            return HOT_SLOW;                /* taken (trailing NULs are padding) */
    }
    if (probes > mask)
        return HOT_SLOW;
    /* (a free record whose claim is not 0 is skipped: a stale append's
     * probe, for a moment, or a dead one's, until recovery) */
    for (t = 0; t < h->p[P_MAX_TABLES] &&
                (TF(h, t, P_T_STATE) != 0 || __atomic_load_n(&TF(h, t, P_T_CLAIM), __ATOMIC_ACQUIRE));
         t++)
        ;
    if (t == h->p[P_MAX_TABLES])
        return HOT_SLOW;
    {
        char *rec = TABLE_REC(h, t);
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
    return t;
}

/* table_drop(t): references released, or HOT_SLOW (nothing changed), or
 * HOT_NOMEM (nothing changed).
 * Live table t's list emptied and its references released last block
 * first, as tables.delete_block_table does with refs.pop_table and
 * reclaim.release_block; the table's state and the table counter too
 * (refs.unlink_table), but not the request-id index: the caller removes
 * the entry in the same hold. Checked first: the chain (each chunk in
 * range, the last linking to -1, so no cycle), every id a block, every
 * block's ref_count at least the ids naming it, and the free list's ends. */
static inline int64_t
hot_table_drop(HotCore *h, int64_t t)
{
    int64_t i, k, len, result = HOT_SLOW;
    int32_t stack_b[256], stack_c[32], *bs = stack_b, *cs = stack_c, *sorted = NULL;

    if (!hot_table_ops_on(h, t))
        return HOT_SLOW;
    len = TF(h, t, P_T_LEN);
    k = NCH_FOR(len);
    if (len < 0 || k > NCHUNKS(h))
        return HOT_SLOW;
    if (len > 128) {
        bs = (int32_t *)malloc(2 * len * sizeof(int32_t));
        cs = (int32_t *)malloc((k + 1) * sizeof(int32_t));
        if (!bs || !cs) {
            free(bs);
            free(cs);
            return HOT_NOMEM;
        }
    }
    sorted = bs + len;
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS], TAIL = HEAD + 1;
        const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
        const int64_t CT = h->c_tokens;
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
            int64_t j = i;
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
            if (TOK(h, b))      /* as free_block (atomic: hot_claim.h) */
                __atomic_fetch_sub(&h->c[CT], TOK(h, b), __ATOMIC_RELAXED);
            free_list_put(h, b, FLAGS(h, b) & CACHED);
            C(h, P_C_NUM_FREE) += 1;
        }
        result = len;
    }
done:
    if (bs != stack_b) {
        free(bs);
        free(cs);
    }
    return result;
}

#endif
