"""What a manager holds through the seed API: allocating and freeing blocks,
block tables (shmcache.manager.tables: forks, appends), and close() releasing it all."""

from __future__ import annotations

import gc
import os

import pytest

import shmcache
from shmcache.shm import layout as L
from shmcache.manager import paged_cache as pc
from shmcache.errors import OutOfBlocksError, PoolClosedError

from _helpers import BS, cached_table, kv_data, payload, snapshot, toks, unchanged
from _helpers import kvpool as kvpool, pair as pair  # pytest fixtures

# ====================================================================== allocation
@pytest.mark.parametrize("kind", ["private", "named"])
def test_allocate_until_full_returns_none(make_pool, kind):
    m = (pc.PagedCacheManager(block_size=4, max_blocks=6) if kind == "private"
         else make_pool(block_size=4, max_blocks=6))
    try:
        got = [m.allocate_block() for _ in range(5)]
        assert sorted(b.block_id for b in got) == [1, 2, 3, 4, 5]
        assert all(b.ref_count == 1 and b.token_count == 0 for b in got)
        assert m.free_blocks == 0 and m.usage == 1.0
        before = snapshot(m)
        assert m.allocate_block() is None
        unchanged(m, before)
    finally:
        if kind == "private":
            m.close()


def test_get_new_blocks_raises_when_not_enough(manager):
    got = manager.get_new_blocks(30)
    assert len({b.block_id for b in got}) == 30
    assert manager.get_new_blocks(0) == []
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.get_new_blocks(2)
    with pytest.raises(OutOfBlocksError):
        manager.get_new_blocks(2)
    unchanged(manager, before)
    assert len(manager.get_new_blocks(1)) == 1


def test_allocate_blocks_for_tokens(manager):
    assert len(manager.allocate_blocks_for_tokens(0)) == 0
    assert len(manager.allocate_blocks_for_tokens(1)) == 1
    assert len(manager.allocate_blocks_for_tokens(4)) == 1
    assert len(manager.allocate_blocks_for_tokens(9)) == 3
    assert manager.free_blocks == 31 - 5


def test_free_block_returns_true_then_false(manager):
    b = manager.allocate_block()
    manager.increment_ref(b.block_id)
    assert b.ref_count == 2 and b.is_shared()
    assert manager.free_block(b.block_id) is False   # still referenced
    assert b.ref_count == 1
    assert manager.decrement_ref(b.block_id) is True
    assert b.ref_count == 0
    assert manager.free_block(b.block_id) is False   # unknown (free) block
    assert manager.check() == []


def test_free_block_accepts_views(manager):
    b = manager.allocate_block()
    manager.free_block_batch([b])
    assert manager.free_blocks == 31


def test_handle_memory_pressure(manager):
    assert manager.handle_memory_pressure(31)
    assert not manager.handle_memory_pressure(32)
    manager.get_new_blocks(10)
    assert manager.handle_memory_pressure(21) and not manager.handle_memory_pressure(22)


def test_touch_takes_refs_and_unlinks_free_blocks(manager):
    t, ids, tokens = cached_table(manager, "r", 2)
    manager.delete_block_table("r")
    assert manager.free_blocks == 31
    blocks = [manager.blocks[i] for i in ids]
    manager.touch(blocks)
    assert [b.ref_count for b in blocks] == [1, 1]
    assert manager.free_blocks == 29
    assert not set(ids) & set(manager.free_block_queue.ids())
    manager.touch([manager.null_block])           # the null block is left alone
    assert manager.null_block.ref_count == 1
    manager.free_block_batch(blocks)
    assert manager.free_blocks == 31 and manager.check() == []


