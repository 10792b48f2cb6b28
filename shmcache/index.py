"""Open-addressing hash index in shared memory.

Used twice: chain hash -> block_id (the prefix cache, several blocks per hash
allowed) and request id -> table index. Keys live in the records the entries
point at, so an entry is one int32; -1 marks an empty slot.

Invariant: every live entry is reachable from its home slot by linear
probing without crossing an empty slot.
NOTE: deletion shifts later entries back (no tombstones), which keeps the
invariant without ever needing a rehash; recovery rebuilds the index from
the records, so a holder dying mid-shift loses nothing.
"""

from __future__ import annotations


class OpenIndex:
    """``slots`` is an int32 memoryview of power-of-two length.

    ``home_of(entry) -> int`` gives an entry's 64-bit key hash and
    ``matches(entry, key) -> bool`` compares an entry's key with ``key``.
    """

    __slots__ = ("slots", "mask", "home_of", "matches")

    def __init__(self, slots, home_of, matches) -> None:
        self.slots = slots
        self.mask = len(slots) - 1
        self.home_of = home_of
        self.matches = matches

    def find(self, key, home: int) -> int:
        """First entry matching ``key``, or -1."""
        s, m = self.slots, self.mask
        i = home & m
        while True:
            e = s[i]
            if e < 0:
                return -1
            if self.matches(e, key):
                return e
            i = (i + 1) & m

    def find_all(self, key, home: int) -> list:
        s, m = self.slots, self.mask
        i = home & m
        out = []
        while True:
            e = s[i]
            if e < 0:
                return out
            if self.matches(e, key):
                out.append(e)
            i = (i + 1) & m

    def insert(self, entry: int, home: int) -> None:
        s, m = self.slots, self.mask
        i = home & m
        while s[i] >= 0:
            i = (i + 1) & m
        s[i] = entry

    def remove(self, entry: int, home: int) -> bool:
        s, m = self.slots, self.mask
        i = home & m
        while True:
            e = s[i]
            if e < 0:
                return False
            if e == entry:
                break
            i = (i + 1) & m
        j = i
        while True:
            j = (j + 1) & m
            e = s[j]
            if e < 0:
                break
            k = self.home_of(e) & m
            # e may move back to i unless its home lies cyclically in (i, j]
            if (i < k <= j) if i <= j else (k > i or k <= j):
                continue
            s[i] = e
            i = j
        s[i] = -1
        return True

    def count(self) -> int:
        return sum(1 for e in self.slots if e >= 0)
