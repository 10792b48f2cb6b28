"""The server's pool, read from outside by the demo driver (``PoolView``: no slot, no lock)."""

from __future__ import annotations

import time


class PoolSampler:
    """Reads the server's pool from outside, read-only (``PoolView``: no slot,
    no lock): peak blocks in use and peak blocks listed by live tables."""

    def __init__(self, pool: str) -> None:
        from shmcache.pool.inspect_pool import PoolView
        self.view = PoolView(pool)
        lay = self.view.layout
        self.max_blocks = lay.max_blocks
        self.block_bytes = lay.block_bytes
        self.peak_blocks = self.peak_table_blocks = 0
        self.used = 0.0

    def in_use(self) -> tuple:
        """(blocks referenced, besides the null block; blocks listed by live tables)."""
        from shmcache.pool import recovery
        s = recovery.scan_stats(self.view)
        t = self.view.tables
        return s["allocated_blocks"] - 1, int(t["length"][t["state"] == 1].sum())

    def sample(self) -> None:
        blocks, table_blocks = self.in_use()
        self.peak_blocks = max(self.peak_blocks, blocks)
        self.peak_table_blocks = max(self.peak_table_blocks, table_blocks)
        self.used = blocks / (self.max_blocks - 1)

    def settle(self, timeout: float) -> int:
        """Waits until nothing is referenced; the blocks still referenced."""
        deadline = time.monotonic() + timeout
        while True:
            blocks, table_blocks = self.in_use()
            if (blocks == 0 and table_blocks == 0) or time.monotonic() > deadline:
                return blocks
            time.sleep(0.05)

    def l2_counters(self, settle_s: float = 0.0) -> dict:
        """The pool-wide L2 counters (every worker's, summed by the pool),
        after ``settle_s`` for the workers' last deltas (each adds them
        every ``shmcache.l2.FLUSH_S``)."""
        if settle_s:
            time.sleep(settle_s)
        return self.view.l2_counters()

    def close(self) -> None:
        self.view.close()
