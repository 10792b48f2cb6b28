/* shmcache/_native/hot_reserve.h: a process's reserve of free blocks,
 * taken and refilled without the pool lock. Included by hot.cpp.
 *
 * A block in slot s's reserve stays one of s's loose references (ref_count
 * 1, in s's list), so nothing in the lists changes when it goes in or comes
 * out; what marks it free is its prev word, STASH_MARK(s) instead of
 * HELD_MARK(h, s) (hot_params.h, layout.py), and the slot's ``reserved``
 * count. The ids themselves are kept in this process (Stash, the binding's).
 *
 * NOTE: why no lock is needed. A block with HELD_MARK(s) and ref_count 1 is
 * referenced by s's loose list alone: nobody else may change it (ref_count
 * changes by others need a reference of theirs, or finding it in the prefix
 * index, and a reserved block is never cached). So only two parties ever
 * change a reserved block's prev: its owner, taking it back (stash -> held),
 * and a process holding the pool lock that takes it out of the reserve for
 * itself (stash -> -1, then it drops s's reference: reserve.py). Both use
 * compare-and-swap on the same word, so exactly one of them gets the block.
 * A process killed between its CAS and the rest leaves either a block still
 * held loose by its slot, which the slot's release at death frees, or a
 * block the taker holds the pool lock for, which repair then sees.
 *
 * The owner changes only the block records it holds alone (prev, the
 * generation, the last access) and its slot's ``reserved``, atomically: no
 * shared line that other processes write on every operation, which is what
 * lets N processes allocate and free at N times the rate of one.
 */
#ifndef SHMCACHE_HOT_RESERVE_H
#define SHMCACHE_HOT_RESERVE_H

#include "hot_params.h"

#include <stdint.h>
#include <time.h>

/* This process's list of the blocks it put in its slot's reserve, newest
 * last. An id here whose prev no longer carries the slot's stash mark was
 * taken out by another process, and is skipped. */
typedef struct {
    int32_t *ids;
    int64_t n, cap;
} Stash;

#define RESERVED(h, s) SF(h, s, P_S_RESERVED)

/* Put b, taken back from the reserve, back into it (its CAS won). */
static inline int
stash_back(HotCore *h, int slot, Stash *st, int32_t b)
{
    int32_t e = HELD_MARK(h, slot);
    __atomic_fetch_add(&RESERVED(h, slot), 1, __ATOMIC_RELAXED);
    if (!__atomic_compare_exchange_n(&PREV(h, b), &e, STASH_MARK(slot), 0,
                                     __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        __atomic_fetch_sub(&RESERVED(h, slot), 1, __ATOMIC_RELAXED);
        return 0;
    }
    st->ids[st->n++] = b;
    return 1;
}

/* stash_take(n, slot): n blocks out of the reserve into ids, as loose
 * references of slot (which they already are), without the pool lock.
 * n: done; 0: nothing changed (the reserve has fewer than n: the caller
 * takes the locked path). */
static inline int64_t
hot_stash_take(HotCore *h, int64_t n, int slot, Stash *st, int32_t *ids)
{
    const int32_t sm = STASH_MARK(slot), hm = HELD_MARK(h, slot);
    int64_t k = 0, i;
    struct timespec ts;
    float now;

    if (n <= 0 || st->n < n || slot < 0 || slot >= h->p[P_MAX_SLOTS] || h->gen_off < 0)
        return 0;
    while (k < n && st->n > 0) {
        int32_t b = st->ids[--st->n], e = sm;
        if (!IS_BLOCK(h, b) ||
            !__atomic_compare_exchange_n(&PREV(h, b), &e, hm, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;       /* taken out of the reserve by another process */
        __atomic_fetch_sub(&RESERVED(h, slot), 1, __ATOMIC_RELAXED);
        ids[k++] = b;
    }
    if (k < n) {
        /* fewer than n left after all: put back what was taken */
        for (i = k; i-- > 0;)
            stash_back(h, slot, st, ids[i]);
        return 0;
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    now = (float)((double)ts.tv_sec + ts.tv_nsec * 1e-9 - h->created_at);
    for (i = 0; i < n; i++) {
        GEN(h, ids[i]) += 1;        /* a new life, as an allocation's */
        LAST(h, ids[i]) = now;
    }
    return n;
}

/* Whether block b may go into slot's reserve: a loose reference the slot
 * allocated and holds alone, with no tokens (so the seed's token count
 * needs no change) and not cached (never found by another process). */
static inline int
stash_ok(const HotCore *h, int32_t b, int slot)
{
    return IS_BLOCK(h, b) && PREV(h, b) == HELD_MARK(h, slot) && REF(h, b) == 1 &&
           TOK(h, b) == 0 && !(FLAGS(h, b) & (uint16_t)h->p[P_FLAG_CACHED]);
}

/* stash_put(bs, n, slot): free the n blocks of bs into the reserve, without
 * the pool lock. n: done; 0: nothing changed (one is not such a block, an
 * id repeats, or the reserve has no room for all: the caller frees them on
 * the locked path, which also reports a bad id). */
static inline int64_t
hot_stash_put(HotCore *h, const int32_t *bs, int64_t n, int slot, Stash *st)
{
    int64_t i, j;

    if (n <= 0 || st->n + n > st->cap || slot < 0 || slot >= h->p[P_MAX_SLOTS])
        return 0;
    for (i = 0; i < n; i++) {
        if (!stash_ok(h, bs[i], slot))
            return 0;
        for (j = 0; j < i; j++)
            if (bs[j] == bs[i])
                return 0;
    }
    for (i = 0; i < n; i++) {
        if (!stash_back(h, slot, st, bs[i])) {
            /* prev changed under us (only a repair of a corrupt mark can):
             * take back what went in; the locked path sorts the rest out */
            while (i-- > 0) {
                int32_t e = STASH_MARK(slot);
                st->n--;
                if (__atomic_compare_exchange_n(&PREV(h, bs[i]), &e, HELD_MARK(h, slot), 0,
                                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                    __atomic_fetch_sub(&RESERVED(h, slot), 1, __ATOMIC_RELAXED);
            }
            return 0;
        }
    }
    return n;
}

/* Drop the ids of the list that other processes took out of the reserve
 * (a full list is made of them only after such takings). */
static inline void
stash_compact(const HotCore *h, int slot, Stash *st)
{
    int64_t i, k = 0;
    for (i = 0; i < st->n; i++)
        if (IS_BLOCK(h, st->ids[i]) && PREV(h, st->ids[i]) == STASH_MARK(slot))
            st->ids[k++] = st->ids[i];
    st->n = k;
}

/* unstash(b, slot): take b out of slot's reserve for the caller, who holds
 * the pool lock and then drops slot's loose reference to it (reserve.py).
 * 1: taken; 0: it is not in that reserve (any more). */
static inline int
hot_unstash(HotCore *h, int32_t b, int slot)
{
    int32_t e = STASH_MARK(slot);
    if (!IS_BLOCK(h, b) || slot < 0 || slot >= h->p[P_MAX_SLOTS])
        return 0;
    if (!__atomic_compare_exchange_n(&PREV(h, b), &e, -1, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return 0;
    __atomic_fetch_sub(&RESERVED(h, slot), 1, __ATOMIC_RELAXED);
    return 1;
}

#endif