# ====================================================================== tables
def test_block_table_lifecycle(manager):
    t = manager.create_block_table("r")
    assert isinstance(t, pc.BlockTable) and t.request_id == "r"
    assert manager.get_block_table("r") == t
    assert manager.get_or_create_block_table("r") == t
    n = manager.get_or_create_block_table("new")
    assert n.request_id == "new" and len(manager.request_tables) == 2
    b = manager.allocate_block()
    manager.add_block_to_table(t, b, 3)
    assert t.block_ids == [b.block_id] and t.num_tokens == 3 and b.token_count == 3
    assert b.ref_count == 1                      # the reference moved into the table
    with pytest.raises(ValueError):
        manager.free_block(b.block_id)           # held by the table, not loose
    manager.delete_block_table("r")
    assert b.ref_count == 0 and manager.get_block_table("r") is None
    assert manager.check() == []


def test_fork_shares_blocks(manager):
    t, ids, _ = cached_table(manager, "a", 2)
    f = manager.fork_block_table(t, "b")
    assert f.block_ids == ids and f.num_tokens == 8
    assert [manager.blocks[i].ref_count for i in ids] == [2, 2]
    manager.delete_block_table("a")
    assert [manager.blocks[i].ref_count for i in ids] == [1, 1]
    assert manager.get_block_table("b").block_ids == ids
    manager.delete_block_table("b")
    assert manager.free_blocks == 31 and manager.check() == []


def test_prepare_append_counts(manager):
    t = manager.create_block_table("r")
    out = manager.prepare_append(t, 5)
    assert len(out) == 2 and [b.token_count for b in out] == [4, 1]
    assert t.num_tokens == 5 and len(t) == 2 and t.block_ids == [b.block_id for b in out]
    assert manager.free_blocks == 29
    out2 = manager.prepare_append(t, 3)
    assert [b.block_id for b in out2] == [out[1].block_id] and out2[0].token_count == 4
    assert t.num_tokens == 8 and len(t) == 2 and manager.free_blocks == 29
    assert manager.prepare_append(t, 0) == []
    assert t.num_tokens == 8
    out3 = manager.prepare_append(t, 9)
    assert len(out3) == 3 and [b.token_count for b in out3] == [4, 4, 1]
    assert t.num_tokens == 17 and len(t) == 5 and manager.free_blocks == 26
    out4 = manager.prepare_append(t, 1)
    assert [b.block_id for b in out4] == [out3[2].block_id] and out4[0].token_count == 2
    assert manager.check() == []


def test_can_append(make_pool):
    m = make_pool(block_size=4, max_blocks=5)        # 4 usable
    t = m.create_block_table("r")
    assert m.can_append(t, 16) and not m.can_append(t, 17)
    m.prepare_append(t, 6)
    assert m.can_append(t, 2 + 8) and not m.can_append(t, 2 + 8 + 1)
    assert m.can_append(t, 0)
    # a shared partial last block needs one more block for its copy
    f = m.fork_block_table(t, "f")
    assert m.can_append(f, 1 + 4) and not m.can_append(f, 1 + 8)
    assert m.free_blocks == 2


def test_prepare_append_out_of_blocks_leaves_pool_unchanged(make_pool):
    m = make_pool(block_size=4, max_blocks=5)
    t = m.create_block_table("r")
    m.prepare_append(t, 6)
    f = m.fork_block_table(t, "f")
    before = snapshot(m)
    assert not m.can_append(t, 11)
    with pytest.raises(OutOfBlocksError):
        m.prepare_append(t, 11)
    unchanged(m, before)
    m.get_new_blocks(2)
    before = snapshot(m)
    assert not m.can_append(f, 1)                     # its COW needs a block
    with pytest.raises(OutOfBlocksError):
        m.prepare_append(f, 1)
    unchanged(m, before)
    assert not m.can_append(t, 1)                     # t's last block is shared too
    assert m.can_append(t, 0)


def test_prepare_append_accepts_request_id(manager):
    manager.create_block_table("r")
    out = manager.prepare_append("r", 2)
    assert len(out) == 1 and manager.get_block_table("r").num_tokens == 2


