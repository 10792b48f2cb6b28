"""A Redis server as the L2 of one layout (``shmcache.l2.store``): lookups
that stop at the first miss, batches, chunked values, bad values rejected and
counted, a full write queue that drops instead of waiting.

The tests run against a real ``redis-server`` started here
(``tests/_redis.py``) and are skipped, with the reason, when there is none.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from shmcache import l2 as L2
from shmcache.l2 import Codec, KVLayout

from _l2 import LAY, SECRET, blocks_array
from _l2 import rclient, redis_srv, stores  # pytest fixtures

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["rclient", "redis_srv", "stores"]

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------- with Redis
@pytest.mark.redis
def test_put_then_lookup_stops_at_the_first_miss(redis_srv, rclient, stores):
    s = stores(redis_srv.url)
    c = s.codec
    chain = c.chain(list(range(40)), 10)
    arr = blocks_array(c, 6, 3)
    assert s.put(chain[:6], arr)
    assert s.flush(10)
    assert s.stats()["writes"] == 6 and rclient.dbsize() == 6
    got = s.lookup(chain)
    assert len(got) == 6
    for i, parts in enumerate(got):
        assert np.array_equal(c.chunk_array(parts[0], 0), arr[:, i])
    st = s.stats()
    assert (st["hits"], st["misses"], st["lookups"]) == (6, 4, 1)
    assert st["read_bytes"] == 6 * (L2.HEADER_BYTES + LAY.block_bytes)
    assert st["written_bytes"] == st["read_bytes"]
    # a hole in the chain ends the run there (LRU may evict any block)
    rclient.delete(c.keys(chain[2])[0])
    assert len(s.lookup(chain)) == 2
    # the TTL is set when asked for
    t = stores(redis_srv.url, ttl=100)
    t.put(chain[6:7], blocks_array(c, 1, 4))
    assert t.flush(10)
    assert 0 < rclient.ttl(c.keys(chain[6])[0]) <= 100
    assert rclient.ttl(c.keys(chain[0])[0]) == -1


@pytest.mark.redis
def test_lookup_across_many_batches(redis_srv, rclient, stores):
    c = Codec(LAY, SECRET)
    s = stores(redis_srv.url, c, batch_bytes=3 * LAY.block_bytes)   # 2 blocks per MGET
    chain = c.chain(list(range(4 * 21)), 21)
    s.put(chain, blocks_array(c, 21, 5))
    assert s.flush(10)
    assert len(s.lookup(chain)) == 21


@pytest.mark.redis
def test_chunked_values_round_trip_through_redis(redis_srv, rclient, stores):
    lay = KVLayout("big@x", "bfloat16", 4, 5, 2, 8)
    c = Codec(lay, SECRET, max_value_bytes=2 * lay.layer_bytes)
    s = stores(redis_srv.url, c)
    chain = c.chain(list(range(12)), 3)
    arr = blocks_array(c, 3, 6)
    s.put(chain, arr)
    assert s.flush(10)
    assert rclient.dbsize() == 9
    got = s.lookup(chain)
    assert len(got) == 3
    for i, parts in enumerate(got):
        whole = np.concatenate([c.chunk_array(p, j) for j, p in enumerate(parts)])
        assert np.array_equal(whole, arr[:, i])
    rclient.delete(c.keys(chain[1])[2])                 # one chunk gone: the block is a miss
    assert len(s.lookup(chain)) == 1


@pytest.mark.redis
def test_corrupt_truncated_and_wrong_layout_values_are_rejected_and_counted(
        redis_srv, rclient, stores, caplog):
    s = stores(redis_srv.url)
    c = s.codec
    chain = c.chain(list(range(12)), 3)
    s.put(chain, blocks_array(c, 3, 7))
    assert s.flush(10)
    key = c.keys(chain[1])[0]
    good = rclient.get(key)
    other = Codec(KVLayout("tiny@abc", "float16", 4, 2, 2, 8), SECRET)
    bads = [good[:-7],                                                  # truncated
            good[:-3] + bytes([good[-3] ^ 0x10]) + good[-2:],          # a flipped bit
            other.encode(chain[1], 0, bytes(other.layout.block_bytes)),  # another layout
            c.encode(chain[0], 0, good[L2.HEADER_BYTES:]),             # another key's value
            b"garbage"]
    with caplog.at_level(logging.WARNING, logger="shmcache.l2"):
        for i, bad in enumerate(bads, 1):
            rclient.set(key, bad)
            assert len(s.lookup(chain)) == 1, f"value {i} was accepted"
            assert s.stats()["rejected"] == i
    warned = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(warned) == 1                              # once, not per value
    rclient.set(key, good)
    assert len(s.lookup(chain)) == 3


@pytest.mark.redis
def test_a_full_queue_drops_instead_of_waiting(redis_srv, rclient, stores):
    c = Codec(LAY, SECRET)
    s = stores(redis_srv.url, c, queue_bytes=2 * LAY.block_bytes)
    redis_srv.pause()                       # the writer's send stalls: the queue fills
    try:
        chain = c.chain(list(range(4 * 40)), 40)
        t0 = time.monotonic()
        ok = [s.put(chain[i:i + 1], blocks_array(c, 1, i)) for i in range(40)]
        assert time.monotonic() - t0 < 0.5
        assert not all(ok) and s.stats()["dropped"] >= 30
    finally:
        redis_srv.resume()
