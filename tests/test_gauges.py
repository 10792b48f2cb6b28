"""``Pool.gauges()`` (what /metrics and the CLI read) and the counter
properties agree with the manager's own statistics, and a snapshot's mapped
view (``MappedViews``, fsck's copy) reads the same structures."""

from __future__ import annotations

from shmcache import PagedCacheManager
from shmcache.shm import layout as L
from shmcache.pool.pool import MappedViews


def test_gauges_follow_the_pool():
    m = PagedCacheManager(block_size=4, max_blocks=16)
    try:
        g0 = m.pool.gauges()
        assert g0["blocks_total"] == 15 and g0["blocks_used"] == 0 and g0["blocks_free"] == 15
        blocks = m.get_new_blocks(3)
        m.create_block_table("r1")
        g = m.pool.gauges()
        assert g["blocks_used"] == 3 and g["blocks_free"] == 12
        assert g["free_list_blocks"] == m.pool.num_free == 12
        assert g["tables"] == m.pool.num_tables == 1
        assert g["ops"] > g0["ops"]                 # lock holds were counted
        s = m.get_stats()
        assert (g["hits"], g["misses"], g["evictions"]) == (s.cache_hits, s.cache_misses,
                                                            s.evictions)
        assert m.pool.epoch == m.pool.c[L.C_EPOCH]
        assert m.pool.dirty is False
        m.free_block_batch(blocks)
        assert m.pool.gauges()["blocks_used"] == 0
    finally:
        m.destroy()


def test_a_snapshot_maps_the_same_views():
    m = PagedCacheManager(block_size=4, max_blocks=16)
    try:
        m.get_new_blocks(2)
        p = m.pool
        snap = MappedViews()
        snap.name, snap.layout = p.name, p.layout
        snap.mm = bytearray(p.mm[:p.layout.arena_off])
        snap.corrupt = p.corrupt
        snap.map_views(arena=False)
        assert snap.arena is None
        assert snap.num_free == p.num_free and snap.epoch == p.epoch
        assert (snap.blocks["ref_count"] == p.blocks["ref_count"]).all()
    finally:
        m.destroy()