# ====================================================================== close()
def test_close_releases_everything_the_manager_held(pair):
    m, other = pair
    mine = m.allocate_block()
    t_mine, _, tokens = cached_table(m, "mine", 2)
    loose = other.get_new_blocks(3)
    ot = other.create_block_table("theirs")
    for b in other.get_new_blocks(2):
        other.add_block_to_table(ot, b, 4)
    other.fork_block_table(t_mine, "their-fork")
    acquired, _ = other.acquire_computed_blocks(tokens)
    other.create_block_table("empty")
    assert m.free_blocks == 31 - 1 - 2 - 3 - 2
    other.close()
    assert m.free_blocks == 31 - 1 - 2
    assert set(m.request_tables) == {"mine"}
    assert [m.blocks[i].ref_count for i in t_mine.block_ids] == [1, 1]
    assert mine.ref_count == 1
    assert all(m.blocks[b.block_id].ref_count == 0 for b in loose)
    assert m.check() == []
    assert m.reclaim_dead() == 0
    other.close()                                          # twice is fine
    with pytest.raises(PoolClosedError):
        other.allocate_block()
    with pytest.raises(PoolClosedError):
        other.get_block_table("mine")
    with pytest.raises(PoolClosedError):
        other.check()
    assert m.check() == []


def test_close_frees_its_slot(make_pool):
    m = make_pool(max_slots=2)
    for _ in range(5):
        o = shmcache.attach(m.name)
        o.allocate_block()
        o.close()
    assert m.free_blocks == 31
    assert len(m.holdings()) == 1


def test_holdings(pair):
    m, other = pair
    other.get_new_blocks(2)
    t = other.create_block_table("x")
    other.add_block_to_table(t, other.allocate_block(), 1)
    h = {d["slot"]: d for d in m.holdings()}
    mine = h[other.pool.slot]
    assert mine["pid"] == os.getpid() and mine["alive"]
    assert (mine["tables"], mine["table_blocks"], mine["loose_blocks"]) == (1, 1, 2)


def test_repair_after_manager_collected_while_pool_dirty(make_pool):
    m = make_pool()
    other = shmcache.attach(m.name)
    other.get_new_blocks(3)
    m.pool.c[L.C_DIRTY] = 1           # as if a holder had died mid-update
    del other
    gc.collect()                    # its finalizer repairs, then releases
    assert m.pool.c[L.C_RECOVERIES] == 1
    assert m.pool.c[L.C_DIRTY] == 0
    assert m.free_blocks == 31
    assert m.check() == []


def test_creator_context_manager_destroys(pool_name):
    path = f"/dev/shm/shmcache.{pool_name}"
    with shmcache.create_pool(pool_name, block_size=4, max_blocks=8) as m:
        m.allocate_block()
        assert os.path.exists(path)
    assert not os.path.exists(path)


# ====================================================== acquiring into a table
def _logical(m, t):
    p = m.pool
    return (list(t.block_ids), t.num_tokens, [p.b_ref[b] for b in range(m.max_blocks)],
            m.free_blocks, [int(x) for x in p.counter_array[[L.C_HITS, L.C_MISSES, L.C_TOKENS]]])


def test_acquire_into_a_table_is_acquire_then_add(make_pool):
    """acquire_computed_blocks(..., table=t) leaves the pool as acquiring and
    then add_block_to_table for each block does: same table, references,
    free list, counters; and no reference left loose."""
    states = []
    for fused in (False, True):
        m = make_pool(block_size=4, max_blocks=32)
        old, ids, tokens = cached_table(m, "old", 3)
        m.delete_block_table("old")                  # cached, no references: in the free list
        t = m.create_block_table("new")
        query = tokens + toks(6, 1000)                # 3 cached blocks, then a miss
        if fused:
            got, n = m.acquire_computed_blocks(query, table=t)
        else:
            got, n = m.acquire_computed_blocks(query)
            for b in got:
                m.add_block_to_table(t, b, m.block_size)
        assert n == 12 and [b.block_id for b in got] == ids
        assert len(m.internals.holder.refs.loose) == 0, "a reference was left loose"
        assert m.check() == []
        states.append(_logical(m, t))
    assert states[0] == states[1]


