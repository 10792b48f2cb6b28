"""Prefix caching (shmcache/manager/prefix.py): publishing full blocks under chain
hashes (cache_full_blocks), lookup (get_computed_blocks, acquire_computed_blocks,
find_shared_prefix, get_cached_block), the seed's legacy per-prefix calls
(register_block_hash, find_cached_block, compute_block_hash), salts, and the
shared hit and miss counters.

The seed's fixed prefix bugs (whole chains only, atomic acquire, salts never
sharing, a per-pool hash root) have their tests in test_seed_fixes.py;
acquiring straight into a table is in test_tables.py."""

from __future__ import annotations

import pytest

from shmcache.manager import paged_cache as pc
from shmcache.errors import CapacityError

from _helpers import cached_table, snapshot, toks, unchanged
from _helpers import pair as pair  # pytest fixtures


def _counts(m) -> tuple:
    s = m.get_stats()
    return s.cache_hits, s.cache_misses


def _ids(blocks) -> list:
    return [b.block_id for b in blocks]


# ====================================================================== publishing
def test_published_blocks_are_full_and_seen_by_every_manager(pair):
    m, other = pair
    blocks = m.get_new_blocks(3)
    assert [b.token_count for b in blocks] == [0, 0, 0]
    m.cache_full_blocks(blocks, toks(12), 0, 3)
    assert [b.token_count for b in blocks] == [4, 4, 4]      # a published block is full
    assert all(b.block_hash is not None for b in blocks)
    assert len({b.block_hash for b in blocks}) == 3
    got, n = other.get_computed_blocks(toks(12))
    assert _ids(got) == _ids(blocks) and n == 12
    assert m.check() == []


def test_only_the_blocks_in_range_are_published(manager):
    blocks = manager.get_new_blocks(4)
    tokens = toks(16)
    manager.cache_full_blocks(blocks, tokens, 1, 3)
    assert [b.block_hash is not None for b in blocks] == [False, True, True, False]
    # the chain starts at block 0, which is not cached: no prefix matches yet
    assert manager.get_computed_blocks(tokens) == ([], 0)
    manager.cache_full_blocks(blocks, tokens, 0, 1)
    got, n = manager.get_computed_blocks(tokens)
    # blocks 1 and 2 were hashed after block 0's tokens, though it was not cached then
    assert _ids(got) == _ids(blocks[:3]) and n == 12
    before = snapshot(manager)
    manager.cache_full_blocks(blocks, tokens, 3, 3)           # an empty range: nothing
    manager.cache_full_blocks(blocks, tokens, 3, 1)
    unchanged(manager, before)


def test_republishing_keeps_one_entry_per_chain(manager):
    t, ids, tokens = cached_table(manager, "a", 2)
    manager.cache_full_blocks([manager.blocks[i] for i in ids], tokens, 0, 2)
    assert len(manager.cached_block_hash_to_block) == 2
    got, _ = manager.get_computed_blocks(tokens)
    assert _ids(got) == ids and manager.check() == []


def test_publishing_a_free_block_changes_nothing(manager):
    held, free = manager.get_new_blocks(2)
    manager.free_block(free.block_id)
    before = snapshot(manager)
    with pytest.raises(ValueError, match="not allocated"):
        manager.cache_full_blocks([held, free], toks(8), 0, 2)
    unchanged(manager, before)                  # not even the held block was published
    assert held.block_hash is None


# ====================================================================== lookup
def test_get_computed_blocks_finds_the_longest_cached_prefix(manager):
    t, ids, tokens = cached_table(manager, "r", 3)
    cases = [(tokens, 3), (tokens + [1, 2, 3], 3),            # a partial block is not looked up
             (tokens[:8] + toks(4, 500), 2), (tokens[:4], 1), (toks(12, 500), 0)]
    for query, n in cases:
        got, n_tokens = manager.get_computed_blocks(query)
        assert _ids(got) == ids[:n] and n_tokens == 4 * n, query
    assert all(manager.blocks[i].ref_count == 1 for i in ids)  # no reference taken


