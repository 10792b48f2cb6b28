"""What the tests of the L2 tier share (``test_l2_client``, ``test_l2_store``,
``test_l2_tier``, ``test_l2_codec``, ``test_l2_library``): a secret and a layout, random blocks,
and the fixtures around a real ``redis-server`` (``tests/_redis.py``;
skipped, with the reason, where there is none). ``redis_srv`` is
module-scoped: one server per test module. The fixtures are imported by name
into the test modules that use them.
"""

from __future__ import annotations

import numpy as np
import pytest

from shmcache.l2 import Codec, KVLayout, RedisL2

from _redis import redis_or_skip


SECRET = b"cluster secret"
LAY = KVLayout("tiny@abc", "float32", 4, 2, 2, 8)


@pytest.fixture(scope="module")
def redis_srv():
    srv = redis_or_skip()
    yield srv
    srv.stop()


@pytest.fixture
def rclient(redis_srv):
    if not redis_srv.alive:
        redis_srv.start()
    c = redis_srv.client()
    c.flushdb()
    yield c
    c.close()


@pytest.fixture
def stores():
    made = []

    def make(url, codec=None, **kw):
        s = RedisL2(url, codec or Codec(LAY, SECRET), **kw)
        made.append(s)
        return s
    yield make
    for s in made:
        s.close(flush_s=0)


def blocks_array(codec: Codec, n: int, seed: int) -> np.ndarray:
    lay = codec.layout
    return np.random.default_rng(seed).standard_normal(
        (lay.num_layers, n, 2, lay.num_kv_heads, lay.block_size, lay.head_dim)).astype(lay.np_dtype)
