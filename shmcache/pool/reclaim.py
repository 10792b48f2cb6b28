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

import errno
import os

import numpy as np

from ..shm import layout as L
from ..shm.claims import claim, detach_pure
from ..shm.freelist import SharedFreeQueue
from ..errors import CorruptPoolError, PoolClosedError
from ..shm.refs import RefStore, unlink_table
from ..shm.slots import live_pools


def release_block(p, fq: SharedFreeQueue, b: int) -> None:
    """Drop one reference to block ``b`` (already removed from its list)."""
    r = p.b_ref[b] - 1
    if r < 0:
        raise p.corrupt(f"block {b} is referenced but its ref_count is {r + 1}")
    p.b_ref[b] = r
    if r == 0:
        p.add_tokens(-(p.b_tok[b]))       # as the seed's free_block
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
    marks = (L.held_mark(slot, p.layout.max_slots), L.stash_mark(slot))
    for b in refs.pop_slot_loose(slot):
        if p.b_prev[b] in marks:
            p.b_prev[b] = -1        # its reserve too: reserved blocks are loose references
        release_block(p, fq, b)
        n += 1
    p.slots["reserved"][slot] = 0
    detach_pure(p, slot)
    owned = np.flatnonzero((p.tables["state"] == 1) & (p.tables["owner"] == slot)).tolist()
    for t in owned:
        claim(p, t)             # (a dead owner's, mid-append, is taken over)
        unlink_table(p, t)
        for b in reversed(refs.pop_table(t)):
            release_block(p, fq, b)
            n += 1
    # a claim the slot left on a record not its own (a stale append's probe)
    cl = p.tables["claim"]
    cl[cl == slot + 1] = 0
    return n


def orphan_tables(p) -> list:
    """Live tables whose owner is no attached slot (a corrupted owner
    field: a slot's tables are released before the slot is freed, so only a
    flipped word makes one): nobody would ever release their blocks."""
    t = p.tables
    ow = t["owner"].astype(np.int64)
    ok = (ow >= 0) & (ow < p.layout.max_slots)
    attached = np.zeros(len(ow), bool)
    attached[ok] = p.slots["state"][ow[ok]] == 1
    return np.flatnonzero((t["state"] == 1) & ~attached).tolist()


def release_orphan_tables(p, refs: RefStore) -> int:
    """Release every table ``orphan_tables`` finds, as a dead owner's."""
    fq = SharedFreeQueue(p)
    n = 0
    for t in orphan_tables(p):
        claim(p, t)
        unlink_table(p, t)
        for b in reversed(refs.pop_table(t)):
            release_block(p, fq, b)
            n += 1
    return n


def reclaim_dead_slots(p, refs: RefStore | None = None) -> int:
    """Release everything dead processes hold and free their slots, and the
    tables whose owner is no attached slot.

    Returns:
        The number of references released (also added to ``C_RECLAIMED``).
    """
    refs = refs if refs is not None else RefStore(p)
    n = 0
    for s in p.slot_ops.dead_slots():
        n += release_slot_holdings(p, refs, s)
        p.slots["state"][s] = 0
    n += release_orphan_tables(p, refs)
    p.counters.count_reclaimed(n)
    return n


def _locked_here_through_another(p) -> bool:
    """Whether this thread holds (or is taking) the lock of ``p``'s segment
    through another manager of this process. The mutex belongs to the thread
    that took it, so taking ``p``'s own lock would then fail with EDEADLK
    (a finalizer run by the GC inside that manager's op)."""
    try:
        st = os.fstat(p.fd)
    except OSError:
        return False
    for q in list(live_pools):
        if q is p or q.closed or q.forked or not q.lock.owned_here():
            continue
        try:
            sq = os.fstat(q.fd)
        except OSError:
            continue
        if (sq.st_dev, sq.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def close(p, refs: RefStore, destroy: bool, finalizing: bool = False) -> None:
    """Close a manager's pool: release what its slot holds and free the slot,
    then unmap (and unlink the segment when ``destroy`` and it created it).

    Run by ``close``/``destroy`` and by the manager's finalizer
    (``finalizing``). Where the lock cannot be taken (this thread holds it
    through another manager of the same segment), it leaves as a death
    would: drops its liveness byte, and the next reclaim releases its
    holdings.
    """
    as_dead = (finalizing and not (p.closed or p.forked)
               and _locked_here_through_another(p))
    if as_dead and p.slot >= 0:
        # Leave as a death would: drop the liveness byte now, and whoever
        # reclaims next releases what this manager held.
        p.slot_ops.drop_liveness()
    if p.closed or p.forked or as_dead:
        if destroy and p.creator and not p.private:
            from ..shm import segment
            segment.unlink(p.name)
        p.unmap()
        return
    try:
        with p.lock:
            try:
                release_slot_holdings(p, refs, p.slot)
            except CorruptPoolError:
                # Pool.corrupt has rebuilt the derived state from the lists:
                # release what they now hold.
                release_slot_holdings(p, refs, p.slot)
            p.release_slot()
            # before the lock is released: a thread waiting for it must not
            # run an operation with no slot (slot -1 is another's slot)
            p.lock.unusable = True
    except PoolClosedError:
        pass                    # another thread closed it while we waited
    except OSError as e:
        # EDEADLK: this thread holds the pool mutex through a C fast path
        # of another manager (a finalizer run by the GC inside it). Leave as
        # a death would; whoever reclaims next releases what we held.
        if e.errno != errno.EDEADLK or p.slot < 0:
            raise
        p.slot_ops.drop_liveness()
    finally:
        if destroy and p.creator and not p.private:
            from ..shm import segment
            segment.unlink(p.name)
        p.unmap()
