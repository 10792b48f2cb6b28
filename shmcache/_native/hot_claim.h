/* shmcache/_native/hot_claim.h: table claims, and the append that runs
 * without the pool lock. Included by hot_tables.h; no Python.
 *
 * A table record's claim word (layout.py, TABLE_DTYPE "claim") says who may
 * write the table now: 0 nobody; -1 the pool lock's holder; s + 1 slot s
 * without the lock: the table's owner appending into the table's last block
 * (hot_append_free), or any slot reading the table's block ids
 * (hot_table_ids_free).
 *
 * Invariant: a table's list, counts and the token count of its last block
 * are written only by a holder of its claim. A lock holder takes the claim
 * (0 -> -1, compare-and-swap) before it writes a table and gives it back
 * (-1 -> 0) before its hold ends (hot_enter.h's release for a fused op,
 * PoolLock's exit for a Python hold); hot_table_ops_on refuses a table
 * whose claim the hold does not have.
 *
 * NOTE: why this is enough for the lock-free append: it changes only the
 * table's token count, the token count of the table's last block (private:
 * one reference, not published) and the pool's token counter (an atomic
 * add). Any other write to those needs the claim, so the two never
 * overlap. A claimer that dies leaves s + 1 behind: a lock holder that finds
 * it checks the slot is dead (claims.py) and takes the claim over; the
 * table's fields are each valid at every instant of the append (the block's
 * count, then the table's), so nothing needs repair. A pure process (no
 * compare-and-swap) is counted in C_PURE, and while it is non-zero no
 * append runs without the lock. A dead lock holder's -1 claims are reset
 * by recovery.
 */
#ifndef SHMCACHE_HOT_CLAIM_H
#define SHMCACHE_HOT_CLAIM_H

#include "hot_enter.h"

#include <sched.h>
#include <stdint.h>
#include <string.h>

/* Polls of a claim held by another slot before the lock holder gives up
 * (a claim is held for a few hundred ns; longer means its holder is not
 * running, or dead: the caller decides, claims.py) */
#define CLAIM_POLLS 4096

static inline int32_t *
claim_word(HotCore *h, int64_t t)
{
    return &TF(h, t, P_T_CLAIM);
}

/* Take table t's claim for the lock's holder (the lock held, t in range):
 * 0 taken; -1 it was -1 already (this hold's); else the claim's value
 * after CLAIM_POLLS polls (s + 1: slot s holds it). */
