"""Bad input to the seed API: wrong ids, counts and tokens raise, and leave
the pool unchanged (byte snapshots). Bad sizes and segments:
test_bad_pool_input.py."""

from __future__ import annotations

import mlx.core as mx
import pytest

import shmcache
from shmcache.manager import paged_cache as pc

from _helpers import cached_table, snapshot, toks, unchanged
from _helpers import pair as pair  # pytest fixtures

# ====================================================================== bad input
@pytest.mark.parametrize("bid", [-1, -100, 32, 10**9])
def test_bad_block_ids(manager, bid):
    manager.get_new_blocks(2)
    before = snapshot(manager)
    for call in (manager.free_block, manager.increment_ref, manager.decrement_ref,
                 lambda b: manager.free_block_batch([1, b]), lambda b: manager.touch([b]),
                 lambda b: manager.write_kv(b, 0, mx.zeros((1, 1, 8)), mx.zeros((1, 1, 8)))):
        with pytest.raises(ValueError):
            call(bid)
    t = manager.create_block_table("t")
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.add_block_to_table(t, bid, 1)
    unchanged(manager, before)


@pytest.mark.parametrize("bid", [1.0, "1", None, True])
def test_non_integer_block_ids(manager, bid):
    manager.get_new_blocks(2)
    before = snapshot(manager)
    for call in (manager.free_block, manager.increment_ref,
                 lambda b: manager.free_block_batch([b]), lambda b: manager.touch([b])):
        with pytest.raises(TypeError):
            call(bid)
    unchanged(manager, before)


def test_double_free(manager):
    b = manager.allocate_block()
    t = manager.create_block_table("t")
    x = manager.allocate_block()
    manager.add_block_to_table(t, x, 1)
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.free_block(x.block_id)               # referenced, but not by a loose ref
    with pytest.raises(ValueError):
        manager.free_block_batch([b, b])             # twice in one batch
    with pytest.raises(ValueError):
        manager.free_block_batch([b, x])             # nothing freed, not even b
    unchanged(manager, before)
    assert manager.free_block(b.block_id) is True
    before = snapshot(manager)
    assert manager.free_block(b.block_id) is False   # the seed's "unknown block"
    with pytest.raises(ValueError):
        manager.free_block_batch([b])
    unchanged(manager, before)


def test_double_free_of_another_managers_block(pair):
    m, other = pair
    b = m.allocate_block()
    before = snapshot(m)
    with pytest.raises(ValueError):
        other.free_block(b.block_id)
    with pytest.raises(ValueError):
        other.free_block_batch([b.block_id])
    assert b.ref_count == 1
    assert m.check() == []
    assert snapshot(m)[2] == before[2]


def test_freeing_the_null_block(manager):
    before = snapshot(manager)
    assert manager.free_block(0) is False
    assert manager.decrement_ref(0) is False
    assert manager.increment_ref(0) is False
    with pytest.raises(ValueError):
        manager.free_block_batch([0])
    with pytest.raises(ValueError):
        manager.free_block_batch([manager.null_block])
    unchanged(manager, before)
    assert manager.null_block.ref_count == 1


def test_null_block_cannot_be_cached_or_tabled(manager):
    t = manager.create_block_table("t")
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.null_block.block_hash = pc.BlockHash(b"x" * 16)
    with pytest.raises(ValueError):
        manager.add_block_to_table(t, manager.null_block, 1)
    with pytest.raises(ValueError):
        manager.cache_full_blocks([manager.null_block], toks(4), 0, 1)
    with pytest.raises(AttributeError):
        manager.blocks[3].is_null = True
    unchanged(manager, before)


def test_free_block_unknown_free_block(manager):
    before = snapshot(manager)
    assert manager.free_block(7) is False
    assert manager.increment_ref(7) is False
    unchanged(manager, before)


def test_unknown_request_ids(manager):
    t, _, _ = cached_table(manager, "real", 1)
    before = snapshot(manager)
    assert manager.get_block_table("nope") is None
    with pytest.raises(KeyError):
        manager.delete_block_table("nope")
    with pytest.raises(KeyError):
        manager.fork_block_table("nope", "new")
    with pytest.raises(KeyError):
        manager.prepare_append("nope", 1)
    with pytest.raises(KeyError):
        manager.can_append("nope", 1)
    with pytest.raises(KeyError):
        manager.get_blocks_for_generation("nope")
    with pytest.raises(KeyError):
        manager.add_block_to_table("nope", 1, 1)
    with pytest.raises(KeyError):
        manager.request_tables["nope"]
    unchanged(manager, before)
    # a stale table object after its deletion
    b = manager.allocate_block()
    manager.delete_block_table("real")
    before = snapshot(manager)
    with pytest.raises(KeyError):
        manager.add_block_to_table(t, b, 1)
    with pytest.raises(KeyError):
        manager.prepare_append(t, 1)
    with pytest.raises(KeyError):
        manager.fork_block_table(t, "x")
    unchanged(manager, before)


def test_stale_table_view_does_not_match_a_reused_slot(manager):
    t = manager.create_block_table("a")
    manager.delete_block_table("a")
    manager.create_block_table("b")                   # may reuse a's slot
    with pytest.raises(KeyError):
        manager.prepare_append(t, 1)
    assert manager.get_block_table("b").num_tokens == 0


