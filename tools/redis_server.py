"""A throwaway ``redis-server`` for the L2 tests, benchmarks and ``make run --l2 local``.

:class:`RedisServer` runs ``redis-server`` bound to 127.0.0.1 on a free port,
with no persistence (``--save '' --appendonly no``: a restart is an empty
Redis), ``maxmemory-policy allkeys-lru`` (Redis's own eviction, as the L2
tier expects) and its working directory in a temporary directory of its
own. It can kill (SIGKILL, as a crash), pause (SIGSTOP: a Redis that does
not answer), resume and restart it on the same port. :meth:`RedisServer.stop`
ends it and removes the directory; it also runs at interpreter exit and when
starting fails.

    python -m tools.redis_server [--port N] [--maxmemory 1gb]

runs one in the foreground and prints its URL until Ctrl-C.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

SEARCH = ("/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server")


def find_redis_server() -> Optional[str]:
    """``$SHMCACHE_REDIS_SERVER`` ("none": act as if there were none), or
    redis-server on the PATH or where Debian puts it; None if none."""
    env = os.environ.get("SHMCACHE_REDIS_SERVER")
    if env:
        return None if env == "none" else env
    return shutil.which("redis-server") or next(
        (p for p in SEARCH if os.access(p, os.X_OK)), None)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process (see the module docstring).

    Args:
        binary: the redis-server executable (default: :func:`find_redis_server`).
        port: the port (default: a free one).
        maxmemory: Redis's ``maxmemory`` ("4gb"; default: none, no limit).
        start: start it now.
    Raises:
        FileNotFoundError: no redis-server.
        RuntimeError: it did not start (port taken, ...); nothing is left.
    """

    def __init__(self, binary: Optional[str] = None, port: Optional[int] = None,
                 maxmemory: Optional[str] = None, start: bool = True) -> None:
        self.binary = binary or find_redis_server()
        if self.binary is None:
            raise FileNotFoundError("redis-server not found (apt-get install redis-server)")
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Optional[subprocess.Popen] = None
        self.dir: Optional[str] = None
        if start:
            self.start()

    @property
    def argv(self) -> list:
        """The command line (its --dir is filled in at start)."""
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning",
                "--maxmemory-policy", "allkeys-lru"]
        if self.maxmemory:
            argv += ["--maxmemory", str(self.maxmemory)]
        if self.dir:
            argv += ["--dir", self.dir]
        return argv

    def start(self, timeout: float = 20) -> "RedisServer":
        """Start it (again, on the same port) and wait until it answers PING."""
        assert self.proc is None or self.proc.poll() is not None
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="shmcache-redis-")
            atexit.register(self.stop)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                c = self.client(1)
                try:
                    if c.ping():
                        return self
                finally:
                    c.close()
            except Exception:
                pass
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise RuntimeError(f"redis-server exited with {code} (port {self.port} taken?)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer within {timeout} s")
            time.sleep(0.05)

    def client(self, timeout: float = 5):
        """A redis-py client of this server."""
        import redis
        return redis.Redis.from_url(self.url, socket_timeout=timeout,
                                    socket_connect_timeout=timeout)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash: no clean shutdown (the directory stays for a restart)."""
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: it accepts connections and answers nothing."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> "RedisServer":
        """Killed and started again, empty, on the same port."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 10 s) and remove its directory."""
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
            atexit.unregister(self.stop)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.redis_server",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=None, help="default: a free port")
    ap.add_argument("--maxmemory", default=None, help="e.g. 1gb (default: no limit)")
    a = ap.parse_args(argv)
    try:
        srv = RedisServer(port=a.port, maxmemory=a.maxmemory)
    except (FileNotFoundError, RuntimeError) as e:
        print(f"redis_server: {e}", file=sys.stderr)
        return 1
    print(srv.url, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while srv.alive:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
