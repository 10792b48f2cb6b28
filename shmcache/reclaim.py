"""Releasing what a slot holds: a closing manager's references, and a dead
process's.

A slot's holdings are its loose list and the block tables it owns (both in
``refs``). Releasing one reference lowers the block's ``ref_count``; at zero
the block goes back to the free list: a cached block to the tail (it stays
findable until reused, least recently freed first), an uncached one to the
head (reused first). Callers hold the pool lock.

NOTE: every step here is one of the same commits the live operations make
(a list shrinks, then the count drops), so a holder killed while releasing
leaves a pool that ``recovery.repair`` rebuilds from the lists: nothing is
released twice, nothing is lost.
"""

from __future__ import annotations

import numpy as np

from . import layout as L
from .freelist import SharedFreeQueue
from .refs import RefStore, unlink_table


def release_block(p, fq: SharedFreeQueue, b: int) -> None:
    """Drop one reference to block ``b`` (already removed from its list)."""
    r = p.b_ref[b] - 1
    if r < 0:
        raise p.corrupt(f"block {b} is referenced but its ref_count is {r + 1}")
    p.b_ref[b] = r
    if r == 0:
        p.c[L.C_TOKENS] -= p.b_tok[b]       # as the seed's free_block
        if p.b_flags[b] & L.FLAG_CACHED:
            fq.append_id(b)
        else:
            fq.appendleft_id(b)


def release_slot_holdings(p, refs: RefStore, slot: int) -> int:
    """Release every reference ``slot`` holds: its loose list, then its
    tables (each tail first, so a prefix chain's head is reused last).

    Returns:
        The number of references released.
    """
    fq = SharedFreeQueue(p)
    n = 0
    for b in refs.pop_slot_loose(slot):
        release_block(p, fq, b)
        n += 1
    owned = np.flatnonzero((p.tables["state"] == 1) & (p.tables["owner"] == slot)).tolist()
    for t in owned:
        unlink_table(p, t)
        for b in reversed(refs.pop_table(t)):
            release_block(p, fq, b)
            n += 1
    return n


def reclaim_dead_slots(p, refs: RefStore | None = None) -> int:
    """Release everything dead processes hold and free their slots.

    Returns:
        The number of references released (also added to ``C_RECLAIMED``).
    """
    refs = refs if refs is not None else RefStore(p)
    n = 0
    for s in p.dead_slots():
        n += release_slot_holdings(p, refs, s)
        p.slots["state"][s] = 0
    p.c[L.C_RECLAIMED] += n
    return n
