"""The process-local map of a slot's loose references, in one int32 array
that Python (numpy) and the C fast path (``_native/hot_localmap.h``) share.

A manager must find, in O(1), a word of its slot's loose list that names a
given block (to drop that reference) and the block a word names (to move
the newest id into a dropped one's place). The slot's list in shared memory
is the truth; this map is a cache of it, rebuilt whenever it could be stale
(``refs.RefStore.resync``), and never read by another process.

Byte map of ``buf`` (int32; ``B`` = max_blocks, ``W`` = chunk-area words;
a link is ``word + 1``, so 0 means none and a fresh array is all zeros)::

    [0, B)              count[block]   loose references held to the block
    [B, 2B)             top[block]     link to its newest word
    [2B, 2B + W)        older[word]    link to the next older word, same block
    [2B + W, 2B + 2W)   newer[word]    link to the next newer word, same block

Each block's words form a doubly linked stack, newest first: ``push`` adds
on top, ``pop`` takes the top, ``move`` puts another word in a word's place
(same position). All three are O(1) and allocate nothing, so the C path can
apply them after it commits the shared change without any way to fail.

Invariant: for every block, following ``older`` from ``top`` visits exactly
``count`` words, each once, and ``newer`` is its reverse; a word not in any
stack has both links 0.
"""

from __future__ import annotations

import numpy as np


class LooseMap:
    """block_id -> the words of this slot's loose ids that name it (a
    multiset, as stacks). See the module docstring for the layout.

    Args:
        max_blocks: the pool's block count (block ids are below it).
        words: the chunk area's size in int32 words (word ids are below it).

    Raises:
        ValueError: a size that does not fit an int32 link.
    """

    def __init__(self, max_blocks: int, words: int) -> None:
        if max_blocks < 1 or words < 0 or max_blocks + words + 1 >= 2**31:
            raise ValueError(f"a loose map of {max_blocks} blocks and {words} words "
                             "does not fit int32 links")
        self.max_blocks, self.words = max_blocks, words
        # np.zeros: pages are only touched when used (a map that a reclaim
        # pass builds and never fills costs nothing)
        self.buf = np.zeros(2 * max_blocks + 2 * words, np.int32)
        b = max_blocks
        self._count = self.buf[:b]
        self._top = self.buf[b:2 * b]
        self._older = self.buf[2 * b:2 * b + words]
        self._newer = self.buf[2 * b + words:]

    # ---- reading ------------------------------------------------------------
    def count(self, block_id: int) -> int:
        """How many loose references this slot holds to ``block_id``."""
        return int(self._count[block_id]) if 0 <= block_id < self.max_blocks else 0

    def top(self, block_id: int) -> int:
        """The newest word naming ``block_id`` (-1: none)."""
        return int(self._top[block_id]) - 1

    def has_word(self, block_id: int, word: int) -> bool:
        """Whether ``word`` is one of ``block_id``'s words (O(1): by its links)."""
        if not (0 <= block_id < self.max_blocks and 0 <= word < self.words):
            return False
        if self._count[block_id] < 1:
            return False
        up = int(self._newer[word])
        if up == 0:
            return int(self._top[block_id]) == word + 1
        return 0 < up <= self.words and int(self._older[up - 1]) == word + 1

    def blocks(self) -> list:
        """The block ids held, ascending."""
        return np.flatnonzero(self._count).tolist()

    def as_dict(self) -> dict:
        """``{block_id: [words, oldest first]}`` (for tests and inspection)."""
        out = {}
        for b in self.blocks():
            ws, link = [], int(self._top[b])
            while link:
                ws.append(link - 1)
                link = int(self._older[link - 1])
            out[b] = ws[::-1]
        return out

    # ---- changing -------------------------------------------------------
    def push(self, block_id: int, word: int) -> None:
        """Record that ``word`` now names ``block_id`` (on top of its stack)."""
        t = int(self._top[block_id])
        self._older[word] = t
        self._newer[word] = 0
        if t:
            self._newer[t - 1] = word + 1
        self._top[block_id] = word + 1
        self._count[block_id] += 1

    def pop(self, block_id: int) -> int:
        """Take ``block_id``'s newest word off its stack; return it (caller
        checked ``count``)."""
        word = int(self._top[block_id]) - 1
        o = int(self._older[word])
        self._top[block_id] = o
        if o:
            self._newer[o - 1] = 0
        self._older[word] = self._newer[word] = 0
        self._count[block_id] -= 1
        return word

    def move(self, block_id: int, old: int, new: int) -> None:
        """Put ``new`` in ``old``'s place in ``block_id``'s stack (caller
        checked ``has_word(block_id, old)``; ``new`` is in no stack)."""
        up, down = int(self._newer[old]), int(self._older[old])
        self._newer[new], self._older[new] = up, down
        if up:
            self._older[up - 1] = new + 1
        else:
            self._top[block_id] = new + 1
        if down:
            self._newer[down - 1] = new + 1
        self._older[old] = self._newer[old] = 0

    def clear(self) -> None:
        self.buf.fill(0)

    def __len__(self) -> int:
        return int(np.count_nonzero(self._count))
