/* shmcache/_native/hot_append.h: the table ops that grow a live table's
 * list, in C: table_take() (a cached prefix taken into the table, the
 * table branch of prefix.acquire_computed_blocks) and table_append()
 * (tables.prepare_append without copy-on-write). Included by hot.cpp.
 *
 * Both run inside the caller's lock hold and check everything before their
 * first write, as hot_tables.h says; both take new chunks for the list from
 * the free chunk list's front, as refs.table_extend does. (hot_fused.h
 * runs them as fused ops that take the lock themselves.)
 */
#ifndef SHMCACHE_HOT_APPEND_H
#define SHMCACHE_HOT_APPEND_H

#include "hot_index.h"
#include "hot_tables.h"

#include <stdint.h>
#include <string.h>

/* table_take(t, ids, now, tokens): n, or HOT_SLOW or HOT_NOMEM (nothing
 * changed). ids: the n block ids to take (the binding reads them from the
 * Python sequence, and refuses one that is not an int first).
 * The table branch of prefix.acquire_computed_blocks after its lookup: a
 * reference on each block of ids (taking a free one out of the free list),
 * its last access set to now, the ids appended to live table t's list
 * (refs.table_extend: new chunks from the free chunk list, the length the
 * commit point), and tokens added to the table's and the pool's token
 * counts. Checked first: the ids (each in [1, max_blocks)), the table's
 * tail, enough free chunks (each one free, its link in range), and the
 * free-list links of every free block in ids. */
static inline int64_t
hot_table_take(HotCore *h, int64_t t, const int32_t *bs, int64_t n, double now, int64_t tokens)
{
    int64_t i, len, need, result = HOT_SLOW;
    int32_t stack_c[32], *cs = stack_c;

    if (!hot_table_ops_on(h, t))
        return HOT_SLOW;
    len = TF(h, t, P_T_LEN);
    if (n <= 0 || n >= h->p[P_MAX_BLOCKS] || len < 0 || len > NCHUNKS(h) * CI)
        return HOT_SLOW;
    for (i = 0; i < n; i++)
        if (!IS_BLOCK(h, bs[i]))
            return HOT_SLOW;
    need = NCH_FOR(len + n) - NCH_FOR(len);
    if (need > 32) {
        cs = (int32_t *)malloc((need + 1) * sizeof(int32_t));
        if (!cs)
            return HOT_NOMEM;
    }
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS], TAIL = HEAD + 1;
        const int64_t CT = h->c_tokens;
        int32_t tail = TF(h, t, P_T_TAIL), k = (int32_t)C(h, P_C_FREE_REF);
        int64_t nfc = C(h, P_C_FREE_REFS), ci = 0, pos;
        if ((len && !IS_CHUNK(h, tail)) || nfc < need || nfc > NCHUNKS(h))
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
        for (pos = len, i = 0; i < n; i++, pos++)
            chain_put(h, t, pos, bs[i], &tail, cs, &ci);
        TF(h, t, P_T_LEN) = (int32_t)pos;        /* commit: the table holds them */
        TF(h, t, P_T_TOK) += (int32_t)tokens;
        __atomic_fetch_add(&h->c[CT], tokens, __ATOMIC_RELAXED);   /* (hot_claim.h) */
        result = n;
    }
done:
    if (cs != stack_c)
        free(cs);
    return result;
}

/* What table_append(t, n, bs) works out from its arguments and the table's
 * counts before it reads a list: the tokens land in blocks [first, last] of
 * the table (needed = last + 1 blocks in all), nnew of them new; the list's
 * k chunks are kept from chunk lo on, and need new ones are taken. */
typedef struct {
    int64_t len, tok, first, needed, last, end, nnew, k, need, lo;
} AppendPlan;

/* 0, or HOT_SLOW: the arguments or the table's counts are refused (live
 * table t only: the lock hold is hot_table_ops_on's to check). */
static inline int
append_plan(const HotCore *h, int64_t t, int64_t n, int64_t bs, AppendPlan *a)
{
    if (n <= 0 || bs <= 0 || bs > 65535 || NCHUNKS(h) <= 0 || h->c_tokens < 0 ||
        h->p[P_MAX_TABLES] <= 0 || t < 0 || t >= h->p[P_MAX_TABLES] || TF(h, t, P_T_STATE) != 1)
        return HOT_SLOW;
    a->len = TF(h, t, P_T_LEN);
    a->tok = TF(h, t, P_T_TOK);
    if (a->len < 0 || a->len > NCHUNKS(h) * CI || a->tok < 0 || n > INT32_MAX - a->tok)
        return HOT_SLOW;
    a->first = a->tok / bs;
    a->needed = (a->tok + n + bs - 1) / bs;
    a->last = a->needed - 1;
    a->end = a->len < a->needed ? a->len : a->needed;
    a->nnew = a->needed > a->len ? a->needed - a->len : 0;
    a->k = NCH_FOR(a->len);
    a->need = NCH_FOR(a->len + a->nnew) - a->k;
    if (a->nnew >= h->p[P_MAX_BLOCKS] || a->need > NCHUNKS(h))
        return HOT_SLOW;
    /* the chunks kept: from the one the first token lands in (or the tail)
     * on, at cs[j - lo]; then the new ones */
    a->lo = a->k ? (a->first / CI < a->k - 1 ? a->first / CI : a->k - 1) : 0;
    return 0;
}

