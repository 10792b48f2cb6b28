"""Per-process reserves of free blocks: what is done with them under the
pool lock.

A manager with a reserve (``PagedCacheManager.set_reserve(n)``) keeps up to
``n`` blocks it freed for its own next allocations, and takes them back,
without the pool lock (``_native/hot_reserve.h``, which says why that is
safe). A block in a reserve stays a loose reference of its slot; its
``prev`` carries the slot's stash mark (``layout.stash_mark``) and it counts
in the slot's ``reserved`` and as free. This module is the rest, always with
the pool lock held:

- a reserve gives its blocks up when the free list runs short
  (``Reserves.take_from_reserves``, from ``BlockLedger.ensure_free``), when one of its
  blocks is referenced by id (``take_block``), or when it shrinks;
- a slot that is released (its process closed or died) frees its reserve
  with the rest of its loose references (``reclaim.release_slot_holdings``
  clears the marks);
- ``recovery.check`` and ``repair`` check and keep the marks
  (``valid_marks``).

NOTE: taking a block out of another slot's reserve drops that slot's loose
reference, which moves a word of its list: the epoch is bumped so that its
owner re-reads its list (the loose-reference map) before its next locked
operation. Its lock-free operations do not read the map.
"""

from __future__ import annotations

import numpy as np

from ..shm import layout as L
from .reclaim import release_block


def stash_slot(p, b: int) -> int:
    """The slot whose reserve holds block ``b``, or -1."""
    m = L.mark_slot(int(p.b_prev[b]), p.layout.max_slots)
    return m[0] if m is not None and m[1] else -1


def reserved_total(p) -> int:
    """Blocks in the reserves of attached slots (read without the lock: a
    statistic, as the free counter is)."""
    live = p.slots["state"] == 1
    return int(np.maximum(p.slots["reserved"][live], 0).sum(dtype=np.int64))


class Reserves:
    """The reserves as seen from one holder (lock held for every method):
    taking blocks out of them and freeing them. Its collaborators: the
    pool, this process's ``holder.Holder`` and the free list."""

    def __init__(self, pool, holder, free_queue) -> None:
        self.pool = pool
        self.holder = holder
        self.free_queue = free_queue

    def _take_out(self, slot: int, blocks) -> int:
        """Take ``blocks`` out of ``slot``'s reserve and free them: the ones its
        owner did not take back first. Returns how many."""
        p, refs = self.pool, self.holder.refs
        if not p.ops.native:
            return 0        # (SHMCACHE_PURE: no compare-and-swap; they stay reserved)
        unstash = p.ops.unstash
        taken = [b for b in blocks if unstash(b, slot)]
        if not taken:
            return 0
        if slot == p.slot:
            for b in taken:
                refs.drop_loose(b)
        else:
            refs.drop_slot_ids(slot, taken)
            # the owner's map of its list is stale; ours is not (our list did not move)
            self.holder.bump_epoch()
        fq = self.free_queue
        for b in taken:
            release_block(p, fq, b)
        return len(taken)

    def take_from_reserves(self, need: int) -> int:
        """Free up to ``need`` blocks out of the reserves: this process's
        first, then the others'. Returns how many were freed."""
        p, refs = self.pool, self.holder.refs
        if not p.ops.native:
            return 0
        got = 0
        slots = [p.slot] + [s for s in np.flatnonzero(p.slots["state"] == 1).tolist()
                            if s != p.slot]
        for s in slots:
            if got >= need:
                break
            if s < 0 or p.slots["reserved"][s] <= 0:
                continue
            mark = L.stash_mark(s)
            ids = refs.blocks_at(refs.slot_words(s), "slot {}'s loose list", s)
            mine = [b for b in ids if p.b_prev[b] == mark][:need - got]
            got += self._take_out(s, mine)
        return got

    def take_block(self, b: int) -> bool:
        """Take block ``b`` out of whichever reserve holds it, so that it can be
        referenced by id. Whether it was in one."""
        s = stash_slot(self.pool, b)
        return s >= 0 and self._take_out(s, [b]) == 1

    def drain_own(self, blocks) -> int:
        """Free ``blocks`` of this process's reserve (ones its reserve list let
        go: ``set_reserve`` to fewer)."""
        return self._take_out(self.pool.slot, blocks)


def valid_marks(p, owners) -> np.ndarray:
    """Which blocks carry a mark that is right (lock held): a slot's mark
    on a block that slot holds as a loose reference (the stash mark on an
    uncached one only). ``owners`` is ``recovery.reachable_lists``."""
    n, ms = p.layout.max_blocks, p.layout.max_slots
    prev = p.blocks["prev"][:n].astype(np.int64)
    ok = np.zeros(n, bool)
    cached = (p.blocks["flags"][:n] & L.FLAG_CACHED) != 0
    for kind, s, _chunks, ids, _ok in owners:
        if kind != "slot" or not len(ids):
            continue
        ids = np.asarray(ids, dtype=np.int64)
        pv = prev[ids]
        ok[ids[pv == L.held_mark(s, ms)]] = True
        ok[ids[(pv == L.stash_mark(s)) & ~cached[ids]]] = True
    return ok
