"""The seed's own methods keep the seed's behaviour, so that code written for
the seed runs unchanged: vllm-mlx 0.6.0's ``BlockAwarePrefixCache`` over
``shmcache.manager.paged_cache``; the seed's statistics, side by side with the seed
module on the same calls; ``table.block_ids`` as a list that changes the
table; ``block.cache_data``; the raw free-queue calls. (``trim_table``:
tests/test_tables.py.)

vllm-mlx is installed ``--no-deps`` in the test environment only (``make
test`` does it); the tests that need it are skipped without it."""

from __future__ import annotations

import logging
import random

import mlx.core as mx
import numpy as np
import pytest

from shmcache.manager import paged_cache as pc

from _helpers import BS, cached_table, snapshot, toks
from _helpers import pair as pair  # pytest fixtures

try:
    from vllm_mlx import paged_cache as seed_pc
    from vllm_mlx.prefix_cache import BlockAwarePrefixCache
except ImportError:          # (vllm-mlx pulls in nothing at import time we lack)
    seed_pc = BlockAwarePrefixCache = None

needs_seed = pytest.mark.skipif(
    seed_pc is None, reason="vllm-mlx is not installed (pip install --no-deps vllm-mlx==0.6.0)")


# ======================================================= BlockAwarePrefixCache
H, D = 2, 8


def _state(n_tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, H, n_tokens, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, H, n_tokens, D)).astype(np.float32))
    return k, v


def _cache_data(n_tokens: int, layers: int = 2, seed: int = 0):
    # what vllm-mlx's scheduler hands store_cache: each layer's extracted state
    return [{"state": _state(n_tokens, seed + i), "meta_state": None, "class_ref": None,
             "class_name": "KVCache"} for i in range(layers)]


@needs_seed
def test_block_aware_prefix_cache_runs_over_the_shared_pool():
    mgr = pc.PagedCacheManager(block_size=4, max_blocks=64)
    cache = BlockAwarePrefixCache(object(), mgr)
    tokens = toks(10)
    data = _cache_data(10)
    # store: blocks allocated, appended to the table's block_ids, cache_data set
    table = cache.store_cache("r1", tokens, data)
    assert table.num_tokens == 10 and len(table.block_ids) == 3
    assert mgr.get_block_table("r1").block_ids == table.block_ids       # the appends stuck
    assert [mgr.blocks[b].ref_count for b in table.block_ids] == [1, 1, 1]
    assert all(mgr.allocated_blocks[b].cache_data is not None for b in table.block_ids)
    assert mgr.check() == []
    # the data read back rebuilds the cache
    rebuilt = cache.reconstruct_cache(table)
    assert rebuilt is not None and len(rebuilt) == 2
    k0, v0 = data[0]["state"]
    assert np.array_equal(np.array(rebuilt[0].keys), np.array(k0))
    assert np.array_equal(np.array(rebuilt[0].values), np.array(v0))
    assert rebuilt[0].offset == 10
    # a second request on the same prompt finds both full blocks (each was
    # registered right after its append: keyed by its whole prefix)
    t2, remaining = cache.fetch_cache("r2", tokens + [50, 51, 52])
    assert t2 is not None and t2.block_ids == table.block_ids[:2]
    assert remaining == tokens[8:] + [50, 51, 52]
    assert [mgr.blocks[b].ref_count for b in table.block_ids] == [2, 2, 1]
    assert mgr.check() == []
    # generation copies every shared block (payload and cache_data with it)
    cache._request_tables["r2"] = cache._request_tables["r1"].__class__(
        block_table=t2, cache_data=data, last_access=0.0)
    out, copied = cache.get_cache_for_generation("r2")
    assert copied is True and out is not None
    t2_now = mgr.get_block_table("r2").block_ids
    assert t2_now[0] != table.block_ids[0]
    assert mgr.allocated_blocks[t2_now[0]].cache_data is \
        mgr.allocated_blocks[table.block_ids[0]].cache_data
    assert mgr.blocks[table.block_ids[0]].ref_count == 1 and mgr.check() == []
    # fork: shares every block, rebuilds the same cache
    f = cache.fork_cache("r1", "r3")
    assert f.block_ids == table.block_ids
    assert [mgr.blocks[b].ref_count for b in table.block_ids] == [2, 2, 2]
    assert np.array_equal(np.array(cache.reconstruct_cache(f)[1].keys),
                          np.array(data[1]["state"][0]))
    stats = cache.get_stats()
    assert stats["allocated_blocks"] == mgr.get_stats().allocated_blocks
    assert "total_tokens_cached" in stats
    for rid in ("r1", "r2", "r3"):
        cache.release_cache(rid)
    s = mgr.get_stats()
    assert s.refs_held == 0 and s.allocated_blocks == 1 and mgr.check() == []
    cache.clear()
    assert mgr.check() == [] and mgr.free_blocks == 63
    mgr.close()


