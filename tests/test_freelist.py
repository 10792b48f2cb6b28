"""The manager's shared free queue (shmcache.shm.freelist): links, order, eviction."""

from __future__ import annotations

import random

import pytest

from shmcache.shm import layout as L
from shmcache.errors import OutOfBlocksError


def walk(mgr) -> list:
    """Every link from HEAD to TAIL and back; prev must mirror next."""
    p = mgr.pool
    head, tail = mgr.max_blocks, mgr.max_blocks + 1
    assert (p.HEAD, p.TAIL) == (head, tail)
    assert p.b_prev[head] == -1 and p.b_next[tail] == -1
    fwd, cur, prev = [], p.b_next[head], head
    while cur != tail:
        assert 0 < cur < mgr.max_blocks, f"link to {cur} after {prev}"
        assert p.b_prev[cur] == prev, f"block {cur}.prev={p.b_prev[cur]}, want {prev}"
        assert cur not in fwd, "cycle in free list"
        fwd.append(cur)
        prev, cur = cur, p.b_next[cur]
    assert p.b_prev[tail] == prev
    back, cur = [], p.b_prev[tail]
    while cur != head:
        back.append(cur)
        cur = p.b_prev[cur]
        assert len(back) <= mgr.max_blocks
    assert back[::-1] == fwd
    assert len(fwd) == mgr.free_blocks == mgr.free_block_queue.num_free_blocks
    # in the list <=> ref_count 0, never the null block; out of the list: no links
    for b in range(mgr.max_blocks):
        if b in fwd:
            assert p.b_ref[b] == 0
        else:
            assert p.b_ref[b] > 0
            # (or its allocator's mark: layout.held_mark, a loose reference)
            assert p.b_prev[b] in (-1, L.held_mark(p.slot, p.layout.max_slots))
            assert p.b_next[b] == -1
    assert 0 not in fwd
    assert mgr.free_block_queue.ids() == fwd
    return fwd


def toks(n: int, base: int = 0) -> list:
    return list(range(base, base + n))


def cached_table(mgr, rid: str, n_blocks: int, base: int = 0):
    """A table of n full, cached blocks; returns (table, block ids, tokens)."""
    t = mgr.create_block_table(rid)
    blocks = mgr.get_new_blocks(n_blocks)
    tokens = toks(n_blocks * mgr.block_size, base)
    for b in blocks:
        mgr.add_block_to_table(t, b, mgr.block_size)
    mgr.cache_full_blocks(blocks, tokens, 0, n_blocks)
    return t, [b.block_id for b in blocks], tokens


def test_initial_queue_is_every_block_but_null(manager):
    assert walk(manager) == list(range(1, 32))
    assert manager.free_blocks == 31


def test_links_after_random_allocate_free(manager):
    rng = random.Random(7)
    held = []
    for step in range(300):
        r = rng.random()
        if r < 0.45 and manager.free_blocks:
            held.append(manager.allocate_block().block_id)
        elif r < 0.6 and manager.free_blocks >= 3:
            held.extend(b.block_id for b in manager.get_new_blocks(3))
        elif r < 0.8 and held:
            b = held.pop(rng.randrange(len(held)))
            assert manager.free_block(b) is True
        elif held:
            k = rng.randint(1, len(held))
            rng.shuffle(held)
            batch, held = held[:k], held[k:]
            manager.free_block_batch(batch)
        if step % 10 == 0:
            assert len(walk(manager)) == 31 - len(held)
    assert len(walk(manager)) == 31 - len(held)
    assert manager.check() == []


def test_links_after_tables_forks_cow_and_acquire(manager):
    rng = random.Random(3)
    for i in range(25):
        t, ids, tokens = cached_table(manager, f"r{i}", rng.randint(1, 3), base=rng.randint(0, 3) * 100)
        manager.prepare_append(t, rng.randint(0, 6))
        if rng.random() < 0.5:
            f = manager.fork_block_table(t, f"f{i}")
            manager.prepare_append(f, 1)
            walk(manager)
            manager.delete_block_table(f.request_id)
        got, _ = manager.acquire_computed_blocks(tokens)
        walk(manager)
        manager.free_block_batch(got)
        manager.delete_block_table(t.request_id)
        walk(manager)
    assert len(walk(manager)) == 31
    assert manager.check() == []


