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

Names, not indexes: ``WORDS`` is the one map from a counter's name to its
word; code above this module names counters (``Counters.add("l2_hits",
3)``, ``Counters.word("tokens")`` for the index the C accelerator's
``add_counter(i, n)`` takes), and an unknown name is a ValueError naming it.
The fields are declared below as well, so that mypy checks every counter
name (a misspelt one is an error); the class checks at import that the
declared names are ``WORDS``' own.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Dict, Type, TypeVar

from . import layout as L

# Counter name -> its word (int64 index in the counters section): every
# ``C_*`` word of layout (``COUNTER_WORDS``) and the L2 tier's as
# ``l2_<name>`` (``C_L2``). The one map: the fields below, ``word`` and
# ``add`` all read it.
WORDS: Dict[str, int] = {**L.COUNTER_WORDS, **{f"l2_{n}": i for n, i in L.C_L2.items()}}
# the counters layers above the pool add to (``PoolAdmin.add_counters``):
# the L2 tier's; the pool's own (below word 16) only the pool writes
SHARED_WORDS = frozenset(f"l2_{n}" for n in L.C_L2)


def _fields() -> list:
    """One int64 field per counter word, named as ``WORDS`` names it
    (``_spare<i>`` for the unused)."""
    name_at = {i: n for n, i in WORDS.items()}
    return [(name_at.get(i, f"_spare{i}"), ctypes.c_int64) for i in range(L.NUM_COUNTERS)]


_T = TypeVar("_T")

if TYPE_CHECKING:
    class _Words:
        """What mypy sees of ``ctypes.Structure`` here: the constructors
        used, and no ``__getattr__`` (the Structure stub's returns Any for
        any name), so that a misspelt counter name is an error."""

        def __init__(self, *args: Any, **kw: Any) -> None: ...

        @classmethod
        def from_buffer(cls: Type[_T], source: Any, offset: int = 0) -> _T: ...

        @classmethod
        def from_address(cls: Type[_T], address: int) -> _T: ...
else:
    _Words = ctypes.Structure


class Counters(_Words):
    """The counter words of one pool, by name: build it over the counters
    section with ``Counters.from_buffer(buffer, layout.counters_off)``
    (``MappedViews`` does: ``pool.counters``), or ``from_address`` over a
    read-only mapping (``PoolView``'s: never written then)."""

    _fields_ = _fields()

    # The fields, declared for mypy (the ctypes fields above are what runs;
    # the class body checks at import that these are ``WORDS``' names).
    # The pool's own words (layout's C_*):
    dirty: int
    num_free: int
    free_ref: int
    hits: int
    misses: int
    cow: int
    evictions: int
    recoveries: int
    reclaimed: int
    lock_wait_ns: int
    num_tables: int
    ops: int
    free_refs: int
    epoch: int
    holder: int
    tokens: int
    turn_next: int
    turn_now: int
    pure: int
    # the L2 tier's (layout.C_L2, as l2_<name>):
    l2_lookups: int
    l2_hits: int
    l2_misses: int
    l2_read_bytes: int
    l2_writes: int
    l2_written_bytes: int
    l2_dropped: int
    l2_rejected: int
    l2_timeouts: int
    l2_errors: int
    l2_outages: int

    # ---- names ---------------------------------------------------------------
    @staticmethod
    def word(name: str) -> int:
        """The word (index in the counters section) of counter ``name``.

        Raises:
            ValueError: ``name`` is no counter's.
        """
        try:
            return WORDS[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown counter {name!r} (the counters: "
                             f"{', '.join(WORDS)})") from None

    def add(self, name: str, n: int) -> None:
        """Counter ``name`` += ``n`` (a plain read and store: the caller holds
        the pool lock). Raises ValueError for an unknown name."""
        self.word(name)
        setattr(self, name, getattr(self, name) + int(n))

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


assert ctypes.sizeof(Counters) == L.NUM_COUNTERS * 8   # type: ignore[arg-type]
assert set(Counters.__annotations__) == set(WORDS), (   # the declared fields are WORDS'
    set(Counters.__annotations__) ^ set(WORDS))