# ====================================================== the seed, side by side
def _seed_step(rng, mgrs, st):
    """One random call of the seed's API, made on every manager in ``mgrs``
    (the seed's and ours); ``st`` keeps per-manager handles: loose blocks,
    tables (index-aligned, so the same logical objects are used)."""
    op = rng.randrange(9)
    tables, loose = st["tables"], st["loose"]
    # NOTE: the seed's allocation keeps a reused block's old token_count
    # (and its running count subtracts it when the block is freed again);
    # ours starts it at 0. Zeroed here, as a careful seed caller would.
    if op == 0:
        got = [m.allocate_block() for m in mgrs]
        if all(g is not None for g in got):
            got[0].token_count = 0
            loose.append([g.block_id for g in got])
    elif op == 1:
        n = rng.randint(1, 3)
        try:
            got = [m.get_new_blocks(n) for m in mgrs]
        except ValueError:
            return
        for i in range(n):
            got[0][i].token_count = 0
            loose.append([g[i].block_id for g in got])
    elif op == 2 and loose:
        ids = loose.pop(rng.randrange(len(loose)))
        for m, b in zip(mgrs, ids):
            m.free_block(b)
    elif op == 3 and len(tables) < 6:
        rid = f"t{st['n']}"
        st["n"] += 1
        for m in mgrs:
            m.create_block_table(rid)
        tables.append(rid)
    elif op == 4 and tables and loose:
        rid = rng.choice(tables)
        ids = loose.pop(rng.randrange(len(loose)))
        k = rng.randint(1, BS)
        for m, b in zip(mgrs, ids):
            m.add_block_to_table(m.get_block_table(rid), m.blocks[b], k)
    elif op == 5 and tables and len(tables) < 6:
        src = rng.choice(tables)
        rid = f"t{st['n']}"
        st["n"] += 1
        for m in mgrs:
            m.fork_block_table(m.get_block_table(src), rid)
        tables.append(rid)
    elif op == 6 and tables:
        rid = tables.pop(rng.randrange(len(tables)))
        for m in mgrs:
            m.delete_block_table(rid)
    elif op == 7 and tables:
        rid = rng.choice(tables)
        for m in mgrs:
            m.get_blocks_for_generation(m.get_block_table(rid))
    elif op == 8 and tables:
        # a block of one table shared into another (increment_ref, then add)
        a, b = rng.choice(tables), rng.choice(tables)
        ids = [m.get_block_table(a).block_ids for m in mgrs]
        if ids[0]:
            i = rng.randrange(len(ids[0]))
            k = rng.randint(1, BS)
            for m, l in zip(mgrs, ids):
                m.increment_ref(l[i])
                m.add_block_to_table(m.get_block_table(b), m.blocks[l[i]], k)


