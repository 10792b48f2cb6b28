"""The seed's fixed bugs, one test per fix (``test_fix_*``), with the
behaviour around them: prefix caching, copy-on-write, eviction order."""

from __future__ import annotations

import numpy as np
import pytest

import shmcache
from shmcache.manager import paged_cache as pc

from _helpers import cached_table, kv_data, payload, toks
from _helpers import kvpool as kvpool, pair as pair  # pytest fixtures

# ====================================================================== seed fixes
def test_fix_free_block_batch_reachable_and_free_blocks_property(manager):
    assert isinstance(type(manager).__dict__["free_blocks"], property)
    blocks = manager.get_new_blocks(4)
    assert manager.free_blocks == 27
    manager.free_block_batch(blocks[:3])
    assert manager.free_blocks == 30
    assert [b.ref_count for b in blocks] == [0, 0, 0, 1]
    manager.free_block_batch([blocks[3].block_id])        # ids work too
    assert manager.free_blocks == 31
    manager.free_block_batch([])
    assert manager.check() == []


def test_fix_free_block_batch_frees_in_order(manager):
    blocks = manager.get_new_blocks(3)
    manager.cache_full_blocks(blocks, toks(12), 0, 3)
    manager.free_block_batch([blocks[2], blocks[0], blocks[1]])
    assert manager.free_block_queue.ids()[-3:] == [blocks[2].block_id, blocks[0].block_id,
                                                   blocks[1].block_id]


def test_fix_tail_first_free(manager):
    t, ids, _ = cached_table(manager, "chain", 4)
    manager.delete_block_table("chain")
    q = manager.free_block_queue.ids()
    assert q[-4:] == ids[::-1]


def test_fix_find_shared_prefix_matches_whole_chains_only(manager):
    a, b, c = toks(4, 100), toks(4, 200), toks(4, 300)
    t = manager.create_block_table("ab")
    blocks = manager.get_new_blocks(2)
    for x in blocks:
        manager.add_block_to_table(t, x, 4)
    manager.cache_full_blocks(blocks, a + b, 0, 2)
    ids = [x.block_id for x in blocks]
    assert manager.find_shared_prefix(a + b + [1]) == (ids, [1])
    # b's tokens at position 0 (no parent) must not match the block cached after a
    assert manager.find_shared_prefix(b) == ([], b)
    assert manager.find_cached_block(b) is None
    assert manager.get_computed_blocks(b) == ([], 0)
    # ... nor after a different prefix
    t2 = manager.create_block_table("c")
    cb = manager.allocate_block()
    manager.add_block_to_table(t2, cb, 4)
    manager.cache_full_blocks([cb], c, 0, 1)
    assert manager.find_shared_prefix(c + b) == ([cb.block_id], b)
    got, n = manager.get_computed_blocks(c + b)
    assert [x.block_id for x in got] == [cb.block_id] and n == 4
    assert manager.find_cached_block(a + b).block_id == ids[1]
    assert manager.find_cached_block(a).block_id == ids[0]


def test_fix_register_block_hash_is_a_chain(manager):
    x = manager.allocate_block()
    manager.register_block_hash(x, toks(8))          # last block of the prefix 0..7
    assert manager.find_cached_block(toks(8)) == x
    assert manager.find_cached_block(toks(4, 4)) is None
    assert manager.check() == []


def test_fix_acquire_computed_blocks_takes_refs_atomically(make_pool):
    m = make_pool(block_size=4, max_blocks=8)
    t, ids, tokens = cached_table(m, "r", 3)
    m.delete_block_table("r")
    assert [m.blocks[i].ref_count for i in ids] == [0, 0, 0]
    hits = m.stats.cache_hits
    got, n = m.acquire_computed_blocks(tokens + [7])
    assert [b.block_id for b in got] == ids and n == 12
    assert [b.ref_count for b in got] == [1, 1, 1]
    assert m.stats.cache_hits == hits + 3
    assert not set(ids) & set(m.free_block_queue.ids())
    # not evictable: allocating everything else never takes them
    rest = m.get_new_blocks(m.free_blocks)
    assert not {b.block_id for b in rest} & set(ids)
    assert m.allocate_block() is None
    assert all(m.blocks[i].block_hash is not None for i in ids)
    # another manager sees them referenced and can share them
    other = shmcache.attach(m.name)
    try:
        og, on = other.acquire_computed_blocks(tokens)
        assert [b.block_id for b in og] == ids and [b.ref_count for b in og] == [2, 2, 2]
    finally:
        other.close()
    assert [m.blocks[i].ref_count for i in ids] == [1, 1, 1]
    # and they can go straight into a table
    t = m.create_block_table("again")
    for b in got:
        m.add_block_to_table(t, b, 4)
    assert t.block_ids == ids and m.check() == []


