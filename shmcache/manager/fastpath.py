"""The reference of the fused hot paths: allocating blocks into a manager's
loose references, and freeing a batch of them.

``_hot`` (``_native/hot_loose.h``) does each in one C call; this module
says what that call must do, built from the same primitives every other
operation uses (``core.BlockLedger.pop_free``, ``refs.RefStore.add_loose`` /
``drop_loose``, ``reclaim.release_block``), and it is what runs with
``SHMCACHE_PURE=1``. tests/test_mutex.py and tests/test_hot.py compare the
state both leave.

NOTE: crash consistency is the primitives': a slot's loose list changes
only by its owner, and a dead owner's list is released whole; everything
else (ref counts, the free list, the chunk free list) is rebuilt from the
lists by recovery. Corruption met midway raises ``CorruptPoolError`` after
the pool has repaired itself (``Pool.corrupt``).
"""

from __future__ import annotations

from ..shm.layout import held_mark
from ..pool.reclaim import release_block


def alloc_loose(holder, pop_free, n: int) -> list:
    """Pop ``n`` blocks (``pop_free()``: one off the free list, counted
    once) into ``holder``'s loose references, in free-list order (the
    caller checked that they are free and the chunks suffice)."""
    ids = []
    p, refs = holder.pool, holder.refs
    mark = held_mark(p.slot, p.layout.max_slots)
    for _ in range(n):
        b = pop_free()
        p.b_prev[b] = mark          # allocated loose: the owner may reserve it
        refs.add_loose(b)
        ids.append(b)
    return ids


def free_loose(holder, free_queue, ids) -> int:
    """Drop one of ``holder``'s loose references per id, in order (the
    caller checked they are held), returning blocks to ``free_queue``.

    Returns:
        How many blocks became free.
    """
    p, refs = holder.pool, holder.refs
    freed = 0
    for b in ids:
        refs.drop_loose(b)
        release_block(p, free_queue, b)
        freed += p.b_ref[b] == 0
    return freed
