"""``PagedCacheManager``: the seed's paged-cache API over a shared-memory pool.

Every public name of ``vllm_mlx.paged_cache`` is here with its signature, so
code written for the seed runs unchanged; the state behind it lives in a
shared segment (``shmcache.shm.layout``) that other processes attach to by
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

from ..shm import layout as L
from ..pool import reserve
from .admin import PoolAdmin
from ..shm.blocks import (BlockHash, BlockHashToBlockMap, BlockTable, CacheBlock, CacheStats,
                     FreeKVCacheBlockQueue, KVCacheBlock, compute_block_hash)
from .core import BlockLedger
from ..shm.freelist import SharedFreeQueue
from ..pool.holder import Holder
from ..shm.index import PrefixIndex
from .kv_ops import KVArena
from ..pool.pool import Pool
from .prefix import PrefixCache
from ..pool.reclaim import close as _close
from .seed_views import (AllocatedBlocksView, BlocksView, LegacyHashView, RequestTablesView,
                         SeedFreeQueue, SharedHashMap, SharedStats)
from .tables import BlockTables
from .views import SharedBlock

logger = logging.getLogger(__name__)


def _doc(owner_method):
    """The facade's method says what its owner's does (one docstring, the owner's)."""
    def same(fn):
        fn.__doc__ = owner_method.__doc__
        return fn
    return same

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

    # ---- blocks: core.BlockLedger
    @_doc(BlockLedger.allocate_block)
    def allocate_block(self) -> Optional[CacheBlock]:
        return self._ledger.allocate_block()

    @_doc(BlockLedger.get_new_blocks)
    def get_new_blocks(self, num_blocks: int) -> List[CacheBlock]:
        return self._ledger.get_new_blocks(num_blocks)

    @_doc(BlockLedger.maybe_evict_cached_block)
    def _maybe_evict_cached_block(self, block: CacheBlock) -> bool:
        return self._ledger.maybe_evict_cached_block(block)

    @_doc(BlockLedger.free_block)
    def free_block(self, block_id: int) -> bool:
        return self._ledger.free_block(block_id)

    @_doc(BlockLedger.free_block_batch)
    def free_block_batch(self, blocks) -> None:
        return self._ledger.free_block_batch(blocks)

    @_doc(BlockLedger.touch)
    def touch(self, blocks) -> None:
        return self._ledger.touch(blocks)

    @_doc(BlockLedger.increment_ref)
    def increment_ref(self, block_id: int) -> bool:
        return self._ledger.increment_ref(block_id)

    @_doc(BlockLedger.evict_lru_blocks)
    def evict_lru_blocks(self, num_blocks: int) -> int:
        return self._ledger.evict_lru_blocks(num_blocks)

    @_doc(BlockLedger.handle_memory_pressure)
    def handle_memory_pressure(self, requested_blocks: int) -> bool:
        return self._ledger.handle_memory_pressure(requested_blocks)

    @property
    @_doc(BlockLedger.free_blocks)
    def free_blocks(self) -> int:
        return self._ledger.free_blocks

    @_doc(BlockLedger.set_reserve)
    def set_reserve(self, n: int) -> None:
        return self._ledger.set_reserve(n)

    @property
    @_doc(BlockLedger.reserve_size)
    def reserve_size(self) -> int:
        return self._ledger.reserve_size

    # ---- block tables: tables.BlockTables
    @_doc(BlockTables.create_block_table)
    def create_block_table(self, request_id: str) -> BlockTable:
        return self._tables.create_block_table(request_id)

    @_doc(BlockTables.get_block_table)
    def get_block_table(self, request_id: str) -> Optional[BlockTable]:
        return self._tables.get_block_table(request_id)

    @_doc(BlockTables.get_or_create_block_table)
    def get_or_create_block_table(self, request_id: str) -> BlockTable:
        return self._tables.get_or_create_block_table(request_id)

    @_doc(BlockTables.delete_block_table)
    def delete_block_table(self, request_id: str) -> None:
        return self._tables.delete_block_table(request_id)

    @_doc(BlockTables.add_block_to_table)
    def add_block_to_table(self, table: BlockTable, block: CacheBlock, tokens_in_block: int) -> None:
        return self._tables.add_block_to_table(table, block, tokens_in_block)

    @_doc(BlockTables.fork_block_table)
    def fork_block_table(self, source_table: BlockTable, new_request_id: str) -> BlockTable:
        return self._tables.fork_block_table(source_table, new_request_id)

    @_doc(BlockTables.can_append)
    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        return self._tables.can_append(table, num_new_tokens)

    @_doc(BlockTables.prepare_append)
    def prepare_append(self, table: BlockTable, num_new_tokens: int) -> List[CacheBlock]:
        return self._tables.prepare_append(table, num_new_tokens)

    @_doc(BlockTables.trim_table)
    def trim_table(self, table: BlockTable, num_tokens: int) -> int:
        return self._tables.trim_table(table, num_tokens)

    @_doc(BlockTables.get_blocks_for_generation)
    def get_blocks_for_generation(self, table: BlockTable) -> Tuple[List[CacheBlock], bool]:
        return self._tables.get_blocks_for_generation(table)

    @_doc(BlockTables.cow_copy_block)
    def _cow_copy_block(self, source_block: CacheBlock) -> Optional[CacheBlock]:
        return self._tables.cow_copy_block(source_block)

    @_doc(BlockTables.allocate_blocks_for_tokens)
    def allocate_blocks_for_tokens(self, num_tokens: int) -> List[CacheBlock]:
        return self._tables.allocate_blocks_for_tokens(num_tokens)

    # ---- prefix cache: prefix.PrefixCache
    @_doc(PrefixCache.get_cached_block)
    def get_cached_block(self, block_hash: BlockHash) -> Optional[CacheBlock]:
        return self._prefix.get_cached_block(block_hash)

    @_doc(PrefixCache.cache_full_blocks)
    def cache_full_blocks(self, blocks: List[CacheBlock], token_ids: List[int],
                          num_cached_blocks: int, num_full_blocks: int,
                          extra_keys: Optional[Tuple[Any, ...]] = None) -> None:
        return self._prefix.cache_full_blocks(blocks, token_ids, num_cached_blocks, num_full_blocks, extra_keys)

    @_doc(PrefixCache.get_computed_blocks)
    def get_computed_blocks(self, token_ids: List[int],
                            extra_keys: Optional[Tuple[Any, ...]] = None
                            ) -> Tuple[List[CacheBlock], int]:
        return self._prefix.get_computed_blocks(token_ids, extra_keys)

    @_doc(PrefixCache.cached_prefix_tokens)
    def cached_prefix_tokens(self, token_ids: List[int],
                             extra_keys: Optional[Tuple[Any, ...]] = None) -> int:
        return self._prefix.cached_prefix_tokens(token_ids, extra_keys)

    @_doc(PrefixCache.acquire_computed_blocks)
    def acquire_computed_blocks(self, token_ids: List[int],
                                extra_keys: Optional[Tuple[Any, ...]] = None,
                                table: Optional[BlockTable] = None
                                ) -> Tuple[List[CacheBlock], int]:
        return self._prefix.acquire_computed_blocks(token_ids, extra_keys, table)

    @_doc(PrefixCache.find_cached_block)
    def find_cached_block(self, tokens: List[int]) -> Optional[CacheBlock]:
        return self._prefix.find_cached_block(tokens)

    @_doc(PrefixCache.register_block_hash)
    def register_block_hash(self, block: CacheBlock, tokens: List[int]) -> None:
        return self._prefix.register_block_hash(block, tokens)

    @_doc(PrefixCache.find_shared_prefix)
    def find_shared_prefix(self, tokens: List[int]) -> Tuple[List[int], List[int]]:
        return self._prefix.find_shared_prefix(tokens)

    # ---- K/V: kv_ops.KVArena
    @_doc(KVArena.write_kv)
    def write_kv(self, block_id: int, layer: int, keys, values, start: int = 0) -> None:
        return self._kv.write_kv(block_id, layer, keys, values, start)

    @_doc(KVArena.export_blocks)
    def export_blocks(self, block_ids) -> np.ndarray:
        return self._kv.export_blocks(block_ids)

    @_doc(KVArena.import_blocks)
    def import_blocks(self, block_ids, data) -> None:
        return self._kv.import_blocks(block_ids, data)

    @_doc(KVArena.append_kv)
    def append_kv(self, table: BlockTable, layer: int, keys, values, start: int) -> None:
        return self._kv.append_kv(table, layer, keys, values, start)

    @_doc(KVArena.read_kv)
    def read_kv(self, block_ids, layer: int):
        return self._kv.read_kv(block_ids, layer)

    # ---- statistics and checks: admin.PoolAdmin
    @_doc(PoolAdmin.get_stats)
    def get_stats(self) -> CacheStats:
        return self._admin.get_stats()

    @_doc(PoolAdmin.get_memory_usage)
    def get_memory_usage(self) -> Dict[str, Any]:
        return self._admin.get_memory_usage()

    @_doc(PoolAdmin.add_counters)
    def add_counters(self, deltas: Dict[str, int]) -> None:
        return self._admin.add_counters(deltas)

    @_doc(PoolAdmin.l2_counters)
    def l2_counters(self) -> Dict[str, int]:
        return self._admin.l2_counters()

    @_doc(PoolAdmin.reset_stats)
    def reset_stats(self) -> None:
        return self._admin.reset_stats()

    @_doc(PoolAdmin.reset_prefix_cache)
    def reset_prefix_cache(self) -> bool:
        return self._admin.reset_prefix_cache()

    @_doc(PoolAdmin.clear)
    def clear(self) -> None:
        return self._admin.clear()

    @_doc(PoolAdmin.check)
    def check(self) -> List[str]:
        return self._admin.check()

    @_doc(PoolAdmin.reclaim_dead)
    def reclaim_dead(self) -> int:
        return self._admin.reclaim_dead()

    @_doc(PoolAdmin.holdings)
    def holdings(self) -> List[Dict[str, Any]]:
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
        fast paths' arguments (``internals.holder.epoch``; a table's record
        is ``SharedBlockTable.internals``); code in shmcache/ calls the
        owners it was given instead."""
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