def test_get_computed_blocks_takes_no_reference(manager):
    t, ids, tokens = cached_table(manager, "r", 2)
    manager.delete_block_table("r")
    got, n = manager.get_computed_blocks(tokens)
    assert [b.block_id for b in got] == ids and n == 8
    assert [b.ref_count for b in got] == [0, 0]


def test_acquire_with_caching_disabled(make_pool):
    m = make_pool(enable_caching=False)
    b = m.allocate_block()
    m.cache_full_blocks([b], toks(4), 0, 1)
    assert b.block_hash is None
    assert m.acquire_computed_blocks(toks(4)) == ([], 0)
    assert m.get_computed_blocks(toks(4)) == ([], 0)
    assert m.find_shared_prefix(toks(6)) == ([], toks(6))
    assert m.get_cached_block(pc.BlockHash(b"x" * 16)) is None
    with pytest.raises(TypeError):
        m.acquire_computed_blocks(["x"])
    assert m.check() == []


def _prefill(m, rid, n_tokens, seed):
    """A table with n_tokens, K/V written per block; returns table and ids."""
    t = m.create_block_table(rid)
    blocks = m.prepare_append(t, n_tokens)
    for i, b in enumerate(blocks):
        for layer in range(m.layout.num_layers):
            k = kv_data(m, seed * 100 + i * 10 + layer)
            m.write_kv(b.block_id, layer, k, k * -1)
    return t, [b.block_id for b in blocks]


def test_fix_cow_copies_payload_bytes_and_only_the_last_block(kvpool):
    m = kvpool
    t, ids = _prefill(m, "orig", 6, seed=1)            # one full block + 2 tokens
    orig_payload = {b: payload(m, b) for b in ids}
    f = m.fork_block_table(t, "fork")
    assert [m.blocks[i].ref_count for i in ids] == [2, 2]
    out = m.prepare_append(f, 1)
    assert len(out) == 1
    copy = out[0].block_id
    assert copy not in ids
    assert f.block_ids == [ids[0], copy]               # the full block stays shared
    assert t.block_ids == ids
    assert m.blocks[ids[0]].ref_count == 2
    assert m.blocks[ids[1]].ref_count == 1 and m.blocks[copy].ref_count == 1
    assert payload(m, copy) == orig_payload[ids[1]]     # the bytes were copied
    assert m.blocks[copy].token_count == 3 and m.blocks[ids[1]].token_count == 2
    assert f.num_tokens == 7 and t.num_tokens == 6
    assert m.get_stats().cow_copies == 1
    # writing into the copy leaves the original alone
    m.write_kv(copy, 0, kv_data(m, 999, 1), kv_data(m, 998, 1), start=2)
    assert payload(m, ids[1]) == orig_payload[ids[1]]
    assert payload(m, copy) != orig_payload[ids[1]]
    assert payload(m, ids[0]) == orig_payload[ids[0]]
    k, _ = m.read_kv(f.block_ids, 0)
    ko, _ = m.read_kv(t.block_ids, 0)
    assert np.array_equal(np.array(k)[:, :6], np.array(ko)[:, :6])
    # the next step appends to the now private copy: no more copies
    assert m.prepare_append(f, 1)[0].block_id == copy
    assert m.get_stats().cow_copies == 1
    assert m.check() == []


