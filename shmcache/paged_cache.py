"""``PagedCacheManager``: the seed's paged-cache API over a shared-memory pool.

Every public name of ``vllm_mlx.paged_cache`` is here with its signature, so
code written for the seed runs unchanged; the state behind it lives in a
shared segment (``shmcache.layout``) that other processes attach to by
name. Every public operation takes the pool lock once, checks its inputs,
then commits: it is atomic and linearizable across processes, and a bad
input raises before anything changes.

The seed's own methods keep the seed's behaviour (so code written for it
runs unchanged) and the better behaviour lives in the calls added here
(``acquire_computed_blocks``, ``prepare_append``, ``trim_table``,
``free_block_batch``, ...); docs/seed_differences.md lists every
deliberate difference and why.

The manager is a facade: each call is one owner's method. The owners, each
built over the ones before it and calling none above it:

- ``holder.Holder``: this process's references, epoch, table maps and
  cache_data; ``freelist.SharedFreeQueue``, ``index.PrefixIndex`` and
  ``reserve.Reserves`` over the pool's shared structures;
- ``core.BlockLedger``: block ids, references, allocation, freeing,
  eviction and reserves;
- ``tables.BlockTables``: block tables (forks, copy-on-write appends);
- ``prefix.PrefixCache``: publishing and looking up prefixes;
- ``kv_ops.KVArena``: the K/V of the blocks this process holds;
- ``admin.PoolAdmin``: statistics, resets, check and reclaim.

This module keeps their construction and the manager's lifetime.
"""

from __future__ import annotations

import logging
import os
import secrets
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from . import layout as L
from . import reserve
from .admin import PoolAdmin
from .blocks import (BlockHash, BlockHashToBlockMap, BlockTable, CacheBlock, CacheStats,
                     FreeKVCacheBlockQueue, KVCacheBlock, compute_block_hash)
from .core import BlockLedger
from .freelist import SharedFreeQueue
from .holder import Holder
from .index import PrefixIndex
from .kv_ops import KVArena
from .pool import Pool
from .prefix import PrefixCache
from .reclaim import close as _close
from .seed_views import (AllocatedBlocksView, BlocksView, LegacyHashView, RequestTablesView,
                         SeedFreeQueue, SharedHashMap, SharedStats)
from .tables import BlockTables
from .views import SharedBlock

logger = logging.getLogger(__name__)

__all__ = ["BlockHash", "CacheBlock", "KVCacheBlock", "FreeKVCacheBlockQueue",
           "BlockHashToBlockMap", "BlockTable", "CacheStats", "PagedCacheManager",
           "compute_block_hash"]


class ManagerInternals(NamedTuple):
    """A manager's owners (``PagedCacheManager.internals``): not API."""
    pool: Pool
    holder: Holder
    ledger: BlockLedger
    tables: BlockTables
    prefix: PrefixCache
    kv: KVArena
    admin: PoolAdmin


