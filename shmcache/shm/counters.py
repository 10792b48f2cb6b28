"""The pool's counters by name: one object over the counter words.

The counters are ``layout``'s ``C_*`` words (int64, one each, in the
counters section; the byte map says which are derived and rebuilt by
recovery). ``Counters`` has one property per counter, named after its
constant in lower case (``C_NUM_FREE`` is ``num_free``): the list is
``layout.COUNTER_WORDS``, built from those constants, never kept a second
time. A property reads the word (a Python int) and, assigned, sets it:
assignment is for the writes that *set* a counter (initialising the pool,
recovery's recount). A change that records an event is a named method
(``count_eviction``, ``bump_epoch``, ``free_list_grew``, ...), so that the
call site says what the write means.

The words are read and written without atomics (``+=`` is a read and a
store): every write here is made under the pool lock, as the byte map
requires, except ``C_TOKENS``'s, which goes through ``hot_ops``
(``add_counter``: atomic where the C accelerator is). Reads without the
lock are statistics (each word is aligned, never torn; a set of them is
not one instant).

Cost: a property is a Python call (about 40 ns more than indexing the
words); the few loops that touch a counter once per block (the free list,
the chunk area) call one method per block, as they indexed the words twice
before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import layout as L


class Counters:
    """The counter words of one pool (``words``: a memoryview, or an array,
    of ``layout.NUM_COUNTERS`` int64), by name. Owns nothing but its view
    of the words; ``MappedViews`` builds it (``pool.counters``)."""

    __slots__ = ("words",)

    def __init__(self, words: Any) -> None:
        self.words = words

    if TYPE_CHECKING:
        # (the properties are made below, one per ``layout.COUNTER_WORDS``:
        # to mypy, every counter name is an int)
        def __getattr__(self, name: str) -> int: ...
        def __setattr__(self, name: str, value: int) -> None: ...

    # ---- events (callers hold the pool lock) ---------------------------------
    def count_hits(self, n: int = 1) -> None:
        """``n`` prompt blocks were found in the prefix cache."""
        self.words[L.C_HITS] += n

    def count_misses(self, n: int = 1) -> None:
        """``n`` prompt blocks were looked up and not found."""
        self.words[L.C_MISSES] += n

    def count_cow(self) -> None:
        """A shared block was copied before a write (copy-on-write)."""
        self.words[L.C_COW] += 1

    def count_eviction(self) -> None:
        """A cached block was evicted (taken for reuse, or dropped)."""
        self.words[L.C_EVICTIONS] += 1

    def count_reclaimed(self, n: int) -> None:
        """``n`` references held by dead holders were released."""
        self.words[L.C_RECLAIMED] += n

    def count_recovery(self) -> None:
        """A dirty pool was repaired."""
        self.words[L.C_RECOVERIES] += 1

    def table_created(self) -> None:
        """A block table was created (``num_tables`` + 1)."""
        self.words[L.C_NUM_TABLES] += 1

    def table_dropped(self) -> None:
        """A block table was deleted (``num_tables`` - 1)."""
        self.words[L.C_NUM_TABLES] -= 1

    def bump_epoch(self) -> int:
        """Lists moved under live managers (a repair, a clear, a block taken
        from another slot's reserve): they re-read their loose maps. Returns
        the new epoch."""
        w = self.words
        w[L.C_EPOCH] += 1
        return w[L.C_EPOCH]

    def free_list_grew(self, n: int = 1) -> None:
        """``n`` blocks joined the free list."""
        self.words[L.C_NUM_FREE] += n

    def free_list_shrank(self, n: int = 1) -> None:
        """``n`` blocks left the free list."""
        self.words[L.C_NUM_FREE] -= n

    def chunk_taken(self, next_head: int) -> None:
        """The free chunk list's head chunk was taken; ``next_head`` (-1:
        none) heads it now."""
        w = self.words
        w[L.C_FREE_REF] = next_head
        w[L.C_FREE_REFS] -= 1

    def chunk_given(self, chunk: int) -> None:
        """``chunk`` (already linked to the old head) heads the free chunk
        list now."""
        w = self.words
        w[L.C_FREE_REF] = chunk
        w[L.C_FREE_REFS] += 1

    def pure_attached(self) -> None:
        """A process without the C accelerator took a slot."""
        self.words[L.C_PURE] += 1

    def pure_detached(self) -> None:
        """A process without the C accelerator let its slot go (or died)."""
        w = self.words
        w[L.C_PURE] = max(0, int(w[L.C_PURE]) - 1)

    # ---- the pool lock's (lock.PoolLock, on every hold) ----------------------
    def begin_hold(self, slot: int) -> bool:
        """A lock hold begins. False when the pool is dirty (nothing written:
        the repair runs, and a dirty pool keeps the holder that left it so);
        else ``slot`` is recorded as the holder and the dirty mark set."""
        w = self.words
        if w[L.C_DIRTY]:
            return False
        w[L.C_HOLDER] = slot
        w[L.C_DIRTY] = 1
        return True

    def end_hold(self, keep_dirty: int) -> None:
        """A lock hold ends cleanly: counted; the dirty mark becomes
        ``keep_dirty``, and without it the pool records no holder."""
        w = self.words
        w[L.C_OPS] += 1
        w[L.C_DIRTY] = keep_dirty
        if not keep_dirty:
            w[L.C_HOLDER] = -1

    def mark_dirty(self) -> None:
        """The pool needs a repair by its next lock holder (or this one)."""
        self.words[L.C_DIRTY] = 1

    def note_lock_wait(self, waited_ns: int) -> None:
        """A wait for the pool lock of ``waited_ns``: kept if the longest."""
        w = self.words
        if waited_ns > w[L.C_LOCK_WAIT_NS]:
            w[L.C_LOCK_WAIT_NS] = waited_ns

    def reset_stats(self, cow: bool = True) -> None:
        """Zero the hit, miss, eviction (and, with ``cow``, copy-on-write)
        statistics."""
        w = self.words
        w[L.C_HITS] = w[L.C_MISSES] = w[L.C_EVICTIONS] = 0
        if cow:
            w[L.C_COW] = 0

    def l2(self) -> dict:
        """The pool-wide L2 counters (``layout.L2_COUNTERS``) by name."""
        w = self.words
        return {name: int(w[i]) for name, i in L.C_L2.items()}

    @property
    def lock_queue(self) -> int:
        """Fused operations waiting for their turn at the lock now."""
        w = self.words
        return max(0, int(w[L.C_TURN_NEXT]) - int(w[L.C_TURN_NOW]))


def _word(name: str, index: int) -> property:
    def get(self: Counters) -> int:
        return self.words[index]

    def put(self: Counters, value: int) -> None:
        self.words[index] = value

    return property(get, put, doc=f"Counter C_{name.upper()} (word {index}).")


for _name, _index in L.COUNTER_WORDS.items():
    setattr(Counters, _name, _word(_name, _index))
del _name, _index
