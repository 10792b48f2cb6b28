"""The Redis connection of the L2 tier and its faults (``shmcache.l2.client``):
URLs checked and redacted; a Redis that is down or does not answer never
raises, costs one short timeout, is counted, warned about once and retried.

The fault tests run against a real ``redis-server`` started here
(``tests/_redis.py``) and are skipped, with the reason, when there is none.
"""

from __future__ import annotations

import logging
import time

import pytest

from shmcache import l2 as L2

from _l2 import blocks_array
from _l2 import rclient, redis_srv, stores  # pytest fixtures
from _redis import SKIP_REASON, RedisServer, find_redis_server, free_port

# the fixtures imported above, listed so that pyflakes counts them as used
__all__ = ["rclient", "redis_srv", "stores"]

pytestmark = pytest.mark.timeout(120)


def test_check_url_and_redact():
    assert L2.check_url("redis://127.0.0.1:6379/0")
    assert L2.check_url("rediss://h:1")
    for bad in ("http://h:1", "redis://h:port", "redis://:1", "redis://h:1/db"):
        with pytest.raises(ValueError):
            L2.check_url(bad)
    assert "hunter2" not in L2.redact("redis://user:hunter2@h:1/0")
    assert L2.redact("redis://h:1/0") == "redis://h:1/0"


@pytest.mark.redis
def test_redis_down_never_raises_is_counted_warned_once_and_retried(stores, caplog):
    binary = find_redis_server()
    if binary is None:
        pytest.skip(SKIP_REASON)
    port = free_port()                      # nothing listens there (yet)
    url = f"redis://127.0.0.1:{port}/0"
    s = stores(url, timeout=0.05, retry_s=0.5)
    c = s.codec
    chain = c.chain(list(range(8)), 2)
    with caplog.at_level(logging.WARNING, logger="shmcache.l2"):
        t0 = time.monotonic()
        assert s.lookup(chain) == []
        assert time.monotonic() - t0 < 0.5
        st = s.stats()
        assert st["outages"] == 1 and st["errors"] + st["timeouts"] >= 1 and st["up"] == 0
        # while down: no network at all, and writes are dropped (counted)
        for _ in range(5):
            assert s.lookup(chain) == []
        assert not s.put(chain, blocks_array(c, 2, 8))
        assert s.stats()["dropped"] == 2
        assert s.stats()["lookups"] == 1
        time.sleep(0.6)
        assert s.lookup(chain) == []            # tried again: still down, not warned again
        assert s.stats()["outages"] == 1
        srv = RedisServer(binary, port)         # Redis comes (back)
        try:
            time.sleep(0.6)
            assert s.put(chain, blocks_array(c, 2, 9))
            assert s.flush(10)
            assert s.stats()["up"] == 1 and s.stats()["writes"] == 2
            assert len(s.lookup(chain)) == 2
            # killed: the next lookup fails fast, a second outage
            srv.kill()
            t0 = time.monotonic()
            assert s.lookup(chain) == []
            assert time.monotonic() - t0 < 0.5
            assert s.stats()["outages"] == 2
        finally:
            srv.stop()
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("is unavailable" in m for m in msgs) == 2, msgs
    assert sum("answers again" in m for m in msgs) == 1, msgs


@pytest.mark.redis
def test_a_redis_that_does_not_answer_costs_one_timeout(redis_srv, rclient, stores):
    s = stores(redis_srv.url, timeout=0.1, retry_s=30)
    chain = s.codec.chain(list(range(8)), 2)
    assert s.ping()
    redis_srv.pause()
    try:
        t0 = time.monotonic()
        assert s.lookup(chain) == []
        took = time.monotonic() - t0
        assert took < 0.5, took
        assert s.stats()["timeouts"] == 1 and s.stats()["up"] == 0
        t0 = time.monotonic()
        assert s.lookup(chain) == []            # down: not even tried
        assert time.monotonic() - t0 < 0.01
    finally:
        redis_srv.resume()
