/* shmcache/_native/hot_loose.h: the two operations a scheduler calls on
 * every step, in C: alloc() (allocate blocks as loose references of the
 * caller's slot) and free() (release a batch of them). Included by hot.cpp.
 *
 * They do exactly what shmcache/manager/fastpath.py does (which stays as the
 * reference, and the path taken where this module is not loaded), plus
 * taking and leaving the lock (hot_mutex.h), in one call: in Python a call
 * costs as much as the work. They only ever *try* the lock: holding the GIL
 * while waiting for a lock that another thread of this process holds would
 * deadlock, so when the lock is busy, the pool dirty, the manager's view
 * stale or anything unusual they return having changed nothing (the binding
 * returns None), and the caller takes the slow path.
 *
 * NOTE: crash consistency is the Python code's: the dirty mark is set (with a
 * fence) before the first shared write and cleared after the last, so a
 * holder killed in between leaves a pool that the next holder repairs.
 *
 * Every index read from shared memory (free-list links, the free chunk list
 * head and links, the slot's list head and its chunk links, the words of
 * the local map) is checked against its structure's size before it is
 * used. One out of range means a corrupt pool: the op gives up (before its
 * first write when the check can be made then, else leaving the pool dirty,
 * as a crash would) and returns the slow path's code (None to Python), and
 * the Python path, which finds the pool dirty or meets the same index,
 * repairs or raises CorruptPoolError. No index is followed outside the segment.
 */
#ifndef SHMCACHE_HOT_LOOSE_H
#define SHMCACHE_HOT_LOOSE_H

#include "hot_enter.h"
#include "hot_index.h"
#include "hot_localmap.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Whether alloc() may run at all for n blocks into slot (else it returns 0
 * at once: the binding checks this before it looks at the loose map). More
 * than the pool has goes to the slow path, which raises, before any
 * allocation. */
static inline int
hot_alloc_ok(const HotCore *h, int64_t n, int slot)
{
    return !(n <= 0 || n >= h->p[P_MAX_BLOCKS] || slot < 0 || slot >= h->p[P_MAX_SLOTS] ||
             NCHUNKS(h) <= 0);
}

/* alloc(n, slot, epoch, loose): n blocks allocated as loose references of
 * slot, their ids written to ids (the caller's, n of them). lm is the
 * manager's LooseMap array (hot_localmap.h). 1: done; 0: nothing changed,
 * the slow path runs (the binding returns None); HOT_BUSY: nothing changed,
 * the lock stayed busy (the binding waits for the lock and tries again);
 * HOT_NOMEM: nothing changed.
 * A cached block among the first n free ones is evicted (hot_evict; when
 * the index around its entry is not sound, 0: the slow path meets it), and
 * the chunks the slot's loose list grows by must be free (otherwise 0: the
 * slow path reports it).
 * NOTE: the shared update cannot fail, and neither can the process-local
 * map's, done after the lock is released (only this thread can see the map:
 * the caller holds the GIL). Only the binding's list of the ids can
 * (MemoryError); the caller then rebuilds the map from the slot's list. */
static inline int
hot_alloc(HotCore *h, int64_t n, int slot, long long epoch, LMap *lm, int32_t *ids)
{
    int64_t i;
    int r;
    int32_t stack_c[8], *bs = ids, *cs = stack_c;
    int64_t stack_g[64], *gs = stack_g;

    if (!hot_alloc_ok(h, n, slot))
        return 0;
    if (n > 64) {
        gs = (int64_t *)malloc(n * sizeof(int64_t));
        cs = (int32_t *)malloc((n / CI + 2) * sizeof(int32_t));
        if (!gs || !cs) {
            free(gs);
            free(cs);
            return HOT_NOMEM;
        }
    }
    if ((r = enter(h, epoch, slot)) < 0) {
        if (r == -2)
            goto contended;
        goto busy;
    }
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS];
        const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
        int32_t b = NEXT(h, HEAD), k = (int32_t)C(h, P_C_FREE_REF);
        int32_t cnt = SF(h, slot, P_S_COUNT), head = SF(h, slot, P_S_HEAD);
        int64_t need, ci = 0;
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
            if (!IS_BLOCK(h, b) || ((FLAGS(h, b) & CACHED) && !hot_can_evict(h, b))) {
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
            if (FLAGS(h, bb) & CACHED)
                hot_evict(h, bb);
            PREV(h, bb) = HELD_MARK(h, slot);   /* allocated loose by slot */
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
        lm_push(lm, bs[i], gs[i]);
    r = 1;
    goto done;
contended:
    r = HOT_BUSY;
    goto done;
busy:
    r = 0;
done:
    if (gs != stack_g) {
        free(gs);
        free(cs);
    }
    return r;
}

