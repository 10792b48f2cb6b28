"""Prefix reuse for code that registers blocks the seed's way, one block's
tokens at a time right after appending the block to a table (vllm-mlx
0.6.0's ``BlockAwarePrefixCache.store_cache``): a pool keys each block by
its whole prefix (``shmcache.shm.table_chains``), so it gets the seed's reuse,
and never hands a block out at a position it was not computed at, where the
seed does.

The tests with ``BlockAwarePrefixCache`` need vllm-mlx (installed ``--no-deps``
in the test environment by ``make test``); they are skipped without it."""

from __future__ import annotations

import pytest

from shmcache.manager import paged_cache as pc

from _helpers import toks

try:
    from vllm_mlx import paged_cache as seed_pc
    from vllm_mlx.prefix_cache import BlockAwarePrefixCache
except ImportError:
    seed_pc = BlockAwarePrefixCache = None

needs_seed = pytest.mark.skipif(
    seed_pc is None, reason="vllm-mlx is not installed (pip install --no-deps vllm-mlx==0.6.0)")

MANAGERS = {"seed": lambda **k: seed_pc.PagedCacheManager(**k),
            "pool": lambda **k: pc.PagedCacheManager(**k)}


def _close(m) -> None:
    if isinstance(m, pc.PagedCacheManager):
        assert m.check() == []
        m.destroy()


# ============================================================== the register
def test_per_block_registration_keys_each_block_by_its_whole_prefix():
    """Blocks registered one at a time, each right after its append, are
    found by a chain lookup of the whole prompt, and by the pool's own
    lookups (the same hashes as ``cache_full_blocks`` gives)."""
    m = pc.PagedCacheManager(block_size=4, max_blocks=32)
    tokens = toks(12, base=100)
    t = m.create_block_table("r1")
    ids = []
    for i in range(3):
        b = m.allocate_block()
        t.block_ids.append(b.block_id)
        m.register_block_hash(b, tokens[4 * i:4 * i + 4])
        ids.append(b.block_id)
    assert m.find_shared_prefix(tokens + [1]) == (ids, [1])
    assert [b.block_id for b in m.get_computed_blocks(tokens)[0]] == ids
    # the same keys as the pool's own publication of the same prompt
    t2 = m.create_block_table("r2")
    other = m.get_new_blocks(3)
    for b in other:
        m.add_block_to_table(t2, b, 4)
    hashes = m.internals.ledger.hashes(tokens, 3, None)
    assert [m.internals.ledger.index.hash_of(b) for b in ids] == hashes
    m.delete_block_table("r2")
    # a block's tokens alone (position 0) find only the first block
    assert m.find_cached_block(tokens[4:8]) is None
    assert m.find_cached_block(tokens[:4]).block_id == ids[0]
    assert m.check() == []
    m.destroy()


def test_a_block_after_an_unknown_prefix_is_not_published():
    """A block appended after a block whose prefix this manager does not
    know (here one added with no registration) is published under nothing:
    no key is better than a wrong one."""
    m = pc.PagedCacheManager(block_size=4, max_blocks=32)
    t = m.create_block_table("r1")
    a, b = m.allocate_block(), m.allocate_block()
    t.block_ids.append(a.block_id)           # never registered
    t.block_ids.append(b.block_id)
    m.register_block_hash(b, toks(4, base=50))
    assert not b.hash_value and m.internals.ledger.index.hash_of(b.block_id) is None
    assert m.find_cached_block(toks(4, base=50)) is None
    # a block not just appended keeps the seed's reading: a prefix from 0
    c = m.allocate_block()
    m.register_block_hash(c, toks(8, base=60))
    assert m.find_shared_prefix(toks(8, base=60))[0] == []      # (block 0 is not cached)
    assert m.internals.ledger.index.find(m.internals.ledger.hashes(toks(8, base=60), 2, None)[1]) == c.block_id
    assert m.check() == []
    m.destroy()


