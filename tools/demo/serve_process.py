"""``shmcache serve`` as a subprocess of the demo driver: start, scrape, kill workers, stop.

With ``--l2 local`` it also runs a throwaway ``redis-server``
(``tools/redis_server.py``) for the server's L2, stopped with it.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import psutil

STOP_TIMEOUT_S = 40.0     # the server's graceful stop (5 s) plus its workers' (10 s), with room
WORKER_MODULE = "workers.worker.main"


class SupervisorError(Exception):
    """The run cannot go on (the server did not start, or died)."""


def _shmcache_command() -> list:
    exe = os.path.join(os.path.dirname(sys.executable), "shmcache")
    if os.access(exe, os.X_OK):
        return [exe]
    return [sys.executable, "-c", "import sys; from shmcache.cli import main; sys.exit(main())"]


def _die_with_parent() -> None:
    # The server gets SIGTERM if this process dies without stopping it.
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:
        pass


class Server:
    """``shmcache serve`` as a subprocess: start, scrape, kill workers, stop."""

    URL_RE = re.compile(r" on (http://\S+) ")
    POOL_RE = re.compile(r"\(pool (\S+): ")

    def __init__(self, a) -> None:
        self.a = a
        self.proc = None
        self.url = self.pool = None
        self.log: deque = deque(maxlen=400)
        self._started = threading.Event()
        self.worker_pids: set = set()
        self._http = None
        self.redis = None          # the local redis-server of --l2 local
        self.l2_url = None

    def start(self, max_blocks: int) -> None:
        cmd = _shmcache_command() + [
            "serve", "--host", "127.0.0.1", "--port", "0", "--workers", str(self.a.workers),
            "--max-blocks", str(max_blocks), "--block-size", str(self.a.block_size),
            "--log-level", "info"]
        if self.a.model:
            cmd += ["--model", self.a.model]
        if self.a.l2:
            self.l2_url = self._l2_url()
            cmd += ["--l2", self.l2_url]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace",
                                     start_new_session=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._read_log, daemon=True, name="server-log").start()
        deadline = time.monotonic() + self.a.startup_timeout
        while not self._started.wait(0.2):
            if self.proc.poll() is not None:
                self._started.wait(1.0)          # the reader may still hold its last lines
                raise SupervisorError(f"shmcache serve exited with {self.proc.returncode} "
                                      "before it was ready")
            if time.monotonic() > deadline:
                raise SupervisorError(f"shmcache serve was not ready after "
                                      f"{self.a.startup_timeout:g} s")
        import httpx
        self._http = httpx.Client(base_url=self.url, timeout=30.0)
        while True:
            try:
                if self._http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SupervisorError("shmcache serve never answered /health with 200")
            time.sleep(0.1)
        if self.pool is None:                    # the backend's default name
            self.pool = f"serve-{self.proc.pid}"
        self.model_id = self._http.get("/v1/models").json()["data"][0]["id"]
        self.workers()

    def _l2_url(self) -> str:
        if self.a.l2 != "local":
            return self.a.l2
        try:
            from tools.redis_server import RedisServer
            self.redis = RedisServer()
        except (ImportError, FileNotFoundError, RuntimeError) as e:
            raise SupervisorError(f"--l2 local: {e}") from None
        return self.redis.url

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.log.append(line)
            if self.pool is None and (m := self.POOL_RE.search(line)):
                self.pool = m.group(1)
            if self.url is None and (m := self.URL_RE.search(line)):
                self.url = m.group(1)
                self._started.set()

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(list(self.log)[-n:])

    def metrics(self) -> dict:
        """The unlabelled samples of /metrics: {name: value}."""
        out = {}
        for line in self._http.get("/metrics").text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def workers(self) -> list:
        """The server's live worker processes (remembered, to check they end)."""
        try:
            kids = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        out = []
        for k in kids:
            try:
                if WORKER_MODULE in " ".join(k.cmdline()):
                    out.append(k)
                    self.worker_pids.add((k.pid, k.create_time()))
            except psutil.Error:
                pass
        return out

    def kill_a_worker(self) -> bool:
        """SIGKILL one random worker, if every worker is up; whether one was."""
        try:
            if self.metrics().get("shmcache_workers_alive", 0) < self.a.workers:
                return False          # one is still loading the model: let it
        except Exception:
            return False
        ws = self.workers()
        if not ws:
            return False
        try:
            random.choice(ws).send_signal(signal.SIGKILL)
        except psutil.Error:
            return False
        return True

    def stop(self) -> dict:
        """SIGTERM and wait; then what it left: its pool, its worker processes."""
        if self._http is not None:
            self._http.close()
        forced = False
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                forced = True
                self.proc.kill()
                self.proc.wait(10)
        left = {"server_exit_code": None if self.proc is None else self.proc.returncode,
                "server_killed": forced, "pool_left": False, "processes_left": []}
        for pid, t in self.worker_pids:
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - t) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                    left["processes_left"].append(pid)
                    p.kill()
            except psutil.Error:
                pass
        if self.redis is not None:
            self.redis.stop()
        pool = self.pool or (self.proc and f"serve-{self.proc.pid}")
        if pool:
            from shmcache.shm import segment
            if os.path.exists(segment.path_for(pool)):
                left["pool_left"] = True
                segment.unlink(pool)    # ours: the server's own pool, named after its pid
        return left