def test_cow_not_needed_when_last_block_full(kvpool):
    m = kvpool
    t, ids = _prefill(m, "orig", 8, seed=2)
    f = m.fork_block_table(t, "fork")
    out = m.prepare_append(f, 1)
    assert len(out) == 1 and out[0].block_id not in ids
    assert f.block_ids == ids + [out[0].block_id]
    assert [m.blocks[i].ref_count for i in ids] == [2, 2]
    assert m.get_stats().cow_copies == 0


def test_cow_not_done_for_unshared_last_block(kvpool):
    m = kvpool
    t, ids = _prefill(m, "orig", 6, seed=3)
    assert [b.block_id for b in m.prepare_append(t, 1)] == [ids[1]]
    assert m.get_stats().cow_copies == 0


def test_get_blocks_for_generation_copies_every_shared_block_as_the_seed(kvpool):
    """The seed's method keeps the seed's behaviour: every shared block of
    the table is copied (payload bytes and token count; the copy replaces
    it in this table only). prepare_append is the path that copies only
    the partly filled block."""
    m = kvpool
    t, ids = _prefill(m, "orig", 10, seed=4)           # 2 full + 2 tokens
    before = [payload(m, b) for b in ids]
    f = m.fork_block_table(t, "fork")
    blocks, copied = m.get_blocks_for_generation(f)
    assert copied is True
    got = [b.block_id for b in blocks]
    assert not set(got) & set(ids) and len(set(got)) == 3
    assert f.block_ids == got and t.block_ids == ids
    assert [payload(m, b) for b in got] == before      # bytes, not references
    assert [m.blocks[b].token_count for b in got] == [4, 4, 2]
    assert [m.blocks[i].ref_count for i in ids] == [1, 1, 1]
    assert [m.blocks[i].ref_count for i in got] == [1, 1, 1]
    assert m.get_stats().cow_copies == 3
    blocks, copied = m.get_blocks_for_generation(f)    # nothing shared any more
    assert copied is False and [b.block_id for b in blocks] == got
    # no free block left for a copy: the shared block stays
    t2, ids2 = _prefill(m, "full", 4, seed=5)
    f2 = m.fork_block_table(t2, "full-fork")
    rest = m.get_new_blocks(m.free_blocks)
    blocks, copied = m.get_blocks_for_generation(f2)
    assert copied is False and [b.block_id for b in blocks] == ids2
    m.free_block_batch(rest)
    assert m.check() == []


def test_prepare_append_copies_only_the_last_partial_block(kvpool):
    m = kvpool
    t, ids = _prefill(m, "orig", 10, seed=4)
    f = m.fork_block_table(t, "fork")
    got = m.prepare_append(f, 1)
    assert len(got) == 1 and got[0].block_id not in ids
    assert f.block_ids == ids[:2] + [got[0].block_id]
    assert [m.blocks[i].ref_count for i in ids] == [2, 2, 1]
    assert m.get_stats().cow_copies == 1


def test_fix_cow_copy_block_copies_payload(kvpool):
    m = kvpool
    src = m.allocate_block()
    m.write_kv(src.block_id, 1, kv_data(m, 1), kv_data(m, 2))
    src.token_count = 3
    new = m._cow_copy_block(src)
    assert new.block_id != src.block_id and new.ref_count == 1
    assert payload(m, new.block_id) == payload(m, src.block_id)
    assert new.token_count == 3
    m.write_kv(new.block_id, 1, kv_data(m, 3), kv_data(m, 4))
    assert payload(m, new.block_id) != payload(m, src.block_id)
    k, _ = m.read_kv([src.block_id], 1)
    assert np.array_equal(np.array(k), np.array(kv_data(m, 1)))
    assert m.get_stats().cow_copies == 1


def test_fix_evict_lru_blocks_keeps_order(manager):
    cached_table(manager, "a", 3)
    manager.delete_block_table("a")
    before = manager.free_block_queue.ids()
    # the seed's return value: the free blocks looked at, min(n, free)
    assert manager.evict_lru_blocks(50) == manager.free_blocks == 31
    assert manager.free_block_queue.ids() == before
    assert len(manager.hash_to_block) == 0
    assert manager.get_stats().evictions == 3


