"""The chunk area: the chains of chunks every reference list is built from.

A reference list (``refs``) is a chain of chunks from the pool's chunk area
(``layout.CHUNK_DTYPE``: a link and ``CHUNK_IDS`` block ids, ``CHUNK_WORDS``
int32 words in all). A list of ``count`` ids is exactly
``ceil(count / CHUNK_IDS)`` chunks long, the last one linking to -1. Unused
chunks form a free list of their own, headed by counter ``C_FREE_REF``
(``C_FREE_REFS`` counts them); a free chunk's first id is -1.

Positions are *words*: the index of an id in the chunk area seen as int32
words (``Pool.kw``), ``chunk * CHUNK_WORDS + 1 + offset``.

Every chunk id read from shared memory is checked before it is used
(``chain``, ``_new_chunk``, ``_check_chunk``), and every block id read from
a list before it indexes a block (``block_at``, ``blocks_at``): one out of
range, or a list whose length needs more chunks than the pool has, is
corruption (``Pool.corrupt``). No walk follows a link outside the area or
round a cycle.
"""

from __future__ import annotations

from ..errors import CapacityError
from .layout import CHUNK_IDS, CHUNK_WORDS

CI, CW = CHUNK_IDS, CHUNK_WORDS


def chunks_for(n: int) -> int:
    """Chunks a list of ``n`` ids takes."""
    return -(-n // CI)


class ChunkArea:
    """Taking and returning chunks, and checked walks of chains (callers
    hold the pool lock; ``refs.RefStore`` builds the lists on it).

    Invariant: ``C_FREE_REFS`` chunks are on the free list, each with -1 as
    its first id, and no chunk is both free and in a list.
    """

    def __init__(self, pool) -> None:
        self.p = pool

    # ---- the chunk pool -----------------------------------------------------
    def free_chunks(self) -> int:
        p = self.p
        free = p.counters.free_refs
        if not 0 <= free <= p.layout.num_chunks:
            raise p.corrupt(f"the free chunk counter is {free}, outside "
                            f"[0, {p.layout.num_chunks}]")
        return free

    def need_chunks(self, k: int) -> None:
        """Raise unless ``k`` chunks are free (check before commit)."""
        if k > 0 and self.free_chunks() < k:
            p = self.p
            raise CapacityError(
                f"pool {p.name!r} holds as many block references as it can "
                f"({p.layout.max_refs}, max_refs): release some (delete tables, free "
                "blocks), or create the pool with a larger max_refs")

    def _new_chunk(self) -> int:
        p = self.p
        c = p.counters.free_ref
        n = p.layout.num_chunks
        if c < 0:
            raise CapacityError(f"pool {p.name!r} has no free reference chunk")
        if c >= n:
            raise p.corrupt(f"the free chunk list's head is {c}, outside [0, {n})")
        w = p.kw
        base = c * CW
        nxt = w[base]
        if w[base + 1] != -1 or not -1 <= nxt < n:
            raise p.corrupt(f"chunk {c} is on the free list but holds block {w[base + 1]} "
                            f"or links to {nxt}")
        k = p.counters
        k.free_ref = nxt            # the next chunk heads the free list
        k.free_refs -= 1
        w[base] = -1
        return c

    def _free_chunk(self, c: int) -> None:
        p = self.p
        w = p.kw
        w[c * CW + 1] = -1
        k = p.counters
        w[c * CW] = k.free_ref
        k.free_ref = c              # c heads the free list
        k.free_refs += 1

    # ---- walks: every chunk id read from shared memory, checked ------------
    def _check_chunk(self, c: int, what: str) -> int:
        if not 0 <= c < self.p.layout.num_chunks:
            raise self.p.corrupt(f"{what} is chunk {c}, outside [0, {self.p.layout.num_chunks})")
        return c

    def chain(self, head: int, count: int, what: str, *args) -> list:
        """The ``ceil(count / CHUNK_IDS)`` chunks of the list at ``head``,
        each checked to be in range and met once, the last linking to -1.
        Changes nothing. (``what.format(*args)``
        names the list in errors.)"""
        p = self.p
        n = p.layout.num_chunks
        k = chunks_for(count) if count > 0 else 0
        if count < 0 or k > n:
            raise p.corrupt(f"{what.format(*args)} counts {count} ids, more than the pool's "
                            f"{n} chunks hold")
        w = p.kw
        out = []
        c = head
        for _ in range(k):
            if not 0 <= c < n:
                raise p.corrupt(f"{what.format(*args)} links to chunk {c}, outside [0, {n})")
            out.append(c)
            c = w[c * CW]
        if k and c != -1:
            raise p.corrupt(f"{what.format(*args)} goes on past its last chunk {out[-1]} "
                            f"(to {c})")
        if k > 1 and len(set(out)) < k:
            raise p.corrupt(f"{what.format(*args)} reaches a chunk twice (a cycle)")
        return out

    def block_at(self, g: int, what: str, *args) -> int:
        """The block at word ``g``, checked to be one: in [1, max_blocks)."""
        b = self.p.kw[g]
        if not 0 < b < self.p.layout.max_blocks:
            raise self.p.corrupt(f"{what.format(*args)}: word {g} names block {b}, outside "
                                 f"[1, {self.p.layout.max_blocks})")
        return b

    def blocks_at(self, words: list, what: str, *args) -> list:
        w, n = self.p.kw, self.p.layout.max_blocks
        out = [w[g] for g in words]
        if out and (min(out) < 1 or max(out) >= n):
            for g in words:
                self.block_at(g, what, *args)   # raises at the first bad one
        return out
