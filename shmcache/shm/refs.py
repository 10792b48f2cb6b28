"""References: who holds each reference to a block.

Every reference to a block (except the null block's permanent one) is one
int32 block id in a *list* held in shared memory: a block table's list (in
table order) or an attached slot's *loose* list (blocks a manager allocated,
acquired or touched and has not put in a table). A list is a chain of
chunks from the pool's chunk area (``chunks``: a link and ``CHUNK_IDS`` ids
each, exactly ``ceil(count / CHUNK_IDS)`` chunks per list, free chunks on a
list of their own). So sharing costs 4 bytes per reference: a fork of a
128-block table takes 9 chunks, whatever the blocks.

- A table's chain runs from ``head`` to ``tail`` in table order: every chunk
  is full but the tail, which holds ``(length - 1) % CHUNK_IDS + 1`` ids.
  ``length`` is the commit point: an append writes the id (after linking a
  new tail chunk if needed) and then bumps it; a truncation lowers it and
  then unlinks the chunks past it; a copy-on-write rewrites one id in place.
  A holder that dies in between leaves at most a chunk past the length,
  which recovery frees.
- A slot's loose list is a multiset and only its owner changes it (or, once
  the owner is dead, whoever releases what it held). Its *first* chunk
  ``loose_head`` is the partly filled one, with ``(count - 1) % CHUNK_IDS +
  1`` ids; the chunks after it are full. Adding writes into the first chunk
  (or pushes a new first chunk); dropping moves the newest id into the
  dropped one's place and pops the first chunk once it is empty: both O(1).

Invariant: a block's ``ref_count`` equals the number of ids naming it in live
tables and attached slots' loose lists (plus 1 for the null block).
Recovery recomputes ``ref_count`` from the lists, so the lists are the truth
and ``ref_count`` a cache of it. Every chunk id and block id read from a
list is checked before it is used (``chunks.ChunkArea``: ``chain``,
``block_at``, ``blocks_at``); one out of range is corruption
(``Pool.corrupt``). Positions are words of the chunk area (``chunks``).

The owning manager keeps a process-local map block_id -> the words of its
loose ids (``loosemap.LooseMap``, an array the C path shares), only to find
its own ids in O(1); it is rebuilt from shared memory whenever it could be
stale, and never consulted by anyone else.

Also here: a request id's key in the table index (``rid_key``) and taking
a table out of the live tables (``unlink_table``).
"""

from __future__ import annotations

from .blocks import chain_hash
from .chunks import CI, CW, ChunkArea, chunks_for
from .layout import RID_BYTES, held_mark
from .loosemap import LooseMap


def rid_key(request_id) -> tuple:
    """``(raw bytes, 64-bit hash)`` of a request id: a table's key in the table index.

    Raises:
        TypeError: not a non-empty str. ValueError: over ``RID_BYTES``
            UTF-8 bytes, or a NUL in it.
    """
    if not isinstance(request_id, str) or not request_id:
        raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
    raw = request_id.encode()
    if len(raw) > RID_BYTES or b"\x00" in raw:
        raise ValueError(f"request_id {request_id!r} must be at most {RID_BYTES} "
                         "UTF-8 bytes with no NUL")
    return raw, int.from_bytes(chain_hash(b"rid", None, raw, b"")[:8], "little")


def unlink_table(p, t: int) -> None:
    """Remove table ``t`` from the live tables (its list is left to pop)."""
    p.t_state[t] = 0           # commit: the table is gone
    p.counters.table_dropped()
    p.tindex.remove(t, int(p.tables["rid_hash"][t]))


