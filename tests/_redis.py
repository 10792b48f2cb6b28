"""A real ``redis-server`` for the tests of the L2 tier (``shmcache.l2``).

The server is ``tools/redis_server.py``'s :class:`RedisServer` (127.0.0.1, a
free port, no persistence, allkeys-lru, its own temporary directory; kill,
pause, resume, restart on the same port). :func:`redis_or_skip` is what the
fixtures call: with no ``redis-server`` on this machine (``apt-get install
redis-server``; ``make test`` and ``.ci/run`` install it where root), the
test is SKIPPED with that reason, never passed.
"""

from __future__ import annotations

import pytest

from tools.redis_server import RedisServer, find_redis_server, free_port

__all__ = ["SKIP_REASON", "RedisServer", "find_redis_server", "free_port", "redis_or_skip"]

SKIP_REASON = ("redis-server not found: the L2 tests need a real Redis "
               "(apt-get install redis-server; make test installs it where root)")


def redis_or_skip() -> RedisServer:
    binary = find_redis_server()
    if binary is None:
        pytest.skip(SKIP_REASON)
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis Python package is not installed (pip install redis)")
    return RedisServer(binary)
