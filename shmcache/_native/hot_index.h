/* shmcache/_native/hot_index.h: the prefix lookup, find_chain(), in C: the
 * read-only probe of the pool's prefix index behind prefix.py's lookups
 * (index.PrefixIndex.find_chain is the reference). Included by hot.cpp,
 * whose find_chain() probes each hash in turn until one is missing.
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
        if (!memcmp(hb + (int64_t)e * h->p[P_BLOCK_SIZE], key, 16))
            break;
    }
    if (probes > mask)
        return HOT_SLOW;
    return e < 0 ? 0 : e;
}

#endif
