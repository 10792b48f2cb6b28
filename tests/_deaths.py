"""Helpers of the tests where processes die (``test_recovery``,
``test_reclaim``): the pool's shape, the bound on how long anyone may be
blocked, and what the parent publishes and looks at."""

from __future__ import annotations

import numpy as np

from shmcache.shm import segment

from _proc_client import lock_is_busy, write_positions
from tools.stress.workload_payload import extra_for


BS = 4
LAYOUT = dict(block_size=BS, num_layers=1, num_kv_heads=2, head_dim=4, dtype="float32")
BLOCKED_BOUND = 5.0   # the issue says "about a second"; generous against CI noise


def ref_counts(mgr) -> np.ndarray:
    return mgr.pool.blocks["ref_count"][: mgr.max_blocks].copy()


def lock_is_held_elsewhere(mgr) -> bool:
    return lock_is_busy(segment.path_for(mgr.name))


def publish(mgr, tokens, salt=0):
    """The parent writes, tables and publishes a chain; returns (rid, block ids)."""
    rid = f"pub-{tokens[0]}-{salt}"
    n = -(-len(tokens) // BS)
    blocks = mgr.get_new_blocks(n)
    t = mgr.create_block_table(rid)
    for i, b in enumerate(blocks):
        write_positions(mgr, [b], i * BS, tokens[:(i + 1) * BS], salt)
        mgr.add_block_to_table(t, b, len(tokens[i * BS:(i + 1) * BS]))
    mgr.cache_full_blocks(blocks, tokens, 0, len(tokens) // BS, extra_for(salt))
    return rid, [b.block_id for b in blocks]


def dead_entries(mgr) -> list:
    return [h for h in mgr.holdings() if not h["alive"]]
