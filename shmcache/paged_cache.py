"""``PagedCacheManager``: the seed's paged-cache API over a shared-memory pool.

Every public name of ``vllm_mlx.paged_cache`` is here with its signature, so
code written for the seed runs unchanged; the state behind it lives in a
shared segment (``shmcache.layout``) that other processes attach to by
name. Every public operation takes the pool lock once, checks its inputs,
then commits: it is atomic and linearizable across processes, and a bad
input raises before anything changes.

Fixes over the seed (NOTES.md): batch free is ``free_block_batch``; a table
frees its blocks tail first; uncached freed blocks are reused before cached
ones; lookups match whole chains only; ``acquire_computed_blocks`` looks up
and takes references in one step; copy-on-write copies payload bytes, and
only for the last, partly filled block; ``evict_lru_blocks`` keeps LRU
order; statistics are computed from the state, so they cannot drift.
"""

from __future__ import annotations

import logging
import os
import secrets
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import kv
from . import layout as L
from . import recovery
from .blocks import (BlockHash, BlockHashToBlockMap, BlockTable, CacheBlock, CacheStats,
                     FreeKVCacheBlockQueue, KVCacheBlock, chain_hash, compute_block_hash,
                     extra_bytes, token_bytes)
from .errors import CapacityError, OutOfBlocksError
from .freelist import SharedFreeQueue
from .pool import Pool
from .refs import RefStore
from .views import (AllocatedBlocksView, BlocksView, LegacyHashView, RequestTablesView,
                    SharedBlock, SharedBlockTable, SharedHashMap, SharedStats)

logger = logging.getLogger(__name__)

__all__ = ["BlockHash", "CacheBlock", "KVCacheBlock", "FreeKVCacheBlockQueue",
           "BlockHashToBlockMap", "BlockTable", "CacheStats", "PagedCacheManager",
           "compute_block_hash"]


def _rid_key(request_id) -> Tuple[bytes, int]:
    if not isinstance(request_id, str) or not request_id:
        raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
    raw = request_id.encode()
    if len(raw) > L.RID_BYTES or b"\x00" in raw:
        raise ValueError(f"request_id {request_id!r} must be at most {L.RID_BYTES} "
                         "UTF-8 bytes with no NUL")
    return raw, int.from_bytes(chain_hash(b"rid", None, raw, b"")[:8], "little")


def _close(p: Pool, refs: RefStore, destroy: bool) -> None:
    if p.closed or p._forked:
        if destroy and p.creator and not p.private:
            from . import segment
            segment.unlink(p.name)
        p.unmap()
        return
    try:
        with p.lock:
            _release_slot_holdings(p, refs, p.slot)
            p.release_slot()
    finally:
        if destroy and p.creator and not p.private:
            from . import segment
            segment.unlink(p.name)
        p.unmap()


def _release_block(p: Pool, fq: SharedFreeQueue, b: int) -> None:
    r = p.b_ref[b] - 1
    p.b_ref[b] = r
    if r == 0:
        if p.b_flags[b] & L.FLAG_CACHED:
            fq.append_id(b)
        else:
            fq.appendleft_id(b)


def _release_slot_holdings(p: Pool, refs: RefStore, slot: int) -> int:
    fq = SharedFreeQueue(p)
    n = 0
    for b in refs.pop_slot_loose(slot):
        _release_block(p, fq, b)
        n += 1
    owned = np.flatnonzero((p.tables["state"] == 1) & (p.tables["owner"] == slot)).tolist()
    for t in owned:
        _unlink_table(p, refs, t)
        for b in reversed(refs.pop_table(t)):
            _release_block(p, fq, b)
            n += 1
    return n