static inline int32_t
hot_claim(HotCore *h, int64_t t)
{
    int32_t *w = claim_word(h, t);
    for (long i = 0;; i++) {
        int32_t e = 0;
        if (__atomic_compare_exchange_n(w, &e, -1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 0;
        if (e == -1 || i >= CLAIM_POLLS)
            return e;
        cpu_relax();
        if (i % 512 == 511)
            sched_yield();
    }
}

/* Give table t's claim back (-1 -> 0), if the lock's holder has it. */
static inline void
hot_unclaim(HotCore *h, int64_t t)
{
    int32_t e = -1;
    __atomic_compare_exchange_n(claim_word(h, t), &e, 0, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}

/* A fused op's claim on table t (the lock held): 0, taken (and given back
 * by release()); else HOT_SLOW (the claim stays with another slot, or was
 * -1: the Python path sorts it out). */
static inline int
claim_for_op(HotCore *h, int64_t t)
{
    if (hot_claim(h, t) != 0)
        return HOT_SLOW;
    h->claimed = t;
    return 0;
}

/* Take table t's claim for slot (0 -> slot + 1) without the pool lock, and
 * check under it that t is still the live table of request-id hash rhash:
 * 0, or HOT_SLOW (the claim not taken, or given back). Off (HOT_SLOW) while
 * a pure process is attached (C_PURE: it cannot compare-and-swap). */
static inline int
claim_free(HotCore *h, int64_t t, uint64_t rhash, int slot)
{
    int32_t *w, e = 0;
    uint64_t have;
    if (NCHUNKS(h) <= 0 || h->p[P_MAX_TABLES] <= 0 || t < 0 || t >= h->p[P_MAX_TABLES] ||
        slot < 0 || slot >= h->p[P_MAX_SLOTS] ||
        __atomic_load_n(&C(h, P_C_PURE), __ATOMIC_ACQUIRE) != 0)
        return HOT_SLOW;
    w = claim_word(h, t);
    if (__atomic_load_n(w, __ATOMIC_RELAXED) != 0 ||
        !__atomic_compare_exchange_n(w, &e, slot + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
        return HOT_SLOW;
    /* (a pure process may have attached between the test above and the claim) */
    memcpy(&have, TABLE_REC(h, t) + h->p[P_T_RHASH], 8);
    if (__atomic_load_n(&C(h, P_C_PURE), __ATOMIC_ACQUIRE) == 0 &&
        TF(h, t, P_T_STATE) == 1 && have == rhash)
        return 0;
    e = slot + 1;
    __atomic_compare_exchange_n(w, &e, 0, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
    return HOT_SLOW;
}

/* Give back the claim claim_free took. */
static inline void
unclaim_free(HotCore *h, int64_t t, int slot)
{
    int32_t e = slot + 1;
    __atomic_compare_exchange_n(claim_word(h, t), &e, 0, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}

/* The ids of table t's list (its claim held, or the lock): n, the list's
 * length, with the ids in out[0, n) when n <= room (when n > room out is
 * untouched); HOT_SLOW when a chunk of the chain is out of range, the
 * chain's last chunk is not the tail, or an id is not a block. */
static inline int64_t
read_table_ids(HotCore *h, int64_t t, int32_t *out, int64_t room)
{
    int64_t len = TF(h, t, P_T_LEN), i;
    int32_t c = TF(h, t, P_T_HEAD);
    if (len < 0 || len > NCHUNKS(h) * CI)
        return HOT_SLOW;
    if (len > room)
        return len;
    for (i = 0; i < len; i++) {
        int32_t b;
        if (i && i % CI == 0)
            c = W(h, (int64_t)c * CW);
        if (!IS_CHUNK(h, c))
            return HOT_SLOW;
        b = W(h, (int64_t)c * CW + 1 + i % CI);
        if (!IS_BLOCK(h, b))
            return HOT_SLOW;
        out[i] = b;
    }
    if (len && c != TF(h, t, P_T_TAIL))
        return HOT_SLOW;
    return len;
}

/* table_ids_free(t, rhash, slot, out, room): hot_fused.h's table_ids
 * without the pool lock, under the table's claim (a table's list changes
 * only under its claim): n, the list's length, with its ids in out when
 * n <= room; HOT_SLOW when the claim is busy or anything read is off (the
 * locked table_ids runs). */
static inline int64_t
hot_table_ids_free(HotCore *h, int64_t t, uint64_t rhash, int slot, int32_t *out, int64_t room)
{
    int64_t r;
    if (claim_free(h, t, rhash, slot) != 0)
        return HOT_SLOW;
    r = read_table_ids(h, t, out, room);
    unclaim_free(h, t, slot);
    return r;
}

/* append_free(t, rhash, n, bs, slot): prepare_append(t, n) without the
 * pool lock when the n tokens land in the last block of table t, which the
 * caller's slot owns and the block is private (one reference, not
 * published): the block's id; else HOT_SLOW, nothing changed (the locked
 * path runs). Under the table's claim (slot + 1): the pool's token counter
 * (atomic), the block's token count, then the table's. */
static inline int64_t
hot_append_free(HotCore *h, int64_t t, uint64_t rhash, int64_t n, int64_t bs, int slot)
{
    const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
    int32_t c, b;
    int64_t len, tok, r = HOT_SLOW;

    if (h->c_tokens < 0 || n <= 0 || bs <= 0 || bs > 65535 ||
        claim_free(h, t, rhash, slot) != 0)
        return HOT_SLOW;
    if (TF(h, t, P_T_OWNER) != slot)
        goto done;
    len = TF(h, t, P_T_LEN);
    tok = TF(h, t, P_T_TOK);
    /* every token in the last block: its first at or past the block's start */
    if (len < 1 || len > NCHUNKS(h) * CI || tok < (len - 1) * bs || tok + n > len * bs)
        goto done;
    c = TF(h, t, P_T_TAIL);
    if (!IS_CHUNK(h, c))
        goto done;
    b = W(h, (int64_t)c * CW + 1 + (len - 1) % CI);
    if (!IS_BLOCK(h, b) || REF(h, b) != 1 || (FLAGS(h, b) & CACHED))
        goto done;
    __atomic_fetch_add(&h->c[h->c_tokens], n, __ATOMIC_RELAXED);
    TOK(h, b) = (uint16_t)(tok + n - (len - 1) * bs);
    __atomic_store_n(&TF(h, t, P_T_TOK), (int32_t)(tok + n), __ATOMIC_RELEASE);
    r = b;
done:
    unclaim_free(h, t, slot);
    return r;
}

#endif
