"""Block tables: per-request block lists in shared memory, forks, and the
copy-on-write append path of a generation step."""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple


from . import kv
from . import layout as L
from .blocks import (BlockTable, CacheBlock)
from .errors import OutOfBlocksError
from .views import SharedBlock

logger = logging.getLogger("shmcache.paged_cache")

from .core import PoolOps, _rid_key, _unlink_table


class TableOps(PoolOps):
    # ============================================================ block tables
    def create_block_table(self, request_id: str) -> BlockTable:
        """Create an empty table owned by this manager.

        Raises:
            ValueError: a table for ``request_id`` exists.
            CapacityError: every table slot is in use.
        """
        with self._p.lock:
            self._sync()
            return self._table_view(self._new_table(request_id))

    def get_block_table(self, request_id: str) -> Optional[BlockTable]:
        """The table of ``request_id`` (from any process), or None."""
        raw, h = _rid_key(request_id)
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
        with self._p.lock:
            self._sync()
            t = self._table_index(request_id)
            self._tcache.pop(t, None)
            _unlink_table(self._p, self._refs, t)
            for b in reversed(self._refs.pop_table(t)):
                self._release(b)

    def add_block_to_table(self, table: BlockTable, block: CacheBlock, tokens_in_block: int) -> None:
        """Move this manager's reference on ``block`` into ``table``.

        Raises:
            KeyError: the table does not exist. ValueError: the block is not
                held by this manager, or ``tokens_in_block`` is out of range.
        """
        self._table_add(table, block, tokens_in_block)

    def fork_block_table(self, source_table: BlockTable, new_request_id: str) -> BlockTable:
        """A new table sharing every block of ``source_table`` (one more reference each)."""
        with self._p.lock:
            self._sync()
            src = self._table_index(source_table)
            blocks = self._refs.table_blocks(src)
            _rid_key(new_request_id)
            self._refs.need(len(blocks))
            t = self._new_table(new_request_id)
            p = self._p
            for b in blocks:
                self._refs.table_append(t, b)
                p.b_ref[b] += 1
            p.t_tok[t] = p.t_tok[src]
            return self._table_view(t)

    def _cow_at(self, rec: int) -> bool:
        p = self._p
        old = self._refs.block_of(rec, "a table's list")
        new = self._pop_free()
        p.b_tok[new] = p.b_tok[old]
        kv.copy_block(p, old, new)
        p.r_block[rec] = new        # commit: the table now holds the copy
        self._release(old)
        p.c[L.C_COW] += 1
        return True

    def _append_plan(self, t: int, n: int) -> Tuple[list, int]:
        """(records of the shared blocks the new tokens would land in, blocks to allocate)."""
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
                if p.t_tail[t] < 0:
                    raise p.corrupt(f"table {t} has length {length} but no tail")
                recs = [p.t_tail[t]]
            else:
                recs = self._refs.table_records(t)[first:end]
            blocks = self._refs.blocks_of(recs, "table {}'s list", t)
            cow = [r for r, b in zip(recs, blocks) if p.b_ref[b] > 1]
        return cow, max(0, needed - length)

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        """Whether ``prepare_append(table, num_new_tokens)`` would find its blocks."""
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        with self._p.lock:
            self._sync()
            cow, new = self._append_plan(self._table_index(table), num_new_tokens)
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
            OutOfBlocksError: not enough free blocks; nothing changed.
            KeyError: unknown table. ValueError: negative count.
        """
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        with self._p.lock:
            self._sync()
            p = self._p
            t = self._table_index(table)
            cow, new = self._append_plan(t, num_new_tokens)
            if not self._ensure_free(len(cow) + new):
                raise OutOfBlocksError(f"prepare_append needs {len(cow) + new} free blocks, "
                                       f"{p.c[L.C_NUM_FREE]} available")
            self._refs.need(new)
            for rec in cow:
                self._cow_at(rec)
            for _ in range(new):
                self._refs.table_append(t, self._pop_free())
            bs, tok = self.block_size, p.t_tok[t]
            recs = self._refs.table_records(t)
            if len(recs) != p.t_len[t]:
                raise p.corrupt(f"table {t} has length {p.t_len[t]} but {len(recs)} records")
            first, last = tok // bs, (tok + num_new_tokens - 1) // bs
            out = []
            for i in range(first, last + 1):
                b = self._refs.block_of(recs[i], "table {}'s list", t)
                p.b_tok[b] = min(bs, tok + num_new_tokens - i * bs)
                out.append(SharedBlock(self, b))
            p.t_tok[t] = tok + num_new_tokens
            return out

    def get_blocks_for_generation(self, table: BlockTable) -> Tuple[List[CacheBlock], bool]:
        """The table's blocks, after copying the last one if it is shared and
        partly filled (the only block a decode step writes into)."""
        with self._p.lock:
            self._sync()
            t = self._table_index(table)
            cow, _ = self._append_plan(t, 1)
            copied = False
            if cow and self._ensure_free(len(cow)):
                for rec in cow:
                    copied = self._cow_at(rec)
            now = self._p.now()
            blocks = self._refs.table_blocks(t)
            for b in blocks:
                self._p.b_last[b] = now
            return [SharedBlock(self, b) for b in blocks], copied

    def _cow_copy_block(self, source_block: CacheBlock) -> Optional[CacheBlock]:
        """A new block (held by this manager) with a copy of the source's payload."""
        with self._p.lock:
            self._sync()
            src = self._bid(source_block)
            if not self._ensure_free(1):
                return None
            self._refs.need(1)
            new = self._pop_free()
            self._refs.add_loose(new)
            self._p.b_tok[new] = self._p.b_tok[src]
            kv.copy_block(self._p, src, new)
            self._p.c[L.C_COW] += 1
            return SharedBlock(self, new)

    def allocate_blocks_for_tokens(self, num_tokens: int) -> List[CacheBlock]:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        return self.get_new_blocks(-(-num_tokens // self.block_size))

