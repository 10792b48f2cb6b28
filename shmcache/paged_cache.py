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

The class is assembled from mixins over ``core.PoolOps`` (the lock-held
primitives): ``tables.TableOps`` (block tables), ``prefix.PrefixOps``
(prefix caching), ``kv_ops.KVOps`` (the K/V payload) and ``admin.AdminOps``
(statistics, resets, check and reclaim). This module keeps construction,
block allocation and freeing, reference counts, eviction and the
manager's lifetime.
"""

from __future__ import annotations

import logging
import os
import secrets
import weakref
from typing import Any, Dict, List, Optional

from . import layout as L
from . import reserve
from .admin import AdminOps
from .blocks import (BlockHash, BlockHashToBlockMap, BlockTable, CacheBlock, CacheStats,
                     FreeKVCacheBlockQueue, KVCacheBlock, compute_block_hash)
from .errors import CapacityError, OutOfBlocksError
from .freelist import SharedFreeQueue
from .holder import Holder
from .index import PrefixIndex
from .fastpath import alloc_loose, free_loose
from .kv_ops import KVOps
from .pool import Pool
from .reclaim import close as _close
from .prefix import PrefixOps
from .tables import TableOps
from .seed_views import (AllocatedBlocksView, BlocksView, LegacyHashView, RequestTablesView,
                         SeedFreeQueue, SharedHashMap, SharedStats)
from .views import SharedBlock

logger = logging.getLogger(__name__)

__all__ = ["BlockHash", "CacheBlock", "KVCacheBlock", "FreeKVCacheBlockQueue",
           "BlockHashToBlockMap", "BlockTable", "CacheStats", "PagedCacheManager",
           "compute_block_hash"]


class PagedCacheManager(TableOps, PrefixOps, KVOps, AdminOps):
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
        self._h = Holder(p)                     # this process's references, epoch, maps
        self._fq = SharedFreeQueue(p)
        self._reserves = reserve.Reserves(p, self._h, self._fq)
        self._root = p.seed
        self._index = PrefixIndex(p)
        self._tindex = p.tindex
        self._lock = p.lock
        self.free_block_queue = SeedFreeQueue(self)
        self.cached_block_hash_to_block = SharedHashMap(self)
        self.hash_to_block = LegacyHashView(self)
        self.request_tables = RequestTablesView(self)
        self.allocated_blocks = AllocatedBlocksView(self)
        self.blocks = BlocksView(self)
        self.null_block = SharedBlock(self, 0)
        self.stats = SharedStats(self)
        self._finalizer = weakref.finalize(self, _close, p, self._refs, p.private, True)

    # ========================================================= block allocation
    def allocate_block(self) -> Optional[CacheBlock]:
        """Allocate one block (ref_count 1, held by this manager).

        Returns:
            The block, or None when the pool has no free block.
        """
        p = self._p
        if p.native.alloc is not None and not p.lock.unusable:
            ids = self._native(p.native.alloc, 1)
            if ids is not None:
                return SharedBlock(self, ids[0])
        with p.lock:
            self._sync()
            if not self._ensure_free(1):
                logger.warning("Out of cache blocks")
                return None
            try:
                self._refs.need(1)
            except CapacityError as e:
                logger.warning("Out of cache blocks: %s", e)
                return None
            b = alloc_loose(self._h, self._pop_free, 1)[0]
        return SharedBlock(self, b)

    def _native(self, op, arg):
        # The C fast path: it changes nothing and returns None whenever the
        # lock is busy or anything needs the slow path (a stale or dirty
        # view, cached blocks to evict, an error to raise).
        p = self._p
        try:
            return op(arg, p.slot, self._epoch, self._refs.loose.buf)
        except MemoryError:
            with p.lock:
                self._refs.resync()     # the op committed; the local map did not
            raise

    def get_new_blocks(self, num_blocks: int) -> List[CacheBlock]:
        """Allocate ``num_blocks`` blocks at once.

        Raises:
            OutOfBlocksError (a ValueError): not enough free blocks, or no
                room for their references (CapacityError, a subclass).
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        p = self._p
        if num_blocks >= self.max_blocks:
            # more than the pool has at all: refused before anything is sized by it
            raise OutOfBlocksError(f"Cannot allocate {num_blocks} blocks, only "
                                   f"{self._p.c[L.C_NUM_FREE]} available (the pool has "
                                   f"{self.max_blocks - 1})")
        if num_blocks and p.native.alloc is not None and not p.lock.unusable:
            ids = self._native(p.native.alloc, num_blocks)
            if ids is not None:
                return [SharedBlock(self, b) for b in ids]
        with p.lock:
            self._sync()
            if not self._ensure_free(num_blocks):
                raise OutOfBlocksError(f"Cannot allocate {num_blocks} blocks, only "
                                       f"{self._p.c[L.C_NUM_FREE]} available")
            self._refs.need(num_blocks)
            ids = alloc_loose(self._h, self._pop_free, num_blocks)
        return [SharedBlock(self, b) for b in ids]

    def _maybe_evict_cached_block(self, block: CacheBlock) -> bool:
        with self._p.lock:
            b = self._bid(block)
            if not self._p.b_flags[b] & L.FLAG_CACHED:
                return False
            self._index.remove(b)
            self._drop_payloads((b,))       # as the seed: cache_data = None
            self._p.c[L.C_EVICTIONS] += 1
            return True

    def free_block(self, block_id: int) -> bool:
        """Drop one reference this manager holds (outside a table) to a block.

        Returns:
            True if the block became free, False if still referenced, if it
            was not allocated (the seed's "unknown block"), or the null block.
        Raises:
            ValueError: out-of-range id, or a double free (this manager holds
                no loose reference to an allocated block).
        """
        p = self._p
        if type(block_id) is int and p.native.free is not None and not p.lock.unusable:
            freed = self._native(p.native.free, (block_id,))
            if freed is not None:
                return freed == 1
        with p.lock:
            self._sync()
            b = self._bid(block_id)
            if self._p.b_ref[b] <= 0:
                logger.warning(f"Attempted to free unknown block: {b}")
                return False
            if b == 0:
                return False
            if not self._loose_held(b):
                raise ValueError(f"double free of block {b}: this manager holds no reference "
                                 "to it outside its block tables")
            return free_loose(self._h, self._fq, (b,)) == 1

    def free_block_batch(self, blocks) -> None:
        """Free several blocks, in the given order (the seed's unreachable batch free).

        Raises:
            ValueError: the null block, an out-of-range id, or a block not held
                (as many times as listed) by this manager; nothing is freed then.
        """
        ids = self._bids(blocks)
        p = self._p
        if p.native.free is not None and not p.lock.unusable:
            if self._native(p.native.free, ids) is not None:
                return
        with p.lock:
            self._sync()
            if len(set(ids)) != len(ids) or not all(self._loose_held(b) for b in ids):
                self._check_batch_free(ids)
            free_loose(self._h, self._fq, ids)

    def _check_batch_free(self, ids) -> None:
        need: Dict[int, int] = {}
        for b in ids:
            if b == 0:
                raise ValueError("cannot free the null block (block 0)")
            need[b] = need.get(b, 0) + 1
        for b, k in need.items():
            held = self._loose_held(b)
            if held < k:
                raise ValueError(f"double free of block {b}: freed {k} times, this manager "
                                 f"holds {held} loose references")

    def touch(self, blocks) -> None:
        """Take a reference on each block (a cache hit), pulling free ones out of the queue."""
        ids = [self._bid(b) for b in blocks]
        with self._p.lock:
            self._sync()
            ids = [b for b in ids if b != 0]
            self._refs.need(len(ids))
            for b in ids:
                self._take_ref(b)

    # ========================================================= reference counts
    def increment_ref(self, block_id: int) -> bool:
        """Take one more reference on an allocated block; False if it is free."""
        with self._p.lock:
            self._sync()
            b = self._bid(block_id)
            if self._p.b_ref[b] <= 0 or b == 0:
                return False
            self._refs.need(1)
            self._take_ref(b)
            return True

    def decrement_ref(self, block_id: int) -> bool:
        """Alias of ``free_block``."""
        return self.free_block(block_id)

    # ================================================================ eviction
    def evict_lru_blocks(self, num_blocks: int) -> int:
        """Drop the prefix-cache entries of the ``num_blocks`` least recently
        used free blocks, leaving the queue order as it is (the seed moves
        them to the back; here uncached free blocks are reused first anyway).

        Returns:
            What the seed returns: the number of free blocks looked at,
            ``min(num_blocks, free_blocks)``, cached or not.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        with self._p.lock:
            self._sync()
            lru = self._fq.ids(limit=num_blocks)
            for b in lru:
                if self._p.b_flags[b] & L.FLAG_CACHED:
                    self._index.remove(b)
                    self._p.c[L.C_EVICTIONS] += 1
            self._drop_payloads(lru)        # as the seed: cache_data = None
            if lru:
                logger.info(f"Evicted {len(lru)} LRU blocks from cache")
            return len(lru)

    def handle_memory_pressure(self, requested_blocks: int) -> bool:
        """Whether ``requested_blocks`` can be allocated (after reclaiming dead holders)."""
        with self._p.lock:
            self._sync()
            return self._ensure_free(requested_blocks)

    # ============================================================ free space
    # (on the class itself, not a mixin: the seed's fix, free_blocks a property
    # of the manager, is checked on the class's own namespace)
    @property
    def free_blocks(self) -> int:
        """Number of free blocks (those in reserves too, see ``set_reserve``)."""
        return self._p.c[L.C_NUM_FREE] + reserve.reserved_total(self._p)

    def _loose_held(self, b: int) -> int:
        # loose references held, less the one of a block in this reserve (freed)
        return self._h.loose_held(b)

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
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 1 << 20:
            raise ValueError(f"reserve must be an int in [0, 1048576], got {n!r}")
        p = self._p
        set_res = getattr(p.native, "set_reserve", None)
        if set_res is None:
            return
        dropped = set_res(n)
        if dropped:
            with p.lock:
                self._sync()
                self._reserves.drain_own(dropped)

    @property
    def reserve_size(self) -> int:
        """Blocks now in this manager's reserve."""
        p = self._p
        return int(p.slots["reserved"][p.slot]) if p.slot >= 0 else 0

    @property
    def usage(self) -> float:
        total = self.max_blocks - 1
        return 0.0 if total == 0 else 1.0 - self.free_blocks / total

    # ================================================================ lifetime
    @property
    def pool(self) -> Pool:
        """The internal seam (not the seed's API): the ``Pool`` this manager
        works on, for ``/metrics`` and the CLI (``pool.gauges()``), tools and
        tests. Its arrays belong to the modules that own them (layout.py's
        byte map says which); code outside them reads the named accessors
        (``gauges``, the counter properties). Tests may read ``_p``, the
        same object, where they must."""
        return self._p

    @property
    def layout(self) -> L.Layout:
        return self._p.layout

    def close(self) -> None:
        """Detach, releasing every reference and table this manager holds."""
        self._finalizer.detach()
        _close(self._p, self._refs, self._p.private)

    def destroy(self) -> None:
        """Close, and unlink the pool if this manager created it."""
        self._finalizer.detach()
        _close(self._p, self._refs, True)

    def __enter__(self) -> "PagedCacheManager":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy() if self._p.creator else self.close()

    def __repr__(self) -> str:
        return (f"PagedCacheManager(name={self.name!r}, block_size={self.block_size}, "
                f"max_blocks={self.max_blocks})")
