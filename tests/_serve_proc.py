"""``shmcache serve`` as a subprocess, and mlx-lm's own answers, for the
end-to-end tests (``test_server_e2e``, ``test_server_backend``,
``test_server_main``; ``test_server_l2`` through ``test_server_e2e``).

Each server is ``python -m shmcache.cli serve --model DIR --port 0`` (its
URL is read from its startup log line) with real worker processes over a
real pool in /dev/shm, serving a small random-weight llama model built once
per test module (``shmcache.models.demo_model.build_model_dir``, the ``model_dir``
fixture). The clients are the official ``openai`` client and raw ``httpx``.

The answers are checked against mlx-lm itself (:class:`Reference`): greedy
tokens must equal ``mlx_lm.generate.generate_step`` run in this process on
the same model directory with its default ``prefill_step_size``, whatever
was cached, which worker ran the request, or whether it was re-run after a
worker died (the engine's chunks start at the cache-hit boundary, so they
differ from mlx-lm's on a warm run: the tokens must not). The demo tokenizer is byte-level (one token per byte),
so the text and ``completion_tokens`` together pin the tokens down.

Every server is stopped by SIGTERM in a ``finally`` (SIGKILL, for it and its
workers, if it does not exit in time), and its teardown asserts that it
exited 0, that no worker survived it, and that its pool
(``/dev/shm/shmcache.serve-<pid>``) is gone; a pool left behind is unlinked
before the assertion fails, so /dev/shm stays clean either way.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

import shmcache  # noqa: F401  first, as in the workers: the same BLAS under MLX
import mlx.core as mx  # noqa: E402


MODEL_NAME = "tiny-llama"       # the model dir's name: the served model id
BS = 16                         # --block-size (the server's default)
STARTUP_S = 150                 # a loaded 2-core machine can be slow to load 2 workers
STOP_S = 20                     # SIGTERM/SIGINT to exit
REPO = Path(__file__).resolve().parents[1]
URL_RE = re.compile(r" on (http://\S+) \(OpenAI API at ")
PRINTABLE_IDS = list(range(0x20, 0x7F))   # the byte-level tokenizer: id == byte


def printable(rng: random.Random, n: int) -> list:
    return [rng.choice(PRINTABLE_IDS) for _ in range(n)]


# ---------------------------------------------------------------- reference
@dataclass(frozen=True)
class Answer:
    text: str
    tokens: int                 # completion tokens, a final EOS included (as usage counts)
    finish_reason: str


class Reference:
    """mlx-lm's own greedy generation, in this process, on the same model dir."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm import load
        self.model, self.tokenizer = load(str(model_dir))
        self.eos = set(self.tokenizer.eos_token_ids)
        self._memo: dict = {}

    def greedy(self, prompt: list, max_tokens: int) -> Answer:
        key = (tuple(prompt), max_tokens)
        if key not in self._memo:
            from mlx_lm.generate import generate_step
            toks = []
            for tok, _ in generate_step(mx.array(prompt), self.model, max_tokens=max_tokens):
                toks.append(int(tok))
                if toks[-1] in self.eos:
                    break
            self._memo[key] = self.answer(toks)
        return self._memo[key]

    def answer(self, toks: list) -> Answer:
        """The text the server makes of these tokens (its streaming detokenizer)."""
        detok = self.tokenizer.detokenizer
        for t in toks:
            if t not in self.eos:
                detok.add_token(t)
        detok.finalize()
        stopped = bool(toks) and toks[-1] in self.eos
        return Answer(detok.text, len(toks), "stop" if stopped else "length")


def got(resp, i: int = 0) -> Answer:
    c = [c for c in resp.choices if c.index == i][0]
    return Answer(c.text, resp.usage.completion_tokens, c.finish_reason)


