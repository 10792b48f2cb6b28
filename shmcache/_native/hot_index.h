/* shmcache/_native/hot_index.h: the prefix index in C: the lookup,
 * find_chain() (the read-only probe behind prefix.py's lookups,
 * index.PrefixIndex.find_chain the reference), hot_index_add (the
 * publication behind cache_full_blocks, index.PrefixIndex.add_many the
 * reference) and the eviction of a cached free block that an allocation
 * takes (core._pop_free's, index.PrefixIndex.remove the reference). Also
 * the removal of an entry from an open-addressing index of block or table
 * ids (index.OpenIndex.remove), which the request-id index shares.
 * Included by hot.cpp, whose find_chain() probes each hash in turn until
 * one is missing, by hot_fused.h (publish()), and by the allocations
 * (hot_loose.h, hot_append.h).
 *
 * Like the table ops (hot_tables.h) it runs inside a lock hold the caller
 * took, and returns HOT_SLOW (None to Python) where the Python path would
 * raise.
 */
#ifndef SHMCACHE_HOT_INDEX_H
#define SHMCACHE_HOT_INDEX_H

#include "hot_params.h"

#include <stdint.h>
#include <string.h>

/* Whether find_chain() may run at all (the pool has a prefix index and the
 * fused ops' slots): else the binding returns None before it reads the
 * hashes. */
static inline int
hot_index_on(const HotCore *h)
{
    return h->p[P_HASH_CAP] > 0 && h->p[P_MAX_SLOTS] > 0;
}

/* The block whose record holds key (16 bytes: a hash of find_chain's), 0
 * when no entry has it (the cached run ends), or HOT_SLOW (a probe met an
 * entry out of range or went all the way round: the Python path,
 * index.PrefixIndex.find_chain, meets the same and raises). Reads only; the
 * caller holds the lock and counts the hits. The key's first 8 bytes,
 * little-endian, are its home slot; an entry matches when its block record
 * holds the key. */
static inline int64_t
hot_index_find(const HotCore *h, const unsigned char *key)
{
    const uint64_t mask = (uint64_t)h->p[P_HASH_CAP] - 1;
    const int32_t *slots = (const int32_t *)(h->base + h->p[P_HASH_OFF]);
    const char *hb = h->base + h->p[P_BLOCKS_OFF] + h->p[P_B_HASH];
    uint64_t home, j, probes;
    int32_t e = -1;
    if (!hot_index_on(h))
        return HOT_SLOW;
    for (home = 0, j = 8; j-- > 0;)     /* its first 8 bytes, little-endian */
        home = home << 8 | (uint8_t)key[j];
    for (j = home & mask, probes = 0; probes <= mask; probes++, j = (j + 1) & mask) {
        e = slots[j];
        if (e < 0)
            break;
        if (!IS_BLOCK(h, e))
            return HOT_SLOW;
        if (!memcmp(hb + (int64_t)e * h->p[P_BLOCK_RECORD_BYTES], key, 16))
            break;
    }
    if (probes > mask)
        return HOT_SLOW;
    return e < 0 ? 0 : e;
}

/* Cache each uncached block of ids (n of them, each in [1, max_blocks),
 * held: the caller checked) under its 16-byte hash (hashes: n of them,
 * concatenated) and count it full (bs tokens), as index.PrefixIndex.add_many
 * and prefix.cache_full_blocks do: its hash written into its record, its
 * FLAG_CACHED set, its id put in the first empty slot from its hash's home.
 * Blocks already cached keep their hash. Lock held, the pool marked dirty.
 * Returns how many were added, or HOT_SLOW when a probe went all the way
 * round: the index holds more entries than there are blocks, which only a
 * corrupted pool does; the blocks before it are added, so the caller leaves
 * the pool dirty for repair (recovery rebuilds the index from the flags). */
