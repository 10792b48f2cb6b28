"""One mapped pool and what keeps it whole across crashes.

``pool.Pool`` maps a segment and hands out named views of its regions
(``Pool.views``, a ``MappedViews``); its slot is ``Pool.slot_ops``.
Every process that attaches holds one slot; ``holder.Holder`` is this
process's side of it (its slot, references, loose map, epoch), and
``reserve.Reserves`` its per-process stock of free blocks taken in batches.

Crash consistency lives here, in one place: ``recovery`` is the one function
that repairs a pool whose lock holder died mid-update (the dirty mark says
so), and ``reclaim`` returns what a dead process held (its slot's references
and reserves) to the free list. Both run under the pool lock, both are
idempotent, and both are exercised by the kill tests.

``inspect_pool`` builds a read-only view of a pool from a snapshot or a live
mapping, without taking a slot or the lock: ``shmcache fsck`` and
``/metrics`` read through it.
"""
