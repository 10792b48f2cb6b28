/* shmcache/_native/hot_fused.h: eight ops of a request's life as fused
 * ops that take the lock themselves, as alloc() and free() do (hot_loose.h),
 * instead of running inside a hold the Python caller takes: new_table()
 * (tables.create_block_table, over table_new), delete_table()
 * (delete_block_table: table_drop, then the request-id index's entry
 * removed), append() (prepare_append's common case, over table_append) and
 * acquire() (the table branch of prefix.acquire_computed_blocks: find_chain,
 * then table_take), add_block() (tables.add_block_to_table: table_take of
 * one block), lookup() (prefix.get_computed_blocks: find_chain, counted),
 * publish() (prefix.cache_full_blocks: hot_index_add) and
 * table_ids() (a table's block_ids, read).
 * Included by hot.cpp.
 *
 * The table is named by its index and its request id's hash (views.py's
 * SharedBlockTable keeps both): an op runs only while the record still
 * holds that table (else it was deleted, its record perhaps reused, and the
 * slow path says so). Results as the ops they wrap, plus HOT_BUSY (nothing
 * changed): the turn did not come or the lock stayed busy through the spin,
 * and the binding waits for the lock in the kernel (hot_wait_lock) and tries
 * again.
 *
 * NOTE: the dirty mark is set before the first write and cleared after the
 * last (begin_update, leave), as a Python hold does on entry and exit; a
 * holder killed in between leaves the pool dirty for the next one to
 * repair. The wrapped ops write nothing unless they succeed, so clearing the
 * mark after a refusal is right.
 */
#ifndef SHMCACHE_HOT_FUSED_H
#define SHMCACHE_HOT_FUSED_H

#include "hot_append.h"
#include "hot_index.h"

#include <stdint.h>
#include <string.h>

/* Take the lock for a fused table op on table t of request-id hash rhash:
 * 0 (held, the pool clean, the view current, the table that one, its claim
 * taken: hot_claim.h), or HOT_BUSY / HOT_SLOW with the lock not held. */
static inline int
enter_table(HotCore *h, int64_t t, uint64_t rhash, int slot, long long epoch)
{
    uint64_t have;
    int e;
    if (h->p[P_MAX_TABLES] <= 0 || t < 0 || t >= h->p[P_MAX_TABLES] || slot < 0 ||
        slot >= h->p[P_MAX_SLOTS])
        return HOT_SLOW;
    if ((e = enter(h, epoch, slot)) < 0)
        return e == -2 ? HOT_BUSY : HOT_SLOW;
    memcpy(&have, TABLE_REC(h, t) + h->p[P_T_RHASH], 8);
    if (TF(h, t, P_T_STATE) != 1 || have != rhash || claim_for_op(h, t) != 0) {
        leave(h, 0);
        return HOT_SLOW;
    }
    return 0;
}

/* table_ids(t, rhash, slot, epoch, out, room): views.SharedBlockTable's
 * block_ids in a hold of its own (a read: nothing changes): n, the length
 * of live table t's list, with its ids in out[0, n) when n <= room (when
 * n > room out is untouched, and the binding asks again with room n); or
 * HOT_SLOW / HOT_BUSY. HOT_SLOW too when a chunk of the chain is out of
 * range, the chain's last chunk is not the tail, or an id is not a block
 * (the Python path, refs.table_blocks, says which). */
static inline int64_t
hot_table_ids(HotCore *h, int64_t t, uint64_t rhash, int slot, long long epoch, int32_t *out,
              int64_t room)
{
    int64_t r;
    int e = enter_table(h, t, rhash, slot, epoch);
    if (e)
        return e;
    r = read_table_ids(h, t, out, room);
    leave(h, 0);
    return r;
}

/* new_table(raw, n, hash, slot, epoch): table_new (hot_tables.h) in a hold
 * of its own: the new table, or HOT_SLOW / HOT_BUSY (nothing changed). */