def test_freed_uncached_blocks_are_reused_before_cached(manager):
    t, ids, _ = cached_table(manager, "r", 1)
    plain = manager.allocate_block().block_id
    manager.delete_block_table("r")          # cached block -> MRU end
    assert manager.free_block(plain)          # uncached block -> front
    q = walk(manager)
    assert q[0] == plain and q[-1] == ids[0]
    # the uncached one comes back first; the cached one survives until
    # every other block is taken
    assert manager.allocate_block().block_id == plain
    order = [manager.allocate_block().block_id for _ in range(manager.free_blocks)]
    assert order[-1] == ids[0]
    assert manager.allocate_block() is None


def test_freeing_uncached_after_cached_still_goes_first(manager):
    a = manager.allocate_block()
    b = manager.allocate_block()
    manager.cache_full_blocks([a], toks(4), 0, 1)
    manager.free_block(a.block_id)
    manager.free_block(b.block_id)
    q = walk(manager)
    assert q[0] == b.block_id and q[-1] == a.block_id


def test_deleted_table_frees_tail_first(manager):
    t, ids, tokens = cached_table(manager, "chain", 3)
    manager.delete_block_table("chain")
    q = walk(manager)
    # the chain's last block is nearest the eviction end, its first block last
    assert q[-3:] == [ids[2], ids[1], ids[0]]
    assert q.index(ids[2]) < q.index(ids[1]) < q.index(ids[0])


def test_tail_first_eviction_keeps_the_prefix_usable(make_pool):
    m = make_pool(block_size=4, max_blocks=8)     # 7 usable blocks
    t, ids, tokens = cached_table(m, "chain", 3)
    m.delete_block_table("chain")
    others = m.get_new_blocks(4)                  # every never-cached block
    assert {b.block_id for b in others}.isdisjoint(ids)
    # the next allocation evicts the chain's LAST block, not its first
    b = m.allocate_block()
    assert b.block_id == ids[2]
    got, n = m.get_computed_blocks(tokens)
    assert [x.block_id for x in got] == ids[:2] and n == 8
    assert m.get_stats().evictions == 1
    assert m.check() == []


def test_table_of_uncached_blocks_goes_to_front(manager):
    t = manager.create_block_table("r")
    blocks = manager.get_new_blocks(3)
    for b in blocks:
        manager.add_block_to_table(t, b, 2)
    manager.delete_block_table("r")
    q = walk(manager)
    assert set(q[:3]) == {b.block_id for b in blocks}


def test_evict_lru_blocks_does_not_reorder(manager):
    t1, ids1, tok1 = cached_table(manager, "a", 2)
    t2, ids2, tok2 = cached_table(manager, "b", 2, base=500)
    manager.delete_block_table("a")
    manager.delete_block_table("b")
    before = manager.free_block_queue.ids()
    manager.evict_lru_blocks(100)
    assert manager.free_block_queue.ids() == before
    walk(manager)
    for b in ids1 + ids2:
        assert manager.blocks[b].block_hash is None
    assert manager.get_computed_blocks(tok1) == ([], 0)
    assert manager.check() == []


def test_evict_lru_blocks_drops_only_the_lru_blocks(make_pool):
    m = make_pool(block_size=4, max_blocks=8)     # 7 usable blocks
    t, ids, tokens = cached_table(m, "c", 3)
    m.get_new_blocks(4)
    m.delete_block_table("c")
    q = walk(m)
    assert q == [ids[2], ids[1], ids[0]]
    assert m.evict_lru_blocks(1) == 1              # (the seed's count: blocks looked at)
    assert m.free_block_queue.ids() == q
    assert m.blocks[ids[2]].block_hash is None
    assert m.blocks[ids[1]].block_hash is not None
    assert m.blocks[ids[0]].block_hash is not None
    assert m.get_stats().evictions == 1
    assert m.evict_lru_blocks(2) == 2              # the 2 LRU: ids[2] (done), ids[1]
    assert m.blocks[ids[1]].block_hash is None
    assert m.blocks[ids[0]].block_hash is not None
    assert m.free_block_queue.ids() == q
    assert m.check() == []


