"""The L2 of a pool manager (``shmcache.l2.tier``): a prefix one pool wrote
is loaded bit-exact by another; salts, secrets, models and layouts do not
share; a full pool loads nothing; the counters reach the pool.

The tests run real named pools (``make_pool``) against a real
``redis-server`` started here (``tests/_redis.py``) and are skipped, with
the reason, when there is none.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from shmcache import l2 as L2
from shmcache.l2 import L2Tier

from _l2 import SECRET
from _l2 import rclient, redis_srv  # pytest fixtures

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["rclient", "redis_srv"]

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------- with pools
def _fill(mgr, tokens, extra=None, seed=0):
    """A table of ``tokens`` (whole blocks) with random K/V, published in L1."""
    bs, lay = mgr.block_size, mgr.layout
    t = mgr.create_block_table(f"fill-{seed}-{len(tokens)}")
    got = mgr.prepare_append(t, len(tokens))
    rng = np.random.default_rng(seed)
    for b in got:
        for layer in range(lay.num_layers):
            k, v = (mx.array(rng.standard_normal((lay.num_kv_heads, bs, lay.head_dim))
                             .astype(np.float32)) for _ in range(2))
            mgr.write_kv(b.block_id, layer, k, v)
    mgr.cache_full_blocks(t.block_ids, tokens, 0, len(tokens) // bs, extra)
    return t


POOL = dict(block_size=4, max_blocks=32, num_layers=3, num_kv_heads=2, head_dim=8)


@pytest.mark.redis
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefix_written_by_one_pool_is_loaded_by_another_bit_exact(
        redis_srv, rclient, make_pool, dtype, chunked):
    kw = dict(max_value_bytes=1) if chunked else {}         # one layer per value when chunked
    a = make_pool(dtype=dtype, **POOL)
    b = make_pool(dtype=dtype, **POOL)
    ta = L2Tier(a, redis_srv.url, model_id="m@1", secret=SECRET, **kw)
    tb = L2Tier(b, redis_srv.url, model_id="m@1", secret=SECRET, **kw)
    assert len(ta.codec.chunks) == (3 if chunked else 1)
    try:
        toks = list(range(50, 74))                             # 6 blocks
        t = _fill(a, toks)
        chain = ta.chain(toks, 6)
        ta.write_back(t.block_ids, chain)
        assert ta.store.flush(10)
        # host B: an L1 hit of 2 blocks of its own, then L2
        _fill(b, toks[:8], seed=1)           # (other K/V: B's L1 copy of blocks 0-1 is its own)
        table = b.create_block_table("req")
        blocks, cached = b.acquire_computed_blocks(toks)
        assert cached == 8
        for blk in blocks:
            b.add_block_to_table(table, blk, 4)
        assert tb.load(table, toks, None, 2, tb.chain(toks, 6)) == 4
        assert table.num_tokens == 24
        ids = table.block_ids
        assert (L2.read_blocks(b, ids[2:]).tobytes()          # bit-exact
                == L2.read_blocks(a, t.block_ids[2:]).tobytes())
        for layer in range(3):                                 # and through read_kv
            for x, y in zip(b.read_kv(ids[2:], layer), a.read_kv(t.block_ids[2:], layer)):
                assert mx.array_equal(x, y).item()
        # published in B's L1: the next lookup finds all six there
        assert b.acquire_computed_blocks(toks)[1] == 24
        assert tb.stats()["hits"] == 4 and b.check() == []
        b.delete_block_table("req")
    finally:
        ta.close()
        tb.close()


@pytest.mark.redis
def test_salts_secrets_and_layouts_do_not_share(redis_srv, rclient, make_pool):
    a = make_pool(dtype="float32", **POOL)
    same = make_pool(dtype="float32", **POOL)
    wider = make_pool(dtype="float32", **dict(POOL, head_dim=16))
    tiers = []

    def tier(m, **kw):
        kw = dict(dict(model_id="m@1", secret=SECRET), **kw)
        tiers.append(L2Tier(m, redis_srv.url, **kw))
        return tiers[-1]
    try:
        toks = list(range(16))
        ta = tier(a)
        t = _fill(a, toks, extra=("tenant-1",))
        ta.write_back(t.block_ids, ta.chain(toks, 4, ("tenant-1",)))
        assert ta.store.flush(10)

        def loaded(tr, m, extra):
            table = m.create_block_table(f"r{len(tiers)}-{extra}")
            n = tr.load(table, toks, extra, 0, tr.chain(toks, 4, extra))
            m.delete_block_table(table.request_id)
            return n
        assert loaded(tier(same), same, ("tenant-2",)) == 0          # another tenant
        assert loaded(tier(same), same, None) == 0                   # no tenant
        assert loaded(tier(same, secret=b"x"), same, ("tenant-1",)) == 0   # another secret
        assert loaded(tier(same, model_id="m@2"), same, ("tenant-1",)) == 0  # another model
        assert loaded(tier(wider), wider, ("tenant-1",)) == 0        # another layout
        assert loaded(tier(same), same, ("tenant-1",)) == 4          # the same: shared
    finally:
        for t in tiers:
            t.close()


@pytest.mark.redis
def test_load_with_a_full_pool_loads_nothing_and_leaks_nothing(redis_srv, rclient, make_pool):
    a = make_pool(dtype="float32", **POOL)
    b = make_pool(dtype="float32", **dict(POOL, max_blocks=4))      # 3 usable blocks
    ta = L2Tier(a, redis_srv.url, model_id="m@1", secret=SECRET)
    tb = L2Tier(b, redis_srv.url, model_id="m@1", secret=SECRET)
    try:
        toks = list(range(20))
        t = _fill(a, toks)
        ta.write_back(t.block_ids, ta.chain(toks, 5))
        assert ta.store.flush(10)
        table = b.create_block_table("r")
        assert tb.load(table, toks, None, 0, tb.chain(toks, 5)) == 0
        assert table.num_tokens == 0 and b.get_stats().allocated_blocks == 1   # the null block
        b.delete_block_table("r")
        assert b.check() == []
    finally:
        ta.close()
        tb.close()


@pytest.mark.redis
def test_counters_reach_the_pool_from_every_tier_without_waiting(redis_srv, rclient, make_pool):
    """Two tiers on one pool (two processes' worth): their counters sum in
    the pool's (layout.C_L2) from the writer thread, within ~0.5 s, and at
    close; the serving calls never flush them themselves."""
    from shmcache.shm import layout
    a = make_pool(dtype="float32", **POOL)
    t1 = L2Tier(a, redis_srv.url, model_id="m@1", secret=SECRET)
    t2 = L2Tier(a, redis_srv.url, model_id="m@1", secret=SECRET)
    try:
        toks = list(range(12))
        t = _fill(a, toks)
        t1.write_back(t.block_ids, t1.chain(toks, 3))
        assert t1.store.flush(10)
        assert a.l2_counters()["writes"] in (0, 3)     # not yet, or already flushed
        assert t2.store.lookup(t2.chain(toks, 3)) and t2.stats()["hits"] == 3
        deadline = time.monotonic() + 5
        while a.l2_counters()["hits"] < 3 or a.l2_counters()["writes"] < 3:
            assert time.monotonic() < deadline, a.l2_counters()
            time.sleep(0.05)
        c = a.l2_counters()
        assert set(c) == set(layout.L2_COUNTERS)
        assert (c["writes"], c["hits"], c["lookups"]) == (3, 3, 1)
        assert c["written_bytes"] == t1.stats()["written_bytes"] > 0
        assert c["read_bytes"] == t2.stats()["read_bytes"] == c["written_bytes"]
        # what is counted just before close reaches the pool at close
        t2.store.c.add("rejected", 2)
        t2.close()
        assert a.l2_counters()["rejected"] == 2
    finally:
        t1.close()
        t2.close()
