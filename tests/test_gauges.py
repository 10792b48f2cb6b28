"""``Pool.gauges()`` (what /metrics and the CLI read) and the counter
properties agree with the manager's own statistics, and a snapshot's mapped
view (``MappedViews``, fsck's copy) reads the same structures."""

from __future__ import annotations

from shmcache import PagedCacheManager
from shmcache.shm import layout as L
from shmcache.pool.pool import MappedViews, Pool
from shmcache.shm.counters import Counters


def test_gauges_follow_the_pool():
    m = PagedCacheManager(block_size=4, max_blocks=16)
    try:
        g0 = m.pool.gauges()
        assert g0["blocks_total"] == 15 and g0["blocks_used"] == 0 and g0["blocks_free"] == 15
        blocks = m.get_new_blocks(3)
        m.create_block_table("r1")
        g = m.pool.gauges()
        assert g["blocks_used"] == 3 and g["blocks_free"] == 12
        assert g["free_list_blocks"] == m.pool.counters.num_free == 12
        assert g["tables"] == m.pool.counters.num_tables == 1
        assert g["ops"] > g0["ops"]                 # lock holds were counted
        s = m.get_stats()
        assert (g["hits"], g["misses"], g["evictions"]) == (s.cache_hits, s.cache_misses,
                                                            s.evictions)
        assert m.pool.counters.epoch == m.pool.c[L.C_EPOCH]
        assert m.pool.counters.dirty == 0
        m.free_block_batch(blocks)
        assert m.pool.gauges()["blocks_used"] == 0
    finally:
        m.destroy()


def test_a_snapshot_maps_the_same_views():
    m = PagedCacheManager(block_size=4, max_blocks=16)
    try:
        m.get_new_blocks(2)
        p = m.pool
        snap = MappedViews(bytearray(p.mm[:p.layout.arena_off]), p.layout, p.corrupt,
                           arena=False)
        assert snap.arena is None
        assert snap.counters.num_free == p.counters.num_free and snap.counters.epoch == p.counters.epoch
        assert (snap.blocks["ref_count"] == p.blocks["ref_count"]).all()
    finally:
        m.destroy()


def test_the_pool_binds_every_view_of_its_views_object():
    """``Pool`` reads its views through the same names as ``MappedViews``
    owns them (``Pool.bind_views``): one list, declared on both."""
    assert set(MappedViews.NAMES) == {k for k in Pool.__annotations__ if k != "views"}
    m = PagedCacheManager(block_size=4, max_blocks=16)
    try:
        p = m.pool
        for k in MappedViews.NAMES:
            assert getattr(p, k) is getattr(p.views, k), k
    finally:
        m.destroy()


def test_every_counter_word_has_one_property():
    """``Counters`` names every ``C_*`` word of layout (``COUNTER_WORDS``,
    built from the constants), each a distinct word, read and set through
    its property; the named writes change only their own words."""
    import numpy as np
    words = L.COUNTER_WORDS
    assert len(set(words.values())) == len(words)
    assert {"dirty", "num_free", "epoch", "holder", "pure", "turn_now"} <= set(words)
    assert all(0 <= i < L.NUM_COUNTERS for i in words.values())
    a = np.zeros(L.NUM_COUNTERS, np.int64)
    k = Counters.from_buffer(a)
    for name, i in words.items():
        setattr(k, name, i + 100)
        assert a[i] == i + 100 and getattr(k, name) == i + 100
    a[:] = 0
    k.count_hits(3)
    k.count_misses()
    k.num_free -= 2
    assert k.bump_epoch() == 1
    assert (k.hits, k.misses, k.num_free, k.epoch) == (3, 1, -2, 1)
    k.table_created()
    k.pure_detached()                   # (never below 0)
    assert (k.num_tables, k.pure) == (1, 0)
    assert int(a.sum()) == 3 + 1 - 2 + 1 + 1
    k.l2_hits = 7
    assert k.l2()["hits"] == 7 == a[L.C_L2["hits"]]


def test_counters_are_named_not_indexed():
    """``counters.WORDS`` is the one name -> word map: ``Counters``' fields
    are its names (and the ones declared for mypy), ``word`` and ``add``
    read it, and an unknown name is a ValueError naming it."""
    import numpy as np
    import pytest
    from shmcache.shm.counters import WORDS
    assert set(Counters.__annotations__) == set(WORDS)
    assert {n for n, _ in Counters._fields_ if not n.startswith("_spare")} == set(WORDS)
    assert Counters.word("tokens") == L.C_TOKENS and Counters.word("l2_hits") == L.C_L2["hits"]
    a = np.zeros(L.NUM_COUNTERS, np.int64)
    k = Counters.from_buffer(a)
    k.add("l2_hits", 3)
    k.add("tokens", 5)
    assert a[L.C_L2["hits"]] == 3 and a[L.C_TOKENS] == 5 and int(a.sum()) == 8
    for bad in ("l2_hitz", "hits ", 16):
        with pytest.raises(ValueError, match=repr(bad)):
            k.add(bad, 1)        # type: ignore[arg-type]
    assert int(a.sum()) == 8


def test_add_counters_takes_the_shared_counters_by_name():
    """``add_counters({name: delta})`` adds to the L2 tier's counters (summed
    over calls); an unknown name, or one of the pool's own counters, is a
    ValueError naming it, and nothing is added."""
    import pytest
    m = PagedCacheManager(block_size=4, max_blocks=16)
    try:
        m.add_counters({"l2_hits": 2, "l2_writes": 1})
        m.add_counters({"l2_hits": 1})
        assert (m.l2_counters()["hits"], m.l2_counters()["writes"]) == (3, 1)
        before = m.pool.counter_array.copy()
        with pytest.raises(ValueError, match="'l2_hitz'"):
            m.add_counters({"l2_misses": 1, "l2_hitz": 1})
        with pytest.raises(ValueError, match="'hits' is the pool's own"):
            m.add_counters({"l2_misses": 1, "hits": 1})
        with pytest.raises(ValueError, match="16"):
            m.add_counters({16: 1})                     # an index is no name
        after = m.pool.counter_array
        assert (after[16:27] == before[16:27]).all() and after[L.C_HITS] == before[L.C_HITS]
    finally:
        m.destroy()