static inline int64_t
hot_index_add(HotCore *h, const int32_t *ids, int64_t n, const unsigned char *hashes, int64_t bs)
{
    const uint64_t mask = (uint64_t)h->p[P_HASH_CAP] - 1;
    const uint16_t CACHED = (uint16_t)h->p[P_FLAG_CACHED];
    int32_t *slots = (int32_t *)(h->base + h->p[P_HASH_OFF]);
    char *hb = h->base + h->p[P_BLOCKS_OFF] + h->p[P_B_HASH];
    int64_t added = 0;
    for (int64_t i = 0; i < n; i++) {
        const unsigned char *key = hashes + 16 * i;
        int32_t b = ids[i];
        uint64_t home = 0, j, probes;
        if (FLAGS(h, b) & CACHED)
            continue;
        for (j = 8; j-- > 0;)
            home = home << 8 | key[j];
        for (j = home & mask, probes = 0; probes <= mask && slots[j] >= 0; probes++)
            j = (j + 1) & mask;
        if (probes > mask)
            return HOT_SLOW;
        memcpy(hb + (int64_t)b * h->p[P_BLOCK_RECORD_BYTES], key, 16);
        FLAGS(h, b) |= CACHED;
        slots[j] = b;
        TOK(h, b) = (uint16_t)bs;
        added++;
    }
    return added;
}

/* ------------------------------------------------ removal and eviction */

/* The home slot (before masking) of entry e of an open-addressing index. */
typedef uint64_t (*oindex_home_fn)(const HotCore *h, int32_t e);

/* Remove slot i's entry of an index of mask + 1 slots, moving back each
 * later entry of its run that may move (one whose home does not lie
 * cyclically in (i, j]): index.OpenIndex.remove after its probe. The
 * caller checked that every entry of the run is one home() may read, and
 * that the run ends (a read-only pass, so that this, which writes, meets
 * nothing it must refuse). */
static inline void
oindex_remove_at(const HotCore *h, int32_t *slots, int64_t mask, int64_t i, oindex_home_fn home)
{
    for (int64_t j = i;;) {
        j = (j + 1) & mask;
        int32_t e = slots[j];
        if (e < 0)
            break;
        int64_t k = (int64_t)(home(h, e) & (uint64_t)mask);
        if (i <= j ? (i < k && k <= j) : (k > i || k <= j))
            continue;
        slots[i] = e;
        i = j;
    }
    slots[i] = -1;
}

/* Block e's home in the prefix index: its hash's first 8 bytes,
 * little-endian (pool.hhome). */
static inline uint64_t
hindex_home(const HotCore *h, int32_t e)
{
    const unsigned char *k = (const unsigned char *)h->base + h->p[P_BLOCKS_OFF] +
                             (int64_t)e * h->p[P_BLOCK_RECORD_BYTES] + h->p[P_B_HASH];
    uint64_t home = 0;
    for (int j = 8; j-- > 0;)
        home = home << 8 | k[j];
    return home;
}

/* Whether a cached block b can be evicted without a refusal: the prefix
 * index is there, and the run of slots from b's home holds only blocks
 * and ends. Reads only: an allocation checks every block it evicts first.
 * NOTE: evicting one block keeps this true for the others: a removal only
 * moves entries of a run back within it and empties a slot. */
static inline int
hot_can_evict(const HotCore *h, int32_t b)
{
    const uint64_t mask = (uint64_t)h->p[P_HASH_CAP] - 1;
    const int32_t *slots = (const int32_t *)(h->base + h->p[P_HASH_OFF]);
    if (!hot_index_on(h))
        return 0;
    for (uint64_t j = hindex_home(h, b) & mask, probes = 0; probes <= mask;
         probes++, j = (j + 1) & mask) {
        if (slots[j] < 0)
            return 1;
        if (!IS_BLOCK(h, slots[j]))
            return 0;
    }
    return 0;
}

/* Evict cached block b, which an allocation takes from the free list
 * (hot_can_evict checked it; lock held, the pool marked dirty): its entry
 * removed from the prefix index (none found: only its flag goes, as
 * index.OpenIndex.remove returns False), its FLAG_CACHED cleared, the
 * eviction counted (core._pop_free). */
static inline void
hot_evict(HotCore *h, int32_t b)
{
    const int64_t mask = h->p[P_HASH_CAP] - 1;
    int32_t *slots = (int32_t *)(h->base + h->p[P_HASH_OFF]);
    for (int64_t i = (int64_t)(hindex_home(h, b) & (uint64_t)mask); slots[i] >= 0;
         i = (i + 1) & mask)
        if (slots[i] == b) {
            oindex_remove_at(h, slots, mask, i, hindex_home);
            break;
        }
    FLAGS(h, b) &= (uint16_t)~(uint16_t)h->p[P_FLAG_CACHED];
    C(h, P_C_EVICTIONS) += 1;
}

#endif
