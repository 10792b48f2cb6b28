"""``PrefixCache``: publishing full blocks under chain hashes, looking
prefixes up, and the seed's legacy hash calls (which here match whole
chains only), as one process uses them.

Its collaborators, given to its constructor: the ``core.BlockLedger``
(references; through it the pool, the holder's append chains and the
shared ``index.PrefixIndex``) and the ``tables.BlockTables`` (the table a
lookup appends to). The index itself is the pool's, shared by every
process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from ..shm.blocks import BlockHash, BlockTable, CacheBlock, compute_block_hash, token_bytes
from .views import SharedBlock, SharedBlockTable

if TYPE_CHECKING:
    from .core import BlockLedger
    from .tables import BlockTables

logger = logging.getLogger("shmcache.manager.paged_cache")


class PrefixCache:
    """Prefix caching for one process's manager (see the module docstring).

    Invariant: only a held block is published, and only under the chain
    hash of the tokens it was computed after (``register_block_hash``).
    """

    def __init__(self, ledger: "BlockLedger", tables: "BlockTables") -> None:
        self.ledger = ledger
        self.tables = tables
        self.pool = ledger.pool
        self.holder = ledger.holder
        self.block_size = ledger.block_size
        self.enable_caching = ledger.enable_caching

    # ============================================================ prefix cache
    def get_cached_block(self, block_hash: BlockHash) -> Optional[CacheBlock]:
        """Any block cached under ``block_hash`` (no reference is taken)."""
        if not self.enable_caching:
            return None
        with self.pool.lock:
            self.ledger.sync()
            b = self.ledger.index.find(bytes(block_hash))
            k = self.pool.counters
            k.count_hits() if b >= 0 else k.count_misses()
            return SharedBlock(self.ledger, b) if b >= 0 else None

    def cache_full_blocks(self, blocks: List[CacheBlock], token_ids: List[int],
                          num_cached_blocks: int, num_full_blocks: int,
                          extra_keys: Optional[Tuple[Any, ...]] = None) -> None:
        """Publish blocks ``num_cached_blocks .. num_full_blocks-1`` in the prefix cache.

        Their K/V must be written first: a published block is visible to
        every process at once. ``extra_keys`` salts the chain (tenant, LoRA).

        Raises:
            ValueError, TypeError: bad counts, tokens, or a block that is free.
        """
        if not self.enable_caching:
            return
        for name, v in (("num_cached_blocks", num_cached_blocks), ("num_full_blocks", num_full_blocks)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if num_cached_blocks >= num_full_blocks:
            return
        if len(blocks) < num_full_blocks or len(token_ids) < num_full_blocks * self.block_size:
            raise ValueError(f"num_full_blocks={num_full_blocks} needs {num_full_blocks} blocks and "
                             f"{num_full_blocks * self.block_size} tokens, got {len(blocks)} "
                             f"and {len(token_ids)}")
        ids = self.ledger.bids(blocks[:num_full_blocks])
        parent = self.ledger.index.hash_of(ids[num_cached_blocks - 1]) if num_cached_blocks else None
        if num_cached_blocks and parent is None:
            parent = self.ledger.hashes(token_ids, num_cached_blocks, extra_keys)[-1]
        hashes = self.ledger.hashes(token_ids, num_full_blocks, extra_keys, parent, num_cached_blocks)
        p = self.pool
        fused = p.ops.publish
        # C (_hot.publish): the hold below in one call that takes the lock
        # itself; None: nothing changed, and the hold below runs (and raises
        # for a block that is not held)
        if (not p.lock.unusable and not p.lock.held
                and fused(ids[num_cached_blocks:], b"".join(hashes), self.block_size, p.slot,
                          self.holder.epoch) is not None):
            return
        with p.lock:
            self.ledger.sync()
            for b in ids[num_cached_blocks:]:
                if p.b_ref[b] <= 0 or b == 0:
                    raise ValueError(f"block {b} is not allocated; only held blocks can be cached")
            tok, bs = p.b_tok, self.block_size
            for b in self.ledger.index.add_many(ids[num_cached_blocks:], hashes):
                tok[b] = bs      # a published block is full

    def _lookup_chain(self, hashes) -> list:
        """Blocks of the longest cached run of ``hashes`` from the first (lock
        held); not counted yet (``_count_lookup``)."""
        found = self.pool.ops.find_chain(hashes)
        if found is None:       # (no C, or it refused: the probes here raise)
            found = self.ledger.index.find_chain(hashes)
        return found

    def _count_lookup(self, found, hashes) -> None:
        """Count a lookup's hits and the miss that ended its run (lock held).

        NOTE: called once the operation can no longer fail, so that one that
        raises (no room for the references) leaves the statistics as well as
        the pool unchanged."""
        k = self.pool.counters
        k.count_hits(len(found))
        if len(found) < len(hashes):
            k.count_misses()

    def get_computed_blocks(self, token_ids: List[int],
                            extra_keys: Optional[Tuple[Any, ...]] = None
                            ) -> Tuple[List[CacheBlock], int]:
        """The cached blocks of the longest cached prefix (no reference taken:
        use ``acquire_computed_blocks`` when another process may evict them)."""
        if not self.enable_caching:
            return [], 0
        hashes = self.ledger.hashes(token_ids, len(token_ids) // self.block_size, extra_keys)
        p = self.pool
        fused = p.ops.lookup
        # C (_hot.lookup): the hold below in one call that takes the lock
        # itself; None: nothing changed, and the hold below runs
        found = (fused(b"".join(hashes), -1.0, p.slot, self.holder.epoch)
                 if not p.lock.unusable and not p.lock.held else None)
        if found is None:
            with p.lock:
                self.ledger.sync()
                found = self._lookup_chain(hashes)
                self._count_lookup(found, hashes)
        self.holder.chains.looked_up(found, hashes)
        return [SharedBlock(self.ledger, b) for b in found], len(found) * self.block_size

    def cached_prefix_tokens(self, token_ids: List[int],
                             extra_keys: Optional[Tuple[Any, ...]] = None) -> int:
        """How many leading tokens of ``token_ids`` the pool holds now (whole
        published blocks): a probe for routing, not a lookup. No reference is
        taken and the hit/miss counters are left alone (the process that
        then takes the prefix counts its lookup), so the answer may be stale
        by the time anyone acts on it."""
        if not self.enable_caching:
            return 0
        hashes = self.ledger.hashes(token_ids, len(token_ids) // self.block_size, extra_keys)
        with self.pool.lock:
            self.ledger.sync()
            found = self._lookup_chain(hashes)
        return len(found) * self.block_size

    def acquire_computed_blocks(self, token_ids: List[int],
                                extra_keys: Optional[Tuple[Any, ...]] = None,
                                table: Optional[BlockTable] = None
                                ) -> Tuple[List[CacheBlock], int]:
        """Look up the longest cached prefix and take a reference on each of
        its blocks, in one atomic step.

        Args:
            token_ids: the tokens; only whole blocks are looked up.
            extra_keys: the tenant salt (entries of other salts never match).
            table: where the references go. None: this manager holds them
                (free them, or add them to a table). A table (empty or not):
                the blocks are appended to it, full, in the same step, as
                ``add_block_to_table(table, b, block_size)`` for each would
                (one lock hold, no detour through the loose list).
        Returns:
            (blocks, num_cached_tokens).
        Raises:
            KeyError: ``table`` does not exist. CapacityError: no room for
                the references (nothing changed).
        """
        if not self.enable_caching:
            token_bytes(token_ids)
            if table is not None:
                with self.pool.lock:
                    self.tables.table_index(table)
            return [], 0
        bs = self.block_size
        hashes = self.ledger.hashes(token_ids, len(token_ids) // bs, extra_keys)
        p = self.pool
        fused = p.ops.acquire
        # C (_hot.acquire): the table branch below in one call that takes the
        # lock itself (as tables.prepare_append's); None: nothing changed
        rec = table.record_in(p) if type(table) is SharedBlockTable else None
        if (rec is not None and not p.lock.unusable
                and not p.lock.held):
            found = fused(rec[0], rec[1], b"".join(hashes), p.now(), bs, p.slot,
                          self.holder.epoch)
            if found is not None:
                return [SharedBlock(self.ledger, b) for b in found], len(found) * bs
        with self.pool.lock:
            self.ledger.sync()
            if table is None:
                found = self._lookup_chain(hashes)
                self.holder.refs.need(len(found))
                self._count_lookup(found, hashes)
                for b in found:
                    self.ledger.take_ref(b)
                self.holder.chains.looked_up(found, hashes)
            else:
                t = self.tables.table_index(table)
                found = self._lookup_chain(hashes)
                now = p.now()
                # C (_hot.table_take): the steps below in one call; None:
                # nothing changed, and they run here (raising for what it refused)
                if found and p.ops.table_take(t, found, now, bs * len(found)) is not None:
                    self._count_lookup(found, hashes)
                    return [SharedBlock(self.ledger, b) for b in found], len(found) * bs
                self.holder.refs.need_table(t, len(found))
                self._count_lookup(found, hashes)
                for b in found:
                    if p.b_ref[b] == 0:
                        if p.b_prev[b] < 0 or p.b_next[b] < 0:
                            raise p.corrupt(f"block {b} has no references but is not in "
                                            "the free list")
                        self.ledger.free_queue.remove_id(b)
                    p.b_ref[b] += 1
                    p.b_last[b] = now
                # NOTE: the references are counted before the table's list
                # names them; a holder dying in between leaves counts above
                # the lists, which repair recomputes from the lists.
                self.holder.refs.table_extend(t, found)
                p.t_tok[t] += bs * len(found)
                p.add_tokens(bs * len(found))     # as add_block_to_table counts them
        return [SharedBlock(self.ledger, b) for b in found], len(found) * bs

    # ================================================================= legacy
    @staticmethod
    def compute_block_hash(tokens: List[int]) -> str:
        """Legacy string hash of a token list (a pure function)."""
        return compute_block_hash(None, tokens).hex()[:16]

    def find_cached_block(self, tokens: List[int]) -> Optional[CacheBlock]:
        """The cached block whose prefix is exactly ``tokens`` (from position 0)."""
        hashes = self._chunk_hashes(tokens)         # (a pure function: before the lock)
        p = self.pool
        fused = p.ops.lookup
        # C (_hot.lookup of the last hash): the hold below in one call that
        # takes the lock itself; None: nothing changed, and the hold runs
        if hashes and not p.lock.unusable and not p.lock.held:
            found = fused(hashes[-1], p.now(), p.slot, self.holder.epoch)
            if found is not None:
                return SharedBlock(self.ledger, found[0]) if found else None
        with self.pool.lock:
            self.ledger.sync()
            b = self.ledger.index.find(hashes[-1]) if hashes else -1
            k = self.pool.counters
            k.count_hits() if b >= 0 else k.count_misses()
            if b < 0:
                return None
            self.pool.b_last[b] = self.pool.now()
            return SharedBlock(self.ledger, b)

    def _chunk_hashes(self, tokens) -> list:
        """Chain hashes of ``tokens`` cut into blocks, the last one possibly partial."""
        return self.ledger.hashes(tokens, -(-len(tokens) // self.block_size), None)

    def register_block_hash(self, block: CacheBlock, tokens: List[int]) -> None:
        """Cache ``block`` under the prefix it ends.

        ``tokens`` is that prefix from position 0, except for the block this
        manager appended to a table last, given at most one block of tokens:
        those are the block's own tokens (as vllm-mlx's
        ``BlockAwarePrefixCache.store_cache`` registers each block right
        after appending it), and its prefix is the table's blocks before it
        (``table_chains``). When the blocks before it were not all cached
        by this manager's registrations or found by its chain lookups, the
        block is published under nothing: never under a prefix it was not
        computed after.

        Raises:
            ValueError: no tokens, or a block that is not allocated.
        """
        n = len(tokens)
        if not n:
            raise ValueError("register_block_hash needs at least one token")
        b = self.ledger.bid(block)
        at = self.holder.chains.just_appended(b) if n <= self.block_size else None
        hashes = self._chunk_hashes(tokens) if at is None else []
        p = self.pool
        with p.lock:
            self.ledger.sync()
            if p.b_ref[b] <= 0:
                raise ValueError(f"block {b} is not allocated; only held blocks can be cached")
            if at is None:
                self.ledger.set_block_hash(b, hashes[-1])
                return
            t, i = at
            ids = self.holder.refs.table_blocks(self.tables.checked_table(t)) if p.t_state[t] == 1 else []
            known, parent = self.holder.chains.parent_at(t, i, b, ids, self.ledger.index.hash_of)
            if not known:
                logger.debug("block %d at position %d of table %d follows blocks of an "
                             "unknown prefix: not cached", b, i, t)
                return
            h = self.ledger.hashes(tokens, 1, None, parent)[0]
            self.ledger.set_block_hash(b, h)
            if n == self.block_size:
                self.holder.chains.published(t, i, b, h)

    def find_shared_prefix(self, tokens: List[int]) -> Tuple[List[int], List[int]]:
        """Block ids of the longest cached whole-chain prefix, and the tokens after it."""
        with self.pool.lock:
            self.ledger.sync()
            found = []
            if self.enable_caching:
                hashes = self.ledger.hashes(tokens, len(tokens) // self.block_size, None)
                found = self._lookup_chain(hashes)
                self._count_lookup(found, hashes)
                self.holder.chains.looked_up(found, hashes)
            return found, list(tokens[len(found) * self.block_size:])


