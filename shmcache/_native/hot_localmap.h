/* shmcache/_native/hot_localmap.h: the process-local map of a slot's loose
 * references, as alloc() and free() (hot_loose.h) read and change it.
 *
 * The map is loosemap.LooseMap's int32 array, which the manager passes to
 * each call (a writable buffer; the binding hands it over as a pointer and
 * a size): per block a count and a link to its newest word, per chunk-area
 * word the links to the next older and newer word of the same block (a
 * link is word + 1; 0 is none). loosemap.py is the reference and holds the
 * byte map; these functions do what its methods of the same names do. None
 * of them allocates or can fail, so the fused ops apply them after
 * committing the shared change.
 *
 * It is this process's alone: read and written without the pool lock (with
 * the GIL held: the binding keeps it around alloc() and free()). The slot's
 * list in shared memory is the truth; a stale map is rebuilt from it
 * (refs.RefStore.resync).
 */
#ifndef SHMCACHE_HOT_LOCALMAP_H
#define SHMCACHE_HOT_LOCALMAP_H

#include "hot_params.h"

#include <stdint.h>

typedef struct {
    int32_t *count, *top, *older, *newer;
    int64_t nblocks, nwords;
} LMap;

/* The int32 items of the map of a pool of h's sizes: 2 * lm_blocks(h) +
 * 2 * lm_words(h). */
static inline int64_t
lm_blocks(const HotCore *h)
{
    return h->p[P_MAX_BLOCKS];
}

static inline int64_t
lm_words(const HotCore *h)
{
    return NCHUNKS(h) * CW;
}

/* View buf (len bytes, writable: the binding asks for a writable buffer) as
 * the map of a pool of h's sizes: 0, or -1 when its size is not the one
 * LooseMap gives them (the binding raises ValueError). */
static inline int
lm_open(const HotCore *h, void *buf, int64_t len, LMap *m)
{
    int64_t b = lm_blocks(h), w = lm_words(h);
    if (len != (2 * b + 2 * w) * (int64_t)sizeof(int32_t))
        return -1;
    m->count = (int32_t *)buf;
    m->top = m->count + b;
    m->older = m->top + b;
    m->newer = m->older + w;
    m->nblocks = b;
    m->nwords = w;
    return 0;
}

/* The newest word naming b (-1: none). */
static inline int64_t
lm_top(const LMap *m, int32_t b)
{
    return (int64_t)m->top[b] - 1;
}

/* Whether word is one of b's words, by its links (O(1)). */
static inline int
lm_has_word(const LMap *m, int32_t b, int64_t word)
{
    int64_t up;
    if (b < 0 || b >= m->nblocks || word < 0 || word >= m->nwords || m->count[b] < 1)
        return 0;
    up = m->newer[word];
    if (up == 0)
        return m->top[b] == word + 1;
    return up > 0 && up <= m->nwords && m->older[up - 1] == word + 1;
}

static inline void
lm_push(LMap *m, int32_t b, int64_t word)
{
    int32_t t = m->top[b];
    m->older[word] = t;
    m->newer[word] = 0;
    if (t)
        m->newer[t - 1] = (int32_t)(word + 1);
    m->top[b] = (int32_t)(word + 1);
    m->count[b] += 1;
}

/* Take b's newest word off its stack (the caller checked the count). */
static inline void
lm_pop(LMap *m, int32_t b)
{
    int64_t word = (int64_t)m->top[b] - 1;
    int32_t o = m->older[word];
    m->top[b] = o;
    if (o)
        m->newer[o - 1] = 0;
    m->older[word] = m->newer[word] = 0;
    m->count[b] -= 1;
}

/* Put word nw in word old's place in b's stack (the caller checked
 * lm_has_word(b, old); nw is in no stack). */
static inline void
lm_move(LMap *m, int32_t b, int64_t old, int64_t nw)
{
    int32_t up = m->newer[old], down = m->older[old];
    m->newer[nw] = up;
    m->older[nw] = down;
    if (up)
        m->older[up - 1] = (int32_t)(nw + 1);
    else
        m->top[b] = (int32_t)(nw + 1);
    if (down)
        m->newer[down - 1] = (int32_t)(nw + 1);
    m->older[old] = m->newer[old] = 0;
}

/* Whether the map holds each id of sorted (n ids, ascending, each in
 * [1, nblocks)) at least as many times as it is listed. */
static inline int
lm_holds(const LMap *m, const int32_t *sorted, int64_t n)
{
    for (int64_t i = 0; i < n;) {
        int64_t j = i;
        while (j < n && sorted[j] == sorted[i])
            j++;
        if (m->count[sorted[i]] < j - i)
            return 0;
        i = j;
    }
    return 1;
}

#endif