class PagedCacheManager:
    """Paged KV cache manager over a shared-memory block pool.

    ``PagedCacheManager(block_size, max_blocks, enable_caching)`` makes a
    private pool (unlinked from /dev/shm at once, freed when the manager is
    closed or collected); ``shmcache.create_pool`` / ``shmcache.attach`` give
    managers of named pools. Both run the same code.

    Args:
        block_size: tokens per block.
        max_blocks: blocks in the pool, block 0 being the null block.
        enable_caching: keep a prefix cache of full blocks.
        **layout: num_layers, num_kv_heads, head_dim, dtype of the KV arena,
            and max_slots / max_tables / max_refs capacities.
    Raises:
        TypeError, ValueError: a non-positive or non-integer size.
        InsufficientSharedMemoryError: /dev/shm cannot hold the pool.
    """

    l2: Any     # the L2 tier of a named pool's manager (shmcache._with_l2 sets it)

    def __init__(self, block_size: int = 64, max_blocks: int = 1000,
                 enable_caching: bool = True, *, _pool: Optional[Pool] = None, **layout):
        if _pool is None:
            name = f"private-{os.getpid()}-{secrets.token_hex(6)}"
            _pool = Pool.create(name, block_size=block_size, max_blocks=max_blocks,
                                enable_caching=enable_caching, private=True, **layout)
        p = self._p = _pool
        lay = p.layout
        self.name = p.name
        self.block_size = lay.block_size
        self.max_blocks = lay.max_blocks
        self.enable_caching = lay.enable_caching
        self._lock = p.lock                     # the seed's attribute (an RLock there)
        holder = Holder(p)                      # this process's references, epoch, maps
        free_queue = SharedFreeQueue(p)
        ledger = BlockLedger(p, holder, free_queue, PrefixIndex(p),
                             reserve.Reserves(p, holder, free_queue))
        tables = BlockTables(ledger)
        self._ledger = ledger
        self._tables = tables
        self._prefix = PrefixCache(ledger, tables)
        self._kv = KVArena(ledger)
        self._admin = PoolAdmin(ledger)
        self._internals = ManagerInternals(p, holder, ledger, tables, self._prefix, self._kv,
                                           self._admin)
        self.free_block_queue = SeedFreeQueue(ledger)
        self.cached_block_hash_to_block = SharedHashMap(ledger)
        self.hash_to_block = LegacyHashView(ledger)
        self.request_tables = RequestTablesView(tables)
        self.allocated_blocks = AllocatedBlocksView(ledger)
        self.blocks = BlocksView(ledger)
        self.null_block = SharedBlock(ledger, 0)
        self.stats = SharedStats(ledger)
        self._finalizer = weakref.finalize(self, _close, p, holder.refs, p.private, True)

    # ---- ledger: shmcache/paged_cache.py
    def allocate_block(self) -> Optional[CacheBlock]:
        """Allocate one block (ref_count 1, held by this manager).

        Returns:
            The block, or None when the pool has no free block.
        """
        return self._ledger.allocate_block()

    def get_new_blocks(self, num_blocks: int) -> List[CacheBlock]:
        """Allocate ``num_blocks`` blocks at once.

        Raises:
            OutOfBlocksError (a ValueError): not enough free blocks, or no
                room for their references (CapacityError, a subclass).
        """
        return self._ledger.get_new_blocks(num_blocks)

    def _maybe_evict_cached_block(self, block: CacheBlock) -> bool:
        return self._ledger.maybe_evict_cached_block(block)

    def free_block(self, block_id: int) -> bool:
        """Drop one reference this manager holds (outside a table) to a block.

        Returns:
            True if the block became free, False if still referenced, if it
            was not allocated (the seed's "unknown block"), or the null block.
        Raises:
            ValueError: out-of-range id, or a double free (this manager holds
                no loose reference to an allocated block).
        """
        return self._ledger.free_block(block_id)

    def free_block_batch(self, blocks) -> None:
        """Free several blocks, in the given order (the seed's unreachable batch free).

        Raises:
            ValueError: the null block, an out-of-range id, or a block not held
                (as many times as listed) by this manager; nothing is freed then.
        """
        return self._ledger.free_block_batch(blocks)

    def touch(self, blocks) -> None:
        """Take a reference on each block (a cache hit), pulling free ones out of the queue."""
        return self._ledger.touch(blocks)

    def increment_ref(self, block_id: int) -> bool:
        """Take one more reference on an allocated block; False if it is free."""
        return self._ledger.increment_ref(block_id)

    def evict_lru_blocks(self, num_blocks: int) -> int:
        """Drop the prefix-cache entries of the ``num_blocks`` least recently
        used free blocks, leaving the queue order as it is (the seed moves
        them to the back; here uncached free blocks are reused first anyway).

        Returns:
            What the seed returns: the number of free blocks looked at,
            ``min(num_blocks, free_blocks)``, cached or not.
        """
        return self._ledger.evict_lru_blocks(num_blocks)

    def handle_memory_pressure(self, requested_blocks: int) -> bool:
        """Whether ``requested_blocks`` can be allocated (after reclaiming dead holders)."""
        return self._ledger.handle_memory_pressure(requested_blocks)

    @property
    def free_blocks(self) -> int:
        """Number of free blocks (those in reserves too, see ``set_reserve``)."""
        return self._ledger.free_blocks

    def set_reserve(self, n: int) -> None:
        """Keep up to ``n`` blocks this manager frees for its own next
        allocations (0, the default: none).

        ``free_block_batch``/``free_block`` of blocks this manager allocated
        and holds alone (no tokens, not cached) put them in its reserve, and
        ``get_new_blocks``/``allocate_block`` take them back, both without the
        pool lock, so these calls scale with the number of processes.
        Reserved blocks count as free (``free_blocks``, ``usage``,
        ``get_stats``), and a process whose allocation finds the free list
        short takes them, so a reserve never makes an allocation fail. A
        process that exits or dies frees its reserve with its other
        references. Without the C accelerator (``SHMCACHE_PURE=1``) this
        does nothing.

        Raises:
            ValueError: ``n`` is not an int in [0, 1048576].
        """
        return self._ledger.set_reserve(n)

    @property
    def reserve_size(self) -> int:
        """Blocks now in this manager's reserve."""
        return self._ledger.reserve_size

    # ---- tables: shmcache/tables.py
    def create_block_table(self, request_id: str) -> BlockTable:
        """Create an empty table owned by this manager.

        Raises:
            ValueError: a table for ``request_id`` exists.
            CapacityError: every table slot is in use.
        """
        return self._tables.create_block_table(request_id)

    def get_block_table(self, request_id: str) -> Optional[BlockTable]:
        """The table of ``request_id`` (from any process), or None."""
        return self._tables.get_block_table(request_id)

    def get_or_create_block_table(self, request_id: str) -> BlockTable:
        return self._tables.get_or_create_block_table(request_id)

    def delete_block_table(self, request_id: str) -> None:
        """Delete a table and drop its references, last block first.

        Raises:
            KeyError: no table for ``request_id``.
        """
        return self._tables.delete_block_table(request_id)

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
        return self._tables.add_block_to_table(table, block, tokens_in_block)

    def fork_block_table(self, source_table: BlockTable, new_request_id: str) -> BlockTable:
        """A new table sharing every block of ``source_table`` (one more
        reference each: 4 bytes apiece, never a copy).

        Raises:
            KeyError: unknown source. ValueError: a table for
                ``new_request_id`` exists. CapacityError (an
                OutOfBlocksError): no free table, or no room for the
                references; nothing changed.
        """
        return self._tables.fork_block_table(source_table, new_request_id)

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        """Whether ``prepare_append(table, num_new_tokens)`` would find its blocks."""
        return self._tables.can_append(table, num_new_tokens)

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
        return self._tables.prepare_append(table, num_new_tokens)

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
        return self._tables.trim_table(table, num_tokens)

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
        return self._tables.get_blocks_for_generation(table)

    def _cow_copy_block(self, source_block: CacheBlock) -> Optional[CacheBlock]:
        """A new block (held by this manager) with a copy of the source's
        payload and token count, or None when no block (or room for its
        reference) is left."""
        return self._tables.cow_copy_block(source_block)

    def allocate_blocks_for_tokens(self, num_tokens: int) -> List[CacheBlock]:
        return self._tables.allocate_blocks_for_tokens(num_tokens)

    # ---- prefix: shmcache/prefix.py
    def get_cached_block(self, block_hash: BlockHash) -> Optional[CacheBlock]:
        """Any block cached under ``block_hash`` (no reference is taken)."""
        return self._prefix.get_cached_block(block_hash)

    def cache_full_blocks(self, blocks: List[CacheBlock], token_ids: List[int],
                          num_cached_blocks: int, num_full_blocks: int,
                          extra_keys: Optional[Tuple[Any, ...]] = None) -> None:
        """Publish blocks ``num_cached_blocks .. num_full_blocks-1`` in the prefix cache.

        Their K/V must be written first: a published block is visible to
        every process at once. ``extra_keys`` salts the chain (tenant, LoRA).

        Raises:
            ValueError, TypeError: bad counts, tokens, or a block that is free.
        """
        return self._prefix.cache_full_blocks(blocks, token_ids, num_cached_blocks, num_full_blocks, extra_keys)

    def get_computed_blocks(self, token_ids: List[int],
                            extra_keys: Optional[Tuple[Any, ...]] = None
                            ) -> Tuple[List[CacheBlock], int]:
        """The cached blocks of the longest cached prefix (no reference taken:
        use ``acquire_computed_blocks`` when another process may evict them)."""
        return self._prefix.get_computed_blocks(token_ids, extra_keys)

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
        return self._prefix.acquire_computed_blocks(token_ids, extra_keys, table)

    def find_cached_block(self, tokens: List[int]) -> Optional[CacheBlock]:
        """The cached block whose prefix is exactly ``tokens`` (from position 0)."""
        return self._prefix.find_cached_block(tokens)

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
        return self._prefix.register_block_hash(block, tokens)

    def find_shared_prefix(self, tokens: List[int]) -> Tuple[List[int], List[int]]:
        """Block ids of the longest cached whole-chain prefix, and the tokens after it."""
        return self._prefix.find_shared_prefix(tokens)

    # ---- kv: shmcache/kv_ops.py
    def write_kv(self, block_id: int, layer: int, keys, values, start: int = 0) -> None:
        """Write K/V of shape (num_kv_heads, T, head_dim) into a block at ``start``.

        Keys and values must be floating-point arrays (MLX or numpy; another
        float width is converted to the pool's dtype).

        Raises:
            ValueError: the null block, a block this manager holds no
                reference to (neither loose nor in a table it owns), or a bad
                layer, shape or start. TypeError: a dtype that is not floating.
        """
        return self._kv.write_kv(block_id, layer, keys, values, start)

    def export_blocks(self, block_ids) -> np.ndarray:
        """A copy of whole blocks' K/V in the storage dtype, every layer at once.

        For moving blocks between tiers (the L2 tier): one copy of n blocks
        instead of a read per block and layer. bfloat16 pools give raw
        uint16 words.

        Args:
            block_ids: ids (or blocks) this manager holds.
        Returns:
            ``# (L, n, 2, H, T, D)`` array; ``[:, i, 0]`` keys, ``[:, i, 1]`` values.
        Raises:
            ValueError: the null block, or a block this manager does not hold.
        """
        return self._kv.export_blocks(block_ids)

    def import_blocks(self, block_ids, data) -> None:
        """Write whole blocks' K/V, the inverse of :meth:`export_blocks`.

        Args:
            block_ids: n ids this manager holds (fresh, unpublished blocks:
                published ones are read by others).
            data: ``# (L, n, 2, H, T, D)`` in the storage dtype (raw uint16
                words for bfloat16), or layers ``lo:hi`` of it with ``layers``.
        Raises:
            ValueError: the null block, an unheld block, or a shape or dtype
                that is not the pool's.
        """
        return self._kv.import_blocks(block_ids, data)

    def append_kv(self, table: BlockTable, layer: int, keys, values, start: int) -> None:
        """Write a span of K/V, (num_kv_heads, T, head_dim), into ``table`` at
        token position ``start``, across as many blocks as it covers.

        The positions must already be in the table (``prepare_append``).

        Raises:
            ValueError: the span is not within the table's tokens, or a
                shape, layer or dtype is wrong (as ``write_kv``).
        """
        return self._kv.append_kv(table, layer, keys, values, start)

    def read_kv(self, block_ids, layer: int):
        """Gather blocks' K/V of one layer into MLX arrays (num_kv_heads, n*block_size, head_dim)."""
        return self._kv.read_kv(block_ids, layer)

    # ---- admin: shmcache/admin.py
    def get_stats(self) -> CacheStats:
        """A snapshot of the statistics (a ``PoolStats``: the seed's
        ``CacheStats`` and the pool's capacities), computed from the pool's
        state; ``total_tokens_cached`` is the seed's running count."""
        return self._admin.get_stats()

    def get_memory_usage(self) -> Dict[str, Any]:
        return self._admin.get_memory_usage()

    def add_counters(self, deltas) -> None:
        """Add ``{counter index: delta}`` to the pool's shared counters, under the lock.

        For statistics kept by layers above the pool (the L2 tier's,
        ``layout.C_L2``); every process's additions sum.

        Raises:
            ValueError: an index outside the counter area, or one of the
                pool's own counters (0..15), which only the pool writes.
        """
        return self._admin.add_counters(deltas)

    def l2_counters(self) -> Dict[str, int]:
        """The pool-wide L2 counters (``layout.L2_COUNTERS``), summed over every process."""
        return self._admin.l2_counters()

    def reset_stats(self) -> None:
        return self._admin.reset_stats()

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache; False (and nothing done) while blocks are in use."""
        return self._admin.reset_prefix_cache()

    def clear(self) -> None:
        """Release every reference every process holds and empty the cache."""
        return self._admin.clear()

    def check(self) -> List[str]:
        """Every violated invariant, one line each; empty when consistent."""
        return self._admin.check()

    def reclaim_dead(self) -> int:
        """Release everything held by managers whose process died.

        Returns:
            The number of block references released.
        """
        return self._admin.reclaim_dead()

    def holdings(self) -> List[Dict[str, Any]]:
        """What each attached manager holds: slot, pid, alive, tables, blocks."""
        return self._admin.holdings()

    # ---- the seed's own, kept here
    compute_block_hash = staticmethod(PrefixCache.compute_block_hash)

    def decrement_ref(self, block_id: int) -> bool:
        """Alias of ``free_block``."""
        return self.free_block(block_id)

    @property
    def usage(self) -> float:
        total = self.max_blocks - 1
        return 0.0 if total == 0 else 1.0 - self.free_blocks / total

    # ================================================================ seams
    @property
    def pool(self) -> Pool:
        """The internal seam (not the seed's API): the ``Pool`` this manager
        works on, for ``/metrics`` and the CLI (``pool.gauges()``), tools and
        tests. Its arrays belong to the modules that own them (layout.py's
        byte map says which); code outside them reads the named accessors
        (``gauges``, the counter properties)."""
        return self._p

    @property
    def internals(self) -> ManagerInternals:
        """The internal seam for tests and tools (not API, no stability
        promised): this manager's owners, as built by ``__init__``: the
        pool, this process's ``Holder`` (references, epoch, table maps),
        the ``BlockLedger``, ``BlockTables``, ``PrefixCache``, ``KVArena``
        and ``PoolAdmin``. Tests use it to reach the primitives and the C
        fast paths' arguments (``internals.holder.epoch``); code in
        shmcache/ calls the owners it was given instead."""
        return self._internals

    @property
    def layout(self) -> L.Layout:
        return self._p.layout

    # ================================================================ lifetime
    def close(self) -> None:
        """Detach, releasing every reference and table this manager holds."""
        self._finalizer.detach()
        _close(self._p, self._internals.holder.refs, self._p.private)

    def destroy(self) -> None:
        """Close, and unlink the pool if this manager created it."""
        self._finalizer.detach()
        _close(self._p, self._internals.holder.refs, True)

    def __enter__(self) -> "PagedCacheManager":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy() if self._p.creator else self.close()

    def __repr__(self) -> str:
        return (f"PagedCacheManager(name={self.name!r}, block_size={self.block_size}, "
                f"max_blocks={self.max_blocks})")
