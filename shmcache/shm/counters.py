"""The pool's counters by name: one object over the counter words.

The counters are ``layout``'s ``C_*`` words (int64, one each, in the
counters section; the byte map says which are derived and rebuilt by
recovery). ``Counters`` has one property per counter, named after its
constant in lower case (``C_NUM_FREE`` is ``num_free``): the list is
``layout.COUNTER_WORDS``, built from those constants, never kept a second
time. A field reads the word (a Python int) and, assigned, sets it:
assignment is for the writes that *set* a counter (initialising the pool,
recovery's recount) and for the structures that keep their own counter in
step, once per block or per hold (the free list's ``num_free``, the chunk
area's ``free_ref``/``free_refs``, the lock's ``dirty``/``holder``/``ops``:
a method call there would cost each about 50 ns more). A change that
records an event elsewhere is a named method (``count_eviction``,
``bump_epoch``, ``table_created``, ...), so that the call site says what the
write means.

The words are read and written without atomics (``+=`` is a read and a
store): every write here is made under the pool lock, as the byte map
requires, except ``C_TOKENS``'s, which goes through ``hot_ops``
(``add_counter``: atomic where the C accelerator is). Reads without the
lock are statistics (each word is aligned, never torn; a set of them is
not one instant).

It is a ``ctypes.Structure`` laid over the counters section (``from_buffer``
on the mapping: live, no copy), its fields generated from
``layout.COUNTER_WORDS`` (the L2 tier's words are ``l2_<name>``, the unused
ones ``_spare<i>``): a field is read and written in C, as fast as indexing
the words (about 20 ns; a Python property costs 55). A named write is one
Python call.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from . import layout as L


def _fields() -> list:
    """One int64 field per counter word, named as ``COUNTER_WORDS`` names it
    (``l2_<name>`` for the L2 tier's, ``_spare<i>`` for the unused)."""
    name_at = {i: n for n, i in L.COUNTER_WORDS.items()}
    name_at.update({i: f"l2_{n}" for n, i in L.C_L2.items()})
    return [(name_at.get(i, f"_spare{i}"), ctypes.c_int64) for i in range(L.NUM_COUNTERS)]


class Counters(ctypes.Structure):
    """The counter words of one pool, by name: build it over the counters
    section with ``Counters.from_buffer(buffer, layout.counters_off)``
    (``MappedViews`` does: ``pool.counters``), or ``from_address`` over a
    read-only mapping (``PoolView``'s: never written then)."""

    _fields_ = _fields()

    if TYPE_CHECKING:
        # (the fields are made from ``layout.COUNTER_WORDS``: to mypy, every
        # counter name is an int; the three the methods below set as well as
        # read are declared)
        def __getattr__(self, name: str) -> int: ...
        def __setattr__(self, name: str, value: int) -> None: ...
        dirty: int
        holder: int
        lock_wait_ns: int

    # ---- events (callers hold the pool lock) ---------------------------------
    def count_hits(self, n: int = 1) -> None:
        """``n`` prompt blocks were found in the prefix cache."""
        self.hits += n

    def count_misses(self, n: int = 1) -> None:
        """``n`` prompt blocks were looked up and not found."""
        self.misses += n

    def count_cow(self) -> None:
        """A shared block was copied before a write (copy-on-write)."""
        self.cow += 1

    def count_eviction(self) -> None:
        """A cached block was evicted (taken for reuse, or dropped)."""
        self.evictions += 1

    def count_reclaimed(self, n: int) -> None:
        """``n`` references held by dead holders were released."""
        self.reclaimed += n

    def count_recovery(self) -> None:
        """A dirty pool was repaired."""
        self.recoveries += 1

    def table_created(self) -> None:
        """A block table was created (``num_tables`` + 1)."""
        self.num_tables += 1

    def table_dropped(self) -> None:
        """A block table was deleted (``num_tables`` - 1)."""
        self.num_tables -= 1

    def bump_epoch(self) -> int:
        """Lists moved under live managers (a repair, a clear, a block taken
        from another slot's reserve): they re-read their loose maps. Returns
        the new epoch."""
        self.epoch += 1
        return self.epoch

    def pure_attached(self) -> None:
        """A process without the C accelerator took a slot."""
        self.pure += 1

    def pure_detached(self) -> None:
        """A process without the C accelerator let its slot go (or died)."""
        self.pure -= min(1, self.pure)          # (to 0 from below 1)

    # ---- the pool lock's (``lock.PoolLock`` sets ``dirty``, ``holder`` and
    # ``ops`` itself on every hold, field by field: a call costs more) -----
    def mark_dirty(self) -> None:
        """The pool needs a repair by its next lock holder (or this one)."""
        self.dirty = 1

    def note_lock_wait(self, waited_ns: int) -> None:
        """A wait for the pool lock of ``waited_ns``: kept if the longest."""
        if waited_ns > self.lock_wait_ns:
            self.lock_wait_ns = waited_ns

    def reset_stats(self, cow: bool = True) -> None:
        """Zero the hit, miss, eviction (and, with ``cow``, copy-on-write)
        statistics."""
        self.hits = self.misses = self.evictions = 0
        if cow:
            self.cow = 0

    def l2(self) -> dict:
        """The pool-wide L2 counters (``layout.L2_COUNTERS``) by name."""
        return {name: getattr(self, f"l2_{name}") for name in L.C_L2}

    @property
    def lock_queue(self) -> int:
        """Fused operations waiting for their turn at the lock now."""
        return max(0, self.turn_next - self.turn_now)


assert ctypes.sizeof(Counters) == L.NUM_COUNTERS * 8
