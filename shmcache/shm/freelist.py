"""The free block queue: a doubly linked list through the block records.

Links are int32 block ids in the records' ``prev``/``next`` fields. Records
``HEAD = max_blocks`` and ``TAIL = max_blocks + 1`` are sentinels that are
never popped, so no operation has a boundary branch.

Invariant: walking ``next`` from HEAD reaches TAIL through exactly
``num_free_blocks`` blocks, ``prev`` mirrors ``next``, and a block is in the
list iff its ``ref_count`` is 0 and it is not the null block. A block out of
the list has ``prev == next == -1``.
NOTE: the front is the eviction end. Freed blocks with no hash go to the
front (reused first, nothing to lose); cached ones go to the back (MRU), and
a request frees its blocks tail first, so a chain's last blocks are evicted
before its first and no cached block is orphaned by losing its parent.
"""

from __future__ import annotations

from ..errors import OutOfBlocksError


class SharedFreeQueue:
    """The seed's ``FreeKVCacheBlockQueue`` over shared records (ids, not objects)."""

    def __init__(self, pool) -> None:
        self.p = pool

    @property
    def num_free_blocks(self) -> int:
        return self.p.counters.num_free

    # Every link read is checked before it is followed or written through:
    # a block in [1, max_blocks), or the sentinel that may stand there. A
    # link out of range is corruption (``Pool.corrupt``), never an index.
    def _link(self, v: int, what: str, head_ok: bool, tail_ok: bool) -> int:
        p = self.p
        if 0 < v < p.HEAD or (head_ok and v == p.HEAD) or (tail_ok and v == p.TAIL):
            return v
        raise p.corrupt(f"free list: {what} is {v}, not a block"
                        + (" or a sentinel" if head_ok or tail_ok else ""))

    def popleft_id(self) -> int:
        p = self.p
        nxt, prv = p.b_next, p.b_prev
        b = self._link(nxt[p.HEAD], "the head's next", False, True)
        if b == p.TAIL:
            raise OutOfBlocksError("no free blocks available")
        n = self._link(nxt[b], f"block {b}'s next", False, True)
        nxt[p.HEAD] = n
        prv[n] = p.HEAD
        prv[b] = nxt[b] = -1
        p.counters.num_free -= 1
        return b

    def remove_id(self, b: int) -> None:
        p = self.p
        nxt, prv = p.b_next, p.b_prev
        pr, n = prv[b], nxt[b]
        if pr < 0 or n < 0:
            raise RuntimeError(f"Block {b} not in free queue")
        self._link(pr, f"block {b}'s prev", True, False)
        self._link(n, f"block {b}'s next", False, True)
        nxt[pr] = n
        prv[n] = pr
        prv[b] = nxt[b] = -1
        p.counters.num_free -= 1

    def append_id(self, b: int) -> None:
        p = self.p
        nxt, prv = p.b_next, p.b_prev
        last = self._link(prv[p.TAIL], "the tail's prev", True, False)
        nxt[last] = b
        prv[b] = last
        nxt[b] = p.TAIL
        prv[p.TAIL] = b
        p.counters.num_free += 1

    def appendleft_id(self, b: int) -> None:
        p = self.p
        nxt, prv = p.b_next, p.b_prev
        first = self._link(nxt[p.HEAD], "the head's next", False, True)
        prv[first] = b
        nxt[b] = first
        prv[b] = p.HEAD
        nxt[p.HEAD] = b
        p.counters.num_free += 1

    def ids(self, limit: int | None = None) -> list:
        p = self.p
        nxt = p.b_next
        out: list = []
        b = nxt[p.HEAD]
        most = p.layout.max_blocks - 1         # every block but the null block
        cap = most if limit is None else min(limit, most)
        while b != p.TAIL and len(out) < cap:
            out.append(self._link(b, "a next link", False, False))
            b = nxt[b]
        if limit is None and b != p.TAIL:
            raise p.corrupt("free list: longer than the pool (a cycle)")
        return out
