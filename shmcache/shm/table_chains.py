"""Where a block appended to a table sits in a prefix chain: the
per-process record that lets the seed's per-block registration
(``register_block_hash(block, that_block's_tokens)``, as vllm-mlx's
``BlockAwarePrefixCache.store_cache`` calls it right after appending the
block to a request's table) key the block by its whole prefix.

The record is this manager's, not the pool's: it only decides which chain
hash a registration publishes, and every use checks it against the table
in shared memory first.

Invariant: a table's record is a list of ``(block, hash)`` whose entry
``i`` is the block at position ``i`` of the table and ``hash`` the chain
hash of the tokens up to its end, known right because either this manager
published it there (a registration right after the append, its parent
the entry before) or a chain lookup of this manager found it at that
position after the entries before. A table position with no such
knowledge ends the record: nothing after it is published from here, so a
block is never published under a prefix it was not computed after. The
record is built when a registration needs it, so an append costs one
tuple.
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

    def looked_up(self, found, hashes) -> None:
        """A chain lookup found ``found`` (their hashes lead ``hashes``)."""
        self._found = list(found)
        self._found_hashes = list(hashes[:len(found)])

    def cut(self, t: int, n: int) -> None:
        """Positions ``n..`` of ``t`` were changed other than by an append."""
        rec = self._rec.get(t)
        if rec and len(rec) > n:
            del rec[n:]

    def just_appended(self, b: int) -> Optional[Tuple[int, int]]:
        """(table, position) where this manager last appended a block, if
        that block is ``b``."""
        la = self.last_add
        return (la[0], la[1]) if la is not None and la[2] == b else None

    def parent_at(self, t: int, i: int, b: int, ids, hash_of) -> Tuple[bool, Optional[bytes]]:
        """Whether block ``b``, at position ``i`` of ``t`` (``ids``: the
        table's blocks now), can be published from its own tokens, and under
        which parent hash (None: position 0, the chain's root).

        The record must reach position ``i``: it is kept while its last
        block is still at its position (the table's reference keeps that
        block from reuse, and its chain hash covers every entry before it),
        and extended by the blocks of the last lookup that sit at their
        positions and are still cached under the hashes it found."""
        if i >= len(ids) or ids[i] != b:
            return False, None
        if i == 0:
            return True, None
        rec = self._rec.get(t) or []
        if rec and (len(rec) > len(ids) or ids[len(rec) - 1] != rec[-1][0]):
            rec = []
        if len(rec) > i:
            del rec[i:]
        k = len(rec)
        found, fh = self._found, self._found_hashes
        if k < i and (not k or (len(fh) >= k and fh[k - 1] == rec[-1][1])):
            while k < i and k < len(found) and ids[k] == found[k] and hash_of(found[k]) == fh[k]:
                rec.append((found[k], fh[k]))
                k += 1
        if rec:
            self._rec[t] = rec
        else:
            self._rec.pop(t, None)
        if k != i:
            return False, None
        return True, rec[-1][1]

    def published(self, t: int, i: int, b: int, h: bytes) -> None:
        """``b``, at position ``i`` of ``t`` (the record's next), was published under ``h``."""
        rec = self._rec.setdefault(t, [])
        if len(rec) == i:
            rec.append((b, h))
