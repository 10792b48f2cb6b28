"""Helpers shared by the seed-API tests (test_paged_cache, test_tables,
test_seed_fixes, test_check, test_bad_input): token lists, cached tables,
byte snapshots of a pool's metadata, recomputed stats, and the ``pair`` and
``kvpool`` fixtures (imported by name into the test modules that use them)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import shmcache
from shmcache.shm import layout as L

BS = 4


def toks(n: int, base: int = 0) -> list:
    return list(range(base, base + n))


def cached_table(m, rid: str, n_blocks: int, base: int = 0, extra_keys=None):
    t = m.create_block_table(rid)
    blocks = m.get_new_blocks(n_blocks)
    tokens = toks(n_blocks * m.block_size, base)
    for b in blocks:
        m.add_block_to_table(t, b, m.block_size)
    m.cache_full_blocks(blocks, tokens, 0, n_blocks, extra_keys=extra_keys)
    return t, [b.block_id for b in blocks], tokens


# Counters that two pools differ in by their lock holds alone (the holds'
# bookkeeping: ops, longest wait, dirty mark, holder, turns): the state
# comparisons leave them out.
LOCK_COUNTERS = [L.C_OPS, L.C_LOCK_WAIT_NS, L.C_DIRTY, L.C_HOLDER, L.C_TURN_NEXT, L.C_TURN_NOW]


def snapshot(m):
    """Every metadata byte of the pool except the lock bookkeeping counters,
    plus the manager's private index of its own references."""
    p = m.pool
    lay = p.layout
    c = p.counter_array.copy()
    c[LOCK_COUNTERS] = 0
    hdr = bytes(p.mm[:L.MUTEX_OFF]) + bytes(p.mm[L.MUTEX_OFF + L.MUTEX_BYTES:lay.counters_off])
    return (hdr, c.tobytes(),
            bytes(p.mm[lay.slots_off:lay.arena_off]),
            m.internals.holder.refs.loose.buf.tobytes())


def unchanged(m, before) -> None:
    after = snapshot(m)
    assert after[0] == before[0], "header changed"
    assert after[1] == before[1], "counters changed"
    assert after[2] == before[2], "slots/blocks/indexes/tables changed"
    assert after[3] == before[3], "the manager's reference map changed"
    assert m.check() == []


def full_scan(m) -> dict:
    """Statistics recomputed from scratch from the raw records."""
    p = m.pool
    n = m.max_blocks
    ref = [p.b_ref[b] for b in range(n)]
    free, cur = 0, p.b_next[p.HEAD]
    while cur != p.TAIL:
        free += 1
        cur = p.b_next[cur]
    return {"total_blocks": n,
            "allocated_blocks": sum(1 for r in ref if r > 0),
            "free_blocks": free,
            "shared_blocks": sum(1 for b in range(1, n) if ref[b] > 1)}


def stats_dict(s) -> dict:
    """The statistics that are a function of the state (total_tokens_cached
    is the seed's running count: see test_seed_consumer.py)."""
    return {k: getattr(s, k) for k in ("total_blocks", "allocated_blocks", "free_blocks",
                                       "shared_blocks")}


@pytest.fixture
def pair(make_pool):
    """(creator, attached) managers of one named pool, block_size 4, 32 blocks."""
    m = make_pool(block_size=BS, max_blocks=32)
    other = shmcache.attach(m.name)
    yield m, other
    other.close()


@pytest.fixture
def kvpool(make_pool):
    return make_pool(block_size=BS, max_blocks=16, num_layers=2, num_kv_heads=2, head_dim=4,
                     dtype="float32")


def kv_data(m, seed: int, tokens: int = BS):
    lay = m.layout
    a = np.random.default_rng(seed).standard_normal(
        (lay.num_kv_heads, tokens, lay.head_dim)).astype(np.float32)
    return mx.array(a)


def payload(m, b: int) -> bytes:
    return m.pool.arena[:, b].tobytes()


def layer_kv(arena, ids, layer: int) -> list:
    """What a read of blocks `ids` of `layer` must give: [K, V], each
    (H, len(ids)*T, D), from an (L, max_blocks, 2, H, T, D) arena."""
    H, T, D = arena.shape[3:]
    return [arena[layer, list(ids), kv].transpose(1, 0, 2, 3).reshape(H, len(ids) * T, D).copy()
            for kv in (0, 1)]
