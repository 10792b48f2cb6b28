"""The server processes ``tools.bench.serve`` starts, measures and stops.

:class:`Server` runs one server command in its own session (so that its
process group is its own), waits for its ``/health``, and on ``stop`` kills
whatever is left of its process tree. It also records which files under
/dev/shm its processes mapped, for the benchmark's leak check, and which
BLAS libraries they mapped.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import httpx
import psutil

SHM_DIR = "/dev/shm"
_BLAS_LIB = re.compile(r"(openblas|blis|mkl_rt|flexiblas|libblas|libcblas)", re.I)


def log(msg: str) -> None:
    print(f"[bench_serve] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def tree_pss(pids: list[int]) -> int:
    """Summed PSS in bytes of these processes and all their children."""
    total = 0
    for pid in pids:
        for p in _tree(pid):
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return total


def tree_cpu_seconds(pids: list[int]) -> float:
    """User+system CPU seconds so far of these processes and all their children."""
    total = 0.0
    for pid in pids:
        for p in _tree(pid):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return total


class PssSampler:
    """Samples the summed PSS of some process trees every ``interval`` seconds
    in a thread, from ``start()`` to ``stop()``; ``peak`` is the largest sum
    seen (one more sample is taken at stop)."""

    def __init__(self, pids: list[int], interval: float = 2.0):
        self.pids, self.interval = list(pids), interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.peak = max(self.peak, tree_pss(self.pids))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> "PssSampler":
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak


def _maps(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [line[line.index("/"):].rstrip("\n") for line in f if "/" in line]
    except OSError:
        return []


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


class Server:
    """One server process (started in its own session, so its group is its own)."""

    #: every Server started and not yet stopped (the benchmark stops them on exit)
    live: "set[Server]" = set()

    def __init__(self, label: str, argv: list[str], env_set: dict, port: int, logdir: str,
                 env_unset: tuple[str, ...] = ()):
        self.label, self.argv, self.env_set, self.port = label, argv, env_set, port
        self.env_unset = tuple(env_unset)
        self.health_path = "/health"         # llama.cpp's server: "/v1/models"
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(logdir, f"{label}-{port}.log")
        self.proc: Optional[subprocess.Popen] = None
        self.pids: set[int] = set()          # every process of its tree seen so far
        self.shm_paths: set[str] = set()     # /dev/shm files its tree mapped

    def command(self) -> str:
        drop = [k for k in ("LD_PRELOAD",) + self.env_unset
                if k in os.environ and k not in self.env_set]
        unset = [a for k in drop for a in ("-u", k)]
        env = [f"{k}={v}" for k, v in self.env_set.items()]
        pre = (["env"] + unset + env) if unset else env
        return shlex.join(pre + self.argv)

    def start(self) -> None:
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        for k in self.env_unset:
            env.pop(k, None)
        env.update(self.env_set)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        Server.live.add(self)
        self.pids.add(self.proc.pid)

    def log_tail(self, n: int = 25) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, client: httpx.Client, timeout: float, workers: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode} before it "
                                   f"was ready; its log:\n{self.log_tail()}")
            try:
                r = client.get(self.url + self.health_path, timeout=2)
                if r.status_code == 200:
                    body = r.json()
                    alive = body.get("workers_alive") if isinstance(body, dict) else None
                    if alive is None or alive >= workers:
                        return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label} not ready after {timeout:.0f} s; its log:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.25)

    def observe(self) -> None:
        """Remember its processes and the /dev/shm files they map (for the leak check)."""
        if self.proc is None:
            return
        for p in _tree(self.proc.pid):
            self.pids.add(p.pid)
            for path in _maps(p.pid):
                if path.startswith(SHM_DIR + "/"):
                    self.shm_paths.add(path.split(" (deleted)")[0])

    def blas(self) -> list[str]:
        """Basenames of the BLAS libraries mapped into its processes."""
        found = set()
        if self.proc is not None:
            for p in _tree(self.proc.pid):
                for path in _maps(p.pid):
                    base = os.path.basename(path)
                    # numpy's own OpenBLAS (scipy_openblas64_) is not one libmlx can bind
                    if _BLAS_LIB.search(base) and "scipy_openblas" not in base:
                        found.add(base)
        return sorted(found)

    def stop(self, grace: float = 20.0) -> Optional[int]:
        if self.proc is None:
            return None
        self.observe()
        procs = []
        for pid in self.pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log(f"{self.label}: no exit {grace:.0f} s after SIGTERM: SIGKILL")
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)     # its own group: what is left of it
        except (ProcessLookupError, PermissionError):
            pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:                  # a child that left the group: ours all the same
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        rc = self.proc.wait()
        self._log.close()
        Server.live.discard(self)
        return rc


def stop_all() -> None:
    """Stop every server still running (the benchmark's exit path)."""
    for s in list(Server.live):
        try:
            s.stop(grace=10)
        except Exception as e:  # noqa: BLE001 - keep stopping the others
            log(f"{s.label}: stop failed: {type(e).__name__}: {e}")

