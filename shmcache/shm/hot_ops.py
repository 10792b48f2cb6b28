"""``HotOps``: a pool's hot operations behind one interface, chosen once
when the pool is mapped (``pool.Pool.ops``).

Two implementations:

- ``NativeOps``: the C accelerator (``_hot.Hot``, shmcache/_native); each
  operation is the compiled method itself, called as it always was;
- ``ReferenceOps``: the Python reference, with ``SHMCACHE_PURE=1`` or
  where no compiled module fits this layout.

The contract of every fused operation (the slow path, handled in one
place): it does the whole operation and returns its result, or returns
None having changed nothing, and the caller's locked Python path does it
(or raises for what it refused). The reference's fused operations always
return None: the locked Python paths are the reference (``fastpath.py``
for alloc/free, the owners' methods for the rest), and the differential
tests (tests/test_hot*.py, test_mutex.py, test_stateful.py) run both and
compare the state they leave.

Adding an operation: a method here (its reference behaviour), the C method
of the same name and arguments (shmcache/_native), the call in the owner
that uses it (one ``result is None`` test), a case in a differential test.
CONTRIBUTING.md says more.
"""

from __future__ import annotations

from typing import Any, Optional


class ReferenceOps:
    """The Python reference of a pool's hot operations.

    ``counters`` and ``claims`` are the pool's counter and table-claim views
    (``pool.MappedViews``): the operations that are not fused (a counter
    addition, giving a claim back) act on them here, under the pool lock
    as every pure process's writes are.
    """

    native = False      # whether these run in C (a compare-and-swap exists)

    def __init__(self, counters: Any, claims: Any) -> None:
        self.counters = counters
        self.claims = claims

    # ---- loose references (fastpath.py is the locked reference)
    def alloc(self, n: int, slot: int, epoch: int, loose: Any) -> Optional[list]:
        """Allocate ``n`` blocks into this slot's loose references."""
        return None

    def free(self, ids: Any, slot: int, epoch: int, loose: Any) -> Optional[int]:
        """Free loose references; the number of blocks that became free."""
        return None

    def set_reserve(self, cap: int) -> Optional[list]:
        """Set this process's reserve size; the ids the reserve drops (the
        reference keeps no reserve: None, nothing to drop)."""
        return None

    def unstash(self, b: int, slot: int) -> bool:
        """Take block ``b`` out of ``slot``'s reserve (compare-and-swap; the
        reference has none: ``native`` False, and callers skip reserves)."""
        return False

    def add_counter(self, i: int, n: int) -> None:
        """Counter word ``i`` += ``n`` (lock held in a pure process): the
        low-level call, by index as the C method takes it; callers name the
        counter and look its word up once (``Counters.word(name)``)."""
        self.counters[i] += n

    # ---- tables (one hold of the C op's own; the ``table_*`` ones inside the caller's)
    def new_table(self, rid: bytes, rid_hash: int, slot: int, epoch: int) -> Optional[int]:
        return None

    def table_new(self, rid: bytes, rid_hash: int, slot: int) -> Optional[int]:
        return None

    def delete_table(self, rid: bytes, rid_hash: int, slot: int, epoch: int) -> Optional[int]:
        return None

    def table_drop(self, t: int) -> Any:
        return None

    def add_block(self, t: int, rid_hash: int, b: int, tokens: int, block_size: int,
                  now: float, slot: int, epoch: int) -> Optional[int]:
        """Append a block the caller holds no loose reference to; its position."""
        return None

    def append(self, t: int, rid_hash: int, n: int, block_size: int, now: float, slot: int,
               epoch: int) -> Optional[list]:
        return None

    def table_append(self, t: int, n: int, block_size: int, now: float) -> Optional[list]:
        return None

    def table_ids(self, t: int, rid_hash: int, slot: int, epoch: int) -> Optional[list]:
        return None

    def claim_table(self, t: int) -> Optional[int]:
        """One attempt at table ``t``'s claim (claims.py says what it returns)."""
        return None

    def unclaim_table(self, t: int) -> None:
        """Give table ``t``'s claim back, if this hold has it."""
        if self.claims[t] == -1:
            self.claims[t] = 0

    # ---- prefix cache
    def acquire(self, t: int, rid_hash: int, hashes: bytes, now: float, block_size: int,
                slot: int, epoch: int) -> Optional[list]:
        return None

    def table_take(self, t: int, found: list, now: float, tokens: int) -> Any:
        return None

    def publish(self, ids: list, hashes: bytes, block_size: int, slot: int,
                epoch: int) -> Any:
        return None

    def lookup(self, hashes: bytes, now: float, slot: int, epoch: int) -> Optional[list]:
        return None

    def find_chain(self, hashes: list) -> Optional[list]:
        return None


# the operations NativeOps takes from the compiled object, by name: every
# public method of the reference (one list, the class itself)
OPERATIONS = tuple(name for name, value in vars(ReferenceOps).items()
                   if callable(value) and not name.startswith("_"))


class NativeOps(ReferenceOps):
    """The C accelerator's operations: each attribute in ``OPERATIONS`` is
    the compiled object's method itself (no Python call in between). A
    build without one of them fails here, at attach (``lock.open_hot`` takes
    only a build made for this layout, which has them all)."""

    native = True

    def __init__(self, hot: Any, counters: Any, claims: Any) -> None:
        super().__init__(counters, claims)
        self.hot = hot
        for name in OPERATIONS:
            setattr(self, name, getattr(hot, name))