static inline int64_t
hot_new_table(HotCore *h, const char *raw, int64_t n, uint64_t hash, int slot, long long epoch)
{
    int64_t t;
    int e;
    if (slot < 0 || slot >= h->p[P_MAX_SLOTS] || h->p[P_MAX_TABLES] <= 0)
        return HOT_SLOW;
    if ((e = enter(h, epoch, slot)) < 0)
        return e == -2 ? HOT_BUSY : HOT_SLOW;
    begin_update(h);
    t = hot_table_new(h, raw, n, hash, slot);
    leave(h, 1);
    return t;
}

/* The request-id index: the slot holding the live table whose request id
 * is raw (n bytes; hash, its 64-bit hash, gives the home slot), that table
 * in *t; or HOT_SLOW (none, or a probe met an entry out of range or went
 * all the way round: the Python path raises). core._table_index's lookup. */
static inline int64_t
tindex_slot(const HotCore *h, const char *raw, int64_t n, uint64_t hash, int64_t *t)
{
    const int64_t mask = h->p[P_TINDEX_CAP] - 1;
    const int32_t *slots = (const int32_t *)(h->base + h->p[P_TINDEX_OFF]);
    int64_t i, probes;
    if (n <= 0 || n > h->p[P_RID_BYTES])
        return HOT_SLOW;
    for (i = (int64_t)(hash & (uint64_t)mask), probes = 0; probes <= mask;
         probes++, i = (i + 1) & mask) {
        int32_t e = slots[i];
        const char *rid;
        if (e < 0 || e >= h->p[P_MAX_TABLES])
            return HOT_SLOW;
        rid = TABLE_REC(h, e) + h->p[P_T_RID];
        if (!memcmp(rid, raw, n) && (n == h->p[P_RID_BYTES] || rid[n] == 0)) {
            *t = e;
            return i;
        }
    }
    return HOT_SLOW;
}

/* The home of table e's index entry: its request id's hash. */
static inline uint64_t
tindex_home(const HotCore *h, int32_t e)
{
    uint64_t v;
    memcpy(&v, TABLE_REC(h, e) + h->p[P_T_RHASH], 8);
    return v;
}

/* Whether slot i's entry can be removed: every entry of the run after it
 * is a table, and the run ends (read only, so that the removal, which
 * writes, meets nothing it must refuse). */
static inline int
tindex_can_remove(const HotCore *h, int64_t i)
{
    const int64_t mask = h->p[P_TINDEX_CAP] - 1;
    const int32_t *slots = (const int32_t *)(h->base + h->p[P_TINDEX_OFF]);
    for (int64_t k = 0, j = i; k <= mask; k++) {
        j = (j + 1) & mask;
        if (slots[j] < 0)
            return 1;
        if (slots[j] >= h->p[P_MAX_TABLES])
            return 0;
    }
    return 0;
}

/* delete_table(raw, n, hash, slot, epoch): the live table whose request id
 * is raw found in the index (its index in *t), dropped (table_drop: its
 * references released, last block first) and its index entry removed, in a
 * hold of its own: the references released, or HOT_SLOW / HOT_NOMEM /
 * HOT_BUSY (nothing changed). */
static inline int64_t
hot_delete_table(HotCore *h, const char *raw, int64_t n, uint64_t hash, int slot,
                 long long epoch, int64_t *t)
{
    int64_t i, r;
    int e;
    if (slot < 0 || slot >= h->p[P_MAX_SLOTS] || h->p[P_MAX_TABLES] <= 0 ||
        h->p[P_TINDEX_CAP] <= 0)
        return HOT_SLOW;
    if ((e = enter(h, epoch, slot)) < 0)
        return e == -2 ? HOT_BUSY : HOT_SLOW;
    if ((i = tindex_slot(h, raw, n, hash, t)) < 0 || !tindex_can_remove(h, i) ||
        TF(h, *t, P_T_STATE) != 1 || claim_for_op(h, *t) != 0) {
        leave(h, 0);
        return HOT_SLOW;
    }
    begin_update(h);
    r = hot_table_drop(h, *t);
    if (r >= 0)
        oindex_remove_at(h, (int32_t *)(h->base + h->p[P_TINDEX_OFF]), h->p[P_TINDEX_CAP] - 1, i,
                         tindex_home);
    leave(h, 1);
    return r;
}

