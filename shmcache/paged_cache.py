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
``free_block_batch``, ...); the README lists every deliberate difference
("Differences from the seed") and why.
"""

from __future__ import annotations

import logging
import os
import secrets
import weakref
from typing import Any, Dict, List, Optional

import numpy as np

from . import kv
from . import layout as L
from . import recovery
from .blocks import (BlockHash, BlockHashToBlockMap, BlockTable, CacheBlock, CacheStats,
                     FreeKVCacheBlockQueue, KVCacheBlock, compute_block_hash)
from .errors import CapacityError, OutOfBlocksError
from .freelist import SharedFreeQueue
from .index import PrefixIndex
from .fastpath import alloc_loose, free_loose
from .pool import Pool
from .reclaim import close as _close, release_slot_holdings
from .prefix import PrefixOps
from .tables import TableOps
from .refs import RefStore
from .seed_views import (AllocatedBlocksView, BlocksView, LegacyHashView, RequestTablesView,
                         SeedFreeQueue, SharedHashMap, SharedStats)
from .views import SharedBlock

logger = logging.getLogger(__name__)

__all__ = ["BlockHash", "CacheBlock", "KVCacheBlock", "FreeKVCacheBlockQueue",
           "BlockHashToBlockMap", "BlockTable", "CacheStats", "PagedCacheManager",
           "compute_block_hash"]


class PagedCacheManager(TableOps, PrefixOps):
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
        self._refs = RefStore(p)
        self._tcache: Dict[int, tuple] = {}     # tables created here (see _holds)
        self._cdata: Dict[int, tuple] = {}      # block -> (generation, cache_data)
        self._cdata_prune = 64
        self._epoch = p.c[L.C_EPOCH]
        self._fq = SharedFreeQueue(p)
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
            b = alloc_loose(self, 1)[0]
        return SharedBlock(self, b)

    def _native(self, op, arg):
        # The C fast path: it changes nothing and returns None whenever the
        # lock is busy or anything needs the slow path (a stale or dirty
        # view, cached blocks to evict, an error to raise).
        p = self._p
        try:
            return op(arg, p.slot, self._epoch, self._refs.loose)
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
            ids = alloc_loose(self, num_blocks)
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
            if not self._refs.holds_loose(b):
                raise ValueError(f"double free of block {b}: this manager holds no reference "
                                 "to it outside its block tables")
            return free_loose(self, (b,)) == 1

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
            loose = self._refs.loose
            if len(set(ids)) != len(ids) or not all(b in loose for b in ids):
                self._check_batch_free(ids)
            free_loose(self, ids)

    def _check_batch_free(self, ids) -> None:
        need: Dict[int, int] = {}
        for b in ids:
            if b == 0:
                raise ValueError("cannot free the null block (block 0)")
            need[b] = need.get(b, 0) + 1
        for b, k in need.items():
            held = len(self._refs.loose.get(b, ()))
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

    # ============================================================ statistics
    @property
    def free_blocks(self) -> int:
        """Number of free blocks."""
        return self._p.c[L.C_NUM_FREE]

    @property
    def usage(self) -> float:
        total = self.max_blocks - 1
        return 0.0 if total == 0 else 1.0 - self.free_blocks / total

    def get_stats(self) -> CacheStats:
        """A snapshot of the statistics (a ``PoolStats``: the seed's
        ``CacheStats`` and the pool's capacities), computed from the pool's
        state; ``total_tokens_cached`` is the seed's running count."""
        return self._scan_stats()

    def get_memory_usage(self) -> Dict[str, Any]:
        s = self.get_stats()
        asked = s.cache_hits + s.cache_misses
        return {"block_size": self.block_size, "max_blocks": self.max_blocks,
                "allocated_blocks": s.allocated_blocks, "free_blocks": s.free_blocks,
                "shared_blocks": s.shared_blocks, "total_tokens_cached": s.total_tokens_cached,
                "utilization": s.allocated_blocks / self.max_blocks,
                "cache_hit_rate": s.cache_hits / asked if asked else 0,
                "metadata_bytes": self._p.layout.metadata_size,
                "kv_bytes": self._p.layout.arena_size,
                **{k: getattr(s, k) for k in s.CAPACITY}}

    def add_counters(self, deltas) -> None:
        """Add ``{counter index: delta}`` to the pool's shared counters, under the lock.

        For statistics kept by layers above the pool (the L2 tier's,
        ``layout.C_L2``); every process's additions sum.

        Raises:
            ValueError: an index outside the counter area, or one of the
                pool's own counters (0..15), which only the pool writes.
        """
        items = [(int(i), int(d)) for i, d in dict(deltas).items()]
        for i, _ in items:
            if not 16 <= i < L.NUM_COUNTERS:
                raise ValueError(f"counter index {i} is not one of 16..{L.NUM_COUNTERS - 1}")
        with self._lock:
            c = self._p.c
            for i, d in items:
                c[i] += d

    def l2_counters(self) -> Dict[str, int]:
        """The pool-wide L2 counters (``layout.L2_COUNTERS``), summed over every process."""
        c = self._p.c
        return {name: int(c[i]) for name, i in L.C_L2.items()}

    def reset_stats(self) -> None:
        with self._p.lock:
            for c in (L.C_HITS, L.C_MISSES, L.C_COW, L.C_EVICTIONS):
                self._p.c[c] = 0

    def _uncache_all(self) -> None:
        with self._p.lock:
            for b in self._index.cached_ids():
                self._index.remove(b)

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache; False (and nothing done) while blocks are in use."""
        with self._p.lock:
            self._sync()
            used = self.max_blocks - self.free_blocks
            if used > 1:
                logger.warning(f"Cannot reset cache: {used - 1} blocks in use")
                return False
            self._uncache_all()
            self._drop_payloads()           # as the seed: every cache_data = None
            for c in (L.C_HITS, L.C_MISSES, L.C_EVICTIONS):
                self._p.c[c] = 0
            return True

    def clear(self) -> None:
        """Release every reference every process holds and empty the cache."""
        with self._p.lock:
            self._sync()
            p = self._p
            for s in np.flatnonzero(p.slots["state"] == 1).tolist():
                release_slot_holdings(p, self._refs, s)
            self._uncache_all()
            self._drop_payloads()
            p.c[L.C_EPOCH] += 1
            self.reset_stats()
            p.c[L.C_TOKENS] = 0
            self._sync()

    # ======================================================= shmcache additions
    def write_kv(self, block_id: int, layer: int, keys, values, start: int = 0) -> None:
        """Write K/V of shape (num_kv_heads, T, head_dim) into a block at ``start``.

        Keys and values must be floating-point arrays (MLX or numpy; another
        float width is converted to the pool's dtype).

        Raises:
            ValueError: the null block, a block this manager holds no
                reference to (neither loose nor in a table it owns), or a bad
                layer, shape or start. TypeError: a dtype that is not floating.
        """
        b = self._bid(block_id)
        p = self._p
        kv.check_layer(p, layer)
        if b == 0:
            raise ValueError("cannot write K/V into the null block (block 0)")
        p.check_usable()
        # (the check needs no lock when what it knows is current: the write
        # itself is outside the lock either way, as is any use of a block
        # this manager holds)
        if not self._holds_fast(b):
            with p.lock:
                self._sync()
                if not self._holds(b):
                    raise ValueError(
                        f"block {b} is not held by this manager: allocate or acquire it, or "
                        "add it to one of its block tables, before writing its K/V")
        kv.write(p, b, layer, keys, values, start)

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
        ids = self._checked_held(block_ids)
        return self._p.arena[:, ids]

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
        ids = self._checked_held(block_ids)
        a = self._p.arena
        data = np.asarray(data)
        want = (a.shape[0], len(ids)) + a.shape[2:]
        if data.shape != want or data.dtype != a.dtype:
            raise ValueError(f"block payloads must be {want} {a.dtype}, "
                             f"not {data.shape} {data.dtype}")
        a[:, ids] = data

    def _checked_held(self, block_ids) -> list:
        ids = self._bids(block_ids)
        p = self._p
        p.check_usable()
        for b in ids:
            if b == 0:
                raise ValueError("the null block (block 0) has no K/V")
        if not all(self._holds_fast(b) for b in ids):
            with p.lock:
                self._sync()
                for b in ids:
                    if not self._holds(b):
                        raise ValueError(f"block {b} is not held by this manager")
        return ids

    def append_kv(self, table: BlockTable, layer: int, keys, values, start: int) -> None:
        """Write a span of K/V, (num_kv_heads, T, head_dim), into ``table`` at
        token position ``start``, across as many blocks as it covers.

        The positions must already be in the table (``prepare_append``).

        Raises:
            ValueError: the span is not within the table's tokens, or a
                shape, layer or dtype is wrong (as ``write_kv``).
        """
        T = int(keys.shape[1])
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 \
                or start + T > table.num_tokens:
            raise ValueError(f"append_kv: tokens {start}..{start + T} are not within the "
                             f"table's {table.num_tokens} tokens (prepare_append first)")
        ids = table.block_ids
        bs, done = self.block_size, 0
        while done < T:
            pos = start + done
            n = min(bs - pos % bs, T - done)
            self.write_kv(ids[pos // bs], layer, keys[:, done:done + n], values[:, done:done + n],
                          pos % bs)
            done += n

    def read_kv(self, block_ids, layer: int):
        """Gather blocks' K/V of one layer into MLX arrays (num_kv_heads, n*block_size, head_dim)."""
        p = self._p
        kv.check_layer(p, layer)
        p.check_usable()
        out = kv.read_fast(p, block_ids, layer)    # plain int ids, where built
        return out if out is not None else kv.read(p, self._bids(block_ids), layer)

    def check(self) -> List[str]:
        """Every violated invariant, one line each; empty when consistent."""
        with self._p.lock:
            self._p.check_usable()
            return recovery.check(self._p)

    def reclaim_dead(self) -> int:
        """Release everything held by managers whose process died.

        Returns:
            The number of block references released.
        """
        with self._p.lock:
            self._sync()
            p = self._p
            n, p.reclaimed_in_repair = p.reclaimed_in_repair, 0
            return n + self._reclaim_locked()

    def holdings(self) -> List[Dict[str, Any]]:
        """What each attached manager holds: slot, pid, alive, tables, blocks."""
        with self._p.lock:
            p = self._p
            out = []
            for s in np.flatnonzero(p.slots["state"] == 1).tolist():
                tabs = np.flatnonzero((p.tables["state"] == 1) & (p.tables["owner"] == s)).tolist()
                out.append({"slot": s, "pid": int(p.slots["pid"][s]),
                            "start_time": float(p.slots["start_time"][s]),
                            "alive": p.slot_alive(s), "tables": len(tabs),
                            "table_blocks": int(sum(p.t_len[t] for t in tabs)),
                            "loose_blocks": int(p.s_count[s])})
            return out

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
