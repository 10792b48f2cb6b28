"""``BlockLedger``: the blocks of a pool as one process uses them.

It checks block ids, takes blocks off the free list, counts and releases
references, publishes and drops cache entries, and holds the seed's block
calls (allocation, freeing, reference counts, eviction, reserves). Every
other owner of a manager (``tables.BlockTables``, ``prefix.PrefixCache``,
``kv_ops.KVArena``, ``admin.PoolAdmin``) is built over it; it calls none
of them.

Its collaborators, given to its constructor: the ``pool.Pool``, this
process's ``holder.Holder`` (references, epoch, table maps, cache_data),
the shared free list, the prefix index and the reserves. The ledger owns no
shared state of its own: the records it changes are the pool's, and
layout.py's byte map says which module writes which.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Dict, List, Optional

import numpy as np

from ..shm import layout as L
from ..pool import recovery
from ..shm.blocks import CacheBlock, PoolStats, chain_hashes
from ..errors import CapacityError, OutOfBlocksError
from .fastpath import alloc_loose, free_loose
from ..pool.reclaim import reclaim_dead_slots, release_block
from ..pool.reserve import reserved_total
from .views import SharedBlock

if TYPE_CHECKING:
    from ..shm.freelist import SharedFreeQueue
    from ..pool.holder import Holder
    from ..shm.index import PrefixIndex
    from ..pool.pool import Pool
    from ..shm.refs import RefStore
    from ..pool.reserve import Reserves

logger = logging.getLogger("shmcache.manager.paged_cache")


class BlockLedger:
    """The block references of one process in one pool (see the module
    docstring). Methods whose docstring says "lock held" expect the
    caller to hold ``pool.lock``; the others take it themselves.

    Invariant: every reference this process counts on a block
    (``b_ref``) is named in one of its lists (its loose list, through the
    holder, or a table's) by the time the lock is released.
    """

    def __init__(self, pool: "Pool", holder: "Holder", free_queue: "SharedFreeQueue",
                 index: "PrefixIndex", reserves: "Reserves") -> None:
        lay = pool.layout
        self.pool = pool
        self.holder = holder
        self.free_queue = free_queue
        self.index = index
        self.reserves = reserves
        self.name: str = pool.name
        self.block_size: int = lay.block_size
        self.max_blocks: int = lay.max_blocks
        self.enable_caching: bool = lay.enable_caching
        self.root: bytes = pool.seed

    # this process's holding, owned by the holder
    @property
    def refs(self) -> "RefStore":
        return self.holder.refs

    # ================================================================ ids
    def bid(self, block) -> int:
        """The id of ``block`` (a block or an int), checked to be in range."""
        if type(block) is int and 0 <= block < self.max_blocks:
            return block
        b = block.block_id if isinstance(block, CacheBlock) else block
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise TypeError(f"block id must be an int, got {type(b).__name__}")
        b = int(b)
        if not 0 <= b < self.max_blocks:
            raise ValueError(f"block id {b} out of range [0, {self.max_blocks})")
        return b

    def bids(self, blocks) -> list:
        """``bid`` of each of ``blocks`` (this ledger's own views read first)."""
        out = []
        n = self.max_blocks
        for b in blocks:
            if type(b) is SharedBlock and b.ledger is self:
                out.append(b._id)             # this ledger's own view: no property call
            elif type(b) is int and 0 <= b < n:
                out.append(b)
            else:
                out.append(self.bid(b))
        return out

    def sync(self) -> None:
        """Re-read this process's loose map if it is stale (lock held; the
        lock has checked that the pool is usable)."""
        self.holder.sync()

    def call_native(self, op, arg):
        """Run a C fast path ``op(arg, slot, epoch, loose map)``.

        It changes nothing and returns None whenever the lock is busy or
        anything needs the slow path (a stale or dirty view, cached blocks
        to evict, an error to raise)."""
        p = self.pool
        try:
            return op(arg, p.slot, self.holder.epoch, self.holder.refs.loose.buf)
        except MemoryError:
            with p.lock:
                self.holder.refs.resync()     # the op committed; the local map did not
            raise

    # ============================================================ block fields
    def set_block_hash(self, b: int, h) -> None:
        """Publish block ``b`` under chain hash ``h`` (None: drop its entry)."""
        with self.pool.lock:
            b = self.bid(b)
            if b == 0:
                raise ValueError("the null block cannot be cached")
            if h is not None and (not isinstance(h, (bytes, bytearray)) or len(h) != L.HASH_BYTES):
                raise ValueError(f"block_hash must be {L.HASH_BYTES} bytes, got {h!r}")
            if h is not None and not self.enable_caching:
                return
            if self.pool.b_flags[b] & L.FLAG_CACHED:
                self.index.remove(b)
            if h is not None:
                self.index.add(b, bytes(h))

    def set_ref_count(self, b: int, v) -> None:
        """The seed's ``block.ref_count = v``: refused unless it changes nothing."""
        if type(v) is int and v == self.pool.b_ref[b]:
            return          # (the seed's own allocation sets it to what it is)
        raise AttributeError(
            "ref_count of a shared block follows the references held; use "
            "touch/increment_ref/free_block (block %d)" % b)

    def set_token_count(self, b: int, v) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= self.block_size:
            raise ValueError(f"token_count must be an int in [0, {self.block_size}], got {v!r}")
        self.pool.b_tok[b] = v

    # cache_data: owned by the holder (holder.Holder.block_payload)
    def block_payload(self, b: int):
        return self.holder.block_payload(b)

    def set_block_payload(self, b: int, data) -> None:
        self.holder.set_block_payload(b, data)

    def drop_payloads(self, blocks=None) -> None:
        self.holder.drop_payloads(blocks)

    def copy_payload(self, old: int, new: int) -> None:
        self.holder.copy_payload(old, new)

    def uncache_all(self) -> None:
        """Drop every prefix-cache entry."""
        with self.pool.lock:
            for b in self.index.cached_ids():
                self.index.remove(b)

    def scan_stats(self) -> PoolStats:
        """The seed's statistics, from a scan of the records."""
        with self.pool.lock:
            s = recovery.scan_stats(self.pool)
            k = self.pool.counters
            return PoolStats(s["total_blocks"], s["allocated_blocks"], s["free_blocks"],
                             s["shared_blocks"], s["total_tokens_cached"], k.hits,
                             k.misses, k.cow, k.evictions,
                             **{k: s[k] for k in PoolStats.CAPACITY})

    # ============================================= lock-held primitive steps
    def pop_free(self) -> int:
        """Take the free list's first block, with one reference (lock held)."""
        p = self.pool
        b = self.free_queue.popleft_id()
        if p.b_flags[b] & L.FLAG_CACHED:
            self.index.remove(b)
            p.counters.count_eviction()
        p.b_ref[b] = 1
        p.b_tok[b] = 0
        p.b_last[b] = p.now()
        p.b_gen[b] = (p.b_gen[b] + 1) & 0xFFFFFFFF     # a new life: old cache_data is void
        return b

    def ensure_free(self, n: int) -> bool:
        """Whether ``n`` blocks are free, after reclaiming dead holders and
        taking blocks out of reserves where they are not (lock held)."""
        p = self.pool
        free = p.counters.num_free
        if not 0 <= free < self.max_blocks:
            raise p.corrupt(f"the free-block counter is {free}, outside "
                            f"[0, {self.max_blocks})")
        if free >= n:
            return True
        self.reclaim_locked()
        free = p.counters.num_free
        if free < n:
            self.reserves.take_from_reserves(n - free)
        return p.counters.num_free >= n

    def take_ref(self, b: int) -> None:
        """One more reference on ``b``, held loose by this process (lock held)."""
        self.count_ref(b)
        self.holder.refs.add_loose(b)

    def count_ref(self, b: int) -> None:
        """One more reference counted on ``b`` (a free one taken out of the
        free list, a reserved one out of its reserve first); the caller
        names it in a list of this process's (loose, or a table's). Lock held."""
        p = self.pool
        if p.b_prev[b] <= -2:
            self.reserves.take_block(b)     # (free now, if a reserve held it)
        if p.b_ref[b] == 0:
            if p.b_prev[b] < 0 or p.b_next[b] < 0:
                raise p.corrupt(f"block {b} has no references but is not in the free list")
            self.free_queue.remove_id(b)
        p.b_ref[b] += 1
        p.b_last[b] = p.now()

    def release(self, b: int) -> bool:
        """Drop one counted reference on ``b``; True if it became free (lock held)."""
        release_block(self.pool, self.free_queue, b)
        return self.pool.b_ref[b] == 0

    def hashes(self, token_ids, n_blocks: int, extra_keys, parent=None, start=0) -> list:
        """Chain hashes of the first ``n_blocks`` blocks of ``token_ids``."""
        return chain_hashes(self.root, self.block_size, token_ids, n_blocks, extra_keys,
                            parent, start)

    def holds(self, b: int) -> bool:
        """Whether this process holds a reference to block ``b`` (lock held):
        ``holder.Holder.holds``."""
        return self.holder.holds(b)

    def holds_fast(self, b: int) -> bool:
        """``holds`` without the lock (False means "ask ``holds``")."""
        return self.holder.holds_fast(b)

    def loose_held(self, b: int) -> int:
        """Loose references held on ``b``, less the one of a block in this
        process's reserve (that one is free)."""
        return self.holder.loose_held(b)

    def reclaim_locked(self) -> int:
        """Release what dead holders held (lock held); the references released."""
        return reclaim_dead_slots(self.pool, self.holder.refs)

    # ========================================================= block allocation
    def allocate_block(self) -> Optional[CacheBlock]:
        """Allocate one block (ref_count 1, held by this manager).

        Returns:
            The block, or None when the pool has no free block.
        """
        p = self.pool
        if not p.lock.unusable:
            ids = self.call_native(p.ops.alloc, 1)
            if ids is not None:
                return SharedBlock(self, ids[0])
        with p.lock:
            self.sync()
            if not self.ensure_free(1):
                logger.warning("Out of cache blocks")
                return None
            try:
                self.holder.refs.need(1)
            except CapacityError as e:
                logger.warning("Out of cache blocks: %s", e)
                return None
            b = alloc_loose(self.holder, self.pop_free, 1)[0]
        return SharedBlock(self, b)

    def get_new_blocks(self, num_blocks: int) -> List[CacheBlock]:
        """Allocate ``num_blocks`` blocks at once.

        Raises:
            OutOfBlocksError (a ValueError): not enough free blocks, or no
                room for their references (CapacityError, a subclass).
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        p = self.pool
        if num_blocks >= self.max_blocks:
            # more than the pool has at all: refused before anything is sized by it
            raise OutOfBlocksError(f"Cannot allocate {num_blocks} blocks, only "
                                   f"{p.counters.num_free} available (the pool has "
                                   f"{self.max_blocks - 1})")
        if num_blocks and not p.lock.unusable:
            ids = self.call_native(p.ops.alloc, num_blocks)
            if ids is not None:
                return [SharedBlock(self, b) for b in ids]
        with p.lock:
            self.sync()
            if not self.ensure_free(num_blocks):
                raise OutOfBlocksError(f"Cannot allocate {num_blocks} blocks, only "
                                       f"{p.counters.num_free} available")
            self.holder.refs.need(num_blocks)
            ids = alloc_loose(self.holder, self.pop_free, num_blocks)
        return [SharedBlock(self, b) for b in ids]

    def maybe_evict_cached_block(self, block: CacheBlock) -> bool:
        p = self.pool
        with p.lock:
            b = self.bid(block)
            if not p.b_flags[b] & L.FLAG_CACHED:
                return False
            self.index.remove(b)
            self.drop_payloads((b,))       # as the seed: cache_data = None
            p.counters.count_eviction()
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
        p = self.pool
        if type(block_id) is int and not p.lock.unusable:
            freed = self.call_native(p.ops.free, (block_id,))
            if freed is not None:
                return freed == 1
        with p.lock:
            self.sync()
            b = self.bid(block_id)
            if p.b_ref[b] <= 0:
                logger.warning(f"Attempted to free unknown block: {b}")
                return False
            if b == 0:
                return False
            if not self.loose_held(b):
                raise ValueError(f"double free of block {b}: this manager holds no reference "
                                 "to it outside its block tables")
            return free_loose(self.holder, self.free_queue, (b,)) == 1

    def free_block_batch(self, blocks) -> None:
        """Free several blocks, in the given order (the seed's unreachable batch free).

        Raises:
            ValueError: the null block, an out-of-range id, or a block not held
                (as many times as listed) by this manager; nothing is freed then.
        """
        ids = self.bids(blocks)
        p = self.pool
        if not p.lock.unusable:
            if self.call_native(p.ops.free, ids) is not None:
                return
        with p.lock:
            self.sync()
            if len(set(ids)) != len(ids) or not all(self.loose_held(b) for b in ids):
                self._check_batch_free(ids)
            free_loose(self.holder, self.free_queue, ids)

    def _check_batch_free(self, ids) -> None:
        need: Dict[int, int] = {}
        for b in ids:
            if b == 0:
                raise ValueError("cannot free the null block (block 0)")
            need[b] = need.get(b, 0) + 1
        for b, k in need.items():
            held = self.loose_held(b)
            if held < k:
                raise ValueError(f"double free of block {b}: freed {k} times, this manager "
                                 f"holds {held} loose references")

    def touch(self, blocks) -> None:
        """Take a reference on each block (a cache hit), pulling free ones out of the queue."""
        ids = [self.bid(b) for b in blocks]
        with self.pool.lock:
            self.sync()
            ids = [b for b in ids if b != 0]
            self.holder.refs.need(len(ids))
            for b in ids:
                self.take_ref(b)

    def increment_ref(self, block_id: int) -> bool:
        """Take one more reference on an allocated block; False if it is free."""
        with self.pool.lock:
            self.sync()
            b = self.bid(block_id)
            if self.pool.b_ref[b] <= 0 or b == 0:
                return False
            self.holder.refs.need(1)
            self.take_ref(b)
            return True

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
        p = self.pool
        with p.lock:
            self.sync()
            lru = self.free_queue.ids(limit=num_blocks)
            for b in lru:
                if p.b_flags[b] & L.FLAG_CACHED:
                    self.index.remove(b)
                    p.counters.count_eviction()
            self.drop_payloads(lru)        # as the seed: cache_data = None
            if lru:
                logger.info(f"Evicted {len(lru)} LRU blocks from cache")
            return len(lru)

    def handle_memory_pressure(self, requested_blocks: int) -> bool:
        """Whether ``requested_blocks`` can be allocated (after reclaiming dead holders)."""
        with self.pool.lock:
            self.sync()
            return self.ensure_free(requested_blocks)

    # ============================================================ free space
    @property
    def free_blocks(self) -> int:
        """Number of free blocks (those in reserves too, see ``set_reserve``)."""
        return self.pool.counters.num_free + reserved_total(self.pool)

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
        p = self.pool
        dropped = p.ops.set_reserve(n)      # (the reference keeps no reserve: None)
        if dropped:
            with p.lock:
                self.sync()
                self.reserves.drain_own(dropped)

    @property
    def reserve_size(self) -> int:
        """Blocks now in this manager's reserve."""
        p = self.pool
        return int(p.slots["reserved"][p.slot]) if p.slot >= 0 else 0
