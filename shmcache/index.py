"""Open-addressing hash index in shared memory.

Used twice: chain hash -> block_id (the prefix cache, several blocks per hash
allowed) and request id -> table index. Keys live in the records the entries
point at, so an entry is one int32; -1 marks an empty slot.

Invariant: every live entry is reachable from its home slot by linear
probing without crossing an empty slot.
Every probe stops after one full round of the table (corruption, see
``OpenIndex``), never loops.
NOTE: deletion shifts later entries back (no tombstones), which keeps the
invariant without ever needing a rehash; recovery rebuilds the index from
the records, so a holder dying mid-shift loses nothing.
"""

from __future__ import annotations

from .errors import CorruptPoolError


def _corrupt(what: str) -> Exception:
    return CorruptPoolError(what)


class OpenIndex:
    """``slots`` is an int32 memoryview of power-of-two length.

    ``home_of(entry) -> int`` gives an entry's 64-bit key hash and
    ``matches(entry, key) -> bool`` compares an entry's key with ``key``.
    Entries must lie in ``[0, limit)``.

    Every probe is bounded: a run longer than the table, or an entry out of
    range, is corruption (the table holds fewer entries than slots, so a
    sound one always has an empty slot), reported through ``corrupt(what)
    -> Exception``, which the pool gives so that it can mark itself for
    repair first.
    """

    __slots__ = ("slots", "mask", "home_of", "matches", "limit", "corrupt", "name")

    def __init__(self, slots, home_of, matches, limit: int = 2**31 - 1,
                 corrupt=_corrupt, name: str = "index") -> None:
        self.slots = slots
        self.mask = len(slots) - 1
        self.home_of = home_of
        self.matches = matches
        self.limit = limit
        self.corrupt = corrupt
        self.name = name

    def _bad_entry(self, e: int, i: int) -> Exception:
        return self.corrupt(f"{self.name} slot {i} holds {e}, not one of its {self.limit} "
                            "entries")

    def _full(self) -> Exception:
        return self.corrupt(f"{self.name} has no empty slot (a probe went all the way round)")

    def find(self, key, home: int) -> int:
        """First entry matching ``key``, or -1."""
        s, m, lim = self.slots, self.mask, self.limit
        i = home & m
        for _ in range(m + 1):
            e = s[i]
            if e < 0:
                return -1
            if e >= lim:
                raise self._bad_entry(e, i)
            if self.matches(e, key):
                return e
            i = (i + 1) & m
        raise self._full()

    def find_all(self, key, home: int) -> list:
        s, m, lim = self.slots, self.mask, self.limit
        i = home & m
        out = []
        for _ in range(m + 1):
            e = s[i]
            if e < 0:
                return out
            if e >= lim:
                raise self._bad_entry(e, i)
            if self.matches(e, key):
                out.append(e)
            i = (i + 1) & m
        raise self._full()

    def insert(self, entry: int, home: int) -> None:
        s, m = self.slots, self.mask
        i = home & m
        for _ in range(m + 1):
            if s[i] < 0:
                s[i] = entry
                return
            i = (i + 1) & m
        raise self._full()

    def remove(self, entry: int, home: int) -> bool:
        s, m, lim = self.slots, self.mask, self.limit
        i = home & m
        for _ in range(m + 1):
            e = s[i]
            if e < 0:
                return False
            if e == entry:
                break
            i = (i + 1) & m
        else:
            raise self._full()
        j = i
        for _ in range(m + 1):
            j = (j + 1) & m
            e = s[j]
            if e < 0:
                break
            if e >= lim:
                raise self._bad_entry(e, j)
            k = self.home_of(e) & m
            # e may move back to i unless its home lies cyclically in (i, j]
            if (i < k <= j) if i <= j else (k > i or k <= j):
                continue
            s[i] = e
            i = j
        else:
            raise self._full()
        s[i] = -1
        return True

    def count(self) -> int:
        return sum(1 for e in self.slots if e >= 0)
