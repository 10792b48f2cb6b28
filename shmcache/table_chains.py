"""Where a block appended to a table sits in a prefix chain: the
per-process record that lets the seed's per-block registration
(``register_block_hash(block, that_block's_tokens)``, as vllm-mlx's
``BlockAwarePrefixCache.store_cache`` calls it right after appending the
block to a request's table) key the block by its whole prefix.

The record is this manager's, not the pool's: it only decides which chain
hash a registration publishes, and every use checks it against the table
in shared memory first.

Invariant: ``chain(t)`` is a list of ``(block, hash)`` where entry ``i``
is the block at position ``i`` of table ``t`` and ``hash`` the chain hash
of the tokens up to its end, known right because either this manager
published it there (a registration right after the append, its parent
the entry before) or it came back from a chain lookup of this manager
whose first ``i`` hashes are the entries before. A table position with no
such knowledge ends the record: nothing after it is published from here,
so a block is never published under a prefix it was not computed after.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

Entry = Tuple[int, bytes]


class TableChains:
    """The record (see the module docstring); pure bookkeeping, no lock."""

    __slots__ = ("_rec", "last_add", "_found", "_found_hashes")

    def __init__(self) -> None:
        self._rec: Dict[int, List[Entry]] = {}
        # (table, position, block) of the last block this manager appended
        self.last_add: Optional[Tuple[int, int, int]] = None
        # the last chain lookup: blocks found and their hashes
        self._found: List[int] = []
        self._found_hashes: List[bytes] = []

    def forget(self, t: int) -> None:
        """Table ``t`` was made anew or deleted here."""
        self._rec.pop(t, None)
        if self.last_add is not None and self.last_add[0] == t:
            self.last_add = None

    def has(self, t: int) -> bool:
        """Whether ``t`` has a record."""
        return bool(self._rec.get(t))

    def looked_up(self, found, hashes) -> None:
        """A chain lookup found ``found`` (their hashes lead ``hashes``)."""
        self._found = list(found)
        self._found_hashes = list(hashes[:len(found)])

    def valid(self, t: int, ids, hash_of) -> List[Entry]:
        """The record of ``t`` cut to what still holds: the table's block at
        each position, still cached under the recorded hash."""
        rec = self._rec.get(t)
        if not rec:
            return []
        k = 0
        for (b, h), tb in zip(rec, ids):
            if b != tb or hash_of(b) != h:
                break
            k += 1
        if k < len(rec):
            del rec[k:]
        return rec

    def appended(self, t: int, start: int, ids, hash_of, old_ids) -> None:
        """Blocks ``ids`` were appended to ``t`` at positions ``start..``
        (``old_ids``: the table's blocks before). A cached one extends the
        record when the last lookup of this manager found it at that
        position after the blocks the record holds."""
        if not ids:
            return
        self.last_add = (t, start + len(ids) - 1, ids[-1])
        rec = self.valid(t, old_ids, hash_of) if start else []
        if len(rec) != start:
            return
        found, fh = self._found, self._found_hashes
        if any(fh[j] != rec[j][1] for j in range(min(len(rec), len(fh)))):
            return
        for i, b in enumerate(ids, start):
            h = hash_of(b)
            if h is None or i >= len(found) or found[i] != b or fh[i] != h:
                break
            rec.append((b, h))
        if rec:
            self._rec[t] = rec
        else:
            self._rec.pop(t, None)

    def just_appended(self, b: int) -> Optional[Tuple[int, int]]:
        """(table, position) where this manager last appended a block, if
        that block is ``b``."""
        la = self.last_add
        return (la[0], la[1]) if la is not None and la[2] == b else None

    def parent_at(self, t: int, i: int, b: int, ids, hash_of) -> Tuple[bool, Optional[bytes]]:
        """Whether block ``b``, at position ``i`` of ``t`` (``ids``: its
        blocks now), can be published from its own tokens, and under which
        parent hash (None: position 0, the chain's root)."""
        if i >= len(ids) or ids[i] != b:
            return False, None
        rec = self.valid(t, ids, hash_of)
        if len(rec) != i:
            return False, None
        return True, (rec[-1][1] if rec else None)

    def published(self, t: int, i: int, b: int, h: bytes) -> None:
        """``b``, at position ``i`` of ``t`` (the record's next), was published under ``h``."""
        rec = self._rec.setdefault(t, [])
        if len(rec) == i:
            rec.append((b, h))