def _unlink_table(p: Pool, refs: RefStore, t: int) -> None:
    p.t_state[t] = 0           # commit: the table is gone
    p.c[L.C_NUM_TABLES] -= 1
    p.tindex.remove(t, int(p.tables["rid_hash"][t]))


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
        self._epoch = p.c[L.C_EPOCH]
        self._fq = SharedFreeQueue(p)
        self._root = p.seed
        self._hhome = p.hhome
        self._hindex = p.hindex
        self._tindex = p.tindex
        p.on_dirty = self._repair
        p.view = lambda b: SharedBlock(self, b)
        self._lock = p.lock
        self.free_block_queue = self._fq
        self.cached_block_hash_to_block = SharedHashMap(self)
        self.hash_to_block = LegacyHashView(self)
        self.request_tables = RequestTablesView(self)
        self.allocated_blocks = AllocatedBlocksView(self)
        self.blocks = BlocksView(self)
        self.null_block = SharedBlock(self, 0)
        self.stats = SharedStats(self)
        self._finalizer = weakref.finalize(self, _close, p, self._refs, p.private)

    # ================================================================ internals
    def _bid(self, block) -> int:
        b = block.block_id if isinstance(block, CacheBlock) else block
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise TypeError(f"block id must be an int, got {type(b).__name__}")
        b = int(b)
        if not 0 <= b < self.max_blocks:
            raise ValueError(f"block id {b} out of range [0, {self.max_blocks})")
        return b

    def _sync(self) -> None:
        self._p.check_usable()
        if self._p.c[L.C_EPOCH] != self._epoch:
            self._refs.resync()
            self._epoch = self._p.c[L.C_EPOCH]

    def _repair(self) -> None:
        logger.warning("pool %r: previous lock holder died mid-update; repairing", self.name)
        recovery.repair(self)
        self._refs.resync()
        self._epoch = self._p.c[L.C_EPOCH]
        self._reclaim_locked()

    def _block_hash(self, b: int):
        p = self._p
        if not p.b_flags[b] & L.FLAG_CACHED:
            return None
        off = p.layout.blocks_off + b * L.BLOCK_DTYPE.itemsize + L.BLOCK_HASH_OFF
        return BlockHash(bytes(p.raw[off:off + L.HASH_BYTES]))

    def _lookup_hash(self, h: bytes) -> int:
        if len(h) != L.HASH_BYTES:
            return -1
        return self._hindex.find(h, int.from_bytes(h[:8], "little"))

    def _cached_ids(self) -> list:
        f = self._p.blocks["flags"][: self.max_blocks]
        return np.flatnonzero(f & L.FLAG_CACHED).tolist()

    def _cache(self, b: int, h: bytes) -> None:
        p = self._p
        off = p.layout.blocks_off + b * L.BLOCK_DTYPE.itemsize + L.BLOCK_HASH_OFF
        p.raw[off:off + L.HASH_BYTES] = h
        p.b_flags[b] |= L.FLAG_CACHED
        self._hindex.insert(b, int.from_bytes(h[:8], "little"))

    def _uncache(self, b: int) -> None:
        p = self._p
        self._hindex.remove(b, self._hhome(b))
        p.b_flags[b] &= ~L.FLAG_CACHED & 0xFFFF

    def _set_block_hash(self, b: int, h) -> None:
        with self._p.lock:
            b = self._bid(b)
            if b == 0:
                raise ValueError("the null block cannot be cached")
            if h is not None and (not isinstance(h, (bytes, bytearray)) or len(h) != L.HASH_BYTES):
                raise ValueError(f"block_hash must be {L.HASH_BYTES} bytes, got {h!r}")
            if h is not None and not self.enable_caching:
                return
            if self._p.b_flags[b] & L.FLAG_CACHED:
                self._uncache(b)
            if h is not None:
                self._cache(b, bytes(h))

    def _set_ref_count(self, b: int, v) -> None:
        raise AttributeError(
            "ref_count of a shared block follows the references held; use "
            "touch/increment_ref/free_block (block %d)" % b)

    def _set_token_count(self, b: int, v) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= self.block_size:
            raise ValueError(f"token_count must be an int in [0, {self.block_size}], got {v!r}")
        self._p.b_tok[b] = v

    def _block_payload(self, b: int):
        if self._p.arena is None:
            return None
        return [self.read_kv([b], layer) for layer in range(self._p.layout.num_layers)]

    def _set_block_payload(self, b: int, data) -> None:
        for layer, (k, v) in enumerate(data):
            self.write_kv(b, layer, k, v)

    def _scan_stats(self) -> CacheStats:
        with self._p.lock:
            s = recovery.scan_stats(self._p)
            c = self._p.c
            return CacheStats(s["total_blocks"], s["allocated_blocks"], s["free_blocks"],
                              s["shared_blocks"], s["total_tokens_cached"], c[L.C_HITS],
                              c[L.C_MISSES], c[L.C_COW], c[L.C_EVICTIONS])

    def _pop_free(self) -> int:
        p = self._p
        b = self._fq.popleft_id()
        if p.b_flags[b] & L.FLAG_CACHED:
            self._uncache(b)
            p.c[L.C_EVICTIONS] += 1
        p.b_ref[b] = 1
        p.b_tok[b] = 0
        p.b_last[b] = p.now()
        return b

    def _ensure_free(self, n: int) -> bool:
        if self._p.c[L.C_NUM_FREE] >= n:
            return True
        self._reclaim_locked()
        return self._p.c[L.C_NUM_FREE] >= n

    def _take_ref(self, b: int) -> None:
        p = self._p
        if p.b_ref[b] == 0:
            self._fq.remove_id(b)
        p.b_ref[b] += 1
        p.b_last[b] = p.now()
        self._refs.add_loose(b)

    def _release(self, b: int) -> bool:
        _release_block(self._p, self._fq, b)
        return self._p.b_ref[b] == 0

    def _hashes(self, token_ids, n_blocks: int, extra_keys, parent=None, start=0) -> list:
        data = token_bytes(token_ids)
        extra = extra_bytes(extra_keys)
        step = 4 * self.block_size
        out = []
        for i in range(start, n_blocks):
            parent = chain_hash(self._root, parent, data[i * step:(i + 1) * step], extra)
            out.append(parent)
        return out

    def _table_index(self, table) -> int:
        p = self._p
        if isinstance(table, SharedBlockTable) and table._m._p is p:
            t = table._t
            if p.t_state[t] == 1 and int(p.tables["rid_hash"][t]) == table._rh:
                return t
            raise KeyError(f"block table {table.request_id!r} no longer exists")
        rid = getattr(table, "request_id", table)
        raw, h = _rid_key(rid)
        t = self._tindex.find(raw, h)
        if t < 0:
            raise KeyError(f"no block table for request {rid!r}")
        return t

    def _table_view(self, t: int) -> SharedBlockTable:
        p = self._p
        rid = bytes(p.tables["request_id"][t]).decode()
        return SharedBlockTable(self, t, rid, int(p.tables["rid_hash"][t]))

    def _table_ids(self) -> list:
        with self._p.lock:
            st = self._p.tables
            return [bytes(st["request_id"][t]).decode()
                    for t in np.flatnonzero(st["state"] == 1).tolist()]

    def _new_table(self, request_id: str) -> int:
        p = self._p
        raw, h = _rid_key(request_id)
        if self._tindex.find(raw, h) >= 0:
            raise ValueError(f"a block table for request {request_id!r} already exists")
        free = np.flatnonzero(p.tables["state"] == 0)
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
        self._tindex.insert(t, h)
        p.t_state[t] = 1           # commit
        p.c[L.C_NUM_TABLES] += 1
        return t

    def _table_add(self, table, block, tokens_in_block: int, set_block_tokens=True) -> None:
        with self._p.lock:
            self._sync()
            t = self._table_index(table)
            b = self._bid(block)
            if isinstance(tokens_in_block, bool) or not isinstance(tokens_in_block, int) \
                    or not 0 <= tokens_in_block <= self.block_size:
                raise ValueError(f"tokens_in_block must be an int in [0, {self.block_size}], "
                                 f"got {tokens_in_block!r}")
            if not self._refs.holds_loose(b):
                raise ValueError(f"block {b} is not held by this manager outside a table: "
                                 "allocate, acquire or touch it before adding it to a table")
            self._refs.need(1)
            self._refs.table_append(t, b)
            self._refs.drop_loose(b)
            p = self._p
            if set_block_tokens:
                p.b_tok[b] = tokens_in_block
            p.t_tok[t] += tokens_in_block

    def _reclaim_locked(self) -> int:
        p = self._p
        n = 0
        for s in p.dead_slots():
            n += _release_slot_holdings(p, self._refs, s)
            p.slots["state"][s] = 0
        p.c[L.C_RECLAIMED] += n
        return n

    # ========================================================= block allocation
    def allocate_block(self) -> Optional[CacheBlock]:
        """Allocate one block (ref_count 1, held by this manager).

        Returns:
            The block, or None when the pool has no free block.
        """
        with self._p.lock:
            self._sync()
            if not self._ensure_free(1):
                logger.warning("Out of cache blocks")
                return None
            self._refs.need(1)
            b = self._pop_free()
            self._refs.add_loose(b)
            return SharedBlock(self, b)

    def get_new_blocks(self, num_blocks: int) -> List[CacheBlock]:
        """Allocate ``num_blocks`` blocks at once.

        Raises:
            OutOfBlocksError (a ValueError): not enough free blocks.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        with self._p.lock:
            self._sync()
            if not self._ensure_free(num_blocks):
                raise OutOfBlocksError(f"Cannot allocate {num_blocks} blocks, only "
                                       f"{self._p.c[L.C_NUM_FREE]} available")
            self._refs.need(num_blocks)
            out = []
            for _ in range(num_blocks):
                b = self._pop_free()
                self._refs.add_loose(b)
                out.append(SharedBlock(self, b))
            return out

    def _maybe_evict_cached_block(self, block: CacheBlock) -> bool:
        with self._p.lock:
            b = self._bid(block)
            if not self._p.b_flags[b] & L.FLAG_CACHED:
                return False
            self._uncache(b)
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
        with self._p.lock:
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
            self._refs.drop_loose(b)
            return self._release(b)

    def free_block_batch(self, blocks) -> None:
        """Free several blocks, in the given order (the seed's unreachable batch free).

        Raises:
            ValueError: the null block, an out-of-range id, or a block not held
                (as many times as listed) by this manager; nothing is freed then.
        """
        ids = [self._bid(b) for b in blocks]
        with self._p.lock:
            self._sync()
            need: Dict[int, int] = {}
            for b in ids:
                if b == 0:
                    raise ValueError("cannot free the null block (block 0)")
                need[b] = need.get(b, 0) + 1
            for b, k in need.items():
                if len(self._refs.loose.get(b, ())) < k:
                    raise ValueError(f"double free of block {b}: freed {k} times, this manager "
                                     f"holds {len(self._refs.loose.get(b, ()))} loose references")
            for b in ids:
                self._refs.drop_loose(b)
                self._release(b)

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

    # ============================================================ prefix cache
    def get_cached_block(self, block_hash: BlockHash) -> Optional[CacheBlock]:
        """Any block cached under ``block_hash`` (no reference is taken)."""
        if not self.enable_caching:
            return None
        with self._p.lock:
            self._sync()
            b = self._lookup_hash(bytes(block_hash))
            self._p.c[L.C_HITS if b >= 0 else L.C_MISSES] += 1
            return SharedBlock(self, b) if b >= 0 else None

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
        ids = [self._bid(b) for b in blocks[:num_full_blocks]]
        parent = self._block_hash(ids[num_cached_blocks - 1]) if num_cached_blocks else None
        if num_cached_blocks and parent is None:
            parent = self._hashes(token_ids, num_cached_blocks, extra_keys)[-1]
        hashes = self._hashes(token_ids, num_full_blocks, extra_keys, parent, num_cached_blocks)
        with self._p.lock:
            self._sync()
            p = self._p
            for b in ids[num_cached_blocks:]:
                if p.b_ref[b] <= 0 or b == 0:
                    raise ValueError(f"block {b} is not allocated; only held blocks can be cached")
            for b, h in zip(ids[num_cached_blocks:], hashes):
                if not p.b_flags[b] & L.FLAG_CACHED:
                    self._cache(b, h)
                    p.b_tok[b] = self.block_size

    def _lookup_chain(self, token_ids, extra_keys) -> list:
        n = len(token_ids) // self.block_size
        hashes = self._hashes(token_ids, n, extra_keys)
        p = self._p
        found = []
        for h in hashes:
            b = self._lookup_hash(h)
            if b < 0:
                p.c[L.C_MISSES] += 1
                break
            found.append(b)
            p.c[L.C_HITS] += 1
        return found

    def get_computed_blocks(self, token_ids: List[int],
                            extra_keys: Optional[Tuple[Any, ...]] = None
                            ) -> Tuple[List[CacheBlock], int]:
        """The cached blocks of the longest cached prefix (no reference taken:
        use ``acquire_computed_blocks`` when another process may evict them)."""
        if not self.enable_caching:
            return [], 0
        with self._p.lock:
            self._sync()
            found = self._lookup_chain(token_ids, extra_keys)
            return [SharedBlock(self, b) for b in found], len(found) * self.block_size

    def acquire_computed_blocks(self, token_ids: List[int],
                                extra_keys: Optional[Tuple[Any, ...]] = None
                                ) -> Tuple[List[CacheBlock], int]:
        """Look up the longest cached prefix and take a reference on each of
        its blocks, in one atomic step.

        Returns:
            (blocks, num_cached_tokens); the blocks are held by this manager
            (free them, or add them to a table).
        """
        if not self.enable_caching:
            token_bytes(token_ids)
            return [], 0
        with self._p.lock:
            self._sync()
            found = self._lookup_chain(token_ids, extra_keys)
            self._refs.need(len(found))
            for b in found:
                self._take_ref(b)
            return [SharedBlock(self, b) for b in found], len(found) * self.block_size

    # ================================================================= legacy
    @staticmethod
    def compute_block_hash(tokens: List[int]) -> str:
        """Legacy string hash of a token list (a pure function)."""
        return compute_block_hash(None, tokens).hex()[:16]

    def find_cached_block(self, tokens: List[int]) -> Optional[CacheBlock]:
        """The cached block whose prefix is exactly ``tokens`` (from position 0)."""
        with self._p.lock:
            self._sync()
            hashes = self._chunk_hashes(tokens)
            b = self._lookup_hash(hashes[-1]) if hashes else -1
            self._p.c[L.C_HITS if b >= 0 else L.C_MISSES] += 1
            if b < 0:
                return None
            self._p.b_last[b] = self._p.now()
            return SharedBlock(self, b)

    def _chunk_hashes(self, tokens) -> list:
        data = token_bytes(tokens)
        step, out, parent = 4 * self.block_size, [], None
        for i in range(0, len(data), step):
            parent = chain_hash(self._root, parent, data[i:i + step], b"")
            out.append(parent)
        return out

    def register_block_hash(self, block: CacheBlock, tokens: List[int]) -> None:
        """Cache ``block`` as the last block of the prefix ``tokens``."""
        hashes = self._chunk_hashes(tokens)
        if not hashes:
            raise ValueError("register_block_hash needs at least one token")
        b = self._bid(block)
        with self._p.lock:
            self._sync()
            if self._p.b_ref[b] <= 0:
                raise ValueError(f"block {b} is not allocated; only held blocks can be cached")
            self._set_block_hash(b, hashes[-1])

    def find_shared_prefix(self, tokens: List[int]) -> Tuple[List[int], List[int]]:
        """Block ids of the longest cached whole-chain prefix, and the tokens after it."""
        with self._p.lock:
            self._sync()
            found = self._lookup_chain(tokens, None) if self.enable_caching else []
            return found, list(tokens[len(found) * self.block_size:])

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
            return self.get_block_table(request_id) or self.create_block_table(request_id)

    def delete_block_table(self, request_id: str) -> None:
        """Delete a table and drop its references, last block first.

        Raises:
            KeyError: no table for ``request_id``.
        """
        with self._p.lock:
            self._sync()
            t = self._table_index(request_id)
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

    def _cow_last(self, t: int) -> bool:
        p = self._p
        rec = p.t_tail[t]
        old = p.r_block[rec]
        new = self._pop_free()
        p.b_tok[new] = p.b_tok[old]
        kv.copy_block(p, old, new)
        p.r_block[rec] = new        # commit: the table now holds the copy
        self._release(old)
        p.c[L.C_COW] += 1
        return True

    def _append_plan(self, t: int, n: int) -> Tuple[bool, int]:
        p = self._p
        tok, length = p.t_tok[t], p.t_len[t]
        room = length * self.block_size - tok
        last = p.r_block[p.t_tail[t]] if length else -1
        cow = last > 0 and 0 < tok % self.block_size and p.b_ref[last] > 1 and n > 0
        new = max(0, -(-(n - room) // self.block_size)) if n > room else 0
        return cow, new

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        """Whether ``prepare_append(table, num_new_tokens)`` would find its blocks."""
        with self._p.lock:
            cow, new = self._append_plan(self._table_index(table), num_new_tokens)
            return self._ensure_free(cow + new)

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
            if not self._ensure_free(cow + new):
                raise OutOfBlocksError(f"prepare_append needs {cow + new} free blocks, "
                                       f"{p.c[L.C_NUM_FREE]} available")
            self._refs.need(new)
            if cow:
                self._cow_last(t)
            for _ in range(new):
                self._refs.table_append(t, self._pop_free())
            bs, tok = self.block_size, p.t_tok[t]
            recs = self._refs.table_records(t)
            first, last = tok // bs, (tok + num_new_tokens - 1) // bs
            out = []
            for i in range(first, last + 1):
                b = p.r_block[recs[i]]
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
            if cow and self._ensure_free(1):
                copied = self._cow_last(t)
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

    # ================================================================ eviction
    def evict_lru_blocks(self, num_blocks: int) -> int:
        """Drop the prefix-cache entries of the ``num_blocks`` least recently
        used free blocks, leaving the queue order as it is.

        Returns:
            The number of cache entries dropped.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        with self._p.lock:
            self._sync()
            n = 0
            for b in self._fq.ids(limit=num_blocks):
                if n >= num_blocks:
                    break
                if self._p.b_flags[b] & L.FLAG_CACHED:
                    self._uncache(b)
                    self._p.c[L.C_EVICTIONS] += 1
                    n += 1
            return n

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
        """A snapshot of the statistics, computed from the pool's state."""
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
                "kv_bytes": self._p.layout.arena_size}

    def reset_stats(self) -> None:
        with self._p.lock:
            for c in (L.C_HITS, L.C_MISSES, L.C_COW, L.C_EVICTIONS):
                self._p.c[c] = 0

    def _uncache_all(self) -> None:
        with self._p.lock:
            for b in self._cached_ids():
                self._uncache(b)

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache; False (and nothing done) while blocks are in use."""
        with self._p.lock:
            self._sync()
            used = self.max_blocks - self.free_blocks
            if used > 1:
                logger.warning(f"Cannot reset cache: {used - 1} blocks in use")
                return False
            self._uncache_all()
            for c in (L.C_HITS, L.C_MISSES, L.C_EVICTIONS):
                self._p.c[c] = 0
            return True

    def clear(self) -> None:
        """Release every reference every process holds and empty the cache."""
        with self._p.lock:
            self._sync()
            p = self._p
            for s in np.flatnonzero(p.slots["state"] == 1).tolist():
                _release_slot_holdings(p, self._refs, s)
            self._uncache_all()
            p.c[L.C_EPOCH] += 1
            self.reset_stats()
            self._sync()

    # ======================================================= shmcache additions
    def write_kv(self, block_id: int, layer: int, keys, values, start: int = 0) -> None:
        """Write K/V of shape (num_kv_heads, T, head_dim) into a block at ``start``."""
        b = self._bid(block_id)
        kv.check_layer(self._p, layer)
        self._p.check_usable()
        kv.write(self._p, b, layer, keys, values, start)

    def read_kv(self, block_ids, layer: int):
        """Gather blocks' K/V of one layer into MLX arrays (num_kv_heads, n*block_size, head_dim)."""
        ids = [self._bid(b) for b in block_ids]
        kv.check_layer(self._p, layer)
        self._p.check_usable()
        return kv.read(self._p, ids, layer)

    def check(self) -> List[str]:
        """Every violated invariant, one line each; empty when consistent."""
        with self._p.lock:
            self._p.check_usable()
            return recovery.check(self)

    def reclaim_dead(self) -> int:
        """Release everything held by managers whose process died.

        Returns:
            The number of block references released.
        """
        with self._p.lock:
            self._sync()
            return self._reclaim_locked()

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