/* Whether free() may run at all for slot (else it returns HOT_SLOW at once:
 * the binding checks this before it looks at the loose map or the ids). */
static inline int
hot_free_ok(const HotCore *h, int slot)
{
    return !(slot < 0 || slot >= h->p[P_MAX_SLOTS] || NCHUNKS(h) <= 0);
}

/* free(ids, slot, epoch, loose): the n block ids of ids released, each a
 * loose reference of slot (lm: the manager's LooseMap array). The number of
 * blocks that became free; HOT_SLOW (nothing changed) when an id is not in
 * [1, max_blocks) (the binding, which reads the ids, refuses one that is
 * not an int first), is not held loose by this slot as many times as
 * listed: the slow path then raises the precise error; HOT_BUSY (nothing
 * changed) when the lock stayed busy (the binding waits for the lock and tries
 * again); HOT_NOMEM (nothing changed). */
static inline int64_t
hot_free(HotCore *h, const int32_t *bs, int64_t n, int slot, long long epoch, LMap *lm)
{
    int32_t stack_s[64], *sorted = stack_s;
    int64_t i, freed = 0, r;

    if (!hot_free_ok(h, slot))
        return HOT_SLOW;
    if (n == 0)
        return 0;
    for (i = 0; i < n; i++)
        if (!IS_BLOCK(h, bs[i]) || PREV(h, bs[i]) == STASH_MARK(slot))
            return HOT_SLOW;    /* (in this slot's reserve: freed already) */
    if (n > 64) {
        sorted = (int32_t *)malloc(n * sizeof(int32_t));
        if (!sorted)
            return HOT_NOMEM;
    }
    /* every id held loose as many times as listed (sorted copy for counts);
     * before the lock: the map is this process's, and the epoch check below
     * confirms that it is current */
    memcpy(sorted, bs, n * sizeof(int32_t));
    if (n > 1)
        qsort(sorted, n, sizeof(int32_t), cmp_i32);
    if (!lm_holds(lm, sorted, n))
        goto busy;
    if ((r = enter(h, epoch, slot)) < 0) {
        if (r == -2)
            goto contended;
        goto busy;
    }
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS], TAIL = HEAD + 1;
        const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
        const int64_t NW = NCHUNKS(h) * CW;
        const int64_t CT = h->c_tokens;
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
            g = lm_top(lm, b);
            if (cnt < 1 || !IS_CHUNK(h, hd) || g < 0 || g >= NW || g % CW == 0 || W(h, g) != b) {
                corrupt = 1;
                break;
            }
            last = (int64_t)hd * CW + 1 + (cnt - 1) % CI;
            if (g != last) {
                bl = W(h, last);
                if (!lm_has_word(lm, bl, last)) {
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
            lm_pop(lm, b);
            if (g != last) {
                /* move the newest id into g, then drop the newest: O(1) removal */
                W(h, g) = bl;
                lm_move(lm, bl, last, g);
            }
            SF(h, slot, P_S_COUNT) = cnt - 1;   /* commit: b's reference is gone */
            if (lm->count[b] == 0 && PREV(h, b) == HELD_MARK(h, slot))
                PREV(h, b) = -1;                /* the slot's last loose reference */
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
                if (TOK(h, b))      /* as free_block (atomic: hot_claim.h) */
                    __atomic_fetch_sub(&h->c[CT], TOK(h, b), __ATOMIC_RELAXED);
                free_list_put(h, b, cached);
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
    r = freed;
    goto done;
contended:
    r = HOT_BUSY;
    goto done;
busy:
    r = HOT_SLOW;
done:
    if (sorted != stack_s)
        free(sorted);
    return r;
}

#endif
