"""A slow Redis costs at most ``timeout`` per lookup, as a whole (issue 29, item 3).

A real ``redis-server`` (``tests/_redis.py``; skipped, with the reason, where
there is none) behind :class:`~_drip_proxy.DripProxy`, which answers a byte
at a time: every socket read gets data well within its timeout, so only a
deadline on the whole lookup bounds it. Here the store (``RedisL2``) and the
library's ``PoolSequence``; ``test_server_l2_slow.py`` has the server.
"""

from __future__ import annotations

import time

import pytest

from _drip_proxy import DripProxy
from _l2 import blocks_array
from _l2 import rclient, redis_srv, stores  # pytest fixtures

__all__ = ["rclient", "redis_srv", "stores"]

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

DEADLINE = 0.3
SLACK = 0.25                    # a loaded 2-core machine's scheduling, not Redis


@pytest.fixture
def proxy(redis_srv):
    p = DripProxy("127.0.0.1", redis_srv.port)
    yield p
    p.close()


def test_a_dripping_redis_costs_one_deadline_per_lookup_and_frees_the_thread(
        rclient, proxy, stores):
    proxy.rate = 20                                   # bytes per second
    s = stores(proxy.url, timeout=DEADLINE, retry_s=0.2)
    chain = s.codec.chain(list(range(40)), 10)
    t0 = time.monotonic()
    lk = s.start(chain)
    assert time.monotonic() - t0 < 0.05              # the caller never waits on Redis
    lk2 = s.start(chain)                             # queued behind it
    assert lk.wait() == [] and lk2.wait() == []
    assert time.monotonic() - t0 < 2 * DEADLINE + SLACK
    st = s.stats()
    assert st["timeouts"] >= 1 and st["outages"] == 1 and st["up"] == 0
    # the aborted lookup's connection was closed: the fetch thread is free
    # again, and once Redis is fast the next lookup answers
    proxy.rate = None
    time.sleep(0.3)
    s.put(chain[:3], blocks_array(s.codec, 3, 1))
    assert s.flush(10)
    assert len(s.lookup(chain)) == 3
    assert s.stats()["up"] == 1


def test_a_slow_redis_delivers_a_prefix_by_the_deadline(rclient, proxy, stores):
    s = stores(proxy.url, timeout=DEADLINE, retry_s=0.2, batch_bytes=2500)
    chain = s.codec.chain(list(range(4 * 60)), 60)
    blocks = blocks_array(s.codec, 60, 2)
    s.put(chain, blocks)
    assert s.flush(10)
    assert len(s.lookup(chain)) == 60                # fast: all of it
    proxy.rate = 20_000                              # about 20 blocks a second
    t0 = time.monotonic()
    found = s.lookup(chain)
    assert time.monotonic() - t0 < DEADLINE + SLACK
    assert 0 < len(found) < 60, len(found)
    # what arrived is the run's first blocks, exact
    for i, payload in enumerate(found):
        assert s.codec.blocks_array([payload]).tobytes() == blocks[:, i:i + 1].tobytes()
    assert s.stats()["up"] == 1                      # too large for the deadline is not down
