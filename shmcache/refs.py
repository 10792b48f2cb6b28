"""Reference records: who holds each reference to a block.

Every reference to a block (except the null block's permanent one) is one
record ``(block_id, next)`` in a singly linked list: either a slot's *loose*
list (blocks a manager allocated, acquired or touched and has not put in a
table) or a block table's list (in table order). Unused records form a free
list headed by counter ``C_FREE_REF`` and have ``block_id == -1``.

Invariant: a block's ``ref_count`` equals the number of records naming it
(plus 1 for the null block). Recovery recomputes ``ref_count`` from the
records, so the records are the truth and ``ref_count`` a cache of it.
NOTE: every list change is ordered so that the single link write is the
commit point: a holder that dies before it leaves an unreachable record
(recovery frees it), never a half-linked list.

The owning manager keeps a process-local map block_id -> its loose record
ids, only to find its own records in O(1); it is rebuilt from shared memory
whenever it could be stale, and never consulted by anyone else.
"""

from __future__ import annotations

from .errors import CapacityError
from .layout import C_FREE_REF, C_FREE_REFS


class RefStore:
    def __init__(self, pool) -> None:
        self.p = pool
        self.loose: dict = {}      # block_id -> [record ids] of this slot

    # ---- record pool ------------------------------------------------------
    def need(self, n: int) -> None:
        """Raise unless ``n`` records are free (check before commit)."""
        p = self.p
        if p.c[C_FREE_REFS] < n:
            raise CapacityError(
                f"pool {p.name!r} needs {n} reference records, {p.c[C_FREE_REFS]} are free "
                f"(max_refs={p.layout.max_refs}); create it with a larger max_refs")

    def _new(self, block_id: int, nxt: int) -> int:
        p = self.p
        r = p.c[C_FREE_REF]
        if r < 0:
            raise CapacityError(
                f"pool {p.name!r} has no free reference records "
                f"(max_refs={p.layout.max_refs}); create it with a larger max_refs")
        p.c[C_FREE_REF] = p.r_next[r]
        p.c[C_FREE_REFS] -= 1
        p.r_block[r] = block_id
        p.r_next[r] = nxt
        return r

    def _release(self, r: int) -> None:
        p = self.p
        p.r_block[r] = -1
        p.r_next[r] = p.c[C_FREE_REF]
        p.c[C_FREE_REF] = r
        p.c[C_FREE_REFS] += 1

    # ---- loose references of this slot -------------------------------------
    def add_loose(self, block_id: int) -> None:
        p, s = self.p, self.p.slot
        r = self._new(block_id, p.s_head[s])
        p.s_head[s] = r          # commit
        p.s_count[s] += 1
        self.loose.setdefault(block_id, []).append(r)

    def holds_loose(self, block_id: int) -> bool:
        return bool(self.loose.get(block_id))

    def drop_loose(self, block_id: int) -> None:
        """Drop one loose reference of this slot to ``block_id`` (caller checked)."""
        p, s = self.p, self.p.slot
        recs = self.loose[block_id]
        r = recs.pop()
        if not recs:
            del self.loose[block_id]
        h = p.s_head[s]
        if r != h:
            # Move the head's block into r, then pop the head: O(1) removal
            # from a singly linked list.
            hb = p.r_block[h]
            p.r_block[r] = hb
            lst = self.loose[hb]
            lst[lst.index(h)] = r
        p.s_head[s] = p.r_next[h]   # commit
        p.s_count[s] -= 1
        self._release(h)

    def pop_slot_loose(self, slot: int) -> list:
        """Unlink a whole slot's loose list; return its block ids."""
        p = self.p
        blocks = []
        r = p.s_head[slot]
        p.s_head[slot] = -1
        p.s_count[slot] = 0
        while r >= 0:
            nxt = p.r_next[r]
            blocks.append(p.r_block[r])
            self._release(r)
            r = nxt
        if slot == p.slot:
            self.loose.clear()
        return blocks

    def resync(self) -> None:
        p = self.p
        self.loose = {}
        if p.slot < 0:
            return
        r = p.s_head[p.slot]
        while r >= 0:
            self.loose.setdefault(p.r_block[r], []).append(r)
            r = p.r_next[r]

    # ---- table lists --------------------------------------------------------
    def table_append(self, t: int, block_id: int) -> None:
        p = self.p
        r = self._new(block_id, -1)
        tail = p.t_tail[t]
        if tail >= 0:
            p.r_next[tail] = r   # commit
        else:
            p.t_head[t] = r      # commit
        p.t_tail[t] = r
        p.t_len[t] += 1

    def table_records(self, t: int) -> list:
        p = self.p
        out, r = [], p.t_head[t]
        while r >= 0 and len(out) <= p.layout.max_refs:
            out.append(r)
            r = p.r_next[r]
        return out

    def table_blocks(self, t: int) -> list:
        rb = self.p.r_block
        return [rb[r] for r in self.table_records(t)]

    def pop_table(self, t: int) -> list:
        """Unlink a table's whole list (the table itself is already gone)."""
        p = self.p
        recs = self.table_records(t)
        p.t_head[t] = p.t_tail[t] = -1
        p.t_len[t] = 0
        blocks = [p.r_block[r] for r in recs]
        for r in recs:
            self._release(r)
        return blocks
