"""Fused hot paths: allocating blocks into a manager's loose references and
freeing a batch of them.

These do exactly the steps of ``freelist``, ``refs`` and ``core`` (pop from
the free list's front, one reference record per block, release to the front
or back of the queue), with the shared memoryviews bound to locals and the
per-block calls inlined: they are what a scheduler calls on every step, and
in Python a call costs as much as the work.

NOTE: crash consistency is the same as the primitives': the slot's list head
is the commit point of each record, and everything else (ref counts, the free
list, the record free list) is rebuilt from the records by recovery.
"""

from __future__ import annotations

import time

from .layout import C_EVICTIONS, C_FREE_REF, C_FREE_REFS, C_NUM_FREE, FLAG_CACHED


def alloc_loose(mgr, n: int) -> list:
    """Pop ``n`` blocks (caller checked they are free and records suffice)."""
    p = mgr._p
    nxt, prv, ref, flags, tok, last, rb, rn, c, s_head, s_count, HEAD, TAIL = p.hot
    s = p.slot
    loose = mgr._refs.loose
    now = time.time() - p.created_at
    fr = c[C_FREE_REF]
    # read-only walk first (as _hot.c's): every block and record id read from
    # shared memory in range, or nothing changes
    b, r, nrefs = nxt[HEAD], fr, p.layout.max_refs
    for i in range(n):
        if not 0 < b < HEAD or not 0 <= r < nrefs:
            raise p.corrupt(f"free list or free-record list broken {i} entries in "
                            f"(block {b}, record {r})")
        b, r = nxt[b], rn[r]
    if not (0 < b < HEAD or b == TAIL):
        raise p.corrupt(f"free list broken {n} entries in (block {b})")
    b = nxt[HEAD]
    ids = []
    for _ in range(n):
        nb = nxt[b]
        prv[b] = nxt[b] = -1
        if flags[b] & FLAG_CACHED:
            mgr._uncache(b)
            c[C_EVICTIONS] += 1
        ref[b] = 1
        tok[b] = 0
        last[b] = now
        r = fr
        fr = rn[r]
        rb[r] = b
        rn[r] = s_head[s]
        s_head[s] = r                  # commit: the slot holds b
        lst = loose.get(b)
        if lst is None:
            loose[b] = [r]
        else:
            lst.append(r)
        ids.append(b)
        b = nb
    nxt[HEAD] = b
    prv[b] = HEAD
    c[C_FREE_REF] = fr
    c[C_FREE_REFS] -= n
    c[C_NUM_FREE] -= n
    s_count[s] += n
    return ids


def free_loose(mgr, ids) -> int:
    """Drop one loose reference per id, in order (caller checked they are held).

    Returns:
        How many blocks became free.
    """
    p = mgr._p
    nxt, prv, ref, flags, _, _, rb, rn, c, s_head, s_count, HEAD, TAIL = p.hot
    s = p.slot
    loose = mgr._refs.loose
    fr = c[C_FREE_REF]
    freed = 0
    nrefs = p.layout.max_refs
    k = 0
    for b in ids:
        # checks first (every id read from shared memory), then the change
        recs = loose[b]
        r, h = recs[-1], s_head[s]
        if not (0 <= r < nrefs and 0 <= h < nrefs):
            _abort_free(p, c, fr, k, freed, s_count, s)
            raise p.corrupt(f"slot {s}'s loose list: record {r} or head {h} out of range")
        if r != h:
            hb = rb[h]
            lst = loose.get(hb)
            if not lst or h not in lst:
                _abort_free(p, c, fr, k, freed, s_count, s)
                raise p.corrupt(f"slot {s}'s loose list head {h} (block {hb}) is not among "
                                "the references this manager holds")
        if ref[b] == 1:
            nb = prv[TAIL] if flags[b] & FLAG_CACHED else nxt[HEAD]
            if not (0 < nb < HEAD or nb == (HEAD if flags[b] & FLAG_CACHED else TAIL)):
                _abort_free(p, c, fr, k, freed, s_count, s)
                raise p.corrupt(f"free list: an end links to {nb}")
        recs.pop()
        if not recs:
            del loose[b]
        if r != h:
            # Move the head's block into r, then pop the head: O(1) removal
            # from a singly linked list.
            rb[r] = hb
            lst[lst.index(h)] = r
        s_head[s] = rn[h]              # commit: b's reference is gone
        rb[h] = -1
        rn[h] = fr
        fr = h
        x = ref[b] - 1
        ref[b] = x
        if x == 0:
            freed += 1
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
        k += 1
    c[C_FREE_REF] = fr
    c[C_FREE_REFS] += k
    c[C_NUM_FREE] += freed
    s_count[s] -= k
    return freed


def _abort_free(p, c, fr, k, freed, s_count, s) -> None:
    # Corruption met after k references were dropped: account for those, so
    # that what was done stays consistent (the repair that follows rebuilds
    # everything from the records anyway).
    c[C_FREE_REF] = fr
    c[C_FREE_REFS] += k
    c[C_NUM_FREE] += freed
    s_count[s] -= k