def test_cached_prefix_tokens_is_a_probe_that_changes_nothing(manager):
    """The supervisor's routing probe: the longest cached prefix's token
    count, with no reference taken and the hit/miss counters untouched."""
    t, ids, tokens = cached_table(manager, "r", 3)
    before, counts = snapshot(manager), _counts(manager)
    cases = [(tokens, 12), (tokens + [1, 2, 3], 12), (tokens[:8] + toks(4, 500), 8),
             (toks(12, 500), 0)]
    for query, n in cases:
        assert manager.cached_prefix_tokens(query) == n, query
    assert manager.cached_prefix_tokens(tokens, ("other salt",)) == 0
    unchanged(manager, before)                    # counters, references: all the same
    assert _counts(manager) == counts
    assert manager.get_computed_blocks(tokens)[1] == 12
    assert _counts(manager) == (counts[0] + 3, counts[1])     # a lookup counts its hits


def test_acquire_takes_one_reference_per_block_and_free_gives_it_back(manager):
    t, ids, tokens = cached_table(manager, "r", 2)
    manager.delete_block_table("r")
    got, n = manager.acquire_computed_blocks(tokens)
    assert _ids(got) == ids and n == 8
    got2, _ = manager.acquire_computed_blocks(tokens[:4])
    assert [manager.blocks[i].ref_count for i in ids] == [2, 1]
    assert manager.holdings()[0]["loose_blocks"] == 3
    manager.free_block_batch(got + got2)
    assert [manager.blocks[i].ref_count for i in ids] == [0, 0]
    assert set(ids) <= set(manager.free_block_queue.ids())    # still cached, evictable
    assert _ids(manager.get_computed_blocks(tokens)[0]) == ids
    assert manager.check() == []


def test_acquire_without_room_for_the_references_changes_nothing(make_pool):
    # 3 chunks: one for the table, two (30 references) for this slot's loose list
    m = make_pool(block_size=4, max_blocks=64, max_refs=15, max_tables=1, max_slots=1)
    t, ids, tokens = cached_table(m, "r", 3)
    m.get_new_blocks(30)
    before, counts = snapshot(m), _counts(m)
    with pytest.raises(CapacityError):
        m.acquire_computed_blocks(tokens)
    assert _counts(m) == counts                               # not even the statistics
    unchanged(m, before)
    assert m.get_computed_blocks(tokens)[1] == 12             # looking needs no room


def test_find_shared_prefix_returns_block_ids_and_the_rest(manager):
    t, ids, tokens = cached_table(manager, "r", 2)
    assert manager.find_shared_prefix(tokens + [9, 9]) == (ids, [9, 9])
    assert manager.find_shared_prefix(tokens[:6]) == (ids[:1], tokens[4:6])
    assert manager.find_shared_prefix([1]) == ([], [1])
    assert manager.find_shared_prefix(toks(8, 300)) == ([], toks(8, 300))
    assert all(manager.blocks[i].ref_count == 1 for i in ids)


def test_get_cached_block_takes_no_reference(manager):
    t, ids, tokens = cached_table(manager, "r", 1)
    manager.delete_block_table("r")
    h = manager.blocks[ids[0]].block_hash
    b = manager.get_cached_block(h)
    assert b.block_id == ids[0] and b.ref_count == 0
    assert manager.get_cached_block(pc.BlockHash(bytes(16))) is None


# ====================================================================== salts
def test_salts_keep_separate_entries_for_the_same_tokens(manager):
    tokens = toks(8)
    _, plain, _ = cached_table(manager, "plain", 2)
    _, a, _ = cached_table(manager, "a", 2, extra_keys=("tenant-a",))
    _, lora, _ = cached_table(manager, "lora", 2, extra_keys=("tenant-a", "lora-1"))
    assert len(manager.cached_block_hash_to_block) == 6
    for keys, want in ((None, plain), (("tenant-a",), a), (("tenant-a", "lora-1"), lora)):
        got, n = manager.get_computed_blocks(tokens, extra_keys=keys)
        assert _ids(got) == want and n == 8
    assert manager.get_computed_blocks(tokens, extra_keys=("lora-1", "tenant-a")) == ([], 0)
    assert manager.find_shared_prefix(tokens)[0] == plain     # the legacy calls: no salt
    assert manager.check() == []


