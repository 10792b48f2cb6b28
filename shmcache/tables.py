"""Block tables: per-request block lists in shared memory, forks, and the
copy-on-write append path of a generation step."""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple


from . import kv
from . import layout as L
from .blocks import (BlockTable, CacheBlock)
from .errors import CapacityError, OutOfBlocksError
from .views import SharedBlock, SharedBlockTable

logger = logging.getLogger("shmcache.paged_cache")

from .core import PoolOps
from .refs import rid_key, unlink_table


class TableOps(PoolOps):
    # ============================================================ block tables
    def create_block_table(self, request_id: str) -> BlockTable:
        """Create an empty table owned by this manager.

        Raises:
            ValueError: a table for ``request_id`` exists.
            CapacityError: every table slot is in use.
        """
        key = rid_key(request_id)           # (hashed before the lock)
        p = self._p
        fused = getattr(p.native, "new_table", None)
        # C (_hot.new_table): the table made in a hold the C op takes itself;
        # None: nothing changed, and the path below makes it or raises
        if fused is not None and not p.lock.unusable and not p.lock.held:
            t = fused(key[0], key[1], p.slot, self._epoch)
            if t is not None:
                self._tcache[t] = (key[1], None, {})
                self._chains.forget(t)
                return SharedBlockTable(self, t, request_id, key[1])
        with self._p.lock:
            self._sync()
            new = getattr(self._p.native, "table_new", None)
            # C (_hot.table_new): _new_table's steps; None: nothing changed,
            # and _new_table raises for what it refused
            t = new(key[0], key[1], self._p.slot) if new is not None else None
            if t is None:
                t = self._new_table(request_id, key)
            else:
                self._tcache[t] = (key[1], None, {})
            self._chains.forget(t)
            return SharedBlockTable(self, t, request_id, key[1])

    def get_block_table(self, request_id: str) -> Optional[BlockTable]:
        """The table of ``request_id`` (from any process), or None."""
        raw, h = rid_key(request_id)
        with self._p.lock:
            self._sync()
            t = self._tindex.find(raw, h)
            return self._table_view(t) if t >= 0 else None

    def get_or_create_block_table(self, request_id: str) -> BlockTable:
        with self._p.lock:
            t = self.get_block_table(request_id)   # not `or`: an empty table is falsy
            return t if t is not None else self.create_block_table(request_id)

    def delete_block_table(self, request_id: str) -> None:
        """Delete a table and drop its references, last block first.

        Raises:
            KeyError: no table for ``request_id``.
        """
        p = self._p
        fused = getattr(p.native, "delete_table", None)
        # C (_hot.delete_table): the steps below in a hold the C op takes
        # itself; by request id only (a table view names one table record,
        # which the path below checks); None: nothing changed
        if fused is not None and type(request_id) is str and not p.lock.unusable \
                and not p.lock.held:
            raw, h = rid_key(request_id)
            t = fused(raw, h, p.slot, self._epoch)
            if t is not None:
                self._tcache.pop(t, None)
                self._chains.forget(t)
                return
        with self._p.lock:
            self._sync()
            t = self._table_index(request_id)
            self._tcache.pop(t, None)
            self._chains.forget(t)
            drop = getattr(p.native, "table_drop", None)
            # C (_hot.table_drop): the same steps but the index removal,
            # which follows in this hold; None: nothing changed, and the
            # Python path below meets (and raises for) what it refused
            if drop is not None and drop(t) is not None:
                p.tindex.remove(t, int(p.t_rhash[t]))
                return
            unlink_table(p, t)
            for b in reversed(self._refs.pop_table(t)):
                self._release(b)

    def add_block_to_table(self, table: BlockTable, block: CacheBlock, tokens_in_block: int) -> None:
        """Append ``block`` to ``table``: a reference this manager holds on
        it outside its tables moves into the table (one that ``allocate_block``,
        ``touch``, ``increment_ref`` or ``acquire_computed_blocks`` gave), or,
        where it holds none, the table takes a new one (as ``touch`` does).

        Raises:
            KeyError: the table does not exist. ValueError: the null block,
                or ``tokens_in_block`` out of range. CapacityError (an
                OutOfBlocksError): no room for the reference.
        """
        p = self._p
        fused = getattr(p.native, "add_block", None)
        # C (_hot.add_block): a new reference's case (this manager holds
        # none loose on the block: a loose one moves, below) in one hold the
        # C op takes itself; None: nothing changed, and the path below runs
        # (and raises for what it refused). Not inside a hold of this process.
        if (fused is not None and type(table) is SharedBlockTable and table._m._p is p
                and type(tokens_in_block) is int and not p.lock.unusable and not p.lock.held):
            b = block._id if type(block) is SharedBlock and block._m is self else block
            if type(b) is int and 0 < b < self.max_blocks and not self._refs.loose.count(b):
                pos = fused(table._t, table._rh, b, tokens_in_block, self.block_size, p.now(),
                            p.slot, self._epoch)
                if pos is not None:
                    self._chains.last_add = (table._t, pos, b)
                    return
        self._table_add(table, block, tokens_in_block, count_tokens=True)

    def fork_block_table(self, source_table: BlockTable, new_request_id: str) -> BlockTable:
        """A new table sharing every block of ``source_table`` (one more
        reference each: 4 bytes apiece, never a copy).

        Raises:
            KeyError: unknown source. ValueError: a table for
                ``new_request_id`` exists. CapacityError (an
                OutOfBlocksError): no free table, or no room for the
                references; nothing changed.
        """
        with self._p.lock:
            self._sync()
            src = self._table_index(source_table)
            rid_key(new_request_id)
            p = self._p
            chunks = self._refs.table_chain(src)        # (checked before anything changes)
            blocks = self._refs.table_blocks(src)
            self._refs.need_chunks(len(chunks))
            t = self._new_table(new_request_id)
            self._refs.copy_table(src, t, chunks)
            for b in blocks:
                p.b_ref[b] += 1
            p.t_tok[t] = p.t_tok[src]
            return self._table_view(t)

    def _cow_at(self, g: int, count_tokens: bool = True) -> int:
        """Copy the block at word ``g`` of a table into a new block, which
        replaces it there (payload and token count included); returns it.
        The copy's tokens count in ``C_TOKENS`` (not in the seed's own
        method, ``count_tokens`` False: the seed does not count them)."""
        p = self._p
        old = self._refs.block_at(g, "a table's list")
        new = self._pop_free()
        p.b_tok[new] = p.b_tok[old]
        if count_tokens:
            p.add_tokens(p.b_tok[new])
        kv.copy_block(p, old, new)
        self._copy_payload(old, new)
        p.kw[g] = new               # commit: the table now holds the copy
        self._release(old)
        p.c[L.C_COW] += 1
        return new

    def _append_plan(self, t: int, n: int) -> Tuple[list, int]:
        """(words of the shared blocks the new tokens would land in, blocks to allocate)."""
        p, bs = self._p, self.block_size
        tok, length = p.t_tok[t], p.t_len[t]
        if n <= 0:
            return [], 0
        first, needed = tok // bs, -(-(tok + n) // bs)
        end = min(length, needed)
        cow = []
        if first < end:
            # Usually just the partly filled last block; any block written into
            # must be private to this table.
            if first == length - 1:
                words = [self._refs.table_word(t, first)]
            else:
                words = self._refs.table_words(t)[first:end]
            blocks = self._refs.blocks_at(words, "table {}'s list", t)
            # shared, or published (a trimmed table's last block can be: its
            # bytes are everyone's now)
            cow = [g for g, b in zip(words, blocks)
                   if p.b_ref[b] > 1 or p.b_flags[b] & L.FLAG_CACHED]
        return cow, max(0, needed - length)

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        """Whether ``prepare_append(table, num_new_tokens)`` would find its blocks."""
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        with self._p.lock:
            self._sync()
            t = self._table_index(table)
            cow, new = self._append_plan(t, num_new_tokens)
            if self._refs.free_chunks() < self._refs.table_chunks_needed(t, new):
                return False
            return self._ensure_free(len(cow) + new)

    def prepare_append(self, table: BlockTable, num_new_tokens: int) -> List[CacheBlock]:
        """Make room in ``table`` for ``num_new_tokens`` more tokens.

        Copies the last block first when it is partly filled and shared
        (copy-on-write, payload included), allocates the blocks still
        needed, and counts the new tokens in the table and its blocks.

        Returns:
            The blocks that receive the new tokens, in order (the first may
            be the table's previous last block, or its copy).
        Raises:
            OutOfBlocksError: not enough free blocks (or room for the
                references: CapacityError, a subclass); nothing changed.
            KeyError: unknown table. ValueError: negative count.
        """
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        p = self._p
        fused = getattr(p.native, "append", None)
        # C (_hot.append): the common case in one call that takes the lock
        # itself, so the hold is the C op's alone (not this method's Python
        # too); None: nothing changed, and the path below runs. Not inside a
        # hold of this process (the mutex is not reentrant; the path below is)
        if (fused is not None and num_new_tokens and not p.lock.unusable and not p.lock.held
                and type(table) is SharedBlockTable and table._m._p is p):
            ids = fused(table._t, table._rh, num_new_tokens, self.block_size, p.now(),
                        p.slot, self._epoch)
            if ids is not None:
                return [SharedBlock(self, b) for b in ids]
        with self._p.lock:
            self._sync()
            t = self._table_index(table)
            append = getattr(p.native, "table_append", None)
            # C (_hot.table_append): the common case (no copy-on-write, free
            # blocks uncached) in one call; None: nothing changed, and the
            # Python path below does it (or raises for what it refused)
            if append is not None and num_new_tokens:
                ids = append(t, num_new_tokens, self.block_size, p.now())
                if ids is not None:
                    return [SharedBlock(self, b) for b in ids]
            cow, new = self._append_plan(t, num_new_tokens)
            if not self._ensure_free(len(cow) + new):
                raise OutOfBlocksError(f"prepare_append needs {len(cow) + new} free blocks, "
                                       f"{p.c[L.C_NUM_FREE]} available")
            self._refs.need_table(t, new)
            for g in cow:
                self._cow_at(g)
            if new:
                self._refs.table_extend(t, [self._pop_free() for _ in range(new)])
            bs, tok = self.block_size, p.t_tok[t]
            first, last = tok // bs, (tok + num_new_tokens - 1) // bs
            if first == last and first == p.t_len[t] - 1:
                words = [self._refs.table_word(t, first)]
            else:
                words = self._refs.table_words(t)[first:last + 1]
            out = []
            for i, g in zip(range(first, last + 1), words):
                b = self._refs.block_at(g, "table {}'s list", t)
                p.b_tok[b] = min(bs, tok + num_new_tokens - i * bs)
                out.append(SharedBlock(self, b))
            p.t_tok[t] = tok + num_new_tokens
            p.add_tokens(num_new_tokens)       # (as add_block_to_table counts them)
            return out

    def trim_table(self, table: BlockTable, num_tokens: int) -> int:
        """Drop the last ``num_tokens`` tokens of ``table`` (all of them at most).

        Blocks left with no token of the table are removed from it and their
        references released (a block becomes free when it was the last
        one); a shared block left partly filled stays, only dereferenced by
        the tokens it no longer counts (the next append copies it first).
        Published blocks keep their cache entries.

        Returns:
            The number of tokens dropped.
        Raises:
            KeyError: unknown table. ValueError: a negative count.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        with self._p.lock:
            self._sync()
            p = self._p
            t = self._table_index(table)
            tok = p.t_tok[t]
            n = min(num_tokens, tok)
            if n == 0:
                return 0
            left = tok - n
            keep = min(p.t_len[t], -(-left // self.block_size))
            cut = self._refs.table_truncate(t, keep) if keep < p.t_len[t] else []
            p.t_tok[t] = left
            if keep and left < keep * self.block_size:
                # the new last block: a private one counts only what is left
                b = self._refs.block_at(self._refs.table_word(t, keep - 1), "table {}'s list", t)
                if p.b_ref[b] == 1 and not p.b_flags[b] & L.FLAG_CACHED:
                    now = min(p.b_tok[b], left - (keep - 1) * self.block_size)
                    p.add_tokens(-(p.b_tok[b] - now))
                    p.b_tok[b] = now
            for b in reversed(cut):
                self._release(b)
            return n

    def get_blocks_for_generation(self, table: BlockTable) -> Tuple[List[CacheBlock], bool]:
        """The table's blocks, after copying every shared block into a
        private one (payload bytes and token count; the copy replaces it in
        the table), as the seed does. A block stays shared when no free
        block is left for its copy.

        ``prepare_append`` is the efficient path: it copies only the
        partly filled block the next tokens land in.

        Returns:
            (blocks, whether any block was copied).
        """
        with self._p.lock:
            self._sync()
            p = self._p
            t = self._table_index(table)
            words = self._refs.table_words(t)
            blocks = self._refs.blocks_at(words, "table {}'s list", t)
            copied = False
            now = p.now()
            out = []
            for g, b in zip(words, blocks):
                p.b_last[b] = now
                if p.b_ref[b] > 1 and self._ensure_free(1):
                    b = self._cow_at(g, count_tokens=False)
                    copied = True
                out.append(SharedBlock(self, b))
            return out, copied

    def _cow_copy_block(self, source_block: CacheBlock) -> Optional[CacheBlock]:
        """A new block (held by this manager) with a copy of the source's
        payload and token count, or None when no block (or room for its
        reference) is left."""
        with self._p.lock:
            self._sync()
            src = self._bid(source_block)
            if not self._ensure_free(1):
                return None
            try:
                self._refs.need(1)
            except CapacityError:
                return None
            new = self._pop_free()
            self._refs.add_loose(new)
            self._p.b_tok[new] = self._p.b_tok[src]
            kv.copy_block(self._p, src, new)
            self._copy_payload(src, new)
            self._p.c[L.C_COW] += 1
            return SharedBlock(self, new)

    def allocate_blocks_for_tokens(self, num_tokens: int) -> List[CacheBlock]:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        return self.get_new_blocks(-(-num_tokens // self.block_size))