def test_a_block_after_blocks_found_by_a_lookup_is_keyed_after_them():
    """Blocks a chain lookup found, appended at their positions, are a
    known prefix: a block registered after them extends the chain, which a
    later lookup then finds whole. A table position changed by an edit
    other than an append ends what is known."""
    m = pc.PagedCacheManager(block_size=4, max_blocks=32)
    P, A, B = toks(8, 10), toks(4, 40), toks(4, 50)
    t1 = m.create_block_table("r1")
    for i in range(2):
        b = m.allocate_block()
        t1.block_ids.append(b.block_id)
        m.register_block_hash(b, P[4 * i:4 * i + 4])
    found, rest = m.find_shared_prefix(P + A)
    assert len(found) == 2 and rest == A
    t2 = m.create_block_table("r2")
    for b in found:
        m.increment_ref(b)
        t2.block_ids.append(b)
    a = m.allocate_block()
    t2.block_ids.append(a.block_id)
    m.register_block_hash(a, A)
    assert m.find_shared_prefix(P + A + B) == (found + [a.block_id], B)
    # an edit in the middle: what follows is not published
    t3 = m.create_block_table("r3")
    for b in found + [a.block_id]:
        m.increment_ref(b)
        t3.block_ids.append(b)
    other = m.allocate_block()
    t3.block_ids[1] = other.block_id            # position 1 now holds another block
    c = m.allocate_block()
    t3.block_ids.append(c.block_id)
    m.register_block_hash(c, B)
    assert m.internals.ledger.index.hash_of(c.block_id) is None
    assert m.find_shared_prefix(P + A + B)[0] == found + [a.block_id]
    assert m.check() == []
    m.destroy()


# =================================================== BlockAwarePrefixCache
def _reuse(make, n_prompts=20, prefix_blocks=10, block_size=64, suffix=100):
    """``n_prompts`` prompts sharing ``prefix_blocks`` blocks, each through
    ``fetch_cache`` then ``store_cache`` (vllm-mlx's scheduler: fetch when the
    request is admitted, store when it finishes). Returns (hits, tokens saved)."""
    m = make(block_size=block_size, max_blocks=1000)
    cache = BlockAwarePrefixCache(None, m)
    prefix = toks(prefix_blocks * block_size, base=10_000)
    hits = saved = 0
    try:
        for i in range(n_prompts):
            prompt = prefix + toks(suffix, base=100_000 + 1_000 * i)
            table, remaining = cache.fetch_cache(f"req-{i}", prompt)
            if table is not None:
                hits += 1
                saved += len(prompt) - len(remaining)
            cache.store_cache(f"req-{i}", prompt, ["kv"])
        return hits, saved
    finally:
        _close(m)


@needs_seed
def test_block_aware_prefix_cache_saves_as_many_tokens_as_on_the_seed():
    seed, pool = _reuse(MANAGERS["seed"]), _reuse(MANAGERS["pool"])
    print(f"hits, tokens saved: seed {seed}, pool {pool}")
    assert seed == (19, 19 * 640)
    assert pool == seed


@needs_seed
def test_a_block_is_never_fetched_at_a_position_it_was_not_computed_at():
    """[X, Y] stored, then [Y, Z] fetched: the seed hands out the block
    computed for Y after X as the first block of [Y, Z] (its K/V are wrong
    there); a pool finds nothing. [X, Y, Z] still finds both blocks."""
    X, Y, Z = toks(4, 10), toks(4, 20), toks(4, 30)
    got = {}
    for name, make in MANAGERS.items():
        m = make(block_size=4, max_blocks=32)
        cache = BlockAwarePrefixCache(None, m)
        stored = list(cache.store_cache("xy", X + Y, ["kv"]).block_ids)
        table, remaining = cache.fetch_cache("yz", Y + Z)
        got[name] = (list(table.block_ids) if table is not None else None, remaining)
        if name == "pool":
            t3, rest = cache.fetch_cache("xyz", X + Y + Z)
            assert list(t3.block_ids) == stored and rest == Z
        _close(m)
        got[name + "_y"] = stored[1]
    assert got["seed"] == ([got["seed_y"]], Z)      # the seed's wrong-position hit
    assert got["pool"] == (None, Y + Z)


@needs_seed
def test_a_block_deduplicated_at_a_wrong_position_is_never_published():
    """``store_cache`` deduplicates each full block with
    ``find_cached_block(its tokens)``, which on a pool finds only a block
    cached at position 0: stored [Y, W], then [X, Y] puts that Y block at
    position 1 of its own table (as the seed does). A pool publishes nothing
    after it, so no later request is handed it: [X, Y, Z] finds X alone."""
    X, Y, W, Z = toks(4, 10), toks(4, 20), toks(4, 40), toks(4, 30)
    m = pc.PagedCacheManager(block_size=4, max_blocks=32)
    cache = BlockAwarePrefixCache(None, m)
    y0 = cache.store_cache("yw", Y + W, ["kv"]).block_ids[0]
    xy = list(cache.store_cache("xy", X + Y + Z, ["kv"]).block_ids)
    assert xy[1] == y0                          # the consumer's own dedup
    table, remaining = cache.fetch_cache("xyz", X + Y + Z + [1])
    assert list(table.block_ids) == xy[:1] and remaining == Y + Z + [1]
    assert m.internals.ledger.index.hash_of(xy[2]) is None      # Z after the misplaced Y: not published
    _close(m)
