"""The seed's plain value types (shmcache.shm.blocks), used without a pool."""

from __future__ import annotations

import time

import pytest

from shmcache.manager import paged_cache as pc
from shmcache.shm.blocks import (BlockHashToBlockMap, BlockTable, CacheBlock, CacheStats,
                             FreeKVCacheBlockQueue, KVCacheBlock, compute_block_hash)


def make_queue(n: int):
    blocks = [CacheBlock(block_id=i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def ids(blocks) -> list:
    return [b.block_id for b in blocks]


def walk_both_ways(q: FreeKVCacheBlockQueue) -> list:
    """Walk head->tail and tail->head; assert they mirror each other."""
    fwd, cur = [], q.fake_head.next_free_block
    while cur is not q.fake_tail:
        assert cur is not None
        fwd.append(cur.block_id)
        cur = cur.next_free_block
    back, cur = [], q.fake_tail.prev_free_block
    while cur is not q.fake_head:
        assert cur is not None
        back.append(cur.block_id)
        cur = cur.prev_free_block
    assert fwd == back[::-1]
    assert len(fwd) == q.num_free_blocks
    return fwd


# ------------------------------------------------------------------ CacheBlock
def test_cache_block_defaults_and_alias():
    b = CacheBlock(block_id=3)
    assert (b.block_id, b.ref_count, b.block_hash, b.token_count) == (3, 0, None, 0)
    assert b.prev_free_block is None and b.next_free_block is None
    assert b.is_null is False and b.cache_data is None and b.hash_value is None
    assert abs(b.last_access - time.time()) < 60
    assert KVCacheBlock is CacheBlock
    assert pc.KVCacheBlock is pc.CacheBlock


def test_cache_block_is_full():
    b = CacheBlock(block_id=1, token_count=3)
    assert not b.is_full(4)
    b.token_count = 4
    assert b.is_full(4)
    assert b.is_full(2)


def test_cache_block_is_shared():
    b = CacheBlock(block_id=1)
    assert not b.is_shared()
    b.ref_count = 1
    assert not b.is_shared()
    b.ref_count = 2
    assert b.is_shared()


def test_cache_block_touch_moves_last_access_forward():
    b = CacheBlock(block_id=1, last_access=0.0)
    b.touch()
    assert b.last_access > 0.0
    assert abs(b.last_access - time.time()) < 60


def test_cache_block_reset_hash():
    b = CacheBlock(block_id=1, block_hash=pc.BlockHash(b"x" * 16), hash_value="abc")
    b.reset_hash()
    assert b.block_hash is None and b.hash_value is None


def test_cache_block_repr_names_neighbours():
    a, b = CacheBlock(block_id=1), CacheBlock(block_id=2)
    a.next_free_block = b
    r = repr(a)
    assert "id=1" in r and "next=2" in r and "prev=None" in r


# ------------------------------------------------------- FreeKVCacheBlockQueue
def test_queue_initial_order_and_sentinels():
    blocks, q = make_queue(5)
    assert q.num_free_blocks == 5
    assert walk_both_ways(q) == [0, 1, 2, 3, 4]
    assert q.fake_head.block_id == -1 and q.fake_tail.block_id == -2
    assert blocks[0].prev_free_block is q.fake_head
    assert blocks[-1].next_free_block is q.fake_tail


def test_queue_empty():
    _, q = make_queue(0)
    assert q.num_free_blocks == 0
    assert q.get_all_free_blocks() == []
    assert q.fake_head.next_free_block is q.fake_tail
    with pytest.raises(ValueError):
        q.popleft()
    assert q.popleft_n(0) == []


def test_queue_popleft_is_fifo_and_clears_links():
    blocks, q = make_queue(3)
    b = q.popleft()
    assert b is blocks[0]
    assert b.prev_free_block is None and b.next_free_block is None
    assert walk_both_ways(q) == [1, 2]
    assert q.popleft() is blocks[1]
    assert q.popleft() is blocks[2]
    assert q.num_free_blocks == 0
    with pytest.raises(ValueError):
        q.popleft()
    # sentinels survive emptying: head and tail point at each other again
    assert q.fake_head.next_free_block is q.fake_tail
    assert q.fake_tail.prev_free_block is q.fake_head


def test_queue_popleft_n():
    blocks, q = make_queue(5)
    got = q.popleft_n(3)
    assert ids(got) == [0, 1, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in got)
    assert walk_both_ways(q) == [3, 4]
    with pytest.raises(AssertionError):
        q.popleft_n(3)
    assert walk_both_ways(q) == [3, 4]  # unchanged by the failed call


def test_queue_remove_middle_and_ends():
    blocks, q = make_queue(5)
    q.remove(blocks[2])
    assert walk_both_ways(q) == [0, 1, 3, 4]
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert walk_both_ways(q) == [1, 3]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None


def test_queue_remove_not_in_queue_raises():
    blocks, q = make_queue(3)
    q.remove(blocks[1])
    with pytest.raises(RuntimeError):
        q.remove(blocks[1])
    with pytest.raises(RuntimeError):
        q.remove(CacheBlock(block_id=99))
    assert walk_both_ways(q) == [0, 2]


def test_queue_append_goes_to_mru_end():
    blocks, q = make_queue(3)
    b = q.popleft()
    q.append(b)
    assert walk_both_ways(q) == [1, 2, 0]
    new = CacheBlock(block_id=7)
    q.append(new)
    assert walk_both_ways(q) == [1, 2, 0, 7]
    assert new.next_free_block is q.fake_tail


def test_queue_append_n_keeps_order():
    blocks, q = make_queue(2)
    extra = [CacheBlock(block_id=i) for i in (10, 11, 12)]
    q.append_n(extra)
    assert walk_both_ways(q) == [0, 1, 10, 11, 12]
    q.append_n([])
    assert q.num_free_blocks == 5


def test_queue_get_all_free_blocks_returns_objects():
    blocks, q = make_queue(4)
    q.remove(blocks[1])
    got = q.get_all_free_blocks()
    assert got == [blocks[0], blocks[2], blocks[3]]
    assert all(g is b for g, b in zip(got, [blocks[0], blocks[2], blocks[3]]))


# --------------------------------------------------------- BlockHashToBlockMap
def test_hash_map_several_blocks_per_hash():
    m = BlockHashToBlockMap()
    h, h2 = pc.BlockHash(b"a" * 16), pc.BlockHash(b"b" * 16)
    b1, b2, b3 = CacheBlock(block_id=1), CacheBlock(block_id=2), CacheBlock(block_id=3)
    assert m.get_block(h) is None
    m.insert(h, b1)
    m.insert(h, b2)
    m.insert(h2, b3)
    assert len(m) == 2            # number of distinct hashes
    assert m.get_block(h) in (b1, b2)
    assert m.get_block(h2) is b3
    # popping one of two keeps the other findable
    assert m.pop(h, 1) is b1
    assert m.get_block(h) is b2
    assert len(m) == 2
    assert m.pop(h, 2) is b2
    assert m.get_block(h) is None
    assert len(m) == 1


def test_hash_map_pop_wrong_id_or_hash():
    m = BlockHashToBlockMap()
    h = pc.BlockHash(b"a" * 16)
    b1 = CacheBlock(block_id=1)
    m.insert(h, b1)
    assert m.pop(h, 99) is None
    assert m.get_block(h) is b1      # the wrong id removed nothing
    assert m.pop(pc.BlockHash(b"z" * 16), 1) is None
    assert len(m) == 1


def test_hash_map_clear():
    m = BlockHashToBlockMap()
    m.insert(pc.BlockHash(b"a" * 16), CacheBlock(block_id=1))
    m.clear()
    assert len(m) == 0 and m.get_block(pc.BlockHash(b"a" * 16)) is None


# ------------------------------------------------------------------ BlockTable
def test_block_table_add_len_copy():
    t = BlockTable("r1")
    assert len(t) == 0 and t.num_tokens == 0 and t.block_ids == []
    t.add_block(5, 4)
    t.add_block(7, 2)
    assert len(t) == 2 and t.block_ids == [5, 7] and t.num_tokens == 6
    c = t.copy("r2")
    assert c.request_id == "r2" and c.block_ids == [5, 7] and c.num_tokens == 6
    c.add_block(9, 1)
    assert t.block_ids == [5, 7] and t.num_tokens == 6   # the copy is independent
    assert BlockTable("a").block_ids is not BlockTable("b").block_ids


def test_cache_stats_defaults():
    s = CacheStats()
    assert (s.total_blocks, s.allocated_blocks, s.free_blocks, s.shared_blocks,
            s.total_tokens_cached, s.cache_hits, s.cache_misses, s.cow_copies,
            s.evictions) == (0,) * 9


# ----------------------------------------------------------- compute_block_hash
def test_compute_block_hash_deterministic_and_bytes():
    h = compute_block_hash(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 16
    assert h == compute_block_hash(None, [1, 2, 3, 4])
    assert h != compute_block_hash(None, [1, 2, 3, 5])
    assert h != compute_block_hash(None, [4, 3, 2, 1])


def test_compute_block_hash_chain_parent_changes_hash():
    p1 = compute_block_hash(None, [1, 2, 3, 4])
    p2 = compute_block_hash(None, [9, 9, 9, 9])
    c1 = compute_block_hash(p1, [5, 6, 7, 8])
    c2 = compute_block_hash(p2, [5, 6, 7, 8])
    assert c1 != c2
    assert c1 != compute_block_hash(None, [5, 6, 7, 8])
    assert c1 == compute_block_hash(p1, [5, 6, 7, 8])


def test_compute_block_hash_extra_keys():
    base = compute_block_hash(None, [1, 2, 3, 4])
    a = compute_block_hash(None, [1, 2, 3, 4], ("tenant-a",))
    b = compute_block_hash(None, [1, 2, 3, 4], ("tenant-b",))
    assert len({base, a, b}) == 3
    assert a == compute_block_hash(None, [1, 2, 3, 4], ("tenant-a",))
    assert compute_block_hash(None, [1, 2, 3, 4], ("lora", 1)) != \
        compute_block_hash(None, [1, 2, 3, 4], ("lora", 2))
    # empty extra keys are the same as none
    assert compute_block_hash(None, [1, 2, 3, 4], ()) == base


@pytest.mark.parametrize("bad", [[1, "a"], [1.5, 2], [None], [1, [2]], [True, False]])
def test_compute_block_hash_non_int_tokens_raise_type_error(bad):
    with pytest.raises(TypeError):
        compute_block_hash(None, bad)


@pytest.mark.parametrize("bad", [[-1], [1, 2, -5], [2**32]])
def test_compute_block_hash_out_of_range_tokens_raise_value_error(bad):
    with pytest.raises(ValueError):
        compute_block_hash(None, bad)


def test_compute_block_hash_exported_from_paged_cache():
    assert pc.compute_block_hash is compute_block_hash
    assert pc.compute_block_hash(None, []) == compute_block_hash(None, [])