@needs_seed
@pytest.mark.parametrize("seed", range(6))
def test_seed_counts_side_by_side_with_the_seed(seed):
    """The same calls of the seed's API on the seed module and on ours give
    the same figures: get_memory_usage()'s total_tokens_cached (the seed's
    running count), allocated, free and shared blocks."""
    logging.disable(logging.WARNING)
    try:
        theirs = seed_pc.PagedCacheManager(block_size=BS, max_blocks=24)
        ours = pc.PagedCacheManager(block_size=BS, max_blocks=24)
        rng = random.Random(seed)
        st = {"tables": [], "loose": [], "n": 0}
        keys = ("total_tokens_cached", "allocated_blocks", "free_blocks", "shared_blocks")
        for step in range(400):
            _seed_step(rng, (theirs, ours), st)
            ut, uo = theirs.get_memory_usage(), ours.get_memory_usage()
            assert {k: uo[k] for k in keys} == {k: ut[k] for k in keys}, step
            assert [len(ours.get_block_table(r)) for r in st["tables"]] == \
                [len(theirs.get_block_table(r)) for r in st["tables"]]
        assert ours.check() == []
        ours.close()
    finally:
        logging.disable(logging.NOTSET)


def test_total_tokens_cached_is_the_seeds_count(manager):
    """Tokens come in with add_block_to_table and go out with a block going
    free; copies, publishing and forks do not count (as in the seed)."""
    m = manager
    t = m.create_block_table("a")
    for k in (3, 4):
        m.add_block_to_table(t, m.allocate_block(), k)
    assert m.get_memory_usage()["total_tokens_cached"] == 7
    f = m.fork_block_table(t, "f")
    m.get_blocks_for_generation(f)               # copies both (the seed's method)
    m.cache_full_blocks([m.blocks[b] for b in t.block_ids], toks(8), 0, 1)
    assert m.get_stats().total_tokens_cached == 7
    m.delete_block_table("f")                    # the copies go free
    assert m.get_stats().total_tokens_cached == 0
    assert m.get_stats().tokens_held == 4 + 4    # (the state: a's blocks)


# ============================================================ block_ids list
def test_block_ids_append_changes_the_table(manager):
    """The issue's case: append was lost while num_tokens changed."""
    m = manager
    t = m.create_block_table("a")
    b = m.allocate_block()
    t.block_ids.append(b.block_id)
    t.num_tokens += BS
    assert t.block_ids == [b.block_id] and len(t) == 1 and t.num_tokens == BS
    assert b.ref_count == 1 and not m.internals.holder.refs.holds_loose(b.block_id)   # the reference moved
    assert m.check() == []
    m.delete_block_table("a")
    assert b.ref_count == 0 and m.free_blocks == 31 and m.check() == []


def test_check_flags_tokens_the_blocks_cannot_hold(manager):
    t = manager.create_block_table("a")
    t.block_ids.append(manager.allocate_block().block_id)
    t.num_tokens = BS + 1                        # what a lost append used to leave
    assert any("num_tokens" in s for s in manager.check())
    t.num_tokens = BS
    assert manager.check() == []


def test_block_ids_mutations(manager):
    m = manager
    t = m.create_block_table("a")
    ids = t.block_ids
    a, b, c = (x.block_id for x in m.get_new_blocks(3))
    ids.extend([a, b])
    ids += [c]
    assert ids == [a, b, c] == t.block_ids and m.check() == []
    assert ids.pop() == c                        # the reference moves to this manager
    assert t.block_ids == [a, b] and m.internals.holder.refs.holds_loose(c) and m.blocks[c].ref_count == 1
    m.free_block(c)                              # as a seed caller would
    ids.insert(0, b)                             # no reference held: the table takes one
    assert t.block_ids == [b, a, b] and m.blocks[b].ref_count == 2
    ids[1] = c                                   # replaces a: a's reference comes here
    assert t.block_ids == [b, c, b] and m.internals.holder.refs.holds_loose(a) and m.blocks[c].ref_count == 1
    del ids[0]
    ids.remove(b)
    assert t.block_ids == [c] and m.blocks[b].ref_count == 2        # both now loose
    ids.clear()
    assert t.block_ids == [] and m.check() == []
    m.free_block_batch([a, b, b, c])
    assert m.free_blocks == 31 and m.check() == []
    with pytest.raises(ValueError):
        ids.append(0)                            # the null block
    with pytest.raises(IndexError):
        ids.pop()
    assert t.block_ids == [] and m.check() == []