/* How many ids table_append(t, n, bs) returns (the blocks the n new tokens
 * land in), or HOT_SLOW when it refuses on its arguments and the table's
 * counts alone: the binding sizes the result's buffer with it. */
static inline int64_t
hot_table_append_span(const HotCore *h, int64_t t, int64_t n, int64_t bs)
{
    AppendPlan a;
    if (append_plan(h, t, n, bs, &a) < 0)
        return HOT_SLOW;
    return a.last - a.first + 1;
}

/* Called by table_append with the ids it will return, before its first
 * write: nonzero refuses them, and then nothing changes (the binding builds
 * its list here, so that a MemoryError changes nothing). */
typedef int (*hot_accept_fn)(void *ctx, const int32_t *ids, int64_t n);

/* table_append(t, n, bs, now): the number of ids written to out (room of
 * them: hot_table_append_span's count) of the blocks the n new tokens land
 * in; HOT_SLOW, HOT_NOMEM, or HOT_REFUSED (accept refused the ids): nothing
 * changed.
 * tables.prepare_append's common case, with no copy-on-write: the blocks
 * still needed popped from the free list's front (a cached one evicted:
 * hot_evict), appended to live table t's list, and the tokens counted in
 * the blocks they land in, the table and the pool. HOT_SLOW when a block
 * the tokens land in is shared or published, free blocks or chunks are
 * short (the Python path reclaims or raises), or any index read is out of
 * range (the prefix index's around a block to evict too). Checked first: the tail, or when the tokens land in a chunk
 * before it the whole chain (each chunk in range, the last one the tail,
 * linking to -1); the ids the tokens land in; the free blocks and chunks
 * taken. */
static inline int64_t
hot_table_append(HotCore *h, int64_t t, int64_t n, int64_t bs, double now,
                 int32_t *out, int64_t room, hot_accept_fn accept, void *ctx)
{
    int64_t len, tok, first, end, last, k, lo, need, nnew, i, result = HOT_SLOW;
    int32_t stack_c[64], stack_n[64], *cs = stack_c, *nbs = stack_n;
    AppendPlan a;

    if (!hot_table_ops_on(h, t) || append_plan(h, t, n, bs, &a) < 0)
        return HOT_SLOW;
    len = a.len, tok = a.tok, first = a.first, end = a.end, last = a.last;
    k = a.k, lo = a.lo, need = a.need, nnew = a.nnew;
    if (last - first + 1 > room)
        return HOT_SLOW;
    if (k - lo + need > 64 || nnew > 64) {
        cs = (int32_t *)malloc((k - lo + need + 1) * sizeof(int32_t));
        nbs = (int32_t *)malloc((nnew + 1) * sizeof(int32_t));
        if (!cs || !nbs) {
            free(cs);
            free(nbs);
            return HOT_NOMEM;
        }
    }
    {
        const int32_t HEAD = (int32_t)h->p[P_MAX_BLOCKS], TAIL = HEAD + 1;
        const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
        const int64_t CT = h->c_tokens;
        int32_t c = TF(h, t, P_T_HEAD), b, tail;
        int64_t nfc = C(h, P_C_FREE_REFS), nfree = C(h, P_C_NUM_FREE), ci, pos;
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
        if (nfree < nnew || nfree >= h->p[P_MAX_BLOCKS] || nfc < need || nfc > NCHUNKS(h))
            goto done;
        b = NEXT(h, HEAD);
        for (i = 0; i < nnew; i++) {
            if (!IS_BLOCK(h, b) || ((FLAGS(h, b) & CACHED) && !hot_can_evict(h, b)))
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
        /* the result, before anything changes (accept may refuse it: then
         * nothing changes) */
        for (i = first; i <= last; i++)
            out[i - first] = i < len ? W(h, (int64_t)cs[i / CI - lo] * CW + 1 + i % CI)
                                     : nbs[i - len];
        if (accept && accept(ctx, out, last - first + 1)) {
            result = HOT_REFUSED;
            goto done;
        }
        /* the writes, in prepare_append's order: the new blocks taken
         * (core._pop_free), appended (refs.table_extend: the length is the
         * commit point), then the token counts */
        for (i = 0; i < nnew; i++) {
            int32_t bb = nbs[i];
            if (FLAGS(h, bb) & CACHED)
                hot_evict(h, bb);
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
        for (ci = k - lo, pos = len, i = 0; i < nnew; i++, pos++)
            chain_put(h, t, pos, nbs[i], &tail, cs, &ci);
        if (nnew)
            TF(h, t, P_T_LEN) = (int32_t)pos;    /* commit: the table holds them */
        for (i = first; i <= last; i++) {
            int64_t left = tok + n - i * bs;
            b = i < len ? W(h, (int64_t)cs[i / CI - lo] * CW + 1 + i % CI) : nbs[i - len];
            TOK(h, b) = (uint16_t)(left < bs ? left : bs);
        }
        TF(h, t, P_T_TOK) = (int32_t)(tok + n);
        __atomic_fetch_add(&h->c[CT], n, __ATOMIC_RELAXED);
        result = last - first + 1;
    }
done:
    if (cs != stack_c) {
        free(cs);
        free(nbs);
    }
    return result;
}

#endif