# ====================================================================== legacy calls
def test_compute_block_hash_static_legacy(manager):
    h = pc.PagedCacheManager.compute_block_hash([1, 2, 3])
    assert isinstance(h, str) and len(h) == 16
    assert h == manager.compute_block_hash([1, 2, 3])
    assert h != manager.compute_block_hash([1, 2, 4])


def test_register_block_hash_caches_the_last_block_of_a_prefix(manager):
    x = manager.allocate_block()
    manager.register_block_hash(x, toks(6))          # a partial last block
    assert x.block_hash is not None
    assert manager.find_cached_block(toks(6)) == x
    assert manager.find_cached_block(toks(5)) is None
    assert manager.find_cached_block(toks(7)) is None
    assert manager.find_cached_block([]) is None
    y = manager.allocate_block()
    manager.register_block_hash(y, toks(6))          # the same prefix in another block
    assert manager.find_cached_block(toks(6)) in (x, y)
    assert manager.check() == []


def test_find_cached_block_touches_the_block(manager):
    x = manager.allocate_block()
    manager.register_block_hash(x, toks(4))
    x.last_access = x.last_access - 1000.0
    stale = x.last_access
    manager.find_cached_block(toks(4))
    assert x.last_access > stale + 900


def test_register_block_hash_refuses_what_it_cannot_cache(manager):
    x = manager.allocate_block()
    free = manager.allocate_block()
    manager.free_block(free.block_id)
    before = snapshot(manager)
    with pytest.raises(ValueError):
        manager.register_block_hash(x, [])
    with pytest.raises(ValueError):
        manager.register_block_hash(free, toks(4))
    with pytest.raises(ValueError):
        manager.register_block_hash(manager.null_block, toks(4))
    unchanged(manager, before)


# ====================================================================== counters
def test_every_lookup_counts_hits_and_misses_in_the_pool(pair):
    m, other = pair
    t, ids, tokens = cached_table(m, "r", 2)
    h = m.blocks[ids[0]].block_hash
    x = m.allocate_block()
    m.register_block_hash(x, toks(2, 700))
    steps = [(lambda: m.get_computed_blocks(tokens), (2, 0)),
             (lambda: m.get_computed_blocks(tokens[:4] + toks(4, 500)), (1, 1)),
             (lambda: other.acquire_computed_blocks(tokens + [1]), (2, 0)),
             (lambda: other.acquire_computed_blocks(toks(4, 500)), (0, 1)),
             (lambda: m.find_shared_prefix(tokens), (2, 0)),
             (lambda: m.get_computed_blocks([1, 2]), (0, 0)),       # no whole block
             (lambda: other.get_cached_block(h), (1, 0)),
             (lambda: other.get_cached_block(pc.BlockHash(bytes(16))), (0, 1)),
             (lambda: m.find_cached_block(toks(2, 700)), (1, 0)),
             (lambda: m.find_cached_block(toks(3, 700)), (0, 1))]
    for step, (dh, dm) in steps:
        h0, m0 = _counts(m)
        step()
        assert _counts(other) == (h0 + dh, m0 + dm)
    m.reset_stats()
    assert _counts(other) == (0, 0)


def test_with_caching_disabled_nothing_is_published_or_counted(make_pool):
    m = make_pool(enable_caching=False)
    x, y = m.get_new_blocks(2)
    m.cache_full_blocks([x], toks(4), 0, 1)
    m.register_block_hash(y, toks(4))
    assert x.block_hash is None and y.block_hash is None
    assert len(m.cached_block_hash_to_block) == 0
    assert m.find_cached_block(toks(4)) is None
    assert m.get_computed_blocks(toks(4)) == ([], 0)
    assert _counts(m)[0] == 0
    assert m.check() == []
