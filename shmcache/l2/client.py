"""The Redis connection of the L2 tier and its fault handling.

* :func:`check_url`, :func:`redact`: the URL (redis://, rediss://, unix://),
  checked before anything connects, and shown without its password.
* :func:`connect`: a redis-py client whose every socket operation is bounded
  by one short timeout and never retried inside redis-py.
* :class:`Health`: up or down. The first failure of an outage is counted
  and warned about once; while down, nothing touches the network until
  ``retry_s`` has passed; the first success after it says so and L2 is used
  again.
* :class:`Counters`: this process's counts (``layout.L2_COUNTERS``), with the
  deltas since the last :meth:`Counters.take` for the pool-wide counters.
"""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import urlsplit, urlunsplit

from ..shm.layout import L2_COUNTERS as COUNTERS

log = logging.getLogger("shmcache.l2")


def check_url(url: str) -> str:
    """The URL if redis-py can take it.

    Returns:
        ``url`` unchanged.
    Raises:
        ValueError: not redis://HOST:PORT[/DB] (rediss:// for TLS,
            unix:///path for a socket), a bad port or a non-numeric database.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"{redact(url)}: not a redis://HOST:PORT[/DB] URL (rediss:// for TLS, "
                         f"unix:///path for a socket)")
    if parts.scheme != "unix":
        if not parts.hostname:
            raise ValueError(f"{redact(url)}: no host")
        try:
            parts.port  # noqa: B018  (the property raises ValueError on a bad port)
        except ValueError:
            raise ValueError(f"{redact(url)}: bad port") from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"{redact(url)}: the database must be a number, not {db!r}")
    return url


def redact(url: str) -> str:
    """The URL without its password (for logs)."""
    try:
        p = urlsplit(url)
    except ValueError:
        return "<bad url>"
    if p.password is None:
        return url
    host = p.hostname or ""
    netloc = f"{p.username or ''}:***@{host}" + (f":{p.port}" if p.port else "")
    return urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))


def connect(url: str, timeout: float):
    """A redis-py client of ``url`` (it connects on first use).

    Raises:
        RuntimeError: redis-py is not installed.
    """
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise RuntimeError("the L2 tier needs the redis package (pip install redis)") from None
    # NOTE: no retries inside redis-py (its default retries ten times with
    # backoff): a fault must cost one timeout, and we retry on our own clock.
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
                                health_check_interval=0, socket_keepalive=True)


def is_timeout(e: BaseException) -> bool:
    import redis
    return isinstance(e, (redis.TimeoutError, TimeoutError))


def is_redis_fault(e: BaseException) -> bool:
    """A fault of Redis or of the network (not a bug of ours)."""
    return isinstance(e, OSError) or type(e).__module__.startswith("redis")


class Counters:
    """This process's L2 counters (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.v = dict.fromkeys(COUNTERS, 0)
        self._taken = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.v[name] += n

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.v)

    def take(self) -> dict:
        """The non-zero changes since the last call."""
        with self._lock:
            out = {k: v - self._taken[k] for k, v in self.v.items() if v != self._taken[k]}
            self._taken = dict(self.v)
        return out


class Health:
    """Up or down (an outage), shared by the lookups and the writer thread.

    Args:
        name: the server, as logged (:func:`redact`).
        retry_s: seconds between attempts while down.
        counters: where timeouts, errors and outages are counted.
    """

    def __init__(self, name: str, retry_s: float, counters: Counters) -> None:
        self.name = name
        self.retry_s = retry_s
        self.c = counters
        self.down = False
        self.retry_at = 0.0
        self._lock = threading.Lock()
        self._warned: set = set()

    def usable(self) -> bool:
        """Up, or down long enough to try again."""
        return not self.down or time.monotonic() >= self.retry_at

    def failed(self, e: BaseException) -> None:
        """An operation failed for ``e``: down until ``retry_s`` from now."""
        self.c.add("timeouts" if is_timeout(e) else "errors")
        with self._lock:
            self.retry_at = time.monotonic() + self.retry_s
            if self.down:
                return
            self.down = True
        self.c.add("outages")
        log.warning("L2 %s is unavailable (%s: %s): serving from L1 alone; retrying every %g s",
                    self.name, type(e).__name__, e, self.retry_s)

    def ok(self) -> None:
        """An operation succeeded: up."""
        if self.down:
            with self._lock:
                was, self.down = self.down, False
            if was:
                log.warning("L2 %s answers again: using it", self.name)

    def warn_once(self, what: str, msg: str, *args) -> None:
        """Log ``msg`` as a warning the first time for ``what``, then at debug."""
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)