class RefStore(ChunkArea):
    """The reference lists as one manager changes them: its own slot's
    loose list (and a closing or dead slot's, emptied whole) and the lists
    of tables (callers hold the pool lock).

    Invariants: the module's; and ``loose`` maps each block id to the words
    of this slot's loose ids that name it (rebuilt by ``resync`` whenever it
    could be stale).
    """

    def __init__(self, pool) -> None:
        super().__init__(pool)
        lay = pool.layout
        self.loose = LooseMap(lay.max_blocks, lay.num_chunks * CW)

    # ---- room: checked before any commit -----------------------------------
    def loose_chunks_needed(self, n: int) -> int:
        cnt = self.p.s_count[self.p.slot]
        return chunks_for(cnt + n) - chunks_for(cnt)

    def table_chunks_needed(self, t: int, n: int) -> int:
        ln = self.p.t_len[t]
        return chunks_for(ln + n) - chunks_for(ln)

    def need(self, n: int) -> None:
        """Raise unless this slot's loose list can take ``n`` more ids."""
        self.need_chunks(self.loose_chunks_needed(n))

    def need_table(self, t: int, n: int) -> None:
        """Raise unless table ``t`` can take ``n`` more ids."""
        self.need_chunks(self.table_chunks_needed(t, n))

    # ---- loose references of this slot -------------------------------------
    def slot_words(self, slot: int) -> list:
        """The words of a slot's loose ids (first chunk first)."""
        p = self.p
        cnt = p.s_count[slot]
        chunks = self.chain(p.s_head[slot], cnt, "slot {}'s loose list", slot)
        if not chunks:
            return []
        first = chunks[0] * CW + 1
        out = list(range(first, first + (cnt - 1) % CI + 1))
        for c in chunks[1:]:
            out.extend(range(c * CW + 1, c * CW + CW))
        return out

    def add_loose(self, block_id: int) -> None:
        """Add a loose reference of this slot (caller checked ``need``)."""
        p, s = self.p, self.p.slot
        cnt = p.s_count[s]
        off = cnt % CI
        w = p.kw
        if off == 0:
            c = self._new_chunk()
            g = c * CW + 1
            w[c * CW] = p.s_head[s] if cnt else -1
            w[g] = block_id
            p.s_head[s] = c
        else:
            h = self._check_chunk(p.s_head[s], f"slot {s}'s loose list head")
            g = h * CW + 1 + off
            w[g] = block_id
        p.s_count[s] = cnt + 1       # commit
        self.loose.push(block_id, g)

    def holds_loose(self, block_id: int) -> bool:
        return self.loose.count(block_id) > 0

    def drop_loose(self, block_id: int) -> None:
        """Drop one loose reference of this slot to ``block_id`` (caller checked)."""
        p, s = self.p, self.p.slot
        w = p.kw
        lm = self.loose
        g = lm.top(block_id)
        cnt = p.s_count[s]
        h = self._check_chunk(p.s_head[s], f"slot {s}'s loose list head")
        if cnt < 1 or not 0 <= g < len(w) or not g % CW or w[g] != block_id:
            raise p.corrupt(f"slot {s}'s loose list does not hold block {block_id} at word "
                            f"{g} (count {cnt})")
        last = h * CW + 1 + (cnt - 1) % CI
        bl = None
        if g != last:
            bl = int(w[last])
            if not lm.has_word(bl, last):
                raise p.corrupt(f"slot {s}'s newest loose id (word {last}, block {bl}) is not "
                                "among the references this manager holds")
        nh = self._head_link(s, h, cnt)
        lm.pop(block_id)
        if bl is not None:
            lm.move(bl, last, g)
        self._drop_word(s, g, h, cnt, nh)
        if not lm.count(block_id) and p.b_prev[block_id] == held_mark(s, p.layout.max_slots):
            p.b_prev[block_id] = -1      # the slot's last loose reference to it

    def drop_slot_ids(self, slot: int, ids) -> None:
        """Drop one loose reference of another slot to each of ``ids`` (lock
        held; that slot's owner re-reads its list: the caller bumps the epoch)."""
        p = self.p
        w = p.kw
        for b in ids:
            words = self.slot_words(slot)
            g = next((g for g in words if w[g] == b), None)
            if g is None:
                raise p.corrupt(f"slot {slot}'s loose list does not hold block {b}")
            cnt, h = p.s_count[slot], words[0] // CW
            self._drop_word(slot, g, h, cnt, self._head_link(slot, h, cnt))

    def _head_link(self, s: int, h: int, cnt: int) -> int:
        """The link of slot ``s``'s head chunk ``h`` (``cnt`` ids), checked
        where dropping one id empties that chunk."""
        p = self.p
        nh = p.kw[h * CW]
        if (cnt - 1) % CI == 0 and not (nh == -1 if cnt == 1 else 0 <= nh < p.layout.num_chunks):
            raise p.corrupt(f"slot {s}'s loose list: chunk {h} links to {nh}")
        return nh

    def _drop_word(self, s: int, g: int, h: int, cnt: int, nh: int) -> None:
        """Drop word ``g`` of slot ``s``'s loose list (head chunk ``h``,
        ``cnt`` ids, ``nh`` from ``_head_link``): O(1), the newest id moves
        into ``g``, and an emptied head chunk is freed."""
        p = self.p
        p.kw[g] = p.kw[h * CW + 1 + (cnt - 1) % CI]
        p.s_count[s] = cnt - 1       # commit
        if (cnt - 1) % CI == 0:
            p.s_head[s] = nh
            self._free_chunk(h)

    def pop_slot_loose(self, slot: int) -> list:
        """Empty a whole slot's loose list; return its block ids."""
        p = self.p
        words = self.slot_words(slot)
        blocks = self.blocks_at(words, "slot {}'s loose list", slot)
        chunks = self.chain(p.s_head[slot], p.s_count[slot], "slot {}'s loose list", slot)
        p.s_count[slot] = 0          # commit
        p.s_head[slot] = -1
        for c in chunks:
            self._free_chunk(c)
        if slot == p.slot:
            self.loose.clear()
        return blocks

    def resync(self) -> None:
        p = self.p
        self.loose.clear()
        if p.slot < 0:
            return
        words = self.slot_words(p.slot)
        blocks = self.blocks_at(words, "slot {}'s loose list", p.slot)
        for g, b in zip(words, blocks):
            self.loose.push(b, g)

    # ---- table lists --------------------------------------------------------
    def table_chain(self, t: int) -> list:
        p = self.p
        return self.chain(p.t_head[t], p.t_len[t], "table {}'s list", t)

    def table_words(self, t: int) -> list:
        """The words of a table's ids, in table order (the blocks they name
        are not checked: ``block_at``)."""
        n = self.p.t_len[t]
        out: list = []
        for c in self.table_chain(t):
            out.extend(range(c * CW + 1, c * CW + CW))
        del out[n:]
        return out

    def table_blocks(self, t: int) -> list:
        chunks = self.table_chain(t)
        if len(chunks) <= 2:
            return self.blocks_at(self.table_words(t), "table {}'s list", t)
        ids = self.p.kmat[chunks, 1:].reshape(-1)[:self.p.t_len[t]]
        if ids.size and (ids.min() < 1 or ids.max() >= self.p.layout.max_blocks):
            self.blocks_at(self.table_words(t), "table {}'s list", t)    # raises
        return ids.tolist()

    def table_word(self, t: int, i: int) -> int:
        """The word of position ``i`` (0 <= i < length) of table ``t``."""
        p = self.p
        ln = p.t_len[t]
        j = i // CI
        if j == (ln - 1) // CI:
            c = self._check_chunk(p.t_tail[t], f"table {t}'s tail")
        else:
            c = self.chain(p.t_head[t], (j + 1) * CI, "table {}'s list", t)[-1]
        return c * CW + 1 + i % CI

    def table_append(self, t: int, block_id: int) -> None:
        """Append one id (caller checked ``need_table``)."""
        p = self.p
        ln = p.t_len[t]
        w = p.kw
        if ln % CI == 0:
            c = self._new_chunk()
            w[c * CW + 1] = block_id
            if ln:
                tail = self._check_chunk(p.t_tail[t], f"table {t}'s tail")
                w[tail * CW] = c
            else:
                p.t_head[t] = c
            p.t_tail[t] = c
        else:
            tail = self._check_chunk(p.t_tail[t], f"table {t}'s tail")
            w[tail * CW + 1 + ln % CI] = block_id
        p.t_len[t] = ln + 1          # commit

    def table_extend(self, t: int, blocks) -> None:
        """Append ids; one commit at the end (caller checked ``need_table``)."""
        p = self.p
        ln = p.t_len[t]
        if not blocks:
            return
        w = p.kw
        tail = self._check_chunk(p.t_tail[t], f"table {t}'s tail") if ln else -1
        pos = ln
        for b in blocks:
            off = pos % CI
            if off == 0:
                c = self._new_chunk()
                if tail >= 0:
                    w[tail * CW] = c
                else:
                    p.t_head[t] = c
                tail = c
                p.t_tail[t] = c
            w[tail * CW + 1 + off] = b
            pos += 1
        p.t_len[t] = pos             # commit

    def table_truncate(self, t: int, n: int) -> list:
        """Keep the first ``n`` ids; return the ids cut off (in table order)."""
        p = self.p
        words = self.table_words(t)
        cut = self.blocks_at(words[n:], "table {}'s list", t)
        chunks = self.table_chain(t)
        keep = chunks_for(n)
        p.t_len[t] = n               # commit
        if keep:
            p.kw[chunks[keep - 1] * CW] = -1
            p.t_tail[t] = chunks[keep - 1]
        else:
            p.t_head[t] = p.t_tail[t] = -1
        for c in chunks[keep:]:
            self._free_chunk(c)
        return cut

    def pop_table(self, t: int) -> list:
        """Empty a table's whole list (the table itself is already gone)."""
        return self.table_truncate(t, 0)

    def copy_table(self, src: int, dst: int, chunks: list) -> None:
        """Give the empty table ``dst`` the ids of ``src``, whose chain
        ``chunks`` is (``table_chain``; caller checked ``need_chunks``)."""
        p = self.p
        ln = p.t_len[src]
        new = [self._new_chunk() for _ in chunks]
        if not new:
            return
        km = p.kmat
        km[new, 1:] = km[chunks, 1:]
        w = p.kw
        for a, b in zip(new, new[1:]):
            w[a * CW] = b
        w[new[-1] * CW] = -1
        p.t_head[dst] = new[0]
        p.t_tail[dst] = new[-1]
        p.t_len[dst] = ln            # commit
