"""A real ``redis-server`` for the tests of the L2 tier (``shmcache.l2``).

:class:`RedisServer` runs ``redis-server --port <free> --bind 127.0.0.1
--save '' --appendonly no`` (no persistence: a restart is an empty Redis),
and can kill, pause (SIGSTOP: a Redis that does not answer), resume and
restart it on the same port. :func:`redis_or_skip` is what the fixtures
call: with no ``redis-server`` on this machine (``apt-get install
redis-server``; ``make test`` and ``.ci/run`` install it where root), the
test is SKIPPED with that reason, never passed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Optional

import pytest

SKIP_REASON = ("redis-server not found: the L2 tests need a real Redis "
               "(apt-get install redis-server; make test installs it where root)")


def find_redis_server() -> Optional[str]:
    """``$SHMCACHE_REDIS_SERVER`` ("none": act as if there were none), or
    redis-server on the PATH or where Debian puts it."""
    env = os.environ.get("SHMCACHE_REDIS_SERVER")
    if env:
        return None if env == "none" else env
    return (shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server",
                     "/usr/local/bin/redis-server") if os.access(p, os.X_OK)), None))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, binary: str, port: Optional[int] = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self, timeout: float = 20) -> "RedisServer":
        assert self.proc is None or self.proc.poll() is not None
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client(1).ping():
                    return self
            except Exception:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} "
                                   f"(port {self.port} taken?)")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer within {timeout} s")
            time.sleep(0.05)

    def client(self, timeout: float = 5):
        import redis
        return redis.Redis.from_url(self.url, socket_timeout=timeout,
                                    socket_connect_timeout=timeout)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash: no clean shutdown."""
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> "RedisServer":
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def redis_or_skip() -> RedisServer:
    binary = find_redis_server()
    if binary is None:
        pytest.skip(SKIP_REASON)
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis Python package is not installed (pip install redis)")
    return RedisServer(binary)
