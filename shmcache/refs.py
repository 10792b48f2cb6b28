"""Reference records: who holds each reference to a block.

Every reference to a block (except the null block's permanent one) is one
record ``(block_id, next)`` in a singly linked list: either a slot's *loose*
list (blocks a manager allocated, acquired or touched and has not put in a
table) or a block table's list (in table order). Unused records form a free
list headed by counter ``C_FREE_REF`` and have ``block_id == -1``.

Invariant: a block's ``ref_count`` equals the number of records naming it
(plus 1 for the null block). Recovery recomputes ``ref_count`` from the
records, so the records are the truth and ``ref_count`` a cache of it.
Every record id read from shared memory is checked before it is used
(``walk``, ``_check``), and every block id read from a record before it
indexes a block (``block_of``, ``blocks_of``): one out of range, a list
longer than the record pool or a record naming no block is corruption
(``Pool.corrupt``).
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
        free = p.c[C_FREE_REFS]
        if not 0 <= free <= p.layout.max_refs:
            raise p.corrupt(f"the free reference-record counter is {free}, outside "
                            f"[0, {p.layout.max_refs}]")
        if free < n:
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
        self._check(r, "the free-record list's head")
        if p.r_block[r] != -1:
            raise p.corrupt(f"reference record {r} is on the free list but names block "
                            f"{p.r_block[r]}")
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

    # ---- checks: every record id read from shared memory, before use -------
    def _check(self, r: int, what: str) -> int:
        if not 0 <= r < self.p.layout.max_refs:
            raise self.p.corrupt(f"{what} is record {r}, outside [0, {self.p.layout.max_refs})")
        return r

    def walk(self, head: int, what: str, *args) -> list:
        """The records of the list starting at ``head``, checked: each in
        range, and no more of them than the record pool has (a cycle).
        Changes nothing. (``what.format(*args)`` names the list in errors.)"""
        p = self.p
        limit = p.layout.max_refs
        rn = p.r_next
        out = []
        add = out.append
        r = head
        for _ in range(limit + 1):
            if r < 0:
                return out
            if r >= limit:
                raise p.corrupt(f"{what.format(*args)} links to record {r}, outside "
                                f"[0, {limit})")
            add(r)
            r = rn[r]
        raise p.corrupt(f"{what.format(*args)} is longer than the record pool (a cycle)")

    def block_of(self, r: int, what: str, *args) -> int:
        """The block record ``r`` names, checked to be one: in [1, max_blocks)."""
        b = self.p.r_block[r]
        if not 0 < b < self.p.layout.max_blocks:
            raise self.p.corrupt(f"{what.format(*args)}: record {r} names block {b}, outside "
                                 f"[1, {self.p.layout.max_blocks})")
        return b

    def blocks_of(self, recs: list, what: str, *args) -> list:
        rb, n = self.p.r_block, self.p.layout.max_blocks
        out = [rb[r] for r in recs]
        if out and (min(out) < 1 or max(out) >= n):
            for r in recs:
                self.block_of(r, what, *args)   # raises at the first bad one
        return out

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
        r = self._check(recs[-1], f"a loose reference to block {block_id}")
        h = self._check(p.s_head[s], f"slot {s}'s loose list head")
        if r != h:
            hb = p.r_block[h]
            lst = self.loose.get(hb)
            if not lst or h not in lst:
                raise p.corrupt(f"slot {s}'s loose list head {h} (block {hb}) is not "
                                "among the references this manager holds")
        recs.pop()
        if not recs:
            del self.loose[block_id]
        if r != h:
            # Move the head's block into r, then pop the head: O(1) removal
            # from a singly linked list.
            p.r_block[r] = hb
            lst[lst.index(h)] = r
        p.s_head[s] = p.r_next[h]   # commit
        p.s_count[s] -= 1
        self._release(h)

    def pop_slot_loose(self, slot: int) -> list:
        """Unlink a whole slot's loose list; return its block ids."""
        p = self.p
        recs = self.walk(p.s_head[slot], "slot {}'s loose list", slot)
        blocks = self.blocks_of(recs, "slot {}'s loose list", slot)
        p.s_head[slot] = -1
        p.s_count[slot] = 0
        for r in recs:
            self._release(r)
        if slot == p.slot:
            self.loose.clear()
        return blocks

    def resync(self) -> None:
        p = self.p
        self.loose = {}
        if p.slot < 0:
            return
        loose = {}
        recs = self.walk(p.s_head[p.slot], "slot {}'s loose list", p.slot)
        for r, b in zip(recs, self.blocks_of(recs, "slot {}'s loose list", p.slot)):
            loose.setdefault(b, []).append(r)
        self.loose = loose

    # ---- table lists --------------------------------------------------------
    def table_append(self, t: int, block_id: int) -> None:
        p = self.p
        tail = p.t_tail[t]
        if tail >= 0:
            self._check(tail, f"table {t}'s tail")
        r = self._new(block_id, -1)
        if tail >= 0:
            p.r_next[tail] = r   # commit
        else:
            p.t_head[t] = r      # commit
        p.t_tail[t] = r
        p.t_len[t] += 1

    def table_records(self, t: int) -> list:
        """A table's records (``walk``; the blocks they name are not checked:
        ``block_of``)."""
        return self.walk(self.p.t_head[t], "table {}'s list", t)

    def table_blocks(self, t: int) -> list:
        return self.blocks_of(self.table_records(t), "table {}'s list", t)

    def pop_table(self, t: int) -> list:
        """Unlink a table's whole list (the table itself is already gone)."""
        p = self.p
        recs = self.table_records(t)
        blocks = self.blocks_of(recs, "table {}'s list", t)
        p.t_head[t] = p.t_tail[t] = -1
        p.t_len[t] = 0
        for r in recs:
            self._release(r)
        return blocks