def test_fix_extra_keys_never_share_blocks(manager):
    tokens = toks(8)
    ta, ida, _ = cached_table(manager, "a", 2, extra_keys=("tenant-a",))
    assert manager.get_computed_blocks(tokens) == ([], 0)
    assert manager.get_computed_blocks(tokens, extra_keys=("tenant-b",)) == ([], 0)
    assert manager.acquire_computed_blocks(tokens, extra_keys=("tenant-b",)) == ([], 0)
    got, n = manager.get_computed_blocks(tokens, extra_keys=("tenant-a",))
    assert [b.block_id for b in got] == ida and n == 8
    tb, idb, _ = cached_table(manager, "b", 2, extra_keys=("tenant-b",))
    assert set(ida).isdisjoint(idb)
    assert {manager.blocks[i].block_hash for i in ida}.isdisjoint(
        {manager.blocks[i].block_hash for i in idb})
    got, _ = manager.acquire_computed_blocks(tokens, extra_keys=("tenant-b",))
    assert [b.block_id for b in got] == idb
    lora1 = cached_table(manager, "l1", 1, extra_keys=("lora", 1))[1]
    assert manager.get_computed_blocks(toks(4), extra_keys=("lora", 2)) == ([], 0)
    assert manager.get_computed_blocks(toks(4), extra_keys=("lora", 1))[0][0].block_id == lora1[0]
    assert manager.check() == []


def test_fix_per_pool_random_seed(make_pool):
    m1, m2 = make_pool(), make_pool()
    _, i1, tokens = cached_table(m1, "r", 2)
    _, i2, _ = cached_table(m2, "r", 2)
    h1 = [m1.blocks[i].block_hash for i in i1]
    h2 = [m2.blocks[i].block_hash for i in i2]
    assert h1[0] != h2[0] and h1[1] != h2[1]
    assert h1[0] != pc.compute_block_hash(None, tokens[:4])
    assert set(m1.hash_to_block).isdisjoint(m2.hash_to_block)
    assert m2.get_cached_block(h1[0]) is None
    # the seed is the pool's, so an attached manager hashes the same way
    other = shmcache.attach(m1.name)
    try:
        got, _ = other.get_computed_blocks(tokens)
        assert [b.block_id for b in got] == i1
    finally:
        other.close()


def test_get_cached_block_counts_hits_and_misses(manager):
    t, ids, _ = cached_table(manager, "r", 1)
    h = manager.blocks[ids[0]].block_hash
    assert manager.get_cached_block(h).block_id == ids[0]
    assert manager.get_cached_block(pc.BlockHash(b"\x01" * 16)) is None
    s = manager.get_stats()
    assert (s.cache_hits, s.cache_misses) == (1, 1)


def test_cache_full_blocks_incremental(manager):
    t = manager.create_block_table("r")
    tokens = toks(12)
    blocks = manager.prepare_append(t, 8)
    manager.cache_full_blocks(blocks, tokens, 0, 2)
    blocks += manager.prepare_append(t, 4)
    manager.cache_full_blocks(blocks, tokens, 2, 3)
    got, n = manager.get_computed_blocks(tokens)
    assert [b.block_id for b in got] == t.block_ids and n == 12
    # same result as caching all three at once in another pool's terms:
    manager.delete_block_table("r")
    got2, _ = manager.acquire_computed_blocks(tokens)
    assert [b.block_id for b in got2] == [b.block_id for b in got]


def test_reset_prefix_cache_and_clear(pair):
    m, other = pair
    t, ids, tokens = cached_table(m, "r", 2)
    assert m.reset_prefix_cache() is False               # blocks in use
    assert len(m.hash_to_block) == 2
    m.delete_block_table("r")
    assert m.reset_prefix_cache() is True
    assert len(m.hash_to_block) == 0 and m.get_computed_blocks(tokens)[0] == []
    cached_table(m, "r2", 2)
    other.get_new_blocks(3)
    other.create_block_table("o")
    m.clear()
    assert m.free_blocks == 31 and len(m.request_tables) == 0
    assert len(m.hash_to_block) == 0 and m.check() == []
    # the other manager notices its holdings are gone
    assert other.free_blocks == 31
    b = other.allocate_block()
    assert other.free_block(b.block_id) is True
    assert other.check() == []
