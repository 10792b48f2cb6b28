"""The manager's statistics and whole-pool operations: the seed's counters,
stats and resets, the shared counters layers above the pool add to, and
shmcache's checks (``check``, ``reclaim_dead``, ``holdings``).

``PoolAdmin`` is one owner of a ``PagedCacheManager``; its collaborator
is the ``core.BlockLedger`` (through it the pool, the holder and the
prefix index), given to its constructor. Statistics are computed from the
pool's shared state, so every process sees the same figures.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List

import numpy as np

from ..shm import layout as L
from ..pool import recovery
from ..shm.blocks import CacheStats, PoolStats
from ..pool.reclaim import release_slot_holdings

if TYPE_CHECKING:
    from .core import BlockLedger

logger = logging.getLogger("shmcache.manager.paged_cache")


class PoolAdmin:
    """Statistics and operations on the whole pool.

    Invariant: the counters below index 16 are the pool's own and only the
    pool writes them; ``add_counters`` writes the rest, under the lock, so
    every process's additions sum.
    """

    def __init__(self, ledger: "BlockLedger") -> None:
        self.ledger = ledger
        self.pool = ledger.pool
        self.holder = ledger.holder
        self.block_size = ledger.block_size
        self.max_blocks = ledger.max_blocks

    # ---- the seed's statistics and resets, and the shared counters
    def get_stats(self) -> CacheStats:
        """A snapshot of the statistics (a ``PoolStats``: the seed's
        ``CacheStats`` and the pool's capacities), computed from the pool's
        state; ``total_tokens_cached`` is the seed's running count."""
        return self.ledger.scan_stats()

    def get_memory_usage(self) -> Dict[str, Any]:
        s = self.get_stats()
        asked = s.cache_hits + s.cache_misses
        return {"block_size": self.block_size, "max_blocks": self.max_blocks,
                "allocated_blocks": s.allocated_blocks, "free_blocks": s.free_blocks,
                "shared_blocks": s.shared_blocks, "total_tokens_cached": s.total_tokens_cached,
                "utilization": s.allocated_blocks / self.max_blocks,
                "cache_hit_rate": s.cache_hits / asked if asked else 0,
                "metadata_bytes": self.pool.layout.metadata_size,
                "kv_bytes": self.pool.layout.arena_size,
                **{k: getattr(s, k) for k in PoolStats.CAPACITY}}

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
        with self.pool.lock:
            c = self.pool.c
            for i, d in items:
                c[i] += d

    def l2_counters(self) -> Dict[str, int]:
        """The pool-wide L2 counters (``layout.L2_COUNTERS``), summed over every process."""
        return self.pool.counters.l2()

    def reset_stats(self) -> None:
        with self.pool.lock:
            self.pool.counters.reset_stats()

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache; False (and nothing done) while blocks are in use."""
        with self.pool.lock:
            self.ledger.sync()
            used = self.max_blocks - self.ledger.free_blocks
            if used > 1:
                logger.warning(f"Cannot reset cache: {used - 1} blocks in use")
                return False
            self.ledger.uncache_all()
            self.ledger.drop_payloads()           # as the seed: every cache_data = None
            self.pool.counters.reset_stats(cow=False)
            return True

    def clear(self) -> None:
        """Release every reference every process holds and empty the cache."""
        with self.pool.lock:
            self.ledger.sync()
            p = self.pool
            for s in np.flatnonzero(p.slots["state"] == 1).tolist():
                release_slot_holdings(p, self.holder.refs, s)
            self.ledger.uncache_all()
            self.ledger.drop_payloads()
            p.counters.bump_epoch()
            self.reset_stats()
            p.counters.tokens = 0
            self.ledger.sync()

    # ---- shmcache's own: the invariant check, dead holders, who holds what
    def check(self) -> List[str]:
        """Every violated invariant, one line each; empty when consistent."""
        with self.pool.lock:
            self.pool.check_usable()
            return recovery.check(self.pool)

    def reclaim_dead(self) -> int:
        """Release everything held by managers whose process died.

        Returns:
            The number of block references released.
        """
        with self.pool.lock:
            self.ledger.sync()
            p = self.pool
            n, p.reclaimed_in_repair = p.reclaimed_in_repair, 0
            return n + self.ledger.reclaim_locked()

    def holdings(self) -> List[Dict[str, Any]]:
        """What each attached manager holds: slot, pid, alive, tables, blocks."""
        with self.pool.lock:
            p = self.pool
            out = []
            for s in np.flatnonzero(p.slots["state"] == 1).tolist():
                tabs = np.flatnonzero((p.tables["state"] == 1) & (p.tables["owner"] == s)).tolist()
                # (a reserve's blocks are loose references, but free)
                res = max(0, int(p.slots["reserved"][s]))
                out.append({"slot": s, "pid": int(p.slots["pid"][s]),
                            "start_time": float(p.slots["start_time"][s]),
                            "alive": p.slot_ops.slot_alive(s), "tables": len(tabs),
                            "table_blocks": int(sum(p.t_len[t] for t in tabs)),
                            "loose_blocks": int(p.s_count[s]) - res, "reserved_blocks": res})
            return out

