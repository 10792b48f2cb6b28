"""The prefix index, and the open-addressing hash index it is built on.

``OpenIndex`` is used twice: chain hash -> block_id (the prefix cache, several
blocks per hash allowed; ``PrefixIndex`` owns it) and request id -> table
(the tables' index). Keys live in the records the entries
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

import numpy as np

from ..errors import CorruptPoolError
from .layout import BLOCK_DTYPE, BLOCK_HASH_OFF, FLAG_CACHED, HASH_BYTES


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

    def bad_entry_error(self, e: int, i: int) -> Exception:
        return self.corrupt(f"{self.name} slot {i} holds {e}, not one of its {self.limit} "
                            "entries")

    def full_error(self) -> Exception:
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
                raise self.bad_entry_error(e, i)
            if self.matches(e, key):
                return e
            i = (i + 1) & m
        raise self.full_error()

    def find_all(self, key, home: int) -> list:
        s, m, lim = self.slots, self.mask, self.limit
        i = home & m
        out: list = []
        for _ in range(m + 1):
            e = s[i]
            if e < 0:
                return out
            if e >= lim:
                raise self.bad_entry_error(e, i)
            if self.matches(e, key):
                out.append(e)
            i = (i + 1) & m
        raise self.full_error()

    def insert(self, entry: int, home: int) -> None:
        s, m = self.slots, self.mask
        i = home & m
        for _ in range(m + 1):
            if s[i] < 0:
                s[i] = entry
                return
            i = (i + 1) & m
        raise self.full_error()

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
            raise self.full_error()
        j = i
        for _ in range(m + 1):
            j = (j + 1) & m
            e = s[j]
            if e < 0:
                break
            if e >= lim:
                raise self.bad_entry_error(e, j)
            k = self.home_of(e) & m
            # e may move back to i unless its home lies cyclically in (i, j]
            if (i < k <= j) if i <= j else (k > i or k <= j):
                continue
            s[i] = e
            i = j
        else:
            raise self.full_error()
        s[i] = -1
        return True

    def count(self) -> int:
        return sum(1 for e in self.slots if e >= 0)


class PrefixIndex:
    """The prefix cache's index over one pool: chain hash -> cached block.

    A block is *cached* when its record has ``FLAG_CACHED`` and its chain
    hash, and the index holds its id. Callers hold the pool lock.

    Invariant: the index holds exactly the blocks flagged cached, each found
    from the hash in its record (``recovery.check`` verifies it and
    ``recovery.repair`` rebuilds the index from the flags).
    NOTE: the probes of ``find_chain`` and ``add_many`` are ``OpenIndex``'s,
    written out: they run once per block of every prompt, and a call per
    probe would double their cost.
    """

    def __init__(self, p) -> None:
        self.p = p
        self.ix = p.hindex
        self._boff = p.layout.blocks_off + BLOCK_HASH_OFF
        self._isz = BLOCK_DTYPE.itemsize

    def _at(self, b: int) -> int:
        return self._boff + b * self._isz

    def hash_of(self, b: int):
        """Block ``b``'s chain hash (16 bytes), or None when it is not cached."""
        if not self.p.b_flags[b] & FLAG_CACHED:
            return None
        o = self._at(b)
        return bytes(self.p.raw[o:o + HASH_BYTES])

    def find(self, h: bytes) -> int:
        """A block cached under ``h``, or -1."""
        if len(h) != HASH_BYTES:
            return -1
        return self.ix.find(h, int.from_bytes(h[:8], "little"))

    def find_chain(self, hashes) -> list:
        """Blocks of the longest cached run of ``hashes``, from the first."""
        p, ix = self.p, self.ix
        slots, mask = ix.slots, ix.mask
        raw, isz, boff = p.raw, self._isz, self._boff
        n = p.layout.max_blocks
        found: list = []
        for h in hashes:
            i = int.from_bytes(h[:8], "little") & mask
            for _ in range(mask + 1):
                e = slots[i]
                if e < 0:
                    return found
                if not 0 < e < n:           # (block 0 is never cached)
                    raise ix.bad_entry_error(e, i)
                if raw[boff + e * isz: boff + e * isz + 16] == h:
                    break
                i = (i + 1) & mask
            else:
                raise ix.full_error()
            found.append(e)
        return found

    def add(self, b: int, h: bytes) -> None:
        """Cache block ``b`` under ``h`` (it must not be cached)."""
        p = self.p
        o = self._at(b)
        p.raw[o:o + HASH_BYTES] = h
        p.b_flags[b] |= FLAG_CACHED
        self.ix.insert(b, int.from_bytes(h[:8], "little"))

    def add_many(self, ids, hashes) -> list:
        """Cache each uncached block of ``ids`` under its hash.

        Returns:
            The ids newly cached (those already cached keep their hash).
        """
        p, ix = self.p, self.ix
        slots, mask = ix.slots, ix.mask
        flags, raw, isz, boff = p.b_flags, p.raw, self._isz, self._boff
        added = []
        for b, h in zip(ids, hashes):
            if flags[b] & FLAG_CACHED:
                continue
            i = int.from_bytes(h[:8], "little") & mask
            for _ in range(mask + 1):
                if slots[i] < 0:
                    break
                i = (i + 1) & mask
            else:
                raise ix.full_error()
            raw[boff + b * isz: boff + b * isz + 16] = h
            flags[b] |= FLAG_CACHED
            slots[i] = b
            added.append(b)
        return added

    def remove(self, b: int) -> None:
        """Uncache block ``b``."""
        p = self.p
        self.ix.remove(b, p.hhome(b))
        p.b_flags[b] &= ~FLAG_CACHED & 0xFFFF

    def cached_ids(self) -> list:
        """Every cached block id, ascending."""
        f = self.p.blocks["flags"][: self.p.layout.max_blocks]
        return np.flatnonzero(f & FLAG_CACHED).tolist()
