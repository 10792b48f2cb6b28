"""The seed's container attributes as live views of the pool
(shmcache/manager/seed_views.py): ``blocks`` (BlocksView), ``allocated_blocks``
(AllocatedBlocksView), ``request_tables`` (RequestTablesView),
``hash_to_block`` (LegacyHashView), ``cached_block_hash_to_block``
(SharedHashMap), ``stats`` (SharedStats) and ``free_block_queue``
(SeedFreeQueue). Every one reads shared memory, so what one manager does
another sees at once.

The free queue's seed calls on the shared free list (order, sentinels) are
also in test_freelist.py."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from shmcache.manager import paged_cache as pc
from shmcache.errors import OutOfBlocksError

from _helpers import cached_table, snapshot, toks, unchanged
from _helpers import pair as pair  # pytest fixtures


# ====================================================================== blocks
def test_blocks_view_indexes_like_a_list(manager):
    b = manager.blocks
    assert len(b) == 32
    assert b[5].block_id == 5 and b[-1].block_id == 31 and b[-32].block_id == 0
    assert [x.block_id for x in b[2:5]] == [2, 3, 4]
    assert [x.block_id for x in b[::10]] == [0, 10, 20, 30]
    assert [x.block_id for x in b] == list(range(32))
    for bad in (32, -33, True, "1", 1.0):
        with pytest.raises(IndexError):
            b[bad]


def test_blocks_view_is_live(pair):
    m, other = pair
    view = m.blocks[7]
    assert view.ref_count == 0
    got = other.get_new_blocks(7)
    assert 7 in [x.block_id for x in got] and view.ref_count == 1


# ====================================================================== allocated_blocks
def test_allocated_blocks_view(pair):
    m, other = pair
    a = m.allocated_blocks
    assert isinstance(a, Mapping)
    assert len(a) == 1 and 0 in a and list(a) == [0]
    blocks = other.get_new_blocks(3)
    ids = [b.block_id for b in blocks]
    assert len(a) == 4
    assert all(i in a for i in ids)
    assert set(a) == {0, *ids}
    assert a[ids[0]].block_id == ids[0] and a[ids[0]].ref_count == 1
    assert 20 not in a and -1 not in a and "x" not in a and 999 not in a
    with pytest.raises(KeyError):
        a[20]
    assert a.get(20) is None
    assert set(a.keys()) == set(a)
    assert repr(a).startswith("AllocatedBlocksView({0: ")
    other.free_block_batch(blocks)
    assert len(a) == 1


# ====================================================================== request_tables
def test_request_tables_view(pair):
    m, other = pair
    r = m.request_tables
    assert len(r) == 0 and list(r) == []
    other.create_block_table("a")
    m.create_block_table("b")
    assert len(r) == 2 and set(r) == {"a", "b"}
    assert "a" in r and "zz" not in r and 5 not in r
    assert r["a"].request_id == "a"
    assert isinstance(r["a"], pc.BlockTable)
    with pytest.raises(KeyError):
        r["zz"]
    assert r.get("zz") is None
    m.delete_block_table("a")
    assert set(other.request_tables) == {"b"}


# ====================================================================== hash_to_block
def test_hash_to_block_view(pair):
    m, other = pair
    h = m.hash_to_block
    assert len(h) == 0
    t, ids, tokens = cached_table(other, "r", 2)
    assert len(h) == 2
    keys = list(h)
    assert all(isinstance(k, str) for k in keys)
    assert {h[k] for k in keys} == set(ids)
    assert keys[0] in h and "00" * 16 not in h and "not-hex" not in h and None not in h
    with pytest.raises(KeyError):
        h["00" * 16]
    assert h[other.blocks[ids[1]].block_hash.hex()] == ids[1]
    assert dict(h) == {other.blocks[i].block_hash.hex(): i for i in ids}


def test_hash_to_block_view_with_two_blocks_per_hash(manager):
    cached_table(manager, "a", 1)
    cached_table(manager, "b", 1)      # same tokens, cached again in another block
    assert len(manager.cached_block_hash_to_block) == 1
    h = manager.hash_to_block
    assert len(h) == len(list(h)) == 1
    assert h[list(h)[0]] in manager.request_tables["a"].block_ids + \
        manager.request_tables["b"].block_ids
    assert manager.check() == []


# ====================================================================== cached_block_hash_to_block
def test_cached_block_hash_to_block_map(manager):
    t, ids, tokens = cached_table(manager, "r", 2)
    hm = manager.cached_block_hash_to_block
    h0 = manager.blocks[ids[0]].block_hash
    assert len(hm) == 2
    assert hm.get_block(h0).block_id == ids[0]
    assert hm.pop(h0, ids[1]) is None                 # wrong id: nothing popped
    assert hm.get_block(h0).block_id == ids[0]
    assert hm.pop(h0, ids[0]).block_id == ids[0]
    assert hm.get_block(h0) is None and len(hm) == 1
    hm.insert(h0, manager.blocks[ids[0]])
    assert hm.get_block(h0).block_id == ids[0]
    hm.clear()
    assert len(hm) == 0 and manager.get_computed_blocks(tokens) == ([], 0)
    assert manager.check() == []


def test_hash_map_insert_moves_a_block_to_its_new_hash(pair):
    m, other = pair
    t, ids, tokens = cached_table(m, "r", 2)
    h0, h1 = (m.blocks[i].block_hash for i in ids)
    other.cached_block_hash_to_block.insert(h1, other.blocks[ids[0]])
    hm = m.cached_block_hash_to_block
    assert m.blocks[ids[0]].block_hash == h1 and hm.get_block(h0) is None
    assert hm.get_block(h1).block_id in ids
    assert len(hm) == 1                               # two blocks, one hash
    with pytest.raises(ValueError):
        hm.insert(b"short", m.blocks[ids[1]])
    assert m.check() == []


# ====================================================================== stats
def test_stats_counters_are_shared(pair):
    m, other = pair
    cached_table(m, "r", 2)
    other.get_computed_blocks(toks(8))
    assert m.stats.cache_hits == other.stats.cache_hits == 2
    other.get_computed_blocks(toks(4, base=900))
    assert m.stats.cache_misses == 1
    m.stats.cache_hits = 40
    assert other.stats.cache_hits == 40 == other.get_stats().cache_hits
    other.reset_stats()
    assert m.stats.cache_hits == 0 and m.stats.cache_misses == 0
    assert m.stats.allocated_blocks == 3          # derived: null + 2
    with pytest.raises(AttributeError):
        m.stats.allocated_blocks = 5


def test_stats_block_figures_follow_the_pool(pair):
    m, other = pair
    s = m.stats
    assert isinstance(s, pc.CacheStats)
    assert (s.total_blocks, s.allocated_blocks, s.free_blocks, s.shared_blocks) == (32, 1, 31, 0)
    t = other.create_block_table("r")
    other.prepare_append(t, 6)
    other.fork_block_table(t, "f")
    assert (s.allocated_blocks, s.free_blocks, s.shared_blocks) == (3, 29, 2)
    assert s.block_tables == 2 and s.refs_held == 4
    s.cow_copies, s.evictions = 7, 8
    assert (other.stats.cow_copies, other.stats.evictions) == (7, 8)
    for name in ("total_blocks", "free_blocks", "shared_blocks", "total_tokens_cached",
                 "max_refs", "nonsense"):
        with pytest.raises(AttributeError):
            setattr(s, name, 1)
    assert "allocated_blocks=3" in repr(s) and "cow_copies=7" in repr(s)


# ====================================================================== free_block_queue
def test_free_queue_shared_between_managers(pair):
    m, other = pair
    m.get_new_blocks(3)
    assert other.free_block_queue.ids() == m.free_block_queue.ids()
    assert other.free_blocks == m.free_blocks == 28


def test_free_queue_pops_give_this_manager_the_reference(pair):
    m, other = pair
    q = m.free_block_queue
    b = q.popleft()
    more = q.popleft_n(2)
    assert [x.ref_count for x in [b] + more] == [1, 1, 1]
    assert m.holdings()[0]["loose_blocks"] == 3 and m.free_blocks == 28
    other.free_block_queue.remove(m.blocks[10])       # the other manager holds this one
    assert m.blocks[10].ref_count == 1 and other.holdings()[-1]["loose_blocks"] == 1
    with pytest.raises(OutOfBlocksError):
        q.popleft_n(28)
    assert m.free_blocks == 27 and m.check() == []


def test_free_queue_takes_back_only_a_block_held_alone_by_this_manager(pair):
    m, other = pair
    mine, shared, theirs = m.get_new_blocks(3)
    other.increment_ref(shared.block_id)
    theirs_ = other.allocate_block()
    t = m.create_block_table("t")
    tabled = m.allocate_block()
    m.add_block_to_table(t, tabled, 4)
    free = m.allocate_block()
    m.free_block(free.block_id)
    q = m.free_block_queue
    before = snapshot(m)
    for bad in ([shared], [theirs_], [tabled], [free], [m.null_block], [mine, mine]):
        with pytest.raises(ValueError):
            q.append_n(bad)
    unchanged(m, before)
    q.append(mine)
    assert mine.ref_count == 0 and q.ids()[-1] == mine.block_id
    assert m.check() == []
