"""Live views of shared records (shmcache/manager/views.py): ``SharedBlock``,
``SharedBlockTable`` and a table's ``block_ids`` (``TableBlockIds``).

A view holds only (manager, id), so what one manager writes another sees at
once, and every write goes through the manager's checks."""

from __future__ import annotations

import copy
import os
import pickle
import time

import pytest

from shmcache.manager import paged_cache as pc

from _helpers import snapshot, toks, unchanged
from _helpers import pair as pair  # pytest fixtures


# ====================================================================== SharedBlock
def test_block_view_reflects_other_manager(pair):
    m, other = pair
    b = m.allocate_block()
    ob = other.blocks[b.block_id]
    assert ob.ref_count == 1
    other.increment_ref(b.block_id)
    assert b.ref_count == 2 and b.is_shared()
    other.blocks[b.block_id].token_count = 3
    assert b.token_count == 3 and not b.is_full(4)
    ob.token_count = 4
    assert b.is_full(4)
    other.cache_full_blocks([ob], toks(4), 0, 1)
    assert b.block_hash is not None and b.block_hash == ob.block_hash
    assert b.hash_value == b.block_hash.hex()
    later = time.time() + 100.0
    ob.last_access = later
    assert abs(b.last_access - later) < 0.01
    ob.touch()
    assert b.last_access < later - 50          # touch: now, earlier than "later"
    b.reset_hash()
    assert ob.block_hash is None
    assert other.get_computed_blocks(toks(4)) == ([], 0)
    assert isinstance(b, pc.CacheBlock) and isinstance(b, pc.KVCacheBlock)
    other.free_block(b.block_id)
    m.free_block(b.block_id)
    assert ob.ref_count == 0


def test_block_view_block_hash_assignment(manager):
    b = manager.allocate_block()
    h = pc.BlockHash(os.urandom(16))
    b.block_hash = h
    assert b.block_hash == h
    assert manager.get_cached_block(h) == b
    assert manager.cached_block_hash_to_block.get_block(h) == b
    with pytest.raises(ValueError):
        b.block_hash = b"short"
    assert b.block_hash == h
    b.block_hash = None
    assert manager.get_cached_block(h) is None
    assert manager.check() == []


def test_block_view_ref_count_cannot_be_assigned(manager):
    b = manager.allocate_block()
    before = snapshot(manager)
    with pytest.raises(AttributeError):
        b.ref_count = 5
    unchanged(manager, before)
    b.ref_count = 1                 # what it is: the seed's own allocation does this
    assert b.ref_count == 1


def test_block_view_token_count_is_checked(manager):
    b = manager.allocate_block()
    for bad in (-1, 5, 2.0, True, "3"):
        with pytest.raises(ValueError):
            b.token_count = bad
    assert b.token_count == 0
    b.token_count = 4
    assert manager.blocks[b.block_id].token_count == 4


def test_block_view_hash_value_can_only_be_cleared(manager):
    b = manager.allocate_block()
    assert b.hash_value is None
    manager.cache_full_blocks([b], toks(4), 0, 1)
    h = b.hash_value
    assert isinstance(h, str) and len(h) == 32
    b.hash_value = "ff" * 16            # not a way to cache: ignored
    assert b.hash_value == h
    b.hash_value = None
    assert b.hash_value is None and b.block_hash is None
    assert manager.get_computed_blocks(toks(4)) == ([], 0)
    assert manager.check() == []


def test_block_view_null_block_is_fixed(manager):
    assert manager.blocks[0].is_null and not manager.blocks[1].is_null
    manager.blocks[0].is_null = True            # what it is: allowed
    manager.blocks[1].is_null = False
    with pytest.raises(AttributeError):
        manager.blocks[0].is_null = False
    with pytest.raises(AttributeError):
        manager.blocks[1].is_null = True
    assert manager.blocks[0].is_null and not manager.blocks[1].is_null


def test_block_view_free_list_neighbours(manager):
    first, second, last = manager.blocks[1], manager.blocks[2], manager.blocks[31]
    assert first.prev_free_block.block_id == -1           # the head sentinel
    assert first.next_free_block == second
    assert second.prev_free_block == first
    assert last.next_free_block.block_id == -2            # the tail sentinel
    b = manager.allocate_block()
    assert b == first                                     # the front is taken first
    assert b.prev_free_block is None and b.next_free_block is None
    assert second.prev_free_block.block_id == -1