def test_evict_lru_blocks_looks_only_at_the_lru_blocks(make_pool):
    m = make_pool(block_size=4, max_blocks=8)
    t, ids, tokens = cached_table(m, "c", 3)
    held = m.get_new_blocks(4)
    m.delete_block_table("c")
    m.free_block(held[0].block_id)                  # uncached: the LRU end
    q = walk(m)
    assert q == [held[0].block_id, ids[2], ids[1], ids[0]]
    # the least recently used block has no cache entry: nothing is dropped
    # (the seed counts the block looked at all the same)
    assert m.evict_lru_blocks(1) == 1
    assert all(m.blocks[b].block_hash is not None for b in ids)
    assert m.get_computed_blocks(tokens)[1] == 12
    assert m.free_block_queue.ids() == q
    assert m.get_stats().evictions == 0
    assert m.check() == []


def test_evict_lru_blocks_zero_and_bad(manager):
    cached_table(manager, "a", 2)
    manager.delete_block_table("a")
    before = manager.free_block_queue.ids()
    assert manager.evict_lru_blocks(0) == 0
    with pytest.raises(ValueError):
        manager.evict_lru_blocks(-1)
    with pytest.raises(ValueError):
        manager.evict_lru_blocks(1.5)
    assert manager.free_block_queue.ids() == before
    assert len(manager.hash_to_block) == 2


def test_ids_limit(manager):
    q = manager.free_block_queue
    assert q.ids(limit=3) == [1, 2, 3]
    assert q.ids(limit=0) == []
    assert q.ids() == list(range(1, 32))


def test_touch_of_free_cached_block_unlinks_it(manager):
    t, ids, tokens = cached_table(manager, "a", 3)
    manager.delete_block_table("a")
    manager.touch([manager.blocks[ids[1]]])
    q = walk(manager)
    assert ids[1] not in q and ids[0] in q and ids[2] in q
    assert manager.blocks[ids[1]].ref_count == 1
    manager.free_block(ids[1])
    assert walk(manager)[-1] == ids[1]   # cached: back at the MRU end


def test_seed_queue_api_on_manager_queue(manager):
    q = manager.free_block_queue
    assert q.num_free_blocks == 31
    views = q.get_all_free_blocks()
    assert [v.block_id for v in views] == list(range(1, 32))
    assert views[0].prev_free_block.block_id == -1      # head sentinel
    assert views[-1].next_free_block.block_id == -2     # tail sentinel
    assert views[0].next_free_block.block_id == 2
    b = q.popleft()
    assert b.block_id == 1 and q.num_free_blocks == 30
    assert b.prev_free_block is None and b.next_free_block is None
    q.append(b)
    assert q.ids()[-1] == 1
    two = q.popleft_n(2)
    assert [x.block_id for x in two] == [2, 3]
    q.append_n(two)
    assert q.ids()[-3:] == [1, 2, 3]
    q.remove(manager.blocks[10])
    assert 10 not in q.ids()
    q.append(manager.blocks[10])
    assert q.ids()[-1] == 10
    walk(manager)
    assert manager.check() == []
    held = manager.allocate_block()
    with pytest.raises(RuntimeError):
        q.remove(held)                        # not in the queue
    walk(manager)
    assert manager.check() == []
    with pytest.raises((AssertionError, ValueError)):
        q.popleft_n(32)
    walk(manager)


def test_popleft_on_empty_shared_queue(make_pool):
    m = make_pool(block_size=4, max_blocks=3)
    m.get_new_blocks(2)
    with pytest.raises(ValueError):
        m.free_block_queue.popleft()
    with pytest.raises(OutOfBlocksError):
        m.get_new_blocks(1)
    assert walk(m) == []


def test_check_detects_broken_links(manager):
    manager.get_new_blocks(3)
    p = manager.pool
    saved = p.b_prev[10]
    p.b_prev[10] = 12
    assert any("prev" in s for s in manager.check())
    p.b_prev[10] = saved
    assert manager.check() == []
    saved = p.b_next[10]
    p.b_next[10] = 12                         # skips block 11
    assert manager.check()
    p.b_next[10] = saved
    p.c[L.C_NUM_FREE] += 1
    assert any("num_free_blocks" in s for s in manager.check())
    p.c[L.C_NUM_FREE] -= 1
    assert manager.check() == []
