"""The prefix index in C (hot_index.h): the fused publish (hot_fused.h's
hot_publish over hot_index_add), the C path of cache_full_blocks, takes the
lock itself, caches what the Python path (prefix.cache_full_blocks,
index.PrefixIndex.add_many) caches, refuses (None, nothing changed) what
that path raises for, and leaves a pool whose index it finds corrupted
dirty, for the next holder to repair; the C allocations (alloc, append)
evict cached free blocks as core._pop_free does. (The byte-for-byte
comparison with the Python path over a random mix is
tests/test_hot_tables.py's; corrupted indexes met while evicting,
tests/test_hot.py's.)"""

from __future__ import annotations

import pytest

import shmcache
from shmcache.shm import layout as L
from shmcache.shm import lock as shlock
from shmcache.shm.hot_ops import NativeOps

from _mutex import python_only
from test_hot_tables import _Counted, _shared_state, assert_unchanged_but_the_lock

pytestmark = pytest.mark.skipif(not shlock.ACCELERATED, reason="the C accelerator is not built")


def _pool_with_a_table(n_tokens=12):
    m = shmcache.PagedCacheManager(block_size=4, max_blocks=32)
    t = m.create_block_table("a")
    m.prepare_append(t, n_tokens)
    return m, t, list(range(100, 100 + n_tokens))


def test_publish_caches_the_blocks_full_in_one_hold_and_keeps_a_cached_hash():
    m, t, tokens = _pool_with_a_table()
    try:
        p, nat = m.pool, m.pool.native
        ids = t.block_ids
        hs = m.internals.ledger.hashes(tokens, 3, None)
        ops = int(p.c[L.C_OPS])
        assert nat.publish(ids[:2], b"".join(hs[:2]), 4, p.slot, m.internals.holder.epoch) == 2
        assert int(p.c[L.C_OPS]) == ops + 1 and p.c[L.C_DIRTY] == 0
        assert [m.blocks[b].token_count for b in ids] == [4, 4, 4]
        # block 0 is cached already: it keeps its hash, and only block 2 is added
        assert nat.publish(ids, b"".join([b"\xff" * 16] + hs[1:]), 4, p.slot, m.internals.holder.epoch) == 1
        assert [m.internals.ledger.index.hash_of(b) for b in ids] == hs
        other = m.create_block_table("b")
        got, n = m.acquire_computed_blocks(tokens, table=other)
        assert [b.block_id for b in got] == ids and n == 12
        m.delete_block_table("b")
        m.delete_block_table("a")
        assert m.check() == []
    finally:
        m.close()


def test_publish_refuses_what_the_python_path_raises_for_and_changes_nothing():
    m, t, tokens = _pool_with_a_table()
    try:
        p, nat = m.pool, m.pool.native
        ids = t.block_ids
        hs = b"".join(m.internals.ledger.hashes(tokens, 3, None))
        free = next(b for b in range(1, 32) if m.blocks[b].ref_count == 0)
        before = bytes(p.raw)
        for args in ((ids, hs[:-1], 4, p.slot, m.internals.holder.epoch),          # hashes not 16 bytes each
                     (ids, hs, 4, p.slot, m.internals.holder.epoch + 1),           # stale view
                     (ids, hs, 4, -1, m.internals.holder.epoch),                   # no slot
                     (ids, hs, 0, p.slot, m.internals.holder.epoch),               # bad block size
                     ([0] + ids[1:], hs, 4, p.slot, m.internals.holder.epoch),     # the null block
                     ([ids[0], 999, ids[2]], hs, 4, p.slot, m.internals.holder.epoch),
                     ([ids[0], free, ids[2]], hs, 4, p.slot, m.internals.holder.epoch)):   # a free block
            assert nat.publish(*args) is None, args
        with p.lock:                                               # held by this thread
            assert nat.publish(ids, hs, 4, p.slot, m.internals.holder.epoch) is None
        assert_unchanged_but_the_lock(p, before)
        with pytest.raises(ValueError, match=f"block {free} is not allocated"):
            m.cache_full_blocks([ids[0], free, ids[2]], tokens, 0, 3)   # (the Python path says why)
        with pytest.raises(TypeError):
            nat.publish(ids, "not bytes", 4, p.slot, m.internals.holder.epoch)
        assert m.internals.ledger.index.hash_of(ids[0]) is None and m.check() == []
    finally:
        m.close()


def test_publish_into_a_corrupted_index_leaves_the_pool_dirty_and_the_next_hold_repairs():
    """An index with no empty slot only comes from corruption (it has twice
    as many slots as the pool has blocks): the fused op stops, unlocks, and
    leaves the dirty mark for the next holder, whose repair rebuilds the
    index from the blocks' flags."""
    m, t, tokens = _pool_with_a_table()
    try:
        p, nat = m.pool, m.pool.native
        ids = t.block_ids
        hs = m.internals.ledger.hashes(tokens, 3, None)
        p.hidx[:] = 31                          # every slot taken, by an uncached block
        assert nat.publish(ids, b"".join(hs), 4, p.slot, m.internals.holder.epoch) is None
        assert p.c[L.C_DIRTY] == 1
        assert nat.trylock() == 0               # the lock was released
        nat.unlock()
        m.cache_full_blocks(ids, tokens, 0, 3)  # repaired first, then published
        assert p.c[L.C_DIRTY] == 0 and m.check() == []
        assert [m.internals.ledger.index.hash_of(b) for b in ids] == hs
        assert int((p.hidx >= 0).sum()) == 3
        m.delete_block_table("a")
    finally:
        m.close()


def _all_cached_and_free(m):
    """Every block of m published, then freed: the free list holds only
    cached blocks, so any allocation evicts."""
    n = m.max_blocks - 1
    t = m.create_block_table("all")
    m.prepare_append(t, 4 * n)
    m.cache_full_blocks(t.block_ids, list(range(4 * n)), 0, n)
    m.delete_block_table("all")
    assert m.free_blocks == n and int(m.pool.hidx.__ge__(0).sum()) == n


def test_the_c_allocations_evict_cached_free_blocks_as_the_python_path_does():
    a = shmcache.PagedCacheManager(block_size=4, max_blocks=16)
    b = python_only(shmcache.PagedCacheManager(block_size=4, max_blocks=16))
    calls = {"alloc": 0, "append": 0}
    try:
        b.internals.ledger.root = a.internals.ledger.root                        # same chain hashes in both
        for m in (a, b):
            _all_cached_and_free(m)
        a.pool.ops = NativeOps(_Counted(a.pool.native, calls), a.pool.c, a.pool.t_claim)
        ev = int(a.pool.c[L.C_EVICTIONS])
        got = [[x.block_id for x in m.get_new_blocks(3)] for m in (a, b)]
        assert got[0] == got[1] and calls["alloc"] == 1
        assert int(a.pool.c[L.C_EVICTIONS]) == ev + 3
        assert all(a.internals.ledger.index.hash_of(x) is None for x in got[0])
        for m in (a, b):
            u = m.create_block_table("u")
            m.prepare_append(u, 9)               # three blocks, each evicted
        assert calls["append"] == 1 and int(a.pool.c[L.C_EVICTIONS]) == ev + 6
        assert _shared_state(a) == _shared_state(b)
        # the rest stays cached and found, past the evicted first blocks
        for m in (a, b):
            left = [x for x in range(1, 16) if m.internals.ledger.index.hash_of(x) is not None]
            assert len(left) == 9
            m.free_block_batch(got[0])
            m.delete_block_table("u")
            assert m.check() == []
        assert _shared_state(a) == _shared_state(b)
    finally:
        a.close()
        b.close()