def test_a_stale_list_edits_the_table_as_it_is_now(manager):
    m = manager
    t, ids0, _ = cached_table(m, "a", 2)
    ids = t.block_ids
    got = m.prepare_append(t, 3)                 # the table grew since the list was read
    assert ids == ids0
    ids[2:] = [g.block_id for g in got]          # mlx_lm's PoolSequence keeps its copy so
    assert ids == t.block_ids == ids0 + [got[0].block_id] and m.check() == []
    ids.append(m.allocate_block().block_id)
    assert len(t.block_ids) == 4 == len(ids)
    assert [type(x) for x in (ids[:], ids.copy(), list(ids))] == [list] * 3
    assert t.copy("c").block_ids == ids and type(t.copy("c").block_ids) is list


# ================================================================ cache_data
def test_cache_data_is_kept_and_dropped_as_in_the_seed(pair):
    m, other = pair
    b = m.allocate_block()
    obj = {"anything": [1, 2]}
    b.cache_data = obj
    assert b.cache_data is obj and m.blocks[b.block_id].cache_data is obj
    assert other.blocks[b.block_id].cache_data is None     # a process's own objects
    b.cache_data = None
    assert b.cache_data is None
    b.cache_data = obj
    # a copy-on-write copy has it too
    t = m.create_block_table("t")
    m.add_block_to_table(t, b, BS)
    f = m.fork_block_table(t, "f")
    (c,), copied = m.get_blocks_for_generation(f)
    assert copied and c.block_id != b.block_id and c.cache_data is obj
    # freed and taken for reuse (by any process): gone
    m.delete_block_table("t")
    m.delete_block_table("f")
    assert b.cache_data is obj                   # free, not reused yet
    got = other.get_new_blocks(other.free_blocks)
    assert b.block_id in [g.block_id for g in got]
    assert m.blocks[b.block_id].cache_data is None
    other.free_block_batch(got)
    # dropped with the cache entry (evict_lru_blocks, reset_prefix_cache)
    t, ids, _ = cached_table(m, "c", 1)
    m.blocks[ids[0]].cache_data = obj
    m.delete_block_table("c")
    m.evict_lru_blocks(m.free_blocks)
    assert m.blocks[ids[0]].cache_data is None
    assert m.check() == []


# ============================================================ raw free queue
def test_free_queue_calls_never_list_a_referenced_block(manager):
    m = manager
    q = m.free_block_queue
    first = q.get_all_free_blocks()[0].block_id
    blk = q.popleft()                            # off the queue, held by this manager
    assert blk.block_id == first and blk.ref_count == 1 and m.internals.holder.refs.holds_loose(first)
    blk.ref_count = 1                            # the seed's own allocation does this: a no-op
    with pytest.raises(AttributeError):
        blk.ref_count = 5
    assert m.check() == []
    m.touch([blk])                               # a second reference
    before = snapshot(m)
    with pytest.raises(ValueError, match="referenced"):
        q.append(blk)                            # would list a referenced block
    assert snapshot(m) == before and m.check() == []
    m.free_block(first)
    q.append(blk)                                # its only reference: released, to the back
    assert blk.ref_count == 0 and q.get_all_free_blocks()[-1].block_id == first
    with pytest.raises(ValueError, match="already"):
        q.append(blk)
    t = m.create_block_table("t")
    m.add_block_to_table(t, m.allocate_block(), 1)
    with pytest.raises(ValueError):
        q.append(m.blocks[t.block_ids[0]])       # held by a table
    with pytest.raises(ValueError):
        q.append(m.null_block)
    with pytest.raises(RuntimeError):
        q.remove(m.blocks[t.block_ids[0]])       # the seed's error: not in the queue
    q.remove(blk)                                # a free block: taken, with a reference
    assert blk.ref_count == 1 and m.check() == []
    got = q.popleft_n(3)
    assert all(g.ref_count == 1 for g in got) and m.check() == []
    q.append_n(got + [blk])
    m.delete_block_table("t")
    assert m.free_blocks == 31 and m.check() == []