def test_block_views_compare_by_mapping_and_id(manager, make_pool):
    m = manager
    a, b = m.blocks[3], m.blocks[3]
    assert a == b and a is not b and hash(a) == hash(b)
    assert a == m.allocated_blocks.get(3, a) == m.get_new_blocks(3)[-1]
    assert a != m.blocks[4]
    assert a != make_pool().blocks[3]             # another pool
    assert len({a, b, m.blocks[4]}) == 2
    assert a != pc.CacheBlock(block_id=3)


def test_block_view_cache_data_is_gone_once_the_block_is_reused(manager):
    b = manager.allocate_block()
    obj = [("k", "v")]
    b.cache_data = obj
    assert manager.blocks[b.block_id].cache_data is obj
    manager.free_block(b.block_id)
    again = manager.allocate_block()             # uncached: reused first
    assert again == b and again.cache_data is None
    again.cache_data = obj
    again.cache_data = None
    assert again.cache_data is None


# ====================================================================== SharedBlockTable
def test_table_view_shared_between_managers(pair):
    m, other = pair
    t = m.create_block_table("req")
    m.add_block_to_table(t, m.allocate_block(), 4)
    ot = other.get_block_table("req")
    assert ot is not None and ot.block_ids == t.block_ids and ot.num_tokens == 4
    ot.add_block(other.allocate_block().block_id, 2)      # BlockTable.add_block, live
    assert len(t) == 2 and t.num_tokens == 6 and t.block_ids == ot.block_ids
    c = t.copy("copy")
    assert isinstance(c, pc.BlockTable) and c.block_ids == t.block_ids
    other.delete_block_table("req")
    assert m.get_block_table("req") is None
    with pytest.raises(KeyError):
        len(t)
    assert m.free_blocks == 31 and m.check() == []


def test_table_view_num_tokens_owner_and_identity(pair):
    m, other = pair
    t = m.create_block_table("r")
    assert t.owner_slot == m.pool.slot != other.pool.slot
    t.num_tokens = 7
    assert other.get_block_table("r").num_tokens == 7
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError):
            t.num_tokens = bad
    assert t.num_tokens == 7
    assert t == m.get_block_table("r") == m.request_tables["r"]
    assert "request_id='r'" in repr(t)
    m.delete_block_table("r")
    m.create_block_table("s")                      # the same record, another request
    assert "deleted" in repr(t)
    assert t != m.get_block_table("s")             # a stale view never matches it
    with pytest.raises(KeyError):
        t.num_tokens


# ====================================================================== TableBlockIds
def test_block_ids_mutations_move_references(manager):
    m = manager
    t = m.create_block_table("t")
    a, b, c = m.get_new_blocks(3)
    ids = t.block_ids
    ids.append(a.block_id)                       # moves this manager's loose reference
    ids.extend([b.block_id, c.block_id])
    assert t.block_ids == ids == [a.block_id, b.block_id, c.block_id]
    assert [x.ref_count for x in (a, b, c)] == [1, 1, 1]
    assert m.holdings()[0]["loose_blocks"] == 0
    ids += [a.block_id]                          # one it does not hold loose: a new reference
    assert a.ref_count == 2 and len(t) == 4
    assert ids.pop() == a.block_id                # its reference moves to this manager
    assert a.ref_count == 2 and m.holdings()[0]["loose_blocks"] == 1
    m.free_block(a.block_id)
    assert a.ref_count == 1
    ids.reverse()
    assert t.block_ids == [c.block_id, b.block_id, a.block_id]
    del ids[0]
    ids.sort()
    assert t.block_ids == sorted([a.block_id, b.block_id]) == ids
    with pytest.raises(ValueError):
        ids.append(0)                            # the null block: nothing changes
    assert t.block_ids == ids and m.check() == []
    ids.clear()
    assert len(t) == 0
    m.free_block_batch([b, c])
    m.free_block(a.block_id)
    assert m.free_blocks == 31 and m.check() == []


def test_block_ids_edits_apply_to_the_table_as_it_is_then(pair):
    m, other = pair
    t = m.create_block_table("t")
    stale = t.block_ids                          # read before another manager's change
    x = other.allocate_block()
    other.get_block_table("t").block_ids.append(x.block_id)
    y = m.allocate_block()
    stale.append(y.block_id)
    assert stale == t.block_ids == [x.block_id, y.block_id]
    assert m.check() == []


def test_block_ids_copies_are_plain_lists(manager):
    t = manager.create_block_table("t")
    t.block_ids.extend([b.block_id for b in manager.get_new_blocks(2)])
    ids = t.block_ids
    for c in (ids[:], copy.copy(ids), copy.deepcopy(ids), list(ids),
              pickle.loads(pickle.dumps(ids))):
        assert type(c) is list and c == ids
        c.append(5)
    assert len(t) == 2 and manager.check() == []