/* append(t, rhash, n, bs, now, slot, epoch): table_append (hot_append.h)
 * in a hold of its own. */
static inline int64_t
hot_append(HotCore *h, int64_t t, uint64_t rhash, int64_t n, int64_t bs, double now,
           int slot, long long epoch, int32_t *out, int64_t room, hot_accept_fn accept,
           void *ctx)
{
    int64_t r = enter_table(h, t, rhash, slot, epoch);
    if (r < 0)
        return r;
    begin_update(h);
    r = hot_table_append(h, t, n, bs, now, out, room, accept, ctx);
    leave(h, 1);
    return r;
}

/* acquire(t, rhash, hashes, nh, now, bs, slot, epoch): the blocks of the
 * longest cached run of the nh 16-byte hashes (hot_index_find), taken into
 * table t (hot_table_take, bs tokens each) and their ids written to out
 * (room for nh); accept sees them before the first write (nonzero: refused,
 * HOT_REFUSED, nothing changed). The number of blocks, or HOT_SLOW,
 * HOT_NOMEM, HOT_BUSY, HOT_REFUSED: nothing changed. The hits and the miss
 * that ended the run are counted only when it succeeds (prefix.py's
 * _count_lookup). */
static inline int64_t
hot_acquire(HotCore *h, int64_t t, uint64_t rhash, const unsigned char *hashes, int64_t nh,
            double now, int64_t bs, int slot, long long epoch, int32_t *out,
            hot_accept_fn accept, void *ctx)
{
    int64_t n, r;
    if (!hot_index_on(h) || nh < 0 || nh >= h->p[P_MAX_BLOCKS] || bs <= 0 || bs > 65535)
        return HOT_SLOW;
    if ((r = enter_table(h, t, rhash, slot, epoch)) < 0)
        return r;
    for (n = 0; n < nh; n++) {
        int64_t b = hot_index_find(h, hashes + 16 * n);
        if (b == 0)
            break;
        if (b < 0) {                /* the Python path meets it and raises */
            leave(h, 0);
            return HOT_SLOW;
        }
        out[n] = (int32_t)b;
    }
    if (accept(ctx, out, n)) {
        leave(h, 0);
        return HOT_REFUSED;
    }
    begin_update(h);
    if (n > 0 && (r = hot_table_take(h, t, out, n, now, bs * n)) < 0) {
        leave(h, 1);
        return r;
    }
    C(h, P_C_HITS) += n;
    if (n < nh)
        C(h, P_C_MISSES) += 1;
    leave(h, 1);
    return n;
}

/* add_block(t, rhash, b, tokens, now, slot, epoch): the position at which
 * block b was appended to table t, or HOT_SLOW / HOT_NOMEM / HOT_BUSY
 * (nothing changed). tables.add_block_to_table's case where the manager
 * holds no loose reference to b (its caller checked: the move of one is
 * the Python path's): a new reference on b (a free one taken out of the
 * free list), its last access now, b appended to the table's list
 * (hot_table_take), tokens added to the table's and the pool's counts, and
 * b's own count set to tokens, in a hold of its own: one C hold instead of
 * a Python one per block of a consumer that adds blocks one at a time.
 * HOT_SLOW also when b carries a reserve's mark (a held block with a prev
 * other than -1: reserve.take_block is the Python path's), or tokens is out
 * of [0, bs]. */