@pytest.mark.parametrize("rid", ["", 5, None, b"bytes", "x" * 65, "nul\x00"])
def test_bad_request_ids(manager, rid):
    before = snapshot(manager)
    with pytest.raises((TypeError, ValueError)):
        manager.create_block_table(rid)
    with pytest.raises((TypeError, ValueError)):
        manager.get_block_table(rid)
    unchanged(manager, before)


def test_duplicate_request_ids(manager):
    t, ids, _ = cached_table(manager, "dup", 2)
    manager.create_block_table("other")
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.create_block_table("dup")
    with pytest.raises(ValueError):
        manager.fork_block_table(t, "other")
    with pytest.raises(ValueError):
        manager.fork_block_table(t, "dup")
    unchanged(manager, before)
    assert [manager.blocks[i].ref_count for i in ids] == [1, 1]


def test_duplicate_request_id_across_managers(pair):
    m, other = pair
    m.create_block_table("r")
    before = snapshot(m)
    with pytest.raises(ValueError):
        other.create_block_table("r")
    assert snapshot(m)[2] == before[2]


BAD_TOKENS = [([1, 2, -3, 4], ValueError), ([1, 2, 2**32, 4], ValueError),
              ([1, "a", 3, 4], TypeError), ([1.5, 2, 3, 4], TypeError),
              ([None] * 4, TypeError), ([[1], [2], [3], [4]], TypeError)]


@pytest.mark.parametrize("bad,exc", BAD_TOKENS)
def test_bad_tokens(manager, bad, exc):
    t, ids, _ = cached_table(manager, "r", 1)
    b = manager.allocate_block()
    before = snapshot(manager)
    calls = [lambda: manager.get_computed_blocks(bad),
             lambda: manager.acquire_computed_blocks(bad),
             lambda: manager.find_shared_prefix(bad),
             lambda: manager.find_cached_block(bad),
             lambda: manager.register_block_hash(b, bad),
             lambda: manager.cache_full_blocks([b], bad, 0, 1),
             lambda: manager.compute_block_hash(bad)]
    for call in calls:
        with pytest.raises(exc):
            call()
    unchanged(manager, before)


def test_cache_full_blocks_bad_counts(manager):
    blocks = manager.get_new_blocks(2)
    before = snapshot(manager)
    for args in ((blocks, toks(8), -1, 2), (blocks, toks(8), 0, 3), (blocks, toks(7), 0, 2),
                 (blocks, toks(8), 0, 1.5), (blocks, toks(8), True, 2)):
        with pytest.raises(ValueError):
            manager.cache_full_blocks(*args)
    manager.cache_full_blocks(blocks, toks(8), 2, 1)            # nothing to do
    unchanged(manager, before)
    free = manager.get_new_blocks(1)[0]
    manager.free_block(free.block_id)
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.cache_full_blocks([free], toks(4), 0, 1)        # a free block
    unchanged(manager, before)


@pytest.mark.parametrize("n", [-1, -10, 1.5, "2", True])
def test_bad_counts(manager, n):
    t = manager.create_block_table("r")
    manager.prepare_append(t, 3)
    before = snapshot(manager)
    for call in (manager.get_new_blocks, manager.allocate_blocks_for_tokens,
                 manager.evict_lru_blocks, lambda k: manager.prepare_append(t, k),
                 lambda k: manager.can_append(t, k)):
        with pytest.raises(ValueError):
            call(n)
    unchanged(manager, before)


@pytest.mark.parametrize("n", [-1, 5, 1.5, None])
def test_bad_tokens_in_block(manager, n):
    t = manager.create_block_table("r")
    b = manager.allocate_block()
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.add_block_to_table(t, b, n)
    with pytest.raises(ValueError):
        b.token_count = n
    unchanged(manager, before)


def test_add_block_not_held_takes_a_reference(pair):
    """A block this manager holds no reference to gets one of the table's
    own (as touch takes one): the seed's callers append blocks they took no
    reference on, and the table's references must still add up."""
    m, other = pair
    t = m.create_block_table("r")
    b = other.allocate_block()
    m.add_block_to_table(t, b, 1)                   # another manager's block
    assert b.ref_count == 2 and other.internals.holder.refs.holds_loose(b.block_id)
    free = m.free_blocks
    m.add_block_to_table(t, 9, 1)                   # a free block: out of the queue
    assert m.blocks[9].ref_count == 1 and m.free_blocks == free - 1
    assert t.block_ids == [b.block_id, 9] and m.check() == []
    m.delete_block_table("r")
    assert b.ref_count == 1 and m.blocks[9].ref_count == 0 and m.check() == []
    with pytest.raises(ValueError):
        m.add_block_to_table(m.create_block_table("s"), 0, 1)   # the null block


# ====================================================================== huge counts
@pytest.mark.parametrize("n", [2**40, 2**63, 10**30, 32, 31])
def test_get_new_blocks_more_than_the_pool_has(manager, n):
    """The C path sized a buffer by the count before checking it (MemoryError,
    OverflowError): any count the pool cannot have is the seed's ValueError."""
    manager.get_new_blocks(2)
    before = snapshot(manager)
    with pytest.raises(shmcache.OutOfBlocksError) as ei:
        manager.get_new_blocks(n)
    assert isinstance(ei.value, ValueError) and str(n) in str(ei.value)
    with pytest.raises(ValueError):
        manager.allocate_blocks_for_tokens(n * manager.block_size)
    unchanged(manager, before)
    assert len(manager.get_new_blocks(29)) == 29    # all that is left still works
