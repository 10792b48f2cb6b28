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

from ..shm.counters import SHARED_WORDS, Counters
from ..pool import recovery
from ..shm.blocks import CacheStats, PoolStats
from ..pool.reclaim import release_slot_holdings

if TYPE_CHECKING:
    from .core import BlockLedger

logger = logging.getLogger("shmcache.manager.paged_cache")


class PoolAdmin:
    """Statistics and operations on the whole pool.

    Invariant: the pool's own counters (layout's ``C_*``) only the pool
    writes; ``add_counters`` writes the shared ones (the L2 tier's, by
    name), under the lock, so every process's additions sum.
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

    def add_counters(self, deltas: Dict[str, int]) -> None:
        """Add ``{counter name: delta}`` to the pool's shared counters, under the lock.

        For statistics kept by layers above the pool: the L2 tier's,
        ``l2_<name>`` for each name of ``layout.L2_COUNTERS``
        (``counters.SHARED_WORDS``); every process's additions sum.
        Nothing is added unless every name is one of them.

        Raises:
            ValueError: an unknown counter name, or one of the pool's own
                counters, which only the pool writes (the message names it).
        """
        items = [(name, int(d)) for name, d in dict(deltas).items()]
        for name, _ in items:
            Counters.word(name)                     # (unknown: ValueError naming it)
            if name not in SHARED_WORDS:
                raise ValueError(f"counter {name!r} is the pool's own (only the pool writes "
                                 f"it); add_counters takes {', '.join(sorted(SHARED_WORDS))}")
        with self.pool.lock:
            counters = self.pool.counters
            for name, d in items:
                counters.add(name, d)

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