# ------------------------------------------------------------------- server
class Server:
    """``shmcache serve`` as a subprocess; ``stop()`` always leaves nothing behind."""

    def __init__(self, model_dir: Path, *args) -> None:
        cmd = [sys.executable, "-m", "shmcache.cli", "serve", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", "0", *map(str, args)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, cwd=REPO, env=env)
        self.pool_path = f"/dev/shm/shmcache.serve-{self.proc.pid}"
        self.url: Optional[str] = None
        self.workers: list = []             # psutil.Process of every worker ever seen
        self._lines: list = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._stopped = False

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._lock:
                self._lines.append(line)
            m = URL_RE.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def log(self) -> str:
        with self._lock:
            return "".join(self._lines)

    def wait_ready(self, timeout: float = STARTUP_S) -> "Server":
        if not self._ready.wait(timeout) or self.url is None:
            raise AssertionError(f"the server did not start in {timeout} s (exit "
                                 f"{self.proc.poll()}); its log:\n{self.log()}")
        self.worker_procs()
        return self

    def worker_procs(self) -> list:
        """The live worker processes (children of the server), by ``--id``."""
        found = []
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in kids:
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if "workers.worker.main" in cmd:
                found.append(p)
                if all(p.pid != w.pid for w in self.workers):
                    self.workers.append(p)
        return sorted(found, key=lambda p: int(p.cmdline()[p.cmdline().index("--id") + 1]))

    def client(self, timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             timeout=timeout)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=30)

    def metrics(self) -> dict:
        """/metrics: {sample name: value} (unlabelled samples)."""
        text = self.get("/metrics").text
        return {s.name: s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if not s.labels}

    def metric(self, name: str) -> float:
        m = self.metrics()
        assert name in m, f"no {name} in /metrics: {sorted(m)}"
        return m[name]

    def wait_idle(self, timeout: float = 30) -> dict:
        """The pool gauges once no block is in use (a worker releases a
        request's blocks just after sending its last token): then every
        block is either cached (reusable prefix data) or free."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            g = {k: m[f"shmcache_pool_blocks_{k}"] for k in ("total", "used", "cached", "free")}
            if g["used"] == 0:
                assert g["cached"] + g["free"] == g["total"], g
                return g
            assert time.monotonic() < deadline, f"pool blocks still in use when idle: {g}"
            time.sleep(0.1)

    def stop(self, *signals, gap: float = 0.05, timeout: float = STOP_S) -> list:
        """Sends the signals (default SIGTERM), waits for the exit, then makes
        sure that nothing is left; returns the problems found (empty: clean)."""
        if self._stopped:
            return []
        self._stopped = True
        problems = []
        self.worker_procs()
        rc = self.proc.poll()
        if rc is None:
            for i, s in enumerate(signals or (signal.SIGTERM,)):
                if i:
                    time.sleep(gap)
                self.proc.send_signal(s)
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                problems.append(f"the server did not exit within {timeout} s of "
                                f"{signals or 'SIGTERM'}: killed")
                self.proc.kill()
                rc = self.proc.wait(30)
        if rc != 0:
            problems.append(f"the server exited with {rc}")
        _, alive = psutil.wait_procs(self.workers, timeout=10)
        alive = [p for p in alive if _is_running(p)]
        if alive:
            problems.append(f"worker processes survived the server: {[p.pid for p in alive]}")
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(alive, timeout=10)
        left = self.segments()
        if left:
            problems.append(f"the server left segments in /dev/shm: {left}")
            for path in left:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._reader.join(10)
        self.proc.stdout.close()
        return problems


    def segments(self) -> list:
        """This server's files in /dev/shm: its pool, and anything named after it."""
        p = self.pool_path            # (not serve-<pid>*: that matches other pids too)
        return sorted(glob.glob(p) + glob.glob(f"{p}.*") + glob.glob(f"{p}-*"))


def _is_running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def serving(model_dir: Path, *args):
    srv = Server(model_dir, *args)
    try:
        yield srv.wait_ready()
    finally:
        problems = srv.stop()
    assert not problems, "; ".join(problems) + "\n--- server log ---\n" + srv.log()


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from shmcache.models.demo_model import build_model_dir
    return build_model_dir(tmp_path_factory.mktemp("model") / MODEL_NAME, "llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)
