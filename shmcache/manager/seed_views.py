"""The seed's container attributes over the shared pool.

``PagedCacheManager`` exposes the seed's ``free_block_queue``,
``cached_block_hash_to_block``, ``hash_to_block``, ``request_tables``,
``allocated_blocks``, ``blocks`` and ``stats``; each is one of these live
objects, reading (and, where the seed writes, writing) shared memory
through the manager's owner it is given: the ``core.BlockLedger`` (blocks,
references, the prefix index), or for ``request_tables`` the
``tables.BlockTables``. So every process sees the same contents.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..shm.blocks import CacheStats, PoolStats
from ..errors import OutOfBlocksError
from ..shm.freelist import SharedFreeQueue
from .views import SharedBlock


class _View(Mapping):
    def __init__(self, owner) -> None:
        self._m = owner     # the BlockLedger (the BlockTables for RequestTablesView)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"


class AllocatedBlocksView(_View):
    """block_id -> live ``CacheBlock`` for every block with ref_count > 0."""

    def __getitem__(self, block_id):
        m = self._m
        if not isinstance(block_id, int) or not 0 <= block_id < m.max_blocks or m.pool.b_ref[block_id] <= 0:
            raise KeyError(block_id)
        return SharedBlock(m, block_id)

    def __contains__(self, block_id) -> bool:
        m = self._m
        return isinstance(block_id, int) and 0 <= block_id < m.max_blocks and m.pool.b_ref[block_id] > 0

    def __iter__(self):
        return iter(np.flatnonzero(self._m.pool.blocks["ref_count"][: self._m.max_blocks] > 0).tolist())

    def __len__(self) -> int:
        return int((self._m.pool.blocks["ref_count"][: self._m.max_blocks] > 0).sum())


class RequestTablesView(_View):
    """request_id -> live ``BlockTable`` for every table in the pool."""

    def __getitem__(self, rid):
        t = self._m.get_block_table(rid)
        if t is None:
            raise KeyError(rid)
        return t

    def __contains__(self, rid) -> bool:
        return isinstance(rid, str) and self._m.get_block_table(rid) is not None

    def __iter__(self):
        return iter(self._m.table_ids())

    def __len__(self) -> int:
        return len(self._m.table_ids())


class LegacyHashView(_View):
    """The seed's ``hash_to_block`` (hex hash -> block_id), over chain hashes.

    NOTE: keys are the hex of *chain* hashes, so a lookup can only match a
    block at the same position after the same prefix (the seed's per-block
    index could hand back a block from another position).
    """

    def __getitem__(self, key):
        try:
            h = bytes.fromhex(key)
        except (TypeError, ValueError):
            raise KeyError(key) from None
        b = self._m.index.find(h)
        if b < 0:
            raise KeyError(key)
        return b

    def __iter__(self):
        m = self._m
        # several blocks may share a hash: each key once, as a Mapping must;
        # under the lock, so no block is uncached between flag and hash reads
        with m.pool.lock:
            return iter(dict.fromkeys(m.index.hash_of(b).hex() for b in m.index.cached_ids()))

    def __len__(self) -> int:
        m = self._m
        with m.pool.lock:
            return len({m.index.hash_of(b) for b in m.index.cached_ids()})


class SharedHashMap:
    """The seed's ``BlockHashToBlockMap`` over the pool's shared index."""

    def __init__(self, ledger) -> None:
        self._m = ledger

    def get_block(self, block_hash):
        with self._m.pool.lock:
            b = self._m.index.find(bytes(block_hash))
        return SharedBlock(self._m, b) if b >= 0 else None

    def insert(self, block_hash, block) -> None:
        self._m.set_block_hash(block.block_id, bytes(block_hash))

    def pop(self, block_hash, block_id: int):
        m = self._m
        with m.pool.lock:            # check and drop as one step
            if m.index.hash_of(m.bid(block_id)) != bytes(block_hash):
                return None
            m.set_block_hash(block_id, None)
        return SharedBlock(m, block_id)

    def __len__(self) -> int:
        with self._m.pool.lock:
            return len({self._m.index.hash_of(b) for b in self._m.index.cached_ids()})

    def clear(self) -> None:
        self._m.uncache_all()


class BlocksView:
    """The seed's ``blocks`` list: ``blocks[i]`` is a live view of block i."""

    def __init__(self, ledger) -> None:
        self._m = ledger

    def __len__(self) -> int:
        return self._m.max_blocks

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [SharedBlock(self._m, j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise IndexError(f"block index {i!r} out of range [0, {n})")
        return SharedBlock(self._m, i % n)

    def __iter__(self):
        return (SharedBlock(self._m, j) for j in range(len(self)))


# the seed's name -> the pool counter's (``counters.Counters``)
_COUNTERS = {"cache_hits": "hits", "cache_misses": "misses",
             "cow_copies": "cow", "evictions": "evictions"}
_DERIVED = ("total_blocks", "allocated_blocks", "free_blocks", "shared_blocks",
            "total_tokens_cached") + PoolStats.CAPACITY


class SharedStats(CacheStats):
    """``CacheStats`` whose counters are the pool's shared counters and whose
    block figures are computed from a scan of the records on each read."""

    def __init__(self, ledger) -> None:  # noqa
        object.__setattr__(self, "_m", ledger)

    def __getattribute__(self, name):
        if name in _COUNTERS:
            return getattr(object.__getattribute__(self, "_m").pool.counters, _COUNTERS[name])
        if name in _DERIVED:
            return getattr(object.__getattribute__(self, "_m").scan_stats(), name)
        return object.__getattribute__(self, name)

    def __setattr__(self, name, value) -> None:
        if name in _COUNTERS:
            setattr(self._m.pool.counters, _COUNTERS[name], int(value))
        else:
            raise AttributeError(f"{name} is derived from the pool's state and cannot be set")

    def __repr__(self) -> str:
        return repr(self._m.scan_stats()).replace("CacheStats", "SharedStats", 1)


class SeedFreeQueue(SharedFreeQueue):
    """A manager's ``free_block_queue``: the seed's ``FreeKVCacheBlockQueue``
    calls over the shared free list, with the references they imply
    accounted for, so that no referenced block is ever on the free list.

    - ``popleft``/``popleft_n``/``remove`` take blocks off the free list and
      give this manager a reference on each (as ``touch`` does: a cached
      block keeps its cache entry);
    - ``append``/``append_n`` put back blocks on which this manager holds the
      only reference (one it holds outside its tables): that reference is
      released and the block goes to the back (MRU). Any other block is
      refused with ``ValueError``: a block someone else references, one held
      in a table, one already free, the null block.
    """

    def __init__(self, ledger) -> None:
        super().__init__(ledger.pool)
        self._m = ledger

    def _taken(self, ids: list) -> list:
        m = self._m
        p = self.p
        for b in ids:
            p.b_ref[b] = 1
            p.b_last[b] = p.now()
            m.refs.add_loose(b)
        return [SharedBlock(m, b) for b in ids]

    def get_all_free_blocks(self) -> list:
        with self.p.lock:
            return [SharedBlock(self._m, b) for b in self.ids()]

    def popleft(self):
        with self.p.lock:
            self._m.sync()
            self._m.refs.need(1)
            return self._taken([self.popleft_id()])[0]

    def popleft_n(self, n: int) -> list:
        with self.p.lock:
            self._m.sync()
            if n > self.num_free_blocks:
                raise OutOfBlocksError(f"Need {n} blocks, have {self.num_free_blocks}")
            self._m.refs.need(n)
            return self._taken([self.popleft_id() for _ in range(n)])

    def remove(self, block) -> None:
        m = self._m
        with self.p.lock:
            m.sync()
            b = m.bid(block)
            p = self.p
            if p.b_ref[b] != 0 or p.b_prev[b] < 0 or p.b_next[b] < 0:
                raise RuntimeError(f"Block {b} not in free queue")
            m.refs.need(1)
            self.remove_id(b)
            self._taken([b])

    def _check_put_back(self, ids: list) -> None:
        m, p = self._m, self.p
        want: dict = {}
        for b in ids:
            want[b] = want.get(b, 0) + 1
        for b, k in want.items():
            if b == 0:
                raise ValueError("the null block (block 0) never goes on the free queue")
            if p.b_ref[b] == 0:
                raise ValueError(f"block {b} is already in the free queue")
            if k > 1 or p.b_ref[b] != 1 or not m.refs.holds_loose(b):
                raise ValueError(
                    f"block {b} is referenced (ref_count {p.b_ref[b]}) and not only by a "
                    "reference this manager holds outside its tables: it cannot go on the "
                    "free queue (free_block drops a reference)")

    def append(self, block) -> None:
        self.append_n([block])

    def append_n(self, blocks) -> None:
        m = self._m
        with self.p.lock:
            m.sync()
            ids = [m.bid(b) for b in blocks]
            self._check_put_back(ids)
            p = self.p
            for b in ids:
                m.refs.drop_loose(b)
                p.b_ref[b] = 0
                p.add_tokens(-(p.b_tok[b]))
                self.append_id(b)