def test_acquire_into_an_unknown_table_changes_nothing(make_pool):
    m = make_pool(block_size=4, max_blocks=32)
    t, ids, tokens = cached_table(m, "old", 2)
    before = snapshot(m)
    with pytest.raises(KeyError):
        m.acquire_computed_blocks(tokens, table="nope")
    unchanged(m, before)


# ================================================================ trim_table
def test_trim_table_releases_emptied_blocks(kvpool):
    m = kvpool
    t = m.create_block_table("a")
    ids = [b.block_id for b in m.prepare_append(t, 10)]        # 4 + 4 + 2
    tokens_before = m.get_stats().total_tokens_cached
    assert m.trim_table(t, 3) == 3
    assert t.num_tokens == 7 and t.block_ids == ids[:2]
    assert m.blocks[ids[2]].ref_count == 0 and m.blocks[ids[1]].token_count == 3
    assert m.get_stats().total_tokens_cached == tokens_before - 3
    assert m.check() == []
    got = m.prepare_append(t, 2)                 # continues in the private block
    assert [g.block_id for g in got] == [ids[1], got[1].block_id]
    assert m.trim_table(t, 100) == 9 and t.block_ids == [] and t.num_tokens == 0
    assert m.free_blocks == 15 and m.check() == []
    with pytest.raises(ValueError):
        m.trim_table(t, -1)
    with pytest.raises(KeyError):
        m.trim_table("nope", 1)


def test_trim_table_into_a_shared_block_only_dereferences(kvpool):
    m = kvpool
    t = m.create_block_table("a")
    ids = [b.block_id for b in m.prepare_append(t, 8)]
    m.write_kv(ids[1], 0, kv_data(m, 1), kv_data(m, 2))
    before = payload(m, ids[1])
    f = m.fork_block_table(t, "f")
    m.trim_table(f, 2)                           # f's last block: shared, now partial
    assert f.block_ids == ids and f.num_tokens == 6
    assert [m.blocks[b].ref_count for b in ids] == [2, 2]
    assert m.blocks[ids[1]].token_count == 4     # (still t's full block)
    m.trim_table(f, 4)                           # drops it: a reference released
    assert f.block_ids == ids[:1] and m.blocks[ids[1]].ref_count == 1
    m.trim_table(t, 2)
    (g,) = m.prepare_append(f, 1)                # f's 2 tokens are in a shared block: copied
    assert g.block_id not in ids and f.block_ids == [g.block_id]
    assert payload(m, g.block_id) == payload(m, ids[0])
    (h,) = m.prepare_append(t, 1)                # t's own block is private: written in place
    assert h.block_id == ids[1]
    m.write_kv(h.block_id, 0, kv_data(m, 3, 1), kv_data(m, 4, 1), start=2)
    assert payload(m, ids[1]) != before and m.check() == []


def test_trim_table_never_writes_into_a_published_block(kvpool):
    m = kvpool
    t, ids, tokens = cached_table(m, "a", 2)
    m.write_kv(ids[1], 0, kv_data(m, 5), kv_data(m, 6))
    before = payload(m, ids[1])
    m.trim_table(t, 1)
    (g,) = m.prepare_append(t, 1)                # lands in the published block: copied
    assert g.block_id != ids[1] and t.block_ids == [ids[0], g.block_id]
    assert payload(m, g.block_id) == before      # the copy has its bytes
    m.write_kv(g.block_id, 0, kv_data(m, 7, 1), kv_data(m, 8, 1), start=3)
    assert payload(m, ids[1]) == before          # the published block is untouched
    assert m.get_computed_blocks(tokens)[1] == 2 * BS
    assert m.check() == []
