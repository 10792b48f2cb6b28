"""``BlockTables``: the per-request block lists of a pool, as one process
uses them: creating, finding, forking and deleting tables, appending
blocks (the copy-on-write append path of a generation step), trimming.

Its collaborator is the ``core.BlockLedger`` (ids, references, the free
list), given to its constructor; through it, the pool and this process's
``holder.Holder`` (its table maps and append chains). The table records,
the table index and the tables' lists in the chunk area are the pool's;
``refs.RefStore`` writes the lists. It hands out ``views.SharedBlockTable``
views of its tables, which call back only into it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional, Tuple

import numpy as np

from ..shm import claims
from . import kv
from ..shm import layout as L
from ..shm.blocks import BlockTable, CacheBlock
from ..errors import CapacityError, OutOfBlocksError
from ..shm.refs import rid_key, unlink_table
from .views import SharedBlock, SharedBlockTable

if TYPE_CHECKING:
    from .core import BlockLedger

logger = logging.getLogger("shmcache.manager.paged_cache")


class BlockTables:
    """The block tables of one process's manager (see the module docstring).

    Invariant: every id in a table's list is a reference counted on its
    block; a table is created, and its lists changed, only by its owner
    slot (claims.py: the C append paths take the table's claim).
    """

    def __init__(self, ledger: "BlockLedger") -> None:
        self.ledger = ledger
        self.pool = ledger.pool
        self.holder = ledger.holder
        self.name = ledger.name
        self.block_size = ledger.block_size
        self.max_blocks = ledger.max_blocks

    # ============================================================ primitives
    def table_index(self, table) -> int:
        p = self.pool
        rec = table.record_in(p) if isinstance(table, SharedBlockTable) else None
        if rec is not None:
            t, rh = rec
            if p.t_state[t] == 1 and p.t_rhash[t] == rh:
                return self.checked_table(t)
            raise KeyError(f"block table {table.request_id!r} no longer exists")
        rid = getattr(table, "request_id", table)
        raw, h = rid_key(rid)
        t = self.pool.tindex.find(raw, h)
        if t < 0:
            raise KeyError(f"no block table for request {rid!r}")
        return self.checked_table(t)

    def checked_table(self, t: int) -> int:
        # the fields every table operation indexes with, checked once here;
        # in a hold, the table's claim taken first (claims.py: its owner may
        # be appending without the lock)
        p = self.pool
        if p.lock.held:
            claims.claim(p, t)
        nch = p.layout.num_chunks
        if not (-1 <= p.t_head[t] < nch and -1 <= p.t_tail[t] < nch
                and 0 <= p.t_len[t] <= nch * L.CHUNK_IDS and p.t_tok[t] >= 0):
            raise p.corrupt(f"table {t}: head {p.t_head[t]}, tail {p.t_tail[t]}, length "
                            f"{p.t_len[t]}, tokens {p.t_tok[t]} do not describe a list")
        return t

    def rid_of(self, t: int) -> str:
        raw = bytes(self.pool.tables["request_id"][t])
        try:
            rid = raw.decode()
            if rid_key(rid)[1] == int(self.pool.tables["rid_hash"][t]):
                return rid
        except (TypeError, ValueError):         # (UnicodeDecodeError is a ValueError)
            pass
        raise self.pool.corrupt(f"table {t}: request id {raw!r} does not match its hash")

    def table_view(self, t: int) -> SharedBlockTable:
        p = self.pool
        return SharedBlockTable(self, t, self.rid_of(t), int(p.tables["rid_hash"][t]))

    def table_ids(self) -> list:
        with self.pool.lock:
            st = self.pool.tables
            return [self.rid_of(t) for t in np.flatnonzero(st["state"] == 1).tolist()]

    def new_table(self, request_id: str, key=None) -> int:
        p = self.pool
        raw, h = key or rid_key(request_id)
        if self.pool.tindex.find(raw, h) >= 0:
            raise ValueError(f"a block table for request {request_id!r} already exists")
        # (a free record whose claim is not 0 is skipped, as hot_table_new does)
        free = np.flatnonzero((p.tables["state"] == 0) & (p.tables["claim"] == 0))
        if not free.size:
            raise CapacityError(f"pool {self.name!r} has no free block table "
                                f"(max_tables={p.layout.max_tables})")
        t = int(free[0])
        rec = p.tables[t]
        rec["request_id"] = raw
        rec["rid_hash"] = h
        rec["owner"] = p.slot
        rec["head"] = rec["tail"] = -1
        rec["length"] = rec["num_tokens"] = 0
        self.pool.tindex.insert(t, h)
        p.t_state[t] = 1           # commit
        p.counters.table_created()
        self.holder.tcache[t] = (h, None, {})
        self.holder.chains.forget(t)
        return t

    def table_add(self, table, block, tokens_in_block: int, set_block_tokens=True,
                   count_tokens=False) -> None:
        with self.pool.lock:
            self.ledger.sync()
            t = self.table_index(table)
            b = self.ledger.bid(block)
            if isinstance(tokens_in_block, bool) or not isinstance(tokens_in_block, int) \
                    or not 0 <= tokens_in_block <= self.block_size:
                raise ValueError(f"tokens_in_block must be an int in [0, {self.block_size}], "
                                 f"got {tokens_in_block!r}")
            self.table_put(t, [b])
            p = self.pool
            if set_block_tokens:
                p.b_tok[b] = tokens_in_block
            p.t_tok[t] += tokens_in_block
            if count_tokens:
                p.add_tokens(tokens_in_block)      # as the seed's add_block_to_table

    def table_edit(self, table, op):
        """Apply ``op`` (a list mutation) to the table's block ids, moving
        references as ``views.TableBlockIds`` says; returns (the table's ids
        now, what ``op`` returned). Nothing changes when ``op`` raises, an id
        is bad, or the references do not fit."""
        with self.pool.lock:
            self.ledger.sync()
            p, refs = self.pool, self.holder.refs
            t = self.table_index(table)
            cur = refs.table_blocks(t)
            new = list(cur)
            result = op(new)
            if new == cur:                  # (the common case: a caller's copy kept in step)
                return cur, result
            new = self.ledger.bids(new)
            if 0 in new:
                raise ValueError("the null block (block 0) cannot be put in a block table")
            have: dict = {}
            for b in cur:
                have[b] = have.get(b, 0) + 1
            added: list = []
            for b in new:
                if have.get(b, 0):
                    have[b] -= 1
                else:
                    added.append(b)
            removed = [b for b, k in have.items() for _ in range(k)]
            avail = {b: refs.loose.count(b) for b in added}
            fresh = 0
            for b in added:
                if avail[b]:
                    avail[b] -= 1
                else:
                    fresh += 1
            refs.need_chunks(refs.table_chunks_needed(t, max(0, len(new) - len(cur)))
                             + refs.loose_chunks_needed(fresh + len(removed)))
            avail = {b: refs.loose.count(b) for b in added}
            for b in added:
                if avail[b]:
                    avail[b] -= 1
                else:
                    self.ledger.take_ref(b)
            # write: ids in place where both have a position, then grow or cut
            # (NOTE: each write is its own commit; a holder dying midway
            # leaves the table part changed, every reference still counted)
            k = min(len(cur), len(new))
            diff = [i for i in range(k) if cur[i] != new[i]]
            if diff:
                words = refs.table_words(t)
                for i in diff:
                    p.kw[words[i]] = new[i]
            if len(new) > len(cur):
                refs.table_extend(t, new[len(cur):])
            elif len(new) < len(cur):
                refs.table_truncate(t, len(new))
            for b in added:
                refs.drop_loose(b)
            for b in removed:
                refs.add_loose(b)
            if len(new) > len(cur) and new[:len(cur)] == cur:
                self.holder.chains.last_add = (t, len(new) - 1, new[-1])
            else:
                self.holder.chains.cut(t, next((i for i, (a, b) in enumerate(zip(cur, new)) if a != b),
                                         min(len(cur), len(new))))
            return new, result

    def table_put(self, t: int, ids: list) -> None:
        """Append block ids to table ``t``, each id one reference: one this
        manager holds outside its tables moves into the table, or, where it
        holds none, a new one is taken (as ``touch`` takes one).

        NOTE: a new reference is counted, then the table's list names it
        (as acquire_computed_blocks's table branch, and _hot.add_block, do:
        no detour through the loose list); a holder dying in between leaves
        a count above the lists, which repair recomputes from them. A moved
        one is named by the table, then dropped from the loose list.

        Raises:
            ValueError: the null block. CapacityError: no room for the
                references (nothing changed).
        """
        if 0 in ids:
            raise ValueError("the null block (block 0) cannot be put in a block table")
        refs = self.holder.refs
        moved: dict = {}
        for b in ids:
            moved[b] = moved.get(b, 0) + 1
        avail = {b: refs.loose.count(b) for b in moved}
        refs.need_chunks(refs.table_chunks_needed(t, len(ids)))
        start = int(self.pool.t_len[t])
        move = []
        for b in ids:
            if avail[b] > 0:
                avail[b] -= 1
                move.append(b)
            else:
                self.ledger.count_ref(b)
        refs.table_extend(t, ids)
        for b in move:
            refs.drop_loose(b)
        if ids:
            self.holder.chains.last_add = (t, start + len(ids) - 1, ids[-1])

    # ============================================================ block tables
    def create_block_table(self, request_id: str) -> BlockTable:
        """Create an empty table owned by this manager.

        Raises:
            ValueError: a table for ``request_id`` exists.
            CapacityError: every table slot is in use.
        """
        key = rid_key(request_id)           # (hashed before the lock)
        p = self.pool
        fused = p.ops.new_table
        # C (_hot.new_table): the table made in a hold the C op takes itself;
        # None: nothing changed, and the path below makes it or raises
        if not p.lock.unusable and not p.lock.held:
            t = fused(key[0], key[1], p.slot, self.holder.epoch)
            if t is not None:
                self.holder.tcache[t] = (key[1], None, {})
                self.holder.chains.forget(t)
                return SharedBlockTable(self, t, request_id, key[1])
        with self.pool.lock:
            self.ledger.sync()
            new = self.pool.ops.table_new
            # C (_hot.table_new): _new_table's steps; None: nothing changed,
            # and _new_table raises for what it refused
            t = new(key[0], key[1], self.pool.slot)
            if t is None:
                t = self.new_table(request_id, key)
            else:
                self.holder.tcache[t] = (key[1], None, {})
            self.holder.chains.forget(t)
            return SharedBlockTable(self, t, request_id, key[1])

    def get_block_table(self, request_id: str) -> Optional[BlockTable]:
        """The table of ``request_id`` (from any process), or None."""
        raw, h = rid_key(request_id)
        with self.pool.lock:
            self.ledger.sync()
            t = self.pool.tindex.find(raw, h)
            return self.table_view(t) if t >= 0 else None

    def get_or_create_block_table(self, request_id: str) -> BlockTable:
        with self.pool.lock:
            t = self.get_block_table(request_id)   # not `or`: an empty table is falsy
            return t if t is not None else self.create_block_table(request_id)

    def delete_block_table(self, request_id: str) -> None:
        """Delete a table and drop its references, last block first.

        Raises:
            KeyError: no table for ``request_id``.
        """
        p = self.pool
        fused = p.ops.delete_table
        # C (_hot.delete_table): the steps below in a hold the C op takes
        # itself; by request id only (a table view names one table record,
        # which the path below checks); None: nothing changed
        if type(request_id) is str and not p.lock.unusable \
                and not p.lock.held:
            raw, h = rid_key(request_id)
            t = fused(raw, h, p.slot, self.holder.epoch)
            if t is not None:
                self.holder.tcache.pop(t, None)
                self.holder.chains.forget(t)
                return
        with self.pool.lock:
            self.ledger.sync()
            t = self.table_index(request_id)
            self.holder.tcache.pop(t, None)
            self.holder.chains.forget(t)
            drop = p.ops.table_drop
            # C (_hot.table_drop): the same steps but the index removal,
            # which follows in this hold; None: nothing changed, and the
            # Python path below meets (and raises for) what it refused
            if drop(t) is not None:
                p.tindex.remove(t, int(p.t_rhash[t]))
                return
            unlink_table(p, t)
            for b in reversed(self.holder.refs.pop_table(t)):
                self.ledger.release(b)

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
        p = self.pool
        fused = p.ops.add_block
        # C (_hot.add_block): a new reference's case (this manager holds
        # none loose on the block: a loose one moves, below) in one hold the
        # C op takes itself; None: nothing changed, and the path below runs
        # (and raises for what it refused). Not inside a hold of this process.
        rec = table.record_in(p) if type(table) is SharedBlockTable else None
        if (rec is not None
                and type(tokens_in_block) is int and not p.lock.unusable and not p.lock.held):
            b = (block.block_id if type(block) is SharedBlock and block.ledger is self.ledger
                 else block)
            if type(b) is int and 0 < b < self.max_blocks and not self.holder.refs.loose.count(b):
                pos = fused(rec[0], rec[1], b, tokens_in_block, self.block_size, p.now(),
                            p.slot, self.holder.epoch)
                if pos is not None:
                    self.holder.chains.last_add = (rec[0], pos, b)
                    return
        self.table_add(table, block, tokens_in_block, count_tokens=True)

    def fork_block_table(self, source_table: BlockTable, new_request_id: str) -> BlockTable:
        """A new table sharing every block of ``source_table`` (one more
        reference each: 4 bytes apiece, never a copy).

        Raises:
            KeyError: unknown source. ValueError: a table for
                ``new_request_id`` exists. CapacityError (an
                OutOfBlocksError): no free table, or no room for the
                references; nothing changed.
        """
        with self.pool.lock:
            self.ledger.sync()
            src = self.table_index(source_table)
            rid_key(new_request_id)
            p = self.pool
            chunks = self.holder.refs.table_chain(src)        # (checked before anything changes)
            blocks = self.holder.refs.table_blocks(src)
            self.holder.refs.need_chunks(len(chunks))
            t = self.new_table(new_request_id)
            self.holder.refs.copy_table(src, t, chunks)
            for b in blocks:
                p.b_ref[b] += 1
            p.t_tok[t] = p.t_tok[src]
            return self.table_view(t)

    def _cow_at(self, g: int, count_tokens: bool = True) -> int:
        """Copy the block at word ``g`` of a table into a new block, which
        replaces it there (payload and token count included); returns it.
        The copy's tokens count in ``C_TOKENS`` (not in the seed's own
        method, ``count_tokens`` False: the seed does not count them)."""
        p = self.pool
        old = self.holder.refs.block_at(g, "a table's list")
        new = self.ledger.pop_free()
        p.b_tok[new] = p.b_tok[old]
        if count_tokens:
            p.add_tokens(p.b_tok[new])
        kv.copy_block(p, old, new)
        self.ledger.copy_payload(old, new)
        p.kw[g] = new               # commit: the table now holds the copy
        self.ledger.release(old)
        p.counters.count_cow()
        return new

    def _append_plan(self, t: int, n: int) -> Tuple[list, int]:
        """(words of the shared blocks the new tokens would land in, blocks to allocate)."""
        p, bs = self.pool, self.block_size
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
                words = [self.holder.refs.table_word(t, first)]
            else:
                words = self.holder.refs.table_words(t)[first:end]
            blocks = self.holder.refs.blocks_at(words, "table {}'s list", t)
            # shared, or published (a trimmed table's last block can be: its
            # bytes are everyone's now)
            cow = [g for g, b in zip(words, blocks)
                   if p.b_ref[b] > 1 or p.b_flags[b] & L.FLAG_CACHED]
        return cow, max(0, needed - length)

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        """Whether ``prepare_append(table, num_new_tokens)`` would find its blocks."""
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        with self.pool.lock:
            self.ledger.sync()
            t = self.table_index(table)
            cow, new = self._append_plan(t, num_new_tokens)
            if self.holder.refs.free_chunks() < self.holder.refs.table_chunks_needed(t, new):
                return False
            return self.ledger.ensure_free(len(cow) + new)

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
        p = self.pool
        fused = p.ops.append
        # C (_hot.append): the common case in one call that takes the lock
        # itself, so the hold is the C op's alone (not this method's Python
        # too); None: nothing changed, and the path below runs. Not inside a
        # hold of this process (the mutex is not reentrant; the path below is)
        rec = table.record_in(p) if type(table) is SharedBlockTable else None
        if (num_new_tokens and not p.lock.unusable and not p.lock.held
                and rec is not None):
            ids = fused(rec[0], rec[1], num_new_tokens, self.block_size, p.now(),
                        p.slot, self.holder.epoch)
            if ids is not None:
                return [SharedBlock(self.ledger, b) for b in ids]
        with self.pool.lock:
            self.ledger.sync()
            t = self.table_index(table)
            append = p.ops.table_append
            # C (_hot.table_append): the common case (no copy-on-write, free
            # blocks uncached) in one call; None: nothing changed, and the
            # Python path below does it (or raises for what it refused)
            if num_new_tokens:
                ids = append(t, num_new_tokens, self.block_size, p.now())
                if ids is not None:
                    return [SharedBlock(self.ledger, b) for b in ids]
            cow, new = self._append_plan(t, num_new_tokens)
            if not self.ledger.ensure_free(len(cow) + new):
                raise OutOfBlocksError(f"prepare_append needs {len(cow) + new} free blocks, "
                                       f"{p.counters.num_free} available")
            self.holder.refs.need_table(t, new)
            for g in cow:
                self._cow_at(g)
            if new:
                self.holder.refs.table_extend(t, [self.ledger.pop_free() for _ in range(new)])
            bs, tok = self.block_size, p.t_tok[t]
            first, last = tok // bs, (tok + num_new_tokens - 1) // bs
            if first == last and first == p.t_len[t] - 1:
                words = [self.holder.refs.table_word(t, first)]
            else:
                words = self.holder.refs.table_words(t)[first:last + 1]
            out: List[CacheBlock] = []
            for i, g in zip(range(first, last + 1), words):
                b = self.holder.refs.block_at(g, "table {}'s list", t)
                p.b_tok[b] = min(bs, tok + num_new_tokens - i * bs)
                out.append(SharedBlock(self.ledger, b))
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
        with self.pool.lock:
            self.ledger.sync()
            p = self.pool
            t = self.table_index(table)
            tok = p.t_tok[t]
            n = min(num_tokens, tok)
            if n == 0:
                return 0
            left = tok - n
            keep = min(p.t_len[t], -(-left // self.block_size))
            cut = self.holder.refs.table_truncate(t, keep) if keep < p.t_len[t] else []
            p.t_tok[t] = left
            if keep and left < keep * self.block_size:
                # the new last block: a private one counts only what is left
                b = self.holder.refs.block_at(self.holder.refs.table_word(t, keep - 1), "table {}'s list", t)
                if p.b_ref[b] == 1 and not p.b_flags[b] & L.FLAG_CACHED:
                    now = min(p.b_tok[b], left - (keep - 1) * self.block_size)
                    p.add_tokens(-(p.b_tok[b] - now))
                    p.b_tok[b] = now
            for b in reversed(cut):
                self.ledger.release(b)
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
        with self.pool.lock:
            self.ledger.sync()
            p = self.pool
            t = self.table_index(table)
            words = self.holder.refs.table_words(t)
            blocks = self.holder.refs.blocks_at(words, "table {}'s list", t)
            copied = False
            now = p.now()
            out: List[CacheBlock] = []
            for g, b in zip(words, blocks):
                p.b_last[b] = now
                if p.b_ref[b] > 1 and self.ledger.ensure_free(1):
                    b = self._cow_at(g, count_tokens=False)
                    copied = True
                out.append(SharedBlock(self.ledger, b))
            return out, copied

    def cow_copy_block(self, source_block: CacheBlock) -> Optional[CacheBlock]:
        """A new block (held by this manager) with a copy of the source's
        payload and token count, or None when no block (or room for its
        reference) is left."""
        with self.pool.lock:
            self.ledger.sync()
            src = self.ledger.bid(source_block)
            if not self.ledger.ensure_free(1):
                return None
            try:
                self.holder.refs.need(1)
            except CapacityError:
                return None
            new = self.ledger.pop_free()
            self.holder.refs.add_loose(new)
            self.pool.b_tok[new] = self.pool.b_tok[src]
            kv.copy_block(self.pool, src, new)
            self.ledger.copy_payload(src, new)
            self.pool.counters.count_cow()
            return SharedBlock(self.ledger, new)

    def allocate_blocks_for_tokens(self, num_tokens: int) -> List[CacheBlock]:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        return self.ledger.get_new_blocks(-(-num_tokens // self.block_size))

