"""Fused hot paths: allocating blocks into a manager's loose references and
freeing a batch of them.

These do exactly the steps of ``freelist``, ``refs`` and ``core`` (pop from
the free list's front, one id per block in the slot's loose list, release
to the front or back of the queue), with the shared memoryviews bound to
locals and the per-block calls inlined: they are what a scheduler calls on
every step, and in Python a call costs as much as the work. ``_hot``
(``_native/hot_loose.h``) does the same in C.

NOTE: crash consistency is the same as the primitives': a slot's loose list
changes only by its owner, and a dead owner's list is released whole;
everything else (ref counts, the free list, the chunk free list) is rebuilt
from the lists by recovery.
"""

from __future__ import annotations

import time

from .layout import (C_EVICTIONS, C_FREE_REF, C_FREE_REFS, C_NUM_FREE, C_TOKENS, CHUNK_IDS,
                     CHUNK_WORDS, FLAG_CACHED)

CI, CW = CHUNK_IDS, CHUNK_WORDS


def alloc_loose(mgr, n: int) -> list:
    """Pop ``n`` blocks (caller checked they are free and chunks suffice)."""
    p = mgr._p
    nxt, prv, ref, flags, tok, last, gen, kw, c, s_head, s_count, HEAD, TAIL = p.hot
    s = p.slot
    loose = mgr._refs.loose
    now = time.time() - p.created_at
    cnt = s_count[s]
    nch = p.layout.num_chunks
    need = -(-(cnt + n) // CI) - -(-cnt // CI)
    # read-only walk first (as hot_loose.h's): every block and chunk id
    # read from shared memory in range, or nothing changes
    b = nxt[HEAD]
    for i in range(n):
        if not 0 < b < HEAD:
            raise p.corrupt(f"free list broken {i} entries in (block {b})")
        b = nxt[b]
    if not (0 < b < HEAD or b == TAIL):
        raise p.corrupt(f"free list broken {n} entries in (block {b})")
    chunks = []
    k = c[C_FREE_REF]
    for i in range(need):
        if not 0 <= k < nch or kw[k * CW + 1] != -1:
            raise p.corrupt(f"free chunk list broken {i} entries in (chunk {k})")
        chunks.append(k)
        k = kw[k * CW]
    if not -1 <= k < nch:
        raise p.corrupt(f"free chunk list broken {need} entries in (chunk {k})")
    head = s_head[s]
    if cnt % CI and not 0 <= head < nch:
        raise p.corrupt(f"slot {s}'s loose list head is chunk {head}")
    b = nxt[HEAD]
    ids = []
    ci = 0
    for _ in range(n):
        nb = nxt[b]
        prv[b] = nxt[b] = -1
        if flags[b] & FLAG_CACHED:
            mgr._index.remove(b)
            c[C_EVICTIONS] += 1
        ref[b] = 1
        tok[b] = 0
        last[b] = now
        gen[b] = (gen[b] + 1) & 0xFFFFFFFF
        off = cnt % CI
        if off == 0:
            ch = chunks[ci]
            ci += 1
            kw[ch * CW] = head if cnt else -1
            g = ch * CW + 1
            kw[g] = b
            head = ch
            s_head[s] = ch
        else:
            g = head * CW + 1 + off
            kw[g] = b
        cnt += 1
        s_count[s] = cnt               # commit: the slot holds b
        lst = loose.get(b)
        if lst is None:
            loose[b] = [g]
        else:
            lst.append(g)
        ids.append(b)
        b = nb
    nxt[HEAD] = b
    prv[b] = HEAD
    c[C_FREE_REF] = k
    c[C_FREE_REFS] -= need
    c[C_NUM_FREE] -= n
    return ids


def free_loose(mgr, ids) -> int:
    """Drop one loose reference per id, in order (caller checked they are held).

    Returns:
        How many blocks became free.
    """
    p = mgr._p
    nxt, prv, ref, flags, tok, _, _, kw, c, s_head, s_count, HEAD, TAIL = p.hot
    s = p.slot
    loose = mgr._refs.loose
    freed = 0
    nch = p.layout.num_chunks
    nw = nch * CW
    for b in ids:
        # checks first (every id read from shared memory), then the change
        recs = loose[b]
        g = recs[-1]
        cnt, h = s_count[s], s_head[s]
        if not (cnt >= 1 and 0 <= h < nch and 0 <= g < nw and g % CW and kw[g] == b):
            _abort_free(c, freed)
            raise p.corrupt(f"slot {s}'s loose list: block {b} not at word {g} (head {h}, "
                            f"count {cnt})")
        lastw = h * CW + 1 + (cnt - 1) % CI
        if g != lastw:
            bl = kw[lastw]
            lst = loose.get(bl)
            if not lst or lastw not in lst:
                _abort_free(c, freed)
                raise p.corrupt(f"slot {s}'s newest loose id (word {lastw}, block {bl}) is "
                                "not among the references this manager holds")
        empty = (cnt - 1) % CI == 0
        if empty:
            nh = kw[h * CW]
            if not (nh == -1 if cnt == 1 else 0 <= nh < nch):
                _abort_free(c, freed)
                raise p.corrupt(f"slot {s}'s loose list: chunk {h} links to {nh}")
        if ref[b] == 1:
            nb = prv[TAIL] if flags[b] & FLAG_CACHED else nxt[HEAD]
            if not (0 < nb < HEAD or nb == (HEAD if flags[b] & FLAG_CACHED else TAIL)):
                _abort_free(c, freed)
                raise p.corrupt(f"free list: an end links to {nb}")
        recs.pop()
        if not recs:
            del loose[b]
        if g != lastw:
            # Move the newest id into g, then drop the newest: O(1) removal.
            kw[g] = bl
            lst[lst.index(lastw)] = g
        s_count[s] = cnt - 1           # commit: b's reference is gone
        if empty:
            s_head[s] = nh
            kw[h * CW + 1] = -1
            kw[h * CW] = c[C_FREE_REF]
            c[C_FREE_REF] = h
            c[C_FREE_REFS] += 1
        x = ref[b] - 1
        ref[b] = x
        if x == 0:
            freed += 1
            c[C_TOKENS] -= tok[b]           # as the seed's free_block
            if flags[b] & FLAG_CACHED:      # to the back: evicted last
                last_b = prv[TAIL]
                nxt[last_b] = b
                prv[b] = last_b
                nxt[b] = TAIL
                prv[TAIL] = b
            else:                           # to the front: reused first
                first = nxt[HEAD]
                prv[first] = b
                nxt[b] = first
                prv[b] = HEAD
                nxt[HEAD] = b
    c[C_NUM_FREE] += freed
    return freed


def _abort_free(c, freed) -> None:
    # Corruption met after some references were dropped: account for the
    # blocks freed so far, so that what was done stays consistent (the
    # repair that follows rebuilds everything from the lists anyway).
    c[C_NUM_FREE] += freed