static inline int64_t
hot_add_block(HotCore *h, int64_t t, uint64_t rhash, int64_t b, int64_t tokens, int64_t bs,
              double now, int slot, long long epoch)
{
    int64_t r, pos;
    int32_t id = (int32_t)b;
    if (!IS_BLOCK(h, b) || bs <= 0 || bs > 65535 || tokens < 0 || tokens > bs)
        return HOT_SLOW;
    if ((r = enter_table(h, t, rhash, slot, epoch)) < 0)
        return r;
    if (REF(h, id) > 0 && PREV(h, id) != -1) {
        leave(h, 0);
        return HOT_SLOW;
    }
    pos = TF(h, t, P_T_LEN);
    begin_update(h);
    r = hot_table_take(h, t, &id, 1, now, tokens);
    if (r >= 0)
        TOK(h, id) = (uint16_t)tokens;
    leave(h, 1);
    return r < 0 ? r : pos;
}

/* lookup(hashes, nh, now, slot, epoch): the blocks of the longest cached
 * run of the nh 16-byte hashes (hot_index_find) written to out, their
 * number, and the hits and the miss that ended the run counted, in a hold
 * of its own (no reference taken): prefix.get_computed_blocks, and, with
 * one hash and now >= 0 (each block found gets now as its last access),
 * find_cached_block. Or HOT_SLOW / HOT_BUSY (nothing changed). */
static inline int64_t
hot_lookup(HotCore *h, const unsigned char *hashes, int64_t nh, double now, int slot,
           long long epoch, int32_t *out)
{
    int64_t n;
    int e;
    if (!hot_index_on(h) || nh < 0 || nh >= h->p[P_MAX_BLOCKS] || slot < 0 ||
        slot >= h->p[P_MAX_SLOTS])
        return HOT_SLOW;
    if ((e = enter(h, epoch, slot)) < 0)
        return e == -2 ? HOT_BUSY : HOT_SLOW;
    for (n = 0; n < nh; n++) {
        int64_t b = hot_index_find(h, hashes + 16 * n);
        if (b == 0)
            break;
        if (b < 0) {                /* the Python path meets it and raises */
            leave(h, 0);
            return HOT_SLOW;
        }
        out[n] = (int32_t)b;
    }
    begin_update(h);
    C(h, P_C_HITS) += n;
    if (n < nh)
        C(h, P_C_MISSES) += 1;
    if (now >= 0)
        for (int64_t i = 0; i < n; i++)
            LAST(h, out[i]) = (float)now;
    leave(h, 1);
    return n;
}

/* publish(ids, n, hashes, bs, slot, epoch): hot_index_add in a hold of its
 * own, after checking that every block of ids is held (a reference > 0):
 * the number of blocks newly cached, or HOT_SLOW / HOT_BUSY (nothing
 * changed; HOT_SLOW also after a corrupted index stopped hot_index_add
 * part way: then the pool stays dirty, and the slow path repairs before
 * it runs). */
static inline int64_t
hot_publish(HotCore *h, const int32_t *ids, int64_t n, const unsigned char *hashes, int64_t bs,
            int slot, long long epoch)
{
    int64_t r;
    int e;
    if (!hot_index_on(h) || n < 0 || n >= h->p[P_MAX_BLOCKS] || bs <= 0 || bs > 65535 ||
        slot < 0 || slot >= h->p[P_MAX_SLOTS])
        return HOT_SLOW;
    if ((e = enter(h, epoch, slot)) < 0)
        return e == -2 ? HOT_BUSY : HOT_SLOW;
    for (int64_t i = 0; i < n; i++)
        if (!IS_BLOCK(h, ids[i]) || REF(h, ids[i]) <= 0) {
            leave(h, 0);            /* the Python path names the block and raises */
            return HOT_SLOW;
        }
    begin_update(h);
    r = hot_index_add(h, ids, n, hashes, bs);
    if (r < 0) {
        leave_dirty(h);             /* the next holder repairs */
        return HOT_SLOW;
    }
    leave(h, 1);
    return r;
}

#endif
